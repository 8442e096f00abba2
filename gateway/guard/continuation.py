"""Continuing a released stream whose held end turned degenerate (``after_release:
continue``).

A stream released early has its unsettled end held back (``gateway.guard.tail``).
When that end turns degenerate it is dropped, and the answer is continued from
exactly the text the client has with a fresh salt (which misses the poisoned blocks,
as a whole retry does), within ``max_attempts`` and the retry budget; the
continuation's stream is relayed on in the client's, rewritten by the API's splice.
What differs between the APIs is the request's ``ContinuationPlan``
(``gateway.apis``), made from its whole body before the first byte is released.

The guard loop owns attempts, the budget, salts and routing: a continuation asks for
them through ``ContinuationHost`` and never imports the loop (inside the guard the
loop is above the continuation, which is above the tail).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from multidict import CIMultiDict

from gateway.apis.base import ContinuationPlan, EventSplice, ReleasedPart, RenderedPrompt
from gateway.detect import DegenerateKind, StreamInspector
from gateway.errors import UpstreamProtocolError
from gateway.guard.attempt import Attempt
from gateway.guard.request import GuardedRequest
from gateway.guard.tail import TailHold
from gateway.observe.metrics import Metrics
from gateway.upstream.pool import Backend

log = logging.getLogger(__name__)


class ContinuationHost(Protocol):
    """What a continuation asks of the guard loop, for the request it belongs to."""

    def grant_retry(self, backend: Backend) -> bool:
        """Whether one more attempt is allowed (``max_attempts``, the budget)."""
        ...

    def settle(self, *, recovered: bool) -> None:
        """The outcome of the retry granted last goes back to the budget."""
        ...

    def count_attempt(self, attempt: Attempt, *, degenerate: bool) -> None:
        """An attempt that will not be relayed further: its duration and tokens."""
        ...

    def next_route(self, failed: Attempt, kind: DegenerateKind) -> tuple[Backend, str]:
        """The backend and salt of the next attempt, after ``failed`` turned ``kind``
        (counted as a retry; the attempt numbered and routed there)."""
        ...

    async def open_attempt(
        self,
        backend: Backend,
        salt: str,
        fields: dict[str, Any],
        inspector: StreamInspector,
        released_tokens: int,
    ) -> Attempt:
        """An attempt whose body is the request's changed by ``fields`` and whose text
        ``inspector`` reads (it has the released text already), never held back;
        ``released_tokens``: how many the client has (its span says)."""
        ...


class Continuation:
    """One request's continuations: its plan, the prompt check a plan continued by
    token ids needs, and how many continuations were asked for and counted."""

    def __init__(
        self,
        plan: ContinuationPlan,
        request: GuardedRequest,
        headers: CIMultiDict[str],
        metrics: Metrics,
    ) -> None:
        self.plan = plan
        self.request = request
        self.headers = headers
        self.metrics = metrics
        #: Continuations asked for.
        self.asked = 0
        #: The latest continuation's outcome is counted already (it degenerated and
        #: was continued again, or was refused): the stream's end does not count it.
        self.counted = False
        #: The continuation being relayed (closed with the stream).
        self.relaying: Attempt | None = None
        #: The prompt's ids as vLLM renders them, for a plan with a ``prompt_check``
        #: (None inside: the check failed), and the backend asked.
        self.prompt_ids: asyncio.Future[list[int] | None] | None = None
        self.prompt_checked_on: Backend | None = None

    # -- the prompt check, beside the attempt ---------------------------------------

    def check_prompt(self, backend: Backend) -> None:
        """For a plan continued by token ids: have ``backend`` render the prompt and
        count it, beside the attempt it serves (the first release waits for it)."""
        check = self.plan.prompt_check
        if check is not None and self.needs_prompt_check(backend):
            ids = rendered_prompt_ids(backend, check, self.headers)
            self.start_prompt_check(backend, asyncio.ensure_future(ids))

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

    async def holds(self, backend: Backend) -> bool:
        """The plan still holds at release: the answer is one the API can continue on
        its backend (``ContinuationPlan.holds_on``: a Responses answer the backend
        does not keep) and, for a plan continued by token ids, vLLM's count agreed
        with the rendered prompt."""
        if not self.plan.holds_on(backend.keeps_responses):
            return False
        if self.prompt_ids is None:
            return self.plan.prompt_check is None
        return await asyncio.shield(self.prompt_ids) is not None

    # -- continuing ------------------------------------------------------------------

    async def continue_after(
        self, segment: Attempt, tail: TailHold, kind: DegenerateKind, host: ContinuationHost
    ) -> tuple[Attempt, EventSplice] | None:
        """``segment``'s held end turned ``kind``: the answer's continuation from the
        text the client has, on a fresh salt, and the splice of its events into the
        client's stream. None where it is refused (the stream goes on as ``pass``).

        Raises a GatewayError (the stream ends with an in-band error) when the
        continuation cannot be had from the backend."""
        backend = segment.backend
        if self.asked and not self.counted:
            host.settle(recovered=False)  # the last continuation degenerated too
            self._count("degenerate")
        released = tail.released_text
        released_ids = await self._released_tokens(backend, released)
        count = tail.released_events if released_ids is None else len(released_ids)
        fields = self.plan.request_fields(released, count, await self._continued_ids(released_ids))
        if fields is None or not host.grant_retry(backend):
            self._count("refused")
            return None
        self.counted = False
        tail.drop()  # never sent, whatever becomes of the continuation
        stream = segment.stream
        assert stream is not None
        stream.close()  # the rest of a degenerate answer is not worth reading
        segment.usage = stream.usage
        host.count_attempt(segment, degenerate=True)
        backend, salt = host.next_route(segment, kind)
        self.asked += 1
        splice = self.plan.splice(
            ReleasedPart(tail.first_bytes, tail.latest_bytes, released, count)
        )
        if splice is None:
            raise UpstreamProtocolError("the released stream's opening event is not JSON")
        inspector = StreamInspector(stream.inspector.detector, watch_nan=stream.inspector.watch_nan)
        inspector.feed_output(0, content=released)
        continued = await host.open_attempt(backend, salt, fields, inspector, count)
        if continued.status != 200:
            raise UpstreamProtocolError(
                f"backend {backend.name} answered the continuation of a released stream "
                f"with HTTP {continued.status}"
            )
        log.info(
            "request %s (%s): released stream degenerate (%s) after %d characters; "
            "continued on %s (continuation %d)",
            self.headers.get("x-request-id", ""), self.request.endpoint, kind, len(released),
            backend.name, self.asked,
        )  # fmt: skip
        tail.follow(inspector, inspector.text_events)
        self.relaying = continued
        return continued, splice

    async def _released_tokens(self, backend: Backend, released: str) -> list[int] | None:
        """The released text's tokens (vLLM's tokenizer): the continuation's prompt
        holds them, its token limits and the client's usage count them (one event may
        carry several tokens, with MTP or ``--stream-interval``)."""
        body = {"model": self.request.model, "prompt": released, "add_special_tokens": False}
        return await backend.tokenize(body, self.headers)

    async def _continued_ids(self, released_ids: list[int] | None) -> list[int] | None:
        """The continuation's prompt as token ids, for a plan continued by them."""
        if self.prompt_ids is None or released_ids is None:
            return None
        prompt_ids = await self.prompt_ids
        return None if prompt_ids is None else prompt_ids + released_ids

    def finish(self, verdict: str, *, client_gone: bool) -> None:
        """The stream ended with ``verdict``: the latest continuation's outcome counted
        (once; nothing when none was asked for, or the client left)."""
        if self.asked and not client_gone and not self.counted:
            self._count("clean" if verdict == "recovered" else verdict)

    def close(self) -> None:
        """The request is over: its continuation's stream closed, its check ended."""
        if self.relaying is not None and self.relaying.stream is not None:
            self.relaying.stream.close()
        self.end_prompt_check()

    def _count(self, outcome: str) -> None:
        self.metrics.continuations.labels(self.request.endpoint, outcome).inc()
        self.counted = True


async def rendered_prompt_ids(
    backend: Backend, rendered: RenderedPrompt, headers: CIMultiDict[str]
) -> list[int] | None:
    """The prompt's token ids as vLLM renders it, for a plan continued by token ids;
    None unless vLLM's own count for the request agrees (the gateway renders a
    conversation the way vLLM converts it; a count that differs says it did not,
    and the answer is not continued)."""
    try:
        ids = await backend.tokenize(rendered.tokenize, headers)
        counted = await backend.ask_json(rendered.count_path, rendered.count_body, headers)
    except Exception:  # a check beside the attempt must never fail the request
        log.warning("the rendered prompt check failed; not continuing", exc_info=True)
        return None
    expected = counted.get("input_tokens") if counted is not None else None
    if ids is None or expected != len(ids):
        log.info(
            "not continuing: the rendered prompt has %s tokens, vLLM counts %s",
            None if ids is None else len(ids), expected,
        )  # fmt: skip
        return None
    return ids
