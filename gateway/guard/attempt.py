"""One attempt at a request's answer (``Attempt``): what the guard keeps of it while
it is read, judged and released or discarded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.apis import ApiAdapter, Usage
from gateway.detect import CLEAN, Verdict
from gateway.guard.stream import StreamState
from gateway.guard.tail import TailHold
from gateway.upstream.pool import Backend, RawHeaders


def judged_label(degenerate: bool, *, inspected: bool) -> str:
    """An answered attempt's label in metrics and spans: ``unguarded`` where nothing
    judged it (``guard.mode: off``), never ``clean``."""
    if not inspected:
        return "unguarded"
    return "degenerate" if degenerate else "clean"


@dataclass(slots=True)
class Attempt:
    backend: Backend
    salt: str | None
    status: int
    headers: RawHeaders
    verdict: Verdict = CLEAN
    body: bytes = b""
    usage: Usage | None = None
    stream: StreamState | None = None
    #: Seconds spent waiting on the backend for this attempt.
    upstream_s: float = 0.0
    #: The parsed body of a non-streaming attempt (for evidence capture).
    payload: dict[str, Any] | None = None
    #: Its duration and tokens are counted (``Accounting.count_attempt``, once).
    counted: bool = False
    #: The rolling hold-back of a stream the guard may continue: it owns what is
    #: sent from the stream's first byte (``gateway.guard.tail``).
    tail: TailHold | None = None
    #: The gateway asked for the sampled tokens' logprobs the client did not: they
    #: are judged (NaN logits) and taken out of what the client gets.
    asked_logprobs: bool = False

    def output_text(self, api: ApiAdapter) -> str:
        """What the degenerate choice said (content, else reasoning, else tool args)."""
        index = self.verdict.choice_index or 0
        if self.stream is not None:
            state = self.stream.inspector.choices.get(index)
            output = state.output() if state is not None else None
        else:
            output = dict(api.outputs(self.payload or {})).get(index)
        if output is None:
            return ""
        return output.content or output.reasoning or "".join(output.tool_arguments)

    async def discard(self) -> None:
        if self.stream is not None:
            try:
                await self.stream.finish_reading()  # a complete stream keeps its connection
            finally:  # the client may leave while it is read: the connection is closed
                self.stream.close()
