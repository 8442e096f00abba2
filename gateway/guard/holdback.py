"""Reading an attempt until the guard may decide on it: a whole body is judged at
once; a stream is held back (every byte kept from the client) until the release
policy (``gateway.guard.release``) lets it go or the inspector calls it degenerate.

A stream whose request has a continuation plan is handed to its rolling hold-back
(``TailHold``) from the first byte, and may be released at its first token; the
per-model settings (detectors, hold-back ceiling, release policy) are looked up
here, once per model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import orjson
from multidict import CIMultiDict

from gateway.config import AfterRelease, GuardMode, ReleasePolicy, Settings
from gateway.detect import CLEAN, DegenerateKind, Detector, StreamInspector, Verdict
from gateway.detect.logprobs import NAN_BODY_ERROR
from gateway.errors import UpstreamProtocolError
from gateway.guard.attempt import Attempt
from gateway.guard.continuation import Continuation
from gateway.guard.release import hold_decision
from gateway.guard.request import GuardedRequest
from gateway.guard.tail import TailHold
from gateway.guard.trace import Trace
from gateway.observe.metrics import Metrics

#: Most bytes of one stream held back before the guard decides on what it has.
MAX_HELD_BYTES = 1024 * 1024


@dataclass(slots=True)
class EchoedPrompts:
    """The visible characters of each choice's echoed prompt (its first text), so that
    they count for nothing in the release decision."""

    expected: int
    chars: dict[int, int] = field(default_factory=dict)

    def see(self, inspector: StreamInspector) -> tuple[int, int]:
        """The echoes seen so far: the longest (a choice's threshold grows by it) and
        all of them (the stream's ceiling does)."""
        if len(self.chars) < self.expected:
            for index, choice in inspector.choices.items():
                if index not in self.chars and choice.visible:
                    self.chars[index] = choice.visible
        return max(self.chars.values(), default=0), sum(self.chars.values())

    @property
    def complete(self) -> bool:
        return len(self.chars) >= self.expected


class HoldBack:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._detectors: dict[str, Detector] = {}
        self._holdback: dict[str | None, int] = {}
        self._release_policies: dict[str | None, ReleasePolicy] = {}
        self._default_detector = Detector(settings.guard.detectors)

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

    def inspect_body(self, attempt: Attempt, trace: Trace) -> None:
        """Judge a whole answer (a body that is not a JSON object is never clean)."""
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
        if not trace.inspecting:
            return
        detector = self.detector_for(request.model)
        watches_nan = request.watches_nan or attempt.asked_logprobs
        nan_choice = (
            request.api.sampled_nan(payload)
            if watches_nan and detector.settings.nan_logits
            else None
        )
        if attempt.asked_logprobs:  # what the client gets is what it asked for
            attempt.body = request.api.strip_logprobs(attempt.body)
        if nan_choice is not None:  # the mechanism itself, before the content rules
            attempt.verdict = Verdict(DegenerateKind.NAN_LOGITS, nan_choice)
        else:
            attempt.verdict = request.api.inspect_body(detector, payload)

    def inspect_refusal(self, attempt: Attempt, trace: Trace) -> None:
        """An answer that is not a 200: vLLM's 400 for a whole body with a NaN
        logprob in it (its JSON encoder refuses the NaN) is the bug, met by a
        request that asked for logprobs: degenerate, and retried as any is."""
        request = trace.request
        if (
            attempt.status == 400
            and trace.inspecting
            and (request.watches_nan or attempt.asked_logprobs)
            and self.detector_for(request.model).settings.nan_logits
            and NAN_BODY_ERROR in attempt.body
        ):
            attempt.verdict = Verdict(DegenerateKind.NAN_LOGITS, 0)

    async def hold(self, attempt: Attempt, trace: Trace) -> None:
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
        continuation = trace.continuation
        tail = self._tail_for(trace, inspector) if continuation is not None else None
        attempt.tail = tail
        first_token = policy is ReleasePolicy.FIRST_TOKEN or (
            policy is ReleasePolicy.AUTO and tail is not None
        )
        # An echoed prompt arrives as each choice's first text: it counts for nothing,
        # and the answer after it is held as if the stream began there.
        echoes = EchoedPrompts(request.n) if request.echoes_prompt else None
        first_token = first_token and echoes is None
        held_bytes = 0
        while (forward := await state.next_batch()) is not None:
            held_bytes += sum(map(len, forward))
            state.held.extend(forward if tail is None else tail.take(forward))
            if state.ended():
                break
            per_choice, in_all = echoes.see(inspector) if echoes is not None else (0, 0)
            decide = functools.partial(
                hold_decision, inspector, min_release + per_choice, request.n, ceiling + in_all,
                full=held_bytes >= MAX_HELD_BYTES, content_only=tail is not None,
            )  # fmt: skip
            decision = decide(first_token=first_token)
            if echoes is not None and not echoes.complete and not (decision or CLEAN).degenerate:
                continue  # a choice's echo is still to come: nothing of its answer seen
            if decision is not None and tail is not None and not decision.degenerate:
                assert continuation is not None
                if not tail.continuable or not await continuation.holds(attempt.backend):
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

    def _tail_for(self, trace: Trace, inspector: StreamInspector) -> TailHold:
        """The rolling hold-back of a stream the guard may continue; a plan continued
        by token ids has its prompt checked now, beside the attempt."""
        assert trace.continuation is not None
        assert trace.routed is not None
        trace.continuation.check_prompt(trace.routed)
        settings = inspector.detector.settings
        max_unit = settings.token_loop_max_unit_chars if settings.token_loop else 0
        return TailHold(inspector.detector.candidates, inspector, max_unit=max_unit)

    def continuation_for(
        self, request: GuardedRequest, headers: CIMultiDict[str]
    ) -> Continuation | None:
        """How a released stream's degenerate end is continued (``after_release:
        continue``), when its request has a continuation plan: decided on the whole
        body before the first byte; a body too large to decode whole (``spans``) has
        none."""
        if not (
            request.stream
            and self.mode is GuardMode.ENFORCE
            and self.settings.guard.stream.after_release is AfterRelease.CONTINUE
            and request.n == 1
            and request.spans is None
        ):
            return None
        plan = request.api.continuation_plan(request.body)
        return None if plan is None else Continuation(plan, request, headers, self.metrics)
