"""What the guard counts and records: metrics per attempt and per request, evidence
of degenerate answers, client departures."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gateway.detect import DegenerateKind
from gateway.guard import traced
from gateway.guard.attempt import Attempt, judged_label
from gateway.guard.request import GuardedRequest
from gateway.guard.trace import Trace
from gateway.observe.evidence import EvidenceRecord, EvidenceStore, prompt_fingerprint
from gateway.observe.metrics import Metrics
from gateway.upstream.pool import Backend

log = logging.getLogger(__name__)


class Accounting:
    def __init__(
        self,
        metrics: Metrics,
        evidence: EvidenceStore | None,
        version_of: Callable[[str], str | None],
    ) -> None:
        self.metrics = metrics
        self.evidence = evidence
        self.version_of = version_of
        #: Backends already reported as not sending cached_tokens (warned once each).
        self._tokens_unreported: set[str] = set()

    def capture(self, attempt: Attempt, trace: Trace, kind: DegenerateKind) -> None:
        if self.evidence is None:
            return
        request = trace.request
        body = request.full_body()
        usage = attempt.usage or (attempt.stream.usage if attempt.stream else None)
        try:
            self.evidence.write(
                EvidenceRecord(
                    model=request.model,
                    backend=attempt.backend.name,
                    vllm_version=self.version_of(attempt.backend.name),
                    kind=kind,
                    endpoint=request.endpoint,
                    stream=request.stream,
                    attempt=trace.attempts,
                    prompt_tokens=usage.prompt_tokens if usage else None,
                    cached_tokens=usage.cached_tokens if usage else None,
                    prompt_fingerprint=prompt_fingerprint(body),
                    output=attempt.output_text(request.api),
                    prompt=body.get(request.api.conversation_field or "prompt"),
                    request_id=trace.request_id or None,
                )
            )
        except OSError:
            log.warning("evidence capture failed; continuing without it", exc_info=True)

    def count_attempt(self, attempt: Attempt, trace: Trace, degenerate: bool | None = None) -> None:
        attempt.counted = True
        backend = attempt.backend.name
        self.metrics.upstream_duration.labels(trace.model, backend).observe(attempt.upstream_s)
        usage = attempt.usage
        if usage is None:
            return
        label = judged_label(
            attempt.verdict.degenerate if degenerate is None else degenerate,
            inspected=trace.inspecting,
        )
        if usage.cached_tokens is None:
            # Counting prompt tokens alone would read as a 0% hit rate: leave both.
            if backend not in self._tokens_unreported:
                self._tokens_unreported.add(backend)
                log.warning(
                    "backend %s does not report cached_tokens; start vLLM with "
                    "--enable-prompt-tokens-details to get prefix-cache hit metrics",
                    backend,
                )
            return
        self.metrics.prompt_tokens.labels(trace.model, backend, label).inc(usage.prompt_tokens)
        self.metrics.cached_prompt_tokens.labels(trace.model, backend, label).inc(
            usage.cached_tokens
        )

    def finish(
        self, trace: Trace, backend: Backend, verdict: str, *, error: str | None = None
    ) -> None:
        """The request's outcome, counted once; its in-flight count given back.
        ``error``: the error the client is answered with, where the verdict is not one
        (a degenerate answer refused by ``guard.on_exhausted: error``)."""
        trace.unroute()
        if trace.finished:
            return
        trace.finished = True
        if trace.otel is not None:
            if error is None and verdict == "error":
                error = verdict
            trace.otel.end(traced.outcome(trace, backend, verdict), error=error)
        request = trace.request
        stream = "true" if request.stream else "false"
        elapsed = time.perf_counter() - trace.started
        m = self.metrics
        m.requests.labels(trace.model, backend.name, request.endpoint, stream, verdict).inc()
        m.attempts.labels(trace.model).observe(trace.attempts)
        m.request_duration.labels(
            trace.model, backend.name, request.endpoint, stream, verdict
        ).observe(elapsed)
        if not request.stream:
            m.overhead.labels(request.endpoint, stream).observe(
                max(0.0, elapsed - trace.upstream_s)
            )
        if verdict not in ("clean", "unguarded") or trace.attempts > 1:
            self.log_outcome(trace, backend, verdict, elapsed)

    def log_outcome(self, trace: Trace, backend: Backend, verdict: str, elapsed: float) -> None:
        """One line for a request that was not plainly clean: what happened to each
        attempt, the salt ladder's rung it ended on (never the salt), the outcome and
        the latency the retries added. With ``log_format: json`` the same as fields."""
        added = max(0.0, trace.attempt_started - trace.started) if trace.attempts > 1 else 0.0
        fields = {
            "api": trace.request.endpoint,
            "model": trace.model,
            "backend": backend.name,
            "attempts": trace.attempts,
            "kinds": trace.kinds,
            "rung": trace.rung,
            "continuations": trace.continuations,
            "outcome": verdict,
            "duration_ms": round(elapsed * 1000, 1),
            "added_ms": round(added * 1000, 1),
        }
        log.info(
            "request %s (%s, model %s): %s after %d attempt(s) [%s], %d continued after "
            "release, backend %s, salt rung %d, %.0f ms (%.0f ms added by retries)",
            trace.request_id, fields["api"], trace.model, verdict, trace.attempts,
            ", ".join(trace.kinds) or "-", trace.continuations, backend.name, trace.rung,
            elapsed * 1000, added * 1000,
            extra={"fields": fields},
        )  # fmt: skip

    def count_disconnect(self, model: str, request: GuardedRequest, phase: str) -> None:
        stream = "true" if request.stream else "false"
        self.metrics.client_disconnects.labels(model, request.endpoint, stream, phase).inc()
