"""What the guard keeps about one request (``Trace``) and each of its attempts
(``Attempt``) while it runs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict

from gateway.apis import ApiAdapter, Usage
from gateway.detect import CLEAN, Verdict
from gateway.guard.budget import RetryTicket
from gateway.guard.request import GuardedRequest
from gateway.guard.stream import StreamState
from gateway.guard.tail import TailHold
from gateway.upstream.pool import Backend, RawHeaders


@dataclass(slots=True)
class Trace:
    """Per-request accounting, filled in as the request goes."""

    request: GuardedRequest
    model: str  # bounded label value
    started: float
    #: The conversation's fingerprint for salt reuse (None: not reused); read it
    #: through ``Guard.conversation``, which computes it when not ``conversation_known``.
    conversation: str | None
    conversation_known: bool
    upstream_s: float = 0.0
    attempts: int = 0
    degenerate_seen: bool = False
    client_gone: bool = False
    #: Who asked (API-key digest or address): the budget's fair-share key.
    client: str = ""
    #: The budget's grant for the attempt under way, when it is a retry.
    ticket: RetryTicket | None = None
    #: The backend whose in-flight count this request holds (affinity's bounded load):
    #: the one serving the attempt under way.
    routed: Backend | None = None
    #: The request's outcome has been counted (``Accounting.finish``).
    finished: bool = False
    #: The salt ladder's rung of the attempt under way (0: the client's own salt).
    rung: int = 0
    #: Answers are read and judged (guard not off, and the request not unguardable).
    inspecting: bool = True
    #: The request's id (``x-request-id``), for its log lines and evidence.
    request_id: str = ""
    #: What went wrong with each attempt that was not released: detector kinds,
    #: ``backend_error``.
    kinds: list[str] = field(default_factory=list)
    #: ``perf_counter`` when the latest attempt started: everything before it is the
    #: latency that retries and failovers added.
    attempt_started: float = 0.0
    #: The headers each attempt is sent with (a continuation's too).
    upstream_headers: CIMultiDict[str] | None = None
    #: A released stream's continuation being relayed (closed with the stream).
    continuing: Attempt | None = None
    #: Continuations asked for after release.
    continuations: int = 0
    #: The latest continuation's outcome is counted already (it degenerated and
    #: was continued again, or refused): the stream's end does not count it again.
    continuation_counted: bool = False
    #: An API continued by token ids (Messages): the prompt's ids as vLLM renders
    #: them, checked against vLLM's own count beside the first attempt (None inside:
    #: the check failed, and the answer is not continued).
    prompt_ids: asyncio.Future[list[int] | None] | None = None
    #: The backend that check asks.
    prompt_checked_on: Backend | None = None

    def route(self, backend: Backend) -> None:
        """Hold the in-flight count on ``backend``, which serves the next attempt (a
        retry or failover moves it from the pod that served the last one)."""
        if self.routed is not backend:
            self.unroute()
            backend.in_flight += 1
            self.routed = backend

    def needs_prompt_check(self, backend: Backend) -> bool:
        """A prompt check should start for an attempt on ``backend``: none has, or
        the one under way or failed asked another backend (a failover from a pod that
        may not answer it); a check that succeeded holds for every pod of the model."""
        check = self.prompt_ids
        if check is None:
            return True
        if self.prompt_checked_on is backend:
            return False
        return not check.done() or check.cancelled() or check.result() is None

    def start_prompt_check(self, backend: Backend, check: asyncio.Future[list[int] | None]) -> None:
        self.end_prompt_check()
        self.prompt_ids, self.prompt_checked_on = check, backend

    def end_prompt_check(self) -> None:
        """The request is over: a prompt check still running is not needed."""
        if self.prompt_ids is not None and not self.prompt_ids.done():
            self.prompt_ids.cancel()

    def unroute(self) -> None:
        """Give back the in-flight count the request holds on its backend (once)."""
        if self.routed is not None:
            self.routed.in_flight -= 1
            self.routed = None


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
