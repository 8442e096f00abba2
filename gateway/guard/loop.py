"""The guard loop: attempts, verdicts, salted retries, the exhausted policy.

One request pipeline for every guarded API (``gateway.apis``: chat, completions,
Responses, Messages), streaming or not; what differs between them is asked of the
request's adapter. An *attempt*
opens the upstream response and lets the inspector read it (the whole body, or
a stream up to the hold-back window) before anything is sent to the client, so a
discarded attempt has sent nothing. Only then does the response start.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from multidict import CIMultiDict

from gateway.apis import ApiAdapter
from gateway.apis.base import EventSplice, ReleasedPart, RenderedPrompt
from gateway.config import (
    AfterRelease,
    ExhaustedPolicy,
    GuardMode,
    ReleasePolicy,
    Settings,
)
from gateway.detect import (
    DegenerateKind,
    Detector,
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
from gateway.guard.accounting import Accounting
from gateway.guard.answer import (
    Answer,
    ChunkSender,
    ChunkWriter,
    StreamedAnswer,
    WholeAnswer,
)
from gateway.guard.budget import Refusal, RetryBudget, RetryTicket
from gateway.guard.conversations import AnswerChains, SaltMemory, conversation_key
from gateway.guard.release import hold_decision
from gateway.guard.request import GuardedRequest, attempt_overrides, body_with
from gateway.guard.salt import SaltLadder, fresh_salt
from gateway.guard.shared_state import RedisLink, SharedAnswerChains, SharedSaltMemory
from gateway.guard.stream import StallWatch, StreamState
from gateway.guard.tail import TailHold
from gateway.guard.trace import Attempt, Trace
from gateway.observe.evidence import EvidenceStore
from gateway.observe.metrics import Metrics
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
#: How long an answer id that no backend held is not asked for again, and how many
#: such ids are remembered.
NOT_FOUND_MEMORY_S = 30.0
MAX_NOT_FOUND = 4096
#: Most bytes of one stream held back before the guard decides on what it has.
MAX_HELD_BYTES = 1024 * 1024


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
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.accounting = Accounting(metrics, evidence, version_of)
        self.rng = rng or random.Random()
        self.budget = RetryBudget(settings.guard.budget)
        self.stalls = StallWatch(settings.upstream.timeouts.read_s)
        salt_reuse = settings.guard.salt_reuse
        local_salts = SaltMemory(salt_reuse)
        local_chains = AnswerChains(salt_reuse.max_entries)
        #: Redis, when ``state.redis_url`` is set: both memories shared through it
        #: (gateway.guard.shared_state); else each process keeps its own.
        self.redis = (
            RedisLink(settings.state, metrics) if settings.state.redis_url is not None else None
        )
        self.shared_salts = (
            SharedSaltMemory(local_salts, self.redis, salt_reuse) if self.redis else None
        )
        self.salts: SaltMemory | SharedSaltMemory = (
            local_salts if self.shared_salts is None else self.shared_salts
        )
        self.chains: AnswerChains | SharedAnswerChains = (
            SharedAnswerChains(local_chains, self.redis, salt_reuse.ttl_s)
            if self.redis
            else local_chains
        )
        key = settings.guard.salt_reuse.key
        self.ladder = SaltLadder(key.get_secret_value().encode() if key is not None else None)
        self._detectors: dict[str, Detector] = {}
        self._holdback: dict[str | None, int] = {}
        self._release_policies: dict[str | None, ReleasePolicy] = {}
        self._default_detector = Detector(settings.guard.detectors)
        #: Answer ids no healthy backend held when asked, and when that was: asked
        #: again only after NOT_FOUND_MEMORY_S (a client repeating an unknown id
        #: would otherwise cost a GET on every pod per request).
        self._not_found: OrderedDict[str, float] = OrderedDict()

    # -- configuration lookups ----------------------------------------------------

    @property
    def mode(self) -> GuardMode:
        return self.settings.guard.mode

    def detector_for(self, model: str | None) -> Detector:
        if model is None or model not in self.settings.models:
            return self._default_detector
        detector = self._detectors.get(model)
        if detector is None:
            detector = Detector(self.settings.detectors_for(model))
            self._detectors[model] = detector
        return detector

    def release_for(self, model: str | None) -> ReleasePolicy:
        configured = model if model in self.settings.models else None  # a bounded set
        policy = self._release_policies.get(configured)
        if policy is None:
            policy = self._release_policies[configured] = self.settings.release_for(configured)
        return policy

    def holdback_for(self, model: str | None) -> int:
        """The hold-back ceiling in visible characters (0: streams are not held)."""
        if self.mode is not GuardMode.ENFORCE:
            return 0
        configured = model if model in self.settings.models else None  # a bounded set
        ceiling = self._holdback.get(configured)
        if ceiling is None:
            ceiling = self._holdback[configured] = self.settings.holdback_for(configured)
        return ceiling

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
        home = await self.answer_home(request.api, continued, headers) if continued else None
        trace, fingerprint = self._new_trace(request, started, client)
        trace.request_id = headers.get("x-request-id", "")
        trace.upstream_headers = headers
        self.budget.record_request()
        salt = await self._first_salt(trace)
        backend = home or self._first_backend(fingerprint)
        # From here the request holds an in-flight count and, while a retry is under
        # way, a budget ticket: every exit below gives both back (``_abandon``), and a
        # streamed answer hands them to its relay (``StreamedAnswer.on_close``).
        try:
            while True:
                trace.attempts += 1
                trace.route(backend)  # in flight on the pod that serves this attempt
                try:
                    attempt = await self._attempt(request, backend, salt, headers, trace)
                except (BackendUnreachable, UpstreamTimeout, UpstreamProtocolError) as exc:
                    failover = await self._after_transport_failure(exc, backend, trace, headers)
                    if failover is None:
                        raise
                    backend = failover
                    continue
                self._settle(
                    trace, recovered=attempt.status == 200 and not attempt.verdict.degenerate
                )
                if attempt.status != 200 or not attempt.verdict.degenerate:
                    return self._release(attempt, trace)
                if not self._degenerate_attempt(attempt, trace, headers):
                    return await self._exhausted(attempt, trace)
                await attempt.discard()
                if attempt.stream is not None:
                    self.accounting.count_attempt(attempt, trace)
                self.metrics.retries.labels(trace.model, backend.name, attempt.verdict.kind).inc()
                salt = self._retry_salt(trace, failed=attempt.salt)
                backend = self.pool.choose_retry(
                    backend, self.settings.guard.retry_target, self.rng, failover=False
                )
        except GatewayError:
            self._abandon(trace, backend, recovered=False)
            raise
        except BaseException:  # the client left: the retry's outcome is unknown
            self._abandon(trace, backend, recovered=None)
            raise

    def _abandon(self, trace: Trace, backend: Backend, *, recovered: bool | None) -> None:
        """The request leaves the loop without an answer to release: its budget ticket
        settled, its in-flight count given back; a failure (``recovered`` False) is
        counted as the request's outcome unless it already was (the exhausted policy
        "error" counts "degenerate"). A client that left is counted by the server."""
        self._settle(trace, recovered=recovered)
        trace.end_prompt_check()
        if recovered is None:
            trace.unroute()
        elif not trace.finished:
            self.accounting.finish(trace, backend, "error")

    def _new_trace(
        self, request: GuardedRequest, started: float, client: str
    ) -> tuple[Trace, str | None]:
        """The request's Trace, and its conversation fingerprint when it is needed now."""
        reuse_salts = self.settings.guard.salt_reuse.enabled and self.mode is GuardMode.ENFORCE
        # The fingerprint (a hash of the leading messages) is needed now only to route
        # by conversation or to look up a remembered salt; with no salt remembered it
        # is computed if and when a retry needs it (Guard.conversation).
        fingerprint = (
            self._fingerprint(request)
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

    async def _first_salt(self, trace: Trace) -> str | None:
        """The client's salt, or the conversation's remembered clean rung."""
        if self.shared_salts is not None and trace.conversation is not None:
            remembered = await self.shared_salts.lookup(trace.conversation)
        else:
            remembered = self.salts.get(trace.conversation)
        if remembered is None or not self.settings.guard.salt_reuse.on_first_attempt:
            return trace.request.client_salt
        salt, trace.rung = remembered
        self.metrics.salt_reuse.labels(trace.model, "first").inc()
        return salt

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
        self.metrics.count_degenerate(trace.model, backend.name, kind, trace.request.endpoint)
        self.accounting.capture(attempt, trace, kind)
        if attempt.salt is not None and attempt.salt != trace.request.client_salt:
            self.salts.forget(self.conversation(trace), attempt.salt)
        retrying = self.mode is GuardMode.ENFORCE and self._may_retry(trace, backend)
        log.info(
            "request %s (%s): attempt %d from %s degenerate (%s); %s",
            headers["x-request-id"], trace.request.endpoint, trace.attempts, backend.name, kind,
            "retrying" if retrying else "not retried",
        )  # fmt: skip
        return retrying

    async def answer_home(
        self, api: ApiAdapter, answer_id: str, headers: Mapping[str, str]
    ) -> Backend | None:
        """The healthy backend that stores the answer ``answer_id`` (Responses: a
        follow-up by ``previous_response_id``, GET and cancel of the id must go there).

        Remembered by this process or, with Redis, by any; else (no Redis, an expired
        entry, the pod gone) found by asking every healthy backend for it, and
        remembered. None when no backend holds it (the request goes where routing
        sends it, and vLLM answers its 404)."""
        chain = await self.chains.lookup(answer_id)
        if chain is not None and (known := self.pool.healthy_with_identity(chain.backend)):
            self.metrics.answer_homes.labels("remembered").inc()
            return known
        path = api.stored_path(answer_id)
        if path is None or sum(b.healthy for b in self.pool.backends) < 2:
            return None  # one backend: routing has no other choice to make
        asked_at = self._not_found.get(answer_id)
        now = time.monotonic()
        if asked_at is not None and now - asked_at < NOT_FOUND_MEMORY_S:
            self.metrics.answer_homes.labels("not_found").inc()
            return None
        found = await self.pool.first_holding(path, headers)
        self.metrics.answer_homes.labels("asked" if found else "not_found").inc()
        if found is None:
            self._not_found[answer_id] = now
            self._not_found.move_to_end(answer_id)
            while len(self._not_found) > MAX_NOT_FOUND:
                self._not_found.popitem(last=False)
        else:
            self._not_found.pop(answer_id, None)
            conversation = chain.conversation if chain is not None else None
            self.chains.remember(answer_id, conversation, found.identity)
        return found

    def _fingerprint(self, request: GuardedRequest) -> str | None:
        continued = request.api.continues(request.body)
        if continued is not None:  # the history lives in the backend: key on its chain
            return self.chains.conversation_of(continued)
        return conversation_key(
            request.endpoint, request.body, request.client_salt, self.settings.guard.salt_reuse
        )

    def conversation(self, trace: Trace) -> str | None:
        """The request's conversation fingerprint (None when salts are not reused)."""
        if not trace.conversation_known:
            trace.conversation = self._fingerprint(trace.request)
            trace.conversation_known = True
        return trace.conversation

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
        if isinstance(refusal, RetryTicket):
            trace.ticket = refusal
            return True
        self.metrics.retries_refused.labels(trace.model, backend.name, refusal).inc()
        return False

    def _settle(self, trace: Trace, *, recovered: bool | None) -> None:
        """The outcome of a granted retry goes back to the budget."""
        if trace.ticket is not None:
            self.budget.settle(trace.ticket, recovered=recovered)
            trace.ticket = None

    def _retry_salt(self, trace: Trace, failed: str | None) -> str:
        """The remembered clean rung if it is not the one that just failed, else the
        conversation's next rung (every process computes the same one), else for a
        request with no conversation a fresh random salt.

        The last attempt a request may make always gets a fresh random salt: a
        namespace nobody has used is a cache miss, and a miss cannot load a corrupt
        state. Shared rungs save prefill, but another process may have seen a rung
        go bad that this one still takes for clean (two gateways alternating a
        conversation's turns delivered corrupt answers when every retry climbed the
        ladder: BENCHMARKS.md)."""
        if trace.attempts + 1 >= self.settings.guard.max_attempts:
            return fresh_salt(trace.request.client_salt)
        conversation = self.conversation(trace)
        remembered = self.salts.get(conversation)
        if remembered is not None and remembered[0] != failed:
            self.metrics.salt_reuse.labels(trace.model, "retry").inc()
            salt, trace.rung = remembered
            return salt
        if conversation is None:
            return fresh_salt(trace.request.client_salt)
        trace.rung += 1
        return self.ladder.rung(conversation, trace.request.client_salt, trace.rung)

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
            self.accounting.finish(trace, attempt.backend, "degenerate")
            self.metrics.degenerate_refused.labels(
                trace.model, attempt.backend.name, kind, trace.request.endpoint
            ).inc()
            raise DegenerateResponse(
                f"the backend returned a degenerate answer ({kind}) on all "
                f"{trace.attempts} attempt(s)"
            )
        self.metrics.degenerate_delivered.labels(
            trace.model, attempt.backend.name, kind, trace.request.endpoint
        ).inc()
        return self._release(attempt, trace)

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
    ) -> Attempt:
        """One attempt; with ``overrides`` and ``inspector`` a released stream's
        continuation (its body changed so, its text read by ``inspector``, which has
        the released text already, and never held back: it is relayed at once)."""
        trace.attempt_started = time.perf_counter()
        body = body_with(request, {**attempt_overrides(request, salt), **(overrides or {})})
        if trace.attempts > 1:
            # A distinct upstream id per attempt: vLLM may still be aborting the
            # previous one, and its logs then tell the attempts apart.
            headers = headers.copy()
            headers["x-request-id"] = f"{headers['x-request-id']}-a{trace.attempts}"
        opened = time.perf_counter()
        response = await backend.open("POST", request.path, headers=headers, body=body)
        # Answered (a response started): the denominator of the bug's rate. An attempt
        # that never reached the backend is not one it could corrupt.
        self.metrics.upstream_attempts.labels(trace.model, backend.name).inc()
        attempt = Attempt(
            backend, salt, response.status, response_headers(response, verbatim=False)
        )
        try:
            if response.status != 200 or not request.stream:
                with map_transport_errors(backend):
                    attempt.body = await response.read()
                response.release()
                if response.status == 200:
                    self._inspect_body(attempt, trace)
            else:
                continuing = inspector is not None
                if inspector is None:
                    inspector = StreamInspector(self.detector_for(request.model))
                attempt.stream = StreamState(
                    response,
                    backend,
                    inspector,
                    strip_usage=request.api.openai_chunks and not request.client_wants_usage,
                    events=request.api.event_reader(inspector),
                    parser=SSEParser(self.settings.upstream.max_sse_event_bytes),
                    whole_events=continuing,
                )
                attempt.stream.watch_stalls(self.stalls)
                if not continuing:
                    await self._hold_back(attempt, trace)
        except BaseException:
            if attempt.stream is not None:
                attempt.stream.close()
            else:
                response.close()
            raise
        finally:
            attempt.upstream_s = time.perf_counter() - opened
            trace.upstream_s += attempt.upstream_s
        if attempt.stream is None:
            self.accounting.count_attempt(attempt, trace)
        return attempt

    def _inspect_body(self, attempt: Attempt, trace: Trace) -> None:
        try:
            payload = orjson.loads(attempt.body)
        except orjson.JSONDecodeError:
            payload = None
        if not isinstance(payload, dict):
            # An HTML error page, a truncated or empty body: never "clean".
            raise UpstreamProtocolError(
                f"backend {attempt.backend.name} answered 200 with a body that is not a JSON object"
            )
        request = trace.request
        attempt.usage = request.api.read_usage(payload)
        attempt.payload = payload
        if trace.inspecting:
            attempt.verdict = request.api.inspect_body(self.detector_for(request.model), payload)

    async def _hold_back(self, attempt: Attempt, trace: Trace) -> None:
        """Read the stream until the guard can decide, keeping every byte back.

        Adaptive: released as soon as the inspector finds the text clearly healthy,
        held while it could still be degenerate, judged at the ceiling (or when the
        held bytes reach MAX_HELD_BYTES: a flood of whitespace shows no characters).

        A stream the guard can continue (its request has a continuation plan) is
        handed to its rolling hold-back (``TailHold``) from the first byte: what may
        be released is only what the tail has settled, whatever arrives in one read,
        and with ``auto`` it is released at its first token."""
        state = attempt.stream
        assert state is not None
        request = trace.request
        ceiling = self.holdback_for(request.model) if trace.inspecting else 0
        if ceiling == 0:
            return  # inspected and counted only: nothing is held, nothing continued
        min_release = min(self.settings.guard.stream.min_release_chars, ceiling)
        policy = self.release_for(request.model)
        inspector = state.inspector
        tail = self._tail_for(trace, inspector) if self._continuable(request) else None
        attempt.tail = tail
        first_token = policy is ReleasePolicy.FIRST_TOKEN or (
            policy is ReleasePolicy.AUTO and tail is not None
        )
        # An echoed prompt (``echo``) arrives as the stream's first text: it counts
        # for nothing, and the answer after it is held as if the stream began there.
        echo_unseen = request.echoes_prompt
        first_token = first_token and not echo_unseen
        echoed = held_bytes = 0
        while (forward := await state.next_batch()) is not None:
            held_bytes += sum(map(len, forward))
            state.held.extend(forward if tail is None else tail.take(forward))
            if state.ended():
                break
            if echo_unseen and inspector.visible_chars:
                echoed, echo_unseen = inspector.visible_chars, False
            decide = functools.partial(
                hold_decision, inspector, min_release + echoed, request.n, ceiling + echoed,
                full=held_bytes >= MAX_HELD_BYTES, content_only=tail is not None,
            )  # fmt: skip
            decision = decide(first_token=first_token)
            if decision is not None and tail is not None and not decision.degenerate:
                if not tail.continuable or not await self._plan_holds(trace):
                    # Not continuable after all: released as adaptive releases it.
                    state.held.extend(tail.release_all())
                    attempt.tail = tail = None
                    first_token = policy is ReleasePolicy.FIRST_TOKEN
                    decision = decide(first_token=first_token, content_only=False)
                elif not tail.has_released_text:
                    # Everything read so far is the tail's unsettled end ("The
                    # capital is !!!!" in one read): held until settled, or judged.
                    continue
            if decision is not None:
                attempt.verdict = decision
                return
        if tail is not None:
            state.held.extend(tail.release_all())  # the whole answer is judged below
        attempt.usage = state.usage
        if state.done and not state.upstream_error:
            attempt.verdict = inspector.final_verdict()

    async def _plan_holds(self, trace: Trace) -> bool:
        """The request's continuation plan still holds at release: for an API
        continued by token ids, vLLM's count agreed with the rendered prompt (the
        check started beside the first attempt)."""
        if trace.prompt_ids is None:
            return True
        return await asyncio.shield(trace.prompt_ids) is not None

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
        if trace.request.unguardable:
            return "unguarded"
        if attempt.verdict.degenerate:
            return "degenerate"
        return "recovered" if trace.degenerate_seen else "clean"

    def _remember_salt(self, attempt: Attempt, trace: Trace) -> None:
        """A clean answer came on ``attempt``'s salt: the conversation's next turn
        starts there (shared through Redis where configured)."""
        salt = attempt.salt
        if salt not in (None, trace.request.client_salt):
            self.salts.remember(self.conversation(trace), salt, trace.rung)

    def _release(self, attempt: Attempt, trace: Trace) -> Answer:
        verdict = self._request_verdict(attempt, trace)
        if verdict in ("clean", "recovered"):
            self._remember_salt(attempt, trace)
        self._remember_answer(attempt, trace)
        headers = self._headers(attempt, trace, verdict)
        if attempt.stream is None:
            self.accounting.finish(trace, attempt.backend, verdict)
            return WholeAnswer(attempt.status, attempt.body, headers)
        now = time.perf_counter()
        self.metrics.ttft.labels(trace.model, attempt.backend.name).observe(now - trace.started)
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
            conversation = self.conversation(trace) or self._fingerprint(trace.request)
            self.chains.remember(answer_id, conversation, attempt.backend.identity)

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
        continued from the text the client has (``_continuation``), whose stream is
        relayed on in this one, rewritten by the API's splice."""
        state = attempt.stream
        assert state is not None
        inspector = state.inspector
        # A stream that ended while held was judged whole then (``_hold_back``).
        inspect = trace.inspecting and not state.ended()
        tail = attempt.tail if inspect else None
        splice: EventSplice | None = None
        segment = attempt  # the attempt being relayed: the first, then a continuation
        released_clean = not attempt.verdict.degenerate
        opened = time.perf_counter()
        last = b""
        try:
            if state.held:
                data = b"".join(state.held)
                state.held.clear()
                if state.ended():
                    last = data
                elif not write_now(data):
                    await send(data)
            while True:
                forward = await state.next_batch()
                ended = forward is None
                if forward is not None and splice is not None:
                    forward = [out for raw in forward if (out := splice.event(raw)) is not None]
                if tail is not None and forward is not None:
                    forward = tail.take(forward)
                kind: DegenerateKind | None = None
                if released_clean and inspect:
                    if ended:
                        kind = inspector.final_verdict().kind if state.done else None
                    elif inspector.suspect:
                        kind = inspector.partial_verdict().kind
                    if kind is None and tail is not None and tail.holding:
                        kind = tail.signature()  # a loop or a run the tail holds whole
                if kind is not None:
                    self._count_late(segment, trace, kind)
                    if tail is not None and tail.holds(kind):
                        if forward:  # the settled text goes out first: the client has it
                            await send(b"".join(forward))
                            forward = []
                        continued = await self._continuation(segment, trace, tail, kind)
                        if continued is not None:
                            segment, splice = continued
                            assert segment.stream is not None
                            state, inspector = segment.stream, segment.stream.inspector
                            verdict = "recovered"
                            continue
                    released_clean = False
                    verdict = "degenerate"
                    cut = self._after_release(segment, trace, kind, ended=ended)
                    if cut is not None:
                        return cut
                if tail is not None and (ended or not released_clean):
                    tail.continuable = False  # from here on relayed as it comes
                    forward = tail.release_all(forward)
                if forward:
                    data = forward[0] if len(forward) == 1 else b"".join(forward)
                    if ended or state.done or state.upstream_error:  # the stream's last bytes
                        last += data
                    elif not write_now(data):
                        await send(data)
                if ended:
                    break
        except GatewayError as exc:
            verdict = "error"
            # What the tail still holds is healthy text (a degenerate end is dropped
            # before it is continued): the client gets it before the error.
            held = b"".join(tail.release_all()) if tail is not None else b""
            error = state.error_event(exc)
            return last + held + (error if splice is None else splice.error(error))
        except asyncio.CancelledError:
            if trace.client_gone:
                raise  # counted as a disconnect; the verdict stands for what was sent
            # The shutdown grace ran out: end the stream in-band where the connection
            # still takes it, then let the cancellation go on.
            verdict = "error"
            shutting_down = ShuttingDown("the gateway is shutting down")
            held = b"".join(tail.release_all()) if tail is not None else b""
            error = state.error_event(shutting_down)
            await send(last + held + (error if splice is None else splice.error(error)))
            raise
        finally:
            if not state.done:  # a complete stream is read to its end, then closed
                state.close()
            relayed = time.perf_counter() - opened
            segment.upstream_s += relayed
            trace.upstream_s += relayed
            segment.usage = state.usage
            if state.upstream_error:
                verdict = "error"
            if not segment.counted:  # a degenerate one left for a continuation was
                self.accounting.count_attempt(segment, trace, degenerate=verdict == "degenerate")
            if trace.continuations and not trace.client_gone and not trace.continuation_counted:
                outcome = "clean" if verdict == "recovered" else verdict
                self.metrics.continuations.labels(trace.request.endpoint, outcome).inc()
            if trace.continuations and verdict == "recovered":
                # As after a whole retry: the conversation's next turn starts on the
                # salt that recovered it, not in the poisoned cache.
                self._remember_salt(segment, trace)
            self._settle(trace, recovered=None if trace.client_gone else verdict == "recovered")
            self.accounting.finish(trace, segment.backend, verdict)
        return last

    def _tail_for(self, trace: Trace, inspector: StreamInspector) -> TailHold:
        """The rolling hold-back of a stream the guard may continue; for an API
        continued by token ids, its prompt check starts now, beside the attempt."""
        request = trace.request
        rendered = request.api.rendered_prompt(request.body)
        backend = trace.routed
        if rendered is not None and backend is not None and trace.needs_prompt_check(backend):
            headers = trace.upstream_headers
            assert headers is not None
            trace.start_prompt_check(
                backend,
                asyncio.ensure_future(self._rendered_prompt_ids(backend, rendered, headers)),
            )
        settings = inspector.detector.settings
        max_unit = settings.token_loop_max_unit_chars if settings.token_loop else 0
        return TailHold(inspector.detector.candidates, inspector, max_unit=max_unit)

    def _continuable(self, request: GuardedRequest) -> bool:
        """The request has a continuation plan: a degenerate end after release may be
        continued (``after_release: continue``). Decided on the whole body before
        the first byte; a body too large to decode whole (``spans``) has none."""
        return (
            self.mode is GuardMode.ENFORCE
            and self.settings.guard.stream.after_release is AfterRelease.CONTINUE
            and request.n == 1
            and request.spans is None
            and request.api.can_continue(request.body)
        )

    async def _continuation(
        self, segment: Attempt, trace: Trace, tail: TailHold, kind: DegenerateKind
    ) -> tuple[Attempt, EventSplice] | None:
        """A released stream's held end turned degenerate: ask for the answer's
        continuation from exactly the text the client has, with a fresh salt (it
        misses the poisoned blocks as a whole retry does), within ``max_attempts``
        and the budget. None where that is refused: the stream goes on as ``pass``.

        Raises a GatewayError (the stream ends with an in-band error) when the
        continuation cannot be had from the backend."""
        request = trace.request
        backend = segment.backend
        api = request.endpoint
        if trace.continuations and not trace.continuation_counted:
            self._settle(trace, recovered=False)  # the last continuation degenerated too
            self.metrics.continuations.labels(api, "degenerate").inc()
            trace.continuation_counted = True
        released = tail.released_text
        body = request.body
        headers = trace.upstream_headers
        assert headers is not None
        # The released text's tokens: the continuation's prompt holds them, the
        # continuation's token limits and the usage the client gets count them
        # (vLLM's tokenizer: one event may carry several tokens, with MTP or
        # --stream-interval).
        text_ids = await backend.tokenize(
            {"model": request.model, "prompt": released, "add_special_tokens": False}, headers
        )
        generated = tail.released_events if text_ids is None else len(text_ids)
        prompt_ids = await trace.prompt_ids if trace.prompt_ids is not None else None
        continued_ids = None
        if prompt_ids is not None and text_ids is not None:
            continued_ids = prompt_ids + text_ids
        overrides = request.api.continuation(body, released, generated, continued_ids)
        if (
            overrides is None
            or self.mode is not GuardMode.ENFORCE
            or not self._may_retry(trace, backend)
        ):
            self.metrics.continuations.labels(api, "refused").inc()
            trace.continuation_counted = True
            return None
        trace.continuation_counted = False
        tail.drop()  # never sent, whatever becomes of the continuation
        stream = segment.stream
        assert stream is not None
        stream.close()  # the rest of a degenerate answer is not worth reading
        segment.usage = stream.usage
        self.accounting.count_attempt(segment, trace, degenerate=True)
        self.metrics.retries.labels(trace.model, backend.name, kind).inc()
        salt = self._retry_salt(trace, failed=segment.salt)
        backend = self.pool.choose_retry(
            backend, self.settings.guard.retry_target, self.rng, failover=False
        )
        trace.attempts += 1
        trace.continuations += 1
        trace.route(backend)
        splice = request.api.splice(
            ReleasedPart(tail.first_bytes, tail.latest_bytes, released, generated, generated)
        )
        if splice is None:
            raise UpstreamProtocolError("the released stream's opening event is not JSON")
        inspector = StreamInspector(self.detector_for(request.model))
        inspector.feed_output(0, content=released)
        continued = await self._attempt(
            request, backend, salt, headers, trace, overrides=overrides, inspector=inspector
        )
        if continued.status != 200:
            raise UpstreamProtocolError(
                f"backend {backend.name} answered the continuation of a released stream "
                f"with HTTP {continued.status}"
            )
        log.info(
            "request %s (%s): released stream degenerate (%s) after %d characters; "
            "continued on %s (attempt %d)",
            trace.request_id, api, kind, len(released), backend.name, trace.attempts,
        )  # fmt: skip
        tail.follow(inspector, inspector.text_events)
        trace.continuing = continued
        return continued, splice

    @staticmethod
    async def _rendered_prompt_ids(
        backend: Backend, rendered: RenderedPrompt, headers: CIMultiDict[str]
    ) -> list[int] | None:
        """The prompt's token ids as vLLM renders it, for an API continued by token
        ids; None unless vLLM's own count for the request agrees (the gateway renders
        a conversation the way vLLM converts it; a count that differs says it did
        not, and the answer is not continued)."""
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

    def _count_late(self, attempt: Attempt, trace: Trace, kind: DegenerateKind) -> None:
        """A released stream degenerated: counted and captured."""
        trace.degenerate_seen = True
        trace.kinds.append(kind)
        self.metrics.count_degenerate(
            trace.model, attempt.backend.name, kind, trace.request.endpoint
        )
        self.accounting.capture(attempt, trace, kind)

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
        for relayed in (attempt, trace.continuing):
            if relayed is not None and relayed.stream is not None:
                relayed.stream.close()
        trace.end_prompt_check()
        trace.unroute()
