"""The guard loop: attempts, verdicts, salted retries, the exhausted policy, and the
relay of a released stream.

One request pipeline for every guarded API (``gateway.apis``: chat, completions,
Responses, Messages), streaming or not; what differs between them is asked of the
request's adapter. An *attempt* opens the upstream response and has it read
(``gateway.guard.holdback``: the whole body, or a stream until it may be released)
before anything is sent to the client, so a discarded attempt has sent nothing.
Only then does the response start. Salts and what the guard remembers to choose
them live in ``gateway.guard.salting``; a released stream's continuation in
``gateway.guard.continuation``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

from gateway.apis.base import EventSplice
from gateway.config import (
    AfterRelease,
    ExhaustedPolicy,
    GuardMode,
    Settings,
)
from gateway.detect import (
    DegenerateKind,
    StreamInspector,
)
from gateway.errors import (
    BackendUnreachable,
    DegenerateResponse,
    GatewayError,
    NoHealthyBackend,
    ShuttingDown,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.guard import traced
from gateway.guard.accounting import Accounting
from gateway.guard.answer import (
    Answer,
    ChunkSender,
    ChunkWriter,
    StreamedAnswer,
    WholeAnswer,
)
from gateway.guard.answer_homes import AnswerHomes
from gateway.guard.attempt import Attempt
from gateway.guard.budget import Refusal, RetryBudget, RetryTicket
from gateway.guard.holdback import HoldBack
from gateway.guard.request import GuardedRequest, attempt_overrides, body_with
from gateway.guard.salting import Salting
from gateway.guard.stream import StallWatch, StreamState
from gateway.guard.tail import TailHold
from gateway.guard.trace import Trace
from gateway.observe.evidence import EvidenceStore
from gateway.observe.metrics import Metrics
from gateway.observe.tracing import Attributes, Tracing
from gateway.upstream.pool import (
    Backend,
    BackendPool,
    RawHeaders,
    map_transport_errors,
    response_headers,
)
from gateway.wire.sse import SSEParser

log = logging.getLogger(__name__)

ATTEMPTS_HEADER = "x-vllm-guard-attempts"
VERDICT_HEADER = "x-vllm-guard-verdict"
ATTEMPTS_HEADER_RAW = ATTEMPTS_HEADER.encode()
VERDICT_HEADER_RAW = VERDICT_HEADER.encode()


def refused_the_ask(attempt: Attempt) -> bool:
    """A client error (4xx) to an attempt that carried the gateway's own logprobs ask
    and is not the NaN refusal: the ask may be what vLLM refused (no logprobs for
    gpt-oss models on Responses), which the client never sent. Its request goes once
    more without it, and the client gets what vLLM answers the request it sent."""
    return attempt.asked_logprobs and 400 <= attempt.status < 500


class Guard:
    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        metrics: Metrics,
        rng: random.Random | None = None,
        *,
        evidence: EvidenceStore | None = None,
        version_of: Callable[[str], str | None] = lambda backend: None,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        #: OpenTelemetry spans per request and attempt; None while tracing is off.
        self.tracing = tracing
        self.pool = pool
        self.metrics = metrics
        self.accounting = Accounting(metrics, evidence, version_of)
        self.rng = rng or random.Random()
        self.budget = RetryBudget(settings.guard.budget)
        self.stalls = StallWatch(settings.upstream.timeouts.read_s)
        self.salting = Salting(settings, metrics, reuse=self.mode is GuardMode.ENFORCE)
        # Their memories, for the server's lifespan and for tests.
        self.redis, self.salts, self.ladder = (
            self.salting.redis, self.salting.salts, self.salting.ladder,
        )  # fmt: skip
        self.answer_homes = AnswerHomes(pool, self.salting.chains, metrics)
        self.holding = HoldBack(settings, metrics)

    @property
    def mode(self) -> GuardMode:
        return self.settings.guard.mode

    # -- the pipeline -------------------------------------------------------------

    async def handle(
        self,
        request: GuardedRequest,
        headers: CIMultiDict[str],
        started: float,
        client: str = "",
    ) -> Answer:
        """Attempts until one may be released: retried while degenerate (salted, within
        the budget), failed over while the backend cannot be reached."""
        continued = request.api.continues(request.body)
        home = await self.answer_homes.find(request.api, continued, headers) if continued else None
        trace, fingerprint = self._new_trace(request, started, client)
        trace.request_id = headers.get("x-request-id", "")
        if self.tracing is not None:
            trace.otel = traced.request_spans(self.tracing, request, headers)
            # What vLLM is asked beside the attempts (tokenize, the prompt check)
            # nests under the request's span, each attempt under its own.
            trace.otel.inject(headers)
        trace.upstream_headers = headers
        trace.continuation = self.holding.continuation_for(request, headers)
        self.budget.record_request()
        try:
            salt = await self.salting.first_salt(trace)
            backend = home or self._first_backend(fingerprint)
        except BaseException as exc:  # no attempt yet: nothing routed, no ticket held
            self._end_spans(trace, exc)  # NoHealthyBackend (a 503), or the client left
            raise
        cause = "first"  # why the next attempt is made (its span says)
        # From here the request holds an in-flight count and, while a retry is under
        # way, a budget ticket: every exit below gives both back (``_abandon``), and a
        # streamed answer hands them to its relay (``StreamedAnswer.on_close``).
        try:
            while True:
                trace.attempts += 1
                trace.route(backend)  # in flight on the pod that serves this attempt
                try:
                    attempt = await self._attempt(
                        request, backend, salt, headers, trace, cause=cause
                    )
                except (BackendUnreachable, UpstreamTimeout, UpstreamProtocolError) as exc:
                    failover = await self._after_transport_failure(exc, backend, trace, headers)
                    if failover is None:
                        raise
                    backend, cause = failover, "failover"
                    continue
                self._settle(
                    trace, recovered=attempt.status == 200 and not attempt.verdict.degenerate
                )
                if not attempt.verdict.degenerate and refused_the_ask(attempt):
                    trace.ask_refused = True  # not asked again for this request
                    attempt = await self._resent_without_ask(attempt, trace)
                if not attempt.verdict.degenerate:  # an answer, or an error that is not one
                    return self._release(attempt, trace)
                if not self._degenerate_attempt(attempt, trace, headers):
                    return await self._exhausted(attempt, trace)
                await attempt.discard()
                if attempt.stream is not None:
                    self.accounting.count_attempt(attempt, trace)
                if trace.otel is not None:
                    trace.otel.end_attempt()
                cause = "retry"
                assert attempt.verdict.kind is not None
                backend, salt = self._retry_route(trace, attempt, attempt.verdict.kind)
        except GatewayError:
            self._abandon(trace, backend, recovered=False)
            raise
        except BaseException as exc:  # the client left: the retry's outcome is unknown
            self._abandon(trace, backend, recovered=None)
            self._end_spans(trace, exc)
            raise

    def _abandon(self, trace: Trace, backend: Backend, *, recovered: bool | None) -> None:
        """The request leaves the loop without an answer to release: its budget ticket
        settled, its in-flight count given back; a failure (``recovered`` False) is
        counted as the request's outcome unless it already was (the exhausted policy
        "error" counts "degenerate"). A client that left is counted by the server."""
        self._settle(trace, recovered=recovered)
        if trace.continuation is not None:
            trace.continuation.end_prompt_check()
        if recovered is None:
            trace.unroute()
        elif not trace.finished:
            self.accounting.finish(trace, backend, "error")

    @staticmethod
    def _end_spans(trace: Trace, exc: BaseException) -> None:
        """The request leaves ``handle`` with ``exc`` and no outcome counted (none to
        count: the client left, or no backend could be chosen): its spans end with
        the error's type."""
        if trace.otel is not None:
            trace.otel.end(traced.left_with(exc), error=traced.error_type(exc))

    def _new_trace(
        self, request: GuardedRequest, started: float, client: str
    ) -> tuple[Trace, str | None]:
        """The request's Trace, and its conversation fingerprint when it is needed now."""
        reuse_salts = self.salting.reuse
        # The fingerprint (a hash of the leading messages) is needed now only to route
        # by conversation or to look up a remembered salt; with no salt remembered it
        # is computed if and when a retry needs it (Guard.conversation).
        fingerprint = (
            self.salting.fingerprint(request)
            if self.pool.conversation_affine or (reuse_salts and len(self.salts))
            else None
        )
        trace = Trace(
            client=client,
            request=request,
            model=self.metrics.model_label(request.model),
            started=started,
            conversation=fingerprint if reuse_salts else None,
            conversation_known=fingerprint is not None or not reuse_salts,
            inspecting=self.mode is not GuardMode.OFF and not request.unguardable,
        )
        return trace, fingerprint

    def _first_backend(self, fingerprint: str | None) -> Backend:
        """The pool's choice: by conversation when routing is affine."""
        affinity = fingerprint if self.pool.conversation_affine else None
        return self.pool.choose_first(
            self.settings.guard.canary_weight, self.rng, affinity=affinity
        )

    async def _after_transport_failure(
        self, exc: GatewayError, backend: Backend, trace: Trace, headers: CIMultiDict[str]
    ) -> Backend | None:
        """An attempt that never got an answer: the backend to fail over to, or None
        (the request fails with ``exc``)."""
        self._settle(trace, recovered=False)
        trace.kinds.append("backend_error")
        if isinstance(exc, UpstreamProtocolError):
            self.metrics.upstream_errors.labels(backend.name, "protocol").inc()
        may_resend = await self._may_send_elsewhere(exc, backend)
        failover = self._failover_backend(backend, trace) if may_resend else None
        cause = repr(exc.__cause__) if exc.__cause__ is not None else exc.code
        request_id, endpoint = headers["x-request-id"], trace.request.endpoint
        if failover is None:
            log.warning("request %s (%s) failed: %s (%s)", request_id, endpoint, exc.message, cause)
            return None
        log.warning(
            "attempt %d of %s (%s) failed: %s (%s); failing over to %s",
            trace.attempts, request_id, endpoint, exc.message, cause, failover.name,
        )  # fmt: skip
        self.metrics.retries.labels(trace.model, backend.name, "backend_error").inc()
        return failover

    def _degenerate_attempt(
        self, attempt: Attempt, trace: Trace, headers: CIMultiDict[str]
    ) -> bool:
        """A degenerate attempt: counted, captured, its salt forgotten; whether it is
        retried (the mode, the per-request bound and the budget allow it)."""
        kind = attempt.verdict.kind
        assert kind is not None
        backend = attempt.backend
        trace.degenerate_seen = True
        trace.kinds.append(kind)
        self.metrics.count_degenerate(
            trace.model, backend.name, backend.series_address, kind, trace.request.endpoint
        )
        self.accounting.capture(attempt, trace, kind)
        self.salting.forget(attempt, trace)
        retrying = self.mode is GuardMode.ENFORCE and self._may_retry(trace, backend)
        log.info(
            "request %s (%s): attempt %d from %s degenerate (%s); %s",
            headers["x-request-id"], trace.request.endpoint, trace.attempts, backend.name, kind,
            "retrying" if retrying else "not retried",
        )  # fmt: skip
        return retrying

    async def _may_send_elsewhere(self, exc: GatewayError, backend: Backend) -> bool:
        """Whether an attempt that failed in transport may be sent to another backend.

        Yes when it never reached its backend (the connection did not open), or its
        backend answered with something that is not an answer (an attempt, counted,
        like a degenerate one). A request the backend may still be working on, or may
        have stored (a cut connection, a silence, a body that broke off), is sent
        again only when the backend is gone: asked at once (``/health`` on a new
        connection), a backend that does not answer has lost what it held, for
        vLLM keeps requests and stored answers in its memory. A load balancer's
        idle timeout cutting a long generation leaves a healthy backend: no resend."""
        if not exc.may_have_reached_backend or isinstance(exc, UpstreamProtocolError):
            return True
        if await backend.probe_health(self.pool.probe_timeout_s):
            return False
        backend.mark(False)
        return True

    def _failover_backend(self, failed: Backend, trace: Trace) -> Backend | None:
        """Another backend for an attempt that sent nothing, if one exists and retries remain."""
        try:
            other = self.pool.choose_retry(
                failed, self.settings.guard.retry_target, self.rng, failover=True
            )
        except NoHealthyBackend:
            return None
        # Failing over costs vLLM little (the failed attempt never reached it, or was
        # answered with garbage at once): only the per-request bound applies, not the
        # budget.
        if other is failed or trace.attempts >= self.settings.guard.max_attempts:
            return None
        return other

    def _may_retry(self, trace: Trace, backend: Backend) -> bool:
        """A degenerate answer: retry it if attempts remain and the budget grants it."""
        if trace.attempts >= self.settings.guard.max_attempts:
            refusal: Refusal | RetryTicket = Refusal.MAX_ATTEMPTS
        else:
            refusal = self.budget.request_retry(backend.name, trace.client)
        if trace.otel is not None:
            decision = "granted" if isinstance(refusal, RetryTicket) else str(refusal)
            trace.otel.annotate_attempt({"vllm_guard.retry.decision": decision})
        if isinstance(refusal, RetryTicket):
            trace.ticket = refusal
            return True
        self.metrics.retries_refused.labels(trace.model, backend.name, refusal).inc()
        return False

    def _retry_route(
        self, trace: Trace, failed: Attempt, kind: DegenerateKind
    ) -> tuple[Backend, str]:
        """After ``failed`` turned ``kind``: the retry counted, and the backend and
        salt it goes to (a whole retry and a continuation alike)."""
        self.metrics.retries.labels(trace.model, failed.backend.name, kind).inc()
        salt = self.salting.retry_salt(trace, failed=failed.salt)
        backend = self.pool.choose_retry(
            failed.backend, self.settings.guard.retry_target, self.rng, failover=False
        )
        return backend, salt

    def _settle(self, trace: Trace, *, recovered: bool | None) -> None:
        """The outcome of a granted retry goes back to the budget."""
        if trace.ticket is not None:
            self.budget.settle(trace.ticket, recovered=recovered)
            trace.ticket = None

    async def _exhausted(self, attempt: Attempt, trace: Trace) -> Answer:
        kind = attempt.verdict.kind
        assert kind is not None
        if (
            self.mode is GuardMode.ENFORCE
            and self.settings.guard.on_exhausted is ExhaustedPolicy.ERROR
        ):
            await attempt.discard()
            if attempt.stream is not None:
                self.accounting.count_attempt(attempt, trace)
            refusal = DegenerateResponse(
                f"the backend returned a degenerate answer ({kind}) on all "
                f"{trace.attempts} attempt(s)"
            )
            # Counted "degenerate"; its span ends as the client's answer does: an error.
            self.accounting.finish(
                trace, attempt.backend, "degenerate", error=traced.error_type(refusal)
            )
            self.metrics.degenerate_refused.labels(
                trace.model, attempt.backend.name, kind, trace.request.endpoint
            ).inc()
            raise refusal
        if attempt.status != 200 and attempt.asked_logprobs:
            attempt = await self._resent_without_ask(attempt, trace)
        self.metrics.degenerate_delivered.labels(
            trace.model, attempt.backend.name, kind, trace.request.endpoint
        ).inc()
        return self._release(attempt, trace)

    async def _resent_without_ask(self, attempt: Attempt, trace: Trace) -> Attempt:
        """The client's request as it was sent, once more, to the same backend, on the
        same salt, without the gateway's own logprobs ask: where vLLM answered the ask
        with a 400 for a NaN it could not write and the degenerate answer is to be
        delivered, or refused the ask itself (``refused_the_ask``)."""
        assert trace.upstream_headers is not None
        trace.attempts += 1
        resent = await self._attempt(
            trace.request, attempt.backend, attempt.salt, trace.upstream_headers, trace,
            ask_logprobs=False, cause="resend",
        )  # fmt: skip
        if resent.status == 200 and attempt.verdict.degenerate:
            resent.verdict = attempt.verdict  # the NaN the 400 said, whatever the text
        return resent

    # -- one attempt --------------------------------------------------------------

    async def _attempt(
        self,
        request: GuardedRequest,
        backend: Backend,
        salt: str | None,
        headers: CIMultiDict[str],
        trace: Trace,
        *,
        overrides: dict[str, Any] | None = None,
        inspector: StreamInspector | None = None,
        ask_logprobs: bool = True,
        cause: str = "first",
    ) -> Attempt:
        """One attempt; with ``overrides`` and ``inspector`` a released stream's
        continuation (its body changed so, its text read by ``inspector``, which has
        the released text already, and never held back: it is relayed at once).
        ``ask_logprobs`` False: never with the backend's logprobs ask. ``cause``: why
        it is made (first, retry, failover, continuation, resend), for its span."""
        trace.attempt_started = time.perf_counter()
        ask = self._logprobs_ask(request, backend, trace) if ask_logprobs else None
        fields = {**attempt_overrides(request, salt), **(ask or {}), **(overrides or {})}
        body = body_with(request, fields)
        otel = trace.otel
        if otel is not None:
            otel.start_attempt(traced.attempt_attributes(trace, backend, salt, cause))
            if trace.attempts > 1:  # a retry, failover, continuation or resend: marked now,
                # for ``keep_retried``, however the request ends (the client may leave)
                otel.annotate(traced.RETRIED_MARK)
        if trace.attempts > 1 or otel is not None:
            headers = headers.copy()
            if trace.attempts > 1:
                # A distinct upstream id per attempt: vLLM may still be aborting the
                # previous one, and its logs then tell the attempts apart.
                headers["x-request-id"] = f"{headers['x-request-id']}-a{trace.attempts}"
            if otel is not None:  # vLLM's spans nest under this attempt's
                otel.inject(headers)
        opened = time.perf_counter()
        try:
            response = await backend.open("POST", request.path, headers=headers, body=body)
        except BaseException as exc:
            if otel is not None:
                otel.end_attempt(error=traced.error_type(exc))
            raise
        # Answered (a response started): the denominator of the bug's rate. An attempt
        # that never reached the backend is not one it could corrupt.
        self.metrics.upstream_attempts.labels(trace.model, backend.name).inc()
        attempt = Attempt(
            backend, salt, response.status, response_headers(response, verbatim=False)
        )
        attempt.asked_logprobs = ask is not None
        try:
            if response.status != 200 or not request.stream:
                with map_transport_errors(backend):
                    attempt.body = await response.read()
                response.release()
                if response.status == 200:
                    self.holding.inspect_body(attempt, trace)
                else:
                    self.holding.inspect_refusal(attempt, trace)
            else:
                continuing = inspector is not None
                if inspector is None:
                    inspector = StreamInspector(self.holding.detector_for(request.model))
                if request.watches_nan or ask is not None:
                    inspector.watch_logprobs()
                attempt.stream = StreamState(
                    response,
                    backend,
                    inspector,
                    strip_usage=request.api.openai_chunks and not request.client_wants_usage,
                    events=request.api.event_reader(inspector),
                    parser=SSEParser(self.settings.upstream.max_sse_event_bytes),
                    whole_events=continuing,
                    strip_logprobs=None if ask is None else request.api.strip_logprobs,
                )
                attempt.stream.watch_stalls(self.stalls)
                if not continuing:
                    await self.holding.hold(attempt, trace)
        except BaseException as exc:
            if attempt.stream is not None:
                attempt.stream.close()
            else:
                response.close()
            if otel is not None:
                otel.end_attempt(error=traced.error_type(exc))
            raise
        finally:
            attempt.upstream_s = time.perf_counter() - opened
            trace.upstream_s += attempt.upstream_s
        if attempt.stream is None:
            self.accounting.count_attempt(attempt, trace)
        if otel is not None:
            otel.annotate_attempt(traced.attempt_answered(attempt, inspected=trace.inspecting))
        return attempt

    def _logprobs_ask(
        self, request: GuardedRequest, backend: Backend, trace: Trace
    ) -> dict[str, Any] | None:
        """The fields that ask ``backend`` for the sampled tokens' logprobs the client
        did not ask for (``ask_logprobs``): a NaN logit is seen on every answer. Only
        where the verdict can act on it (enforce, ``nan_logits`` on): asked, vLLM
        answers a NaN it cannot write with a 400 instead of the degenerate text."""
        if (
            not backend.settings.ask_logprobs
            or trace.ask_refused
            or not trace.inspecting
            or self.mode is not GuardMode.ENFORCE
            or request.echoes_prompt
            or not self.holding.detector_for(request.model).settings.nan_logits
        ):
            return None
        return request.api.logprobs_ask(request.body, backend_keeps_answers=backend.keeps_responses)

    # -- releasing to the client ----------------------------------------------------

    def _headers(self, attempt: Attempt, trace: Trace, verdict: str) -> RawHeaders:
        return [
            *attempt.headers,
            (ATTEMPTS_HEADER_RAW, str(trace.attempts).encode()),
            (VERDICT_HEADER_RAW, verdict.encode()),
        ]

    def _request_verdict(self, attempt: Attempt, trace: Trace) -> str:
        if attempt.status != 200:
            return "error"
        if not trace.inspecting:  # guard.mode off, or nothing to inspect: never "clean"
            return "unguarded"
        if attempt.verdict.degenerate:
            return "degenerate"
        return "recovered" if trace.degenerate_seen else "clean"

    def _release(self, attempt: Attempt, trace: Trace) -> Answer:
        verdict = self._request_verdict(attempt, trace)
        if verdict in ("clean", "recovered"):
            self.salting.remember(attempt, trace)
        self._remember_answer(attempt, trace)
        headers = self._headers(attempt, trace, verdict)
        if attempt.stream is None:
            self.accounting.finish(trace, attempt.backend, verdict)
            return WholeAnswer(attempt.status, attempt.body, headers)
        now = time.perf_counter()
        self.metrics.ttft.labels(trace.model, attempt.backend.name).observe(now - trace.started)
        if trace.otel is not None:  # the stream's first bytes go to the client now
            trace.otel.annotate({"vllm_guard.time_to_first_token_s": now - trace.started})
        self.metrics.overhead.labels(trace.request.endpoint, "true").observe(
            max(0.0, now - trace.started - trace.upstream_s)
        )
        return StreamedAnswer(
            headers,
            lambda send, write_now: self._relay(attempt, trace, verdict, send, write_now),
            body_ready=bool(attempt.stream.held),
            after_complete=attempt.stream.finish_reading,
            on_close=lambda: self._closed(attempt, trace),
            on_client_gone=lambda: self._client_left_mid_stream(trace),
        )

    def _remember_answer(self, attempt: Attempt, trace: Trace) -> None:
        """An answer a later request may continue by id (Responses): remember its
        conversation, so the next turn is keyed on the same one."""
        if attempt.stream is not None:
            events = attempt.stream.events
            answer_id = events.answer_id if events is not None else None
        else:
            answer_id = trace.request.api.answer_id(attempt.payload or {})
        if answer_id is not None:
            self.salting.remember_answer(answer_id, attempt, trace)

    def client_left_before_response(self, request: GuardedRequest) -> None:
        """The client disconnected while the gateway was still working on its answer."""
        model = self.metrics.model_label(request.model)
        self.accounting.count_disconnect(model, request, "before_response")

    def _client_left_mid_stream(self, trace: Trace) -> None:
        trace.client_gone = True
        self.accounting.count_disconnect(trace.model, trace.request, "streaming")

    async def _relay(
        self,
        attempt: Attempt,
        trace: Trace,
        verdict: str,
        send: ChunkSender,
        write_now: ChunkWriter,
    ) -> bytes:
        """Send the held bytes, then the rest of the stream as it arrives, watching it:
        each chunk written at once where the server allows (``write_now``), else
        sent. The stream's last bytes (from the read that brought
        ``[DONE]``, or a closing error event) are returned, to leave with the end of
        the body in one write.

        With ``after_release: continue`` the stream's unsettled end is held back
        (``TailHold``); when it turns degenerate it is dropped and the answer is
        continued from the text the client has (``gateway.guard.continuation``),
        whose stream is relayed on in this one, rewritten by the API's splice."""
        relayed = _Relayed(attempt, verdict, clean=not attempt.verdict.degenerate)
        # A stream that ended while held was judged whole then (``HoldBack.hold``).
        inspect = trace.inspecting and not relayed.state.ended()
        tail = attempt.tail if inspect else None
        opened = time.perf_counter()
        try:
            return await self._relay_events(relayed, trace, tail, inspect, send, write_now)
        except GatewayError as exc:
            relayed.verdict, relayed.error = "error", traced.error_type(exc)
            return relayed.last + self._error_end(relayed, tail, exc)
        except asyncio.CancelledError:
            if trace.client_gone:
                raise  # counted as a disconnect; the verdict stands for what was sent
            # The shutdown grace ran out: end the stream in-band where the connection
            # still takes it, then let the cancellation go on.
            shutting_down = ShuttingDown("the gateway is shutting down")
            relayed.verdict, relayed.error = "error", traced.error_type(shutting_down)
            await send(relayed.last + self._error_end(relayed, tail, shutting_down))
            raise
        finally:
            self._relay_ended(relayed, trace, time.perf_counter() - opened)

    async def _relay_events(
        self,
        relayed: _Relayed,
        trace: Trace,
        tail: TailHold | None,
        inspect: bool,
        send: ChunkSender,
        write_now: ChunkWriter,
    ) -> bytes:
        """``_relay``'s loop: the stream's events to the client, each read judged."""
        state = relayed.state
        if state.held:
            data = b"".join(state.held)
            state.held.clear()
            if state.ended():
                relayed.last = data
            elif not write_now(data):
                await send(data)
        while True:
            state = relayed.state  # the first attempt's, then a continuation's
            forward = await state.next_batch()
            ended = forward is None
            if forward is not None and relayed.splice is not None:
                splice = relayed.splice
                forward = [out for raw in forward if (out := splice.event(raw)) is not None]
            if tail is not None and forward is not None:
                forward = tail.take(forward)
            kind = _late_kind(state, tail, ended) if inspect and relayed.clean else None
            if kind is not None:
                self._count_late(relayed.segment, trace, kind)
                if tail is not None and tail.holds(kind):
                    if forward:  # the settled text goes out first: the client has it
                        await send(b"".join(forward))
                        forward = []
                    if await self._continue(relayed, trace, tail, kind):
                        continue
                relayed.clean = False
                relayed.verdict = "degenerate"
                cut = self._after_release(relayed.segment, trace, kind, ended=ended)
                if cut is not None:
                    relayed.error = DegenerateResponse.code  # the stream ends in-band so
                    return cut
            if tail is not None and (ended or not relayed.clean):
                tail.continuable = False  # from here on relayed as it comes
                forward = tail.release_all(forward)
            if forward:
                data = forward[0] if len(forward) == 1 else b"".join(forward)
                if ended or state.done or state.upstream_error:  # the stream's last bytes
                    relayed.last += data
                elif not write_now(data):
                    await send(data)
            if ended:
                return relayed.last

    async def _continue(
        self, relayed: _Relayed, trace: Trace, tail: TailHold, kind: DegenerateKind
    ) -> bool:
        """The held end turned ``kind``: relay the answer's continuation from here on,
        if it is granted."""
        assert trace.continuation is not None
        continued = await trace.continuation.continue_after(
            relayed.segment, tail, kind, _RequestAttempts(self, trace)
        )
        if continued is None:
            return False
        relayed.segment, relayed.splice = continued
        relayed.verdict = "recovered"
        return True

    @staticmethod
    def _error_end(relayed: _Relayed, tail: TailHold | None, error: GatewayError) -> bytes:
        """The end of a stream that fails: what the tail still holds (healthy text: a
        degenerate end is dropped before it is continued), then the in-band error."""
        held = b"".join(tail.release_all()) if tail is not None else b""
        event = relayed.state.error_event(error)
        return held + (event if relayed.splice is None else relayed.splice.error(event))

    def _relay_ended(self, relayed: _Relayed, trace: Trace, seconds: float) -> None:
        """The relay is over, however it ended: the attempt relayed last counted, the
        request's outcome and its continuation's."""
        segment, state = relayed.segment, relayed.state
        if not state.done:  # a complete stream is read to its end, then closed
            state.close()
        segment.upstream_s += seconds
        trace.upstream_s += seconds
        segment.usage = state.usage
        if state.upstream_error:
            relayed.verdict = "error"
        verdict = relayed.verdict
        if not segment.counted:  # a degenerate one left for a continuation was
            self.accounting.count_attempt(segment, trace, degenerate=verdict == "degenerate")
        if trace.otel is not None:
            trace.otel.end_attempt(traced.relayed_attempt(segment, verdict, trace.client_gone))
        continuation = trace.continuation
        if continuation is not None:
            continuation.finish(verdict, client_gone=trace.client_gone)
            if continuation.asked and verdict == "recovered":
                # As after a whole retry: the conversation's next turn starts on the
                # salt that recovered it, not in the poisoned cache.
                self.salting.remember(segment, trace)
        self._settle(trace, recovered=None if trace.client_gone else verdict == "recovered")
        self.accounting.finish(trace, segment.backend, verdict, error=relayed.error)

    def _count_late(self, attempt: Attempt, trace: Trace, kind: DegenerateKind) -> None:
        """A released stream degenerated: counted and captured."""
        trace.degenerate_seen = True
        trace.kinds.append(kind)
        backend = attempt.backend
        self.metrics.count_degenerate(
            trace.model, backend.name, backend.series_address, kind, trace.request.endpoint
        )
        self.accounting.capture(attempt, trace, kind)
        if trace.otel is not None:
            trace.otel.annotate_attempt(traced.degenerate_after_release(kind))

    def _after_release(
        self, attempt: Attempt, trace: Trace, kind: DegenerateKind, *, ended: bool = False
    ) -> bytes | None:
        """A released stream that degenerated and is not continued: with policy "cut",
        ended in-band; else relayed, and counted as delivered."""
        backend = attempt.backend.name
        if (
            not ended
            and self.mode is GuardMode.ENFORCE  # observe: detect and count, never change
            and self.settings.guard.stream.after_release is AfterRelease.CUT
        ):
            assert attempt.stream is not None
            attempt.stream.close()
            self.metrics.stream_cut.labels(trace.model, backend).inc()
            return attempt.stream.error_event(
                DegenerateResponse(f"the answer degenerated ({kind}) after it was released")
            )
        self.metrics.degenerate_delivered.labels(
            trace.model, backend, kind, trace.request.endpoint
        ).inc()
        return None

    def _closed(self, attempt: Attempt, trace: Trace) -> None:
        """A released stream's end, however it came (even when its relay never ran)."""
        if attempt.stream is not None:
            attempt.stream.close()
        if trace.continuation is not None:
            trace.continuation.close()
        trace.unroute()
        if trace.otel is not None:  # ended by the outcome, unless the relay never ran
            trace.otel.end()


def _late_kind(state: StreamState, tail: TailHold | None, ended: bool) -> DegenerateKind | None:
    """What a released stream turned into, judged on the read that just came: the
    whole answer at its end, a suspect text as it goes, or what the tail holds whole
    (a loop, a run)."""
    inspector = state.inspector
    kind: DegenerateKind | None = None
    if ended:
        kind = inspector.final_verdict().kind if state.done else None
    elif inspector.suspect:
        kind = inspector.partial_verdict().kind
    if kind is None and tail is not None and tail.holding:
        kind = tail.signature()
    return kind


@dataclass(slots=True)
class _Relayed:
    """The stream a relay sends: the first attempt's, then each continuation's."""

    segment: Attempt
    verdict: str
    #: Released clean and not degenerate since.
    clean: bool
    splice: EventSplice | None = None
    #: The stream's last bytes, to leave with the end of the body.
    last: bytes = b""
    #: The error the client's stream ended with, in-band (its ``error.type``).
    error: str | None = None

    @property
    def state(self) -> StreamState:
        assert self.segment.stream is not None
        return self.segment.stream


@dataclass(slots=True)
class _RequestAttempts:
    """The loop's side of one request's continuations (``ContinuationHost``)."""

    guard: Guard
    trace: Trace

    def grant_retry(self, backend: Backend) -> bool:
        return self.guard._may_retry(self.trace, backend)

    def settle(self, *, recovered: bool) -> None:
        self.guard._settle(self.trace, recovered=recovered)

    def count_attempt(self, attempt: Attempt, *, degenerate: bool) -> None:
        self.guard.accounting.count_attempt(attempt, self.trace, degenerate=degenerate)

    def next_route(self, failed: Attempt, kind: DegenerateKind) -> tuple[Backend, str]:
        trace = self.trace
        backend, salt = self.guard._retry_route(trace, failed, kind)
        trace.attempts += 1
        trace.route(backend)
        return backend, salt

    async def open_attempt(
        self,
        backend: Backend,
        salt: str,
        fields: dict[str, Any],
        inspector: StreamInspector,
        released_tokens: int,
    ) -> Attempt:
        trace = self.trace
        assert trace.upstream_headers is not None
        attempt = await self.guard._attempt(
            trace.request, backend, salt, trace.upstream_headers, trace,
            overrides=fields, inspector=inspector, cause="continuation",
        )  # fmt: skip
        if trace.otel is not None:
            released: Attributes = {"vllm_guard.continuation.released_tokens": released_tokens}
            trace.otel.annotate_attempt(released)
            if attempt.status != 200:  # the continuation fails (the relay ends in error):
                # its span ends now, with its own status, not the relayed segment's end
                trace.otel.end_attempt(error=traced.http_error_type(attempt.status))
        return attempt
