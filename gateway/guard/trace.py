"""What the guard keeps about one request (``Trace``) while it runs; each attempt
is an ``Attempt`` (``gateway.guard.attempt``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from multidict import CIMultiDict

from gateway.guard.budget import RetryTicket
from gateway.guard.continuation import Continuation
from gateway.guard.request import GuardedRequest
from gateway.observe.tracing import RequestSpans
from gateway.upstream.pool import Backend


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
    #: The backend answered the gateway's own logprobs ask with a client error: the
    #: request's later attempts go without it (``loop.refused_the_ask``).
    ask_refused: bool = False
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
    #: How the answer is continued after release, when its request has a plan
    #: (``gateway.guard.continuation``): its prompt check, its continuations.
    continuation: Continuation | None = None
    #: The request's OpenTelemetry spans (``gateway.guard.traced``); None while
    #: tracing is off, or the request not traced.
    otel: RequestSpans | None = None

    @property
    def continuations(self) -> int:
        """Continuations asked for after release."""
        return self.continuation.asked if self.continuation is not None else 0

    def route(self, backend: Backend) -> None:
        """Hold the in-flight count on ``backend``, which serves the next attempt (a
        retry or failover moves it from the pod that served the last one)."""
        if self.routed is not backend:
            self.unroute()
            backend.in_flight += 1
            self.routed = backend

    def unroute(self) -> None:
        """Give back the in-flight count the request holds on its backend (once)."""
        if self.routed is not None:
            self.routed.in_flight -= 1
            self.routed = None
