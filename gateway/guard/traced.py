"""What a request's OpenTelemetry spans say (``tracing.enabled``): the attributes the
guard gives the request span and each attempt's span, from its own records.

The names follow the OpenTelemetry GenAI semantic conventions where they name the
thing (``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.*``,
``server.address``, ``http.response.status_code``, ``error.type``); the guard's own
are ``vllm_guard.*`` (docs/metrics.md, "Traces"). A salt is never written, only its
rung on the ladder. Each function is called only where the request has spans (the
guard's hooks check ``trace.otel is not None``: with tracing off, nothing here runs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from gateway.guard.attempt import Attempt, judged_label
from gateway.guard.request import GuardedRequest
from gateway.guard.trace import Trace
from gateway.observe.tracing import RETRIED, Attributes, RequestSpans, Tracing
from gateway.upstream.pool import Backend

#: ``gen_ai.operation.name`` of each guarded API.
OPERATIONS = {
    "chat": "chat",
    "completions": "text_completion",
    "responses": "chat",
    "messages": "chat",
}


def request_spans(
    tracing: Tracing, request: GuardedRequest, headers: Mapping[str, str]
) -> RequestSpans:
    """The request's span, child of the client's trace context when it sent one."""
    operation = OPERATIONS.get(request.endpoint, request.endpoint)
    model = request.model or ""
    attributes: Attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "vllm_guard.api": request.endpoint,
        "vllm_guard.stream": request.stream,
        "vllm_guard.request_id": headers.get("x-request-id", ""),
    }
    # The GenAI conventions' span name: "{operation} {model}".
    return tracing.request(f"{operation} {model}".strip(), headers, attributes)


def attempt_attributes(trace: Trace, backend: Backend, salt: str | None, cause: str) -> Attributes:
    """An attempt's span at its start: which attempt, why, where, on which rung."""
    host, _, port = backend.address.rpartition(":")
    attributes: Attributes = {
        "vllm_guard.attempt.number": trace.attempts,
        "vllm_guard.attempt.cause": cause,
        "vllm_guard.backend": backend.name,
        "vllm_guard.backend.address": backend.address,
        "vllm_guard.backend.identity": backend.identity,
        "server.address": host or backend.address,
        "vllm_guard.salted": salt is not None,
        "vllm_guard.salt.rung": trace.rung,
    }
    if port.isdigit():
        attributes["server.port"] = int(port)
    return attributes


def attempt_answered(attempt: Attempt, *, inspected: bool) -> Attributes:
    """An attempt that got a response: its status, and the verdict so far (a released
    stream's may change while it is relayed). ``inspected``: the guard judges its
    answers (not ``guard.mode: off``)."""
    verdict = attempt.verdict
    attributes: Attributes = {
        "http.response.status_code": attempt.status,
        "vllm_guard.verdict": verdict_of(attempt, inspected=inspected),
    }
    if verdict.kind is not None:
        attributes["vllm_guard.degenerate.kind"] = verdict.kind
    attributes.update(usage_of(attempt))
    return attributes


def verdict_of(attempt: Attempt, *, inspected: bool) -> str:
    if attempt.status != 200:
        return "error"
    return judged_label(attempt.verdict.degenerate, inspected=inspected)


def usage_of(attempt: Attempt) -> Attributes:
    usage = attempt.usage or (attempt.stream.usage if attempt.stream is not None else None)
    if usage is None:
        return {}
    attributes: Attributes = {"gen_ai.usage.input_tokens": usage.prompt_tokens}
    if usage.cached_tokens is not None:
        attributes["vllm_guard.usage.cached_input_tokens"] = usage.cached_tokens
    return attributes


def outcome(trace: Trace, backend: Backend, verdict: str) -> Attributes:
    """The request span at its end: the outcome the metrics count, how it got there."""
    attributes: Attributes = {
        "vllm_guard.verdict": verdict,
        "vllm_guard.attempts": trace.attempts,
        "vllm_guard.salt.rung": trace.rung,
        "vllm_guard.continuations": trace.continuations,
        RETRIED: trace.attempts > 1,
        "vllm_guard.backend": backend.name,
        "vllm_guard.backend.address": backend.address,
    }
    if trace.continuations:  # the last continuation's, as its metric counts it
        attributes["vllm_guard.continuation.outcome"] = (
            "clean" if verdict == "recovered" else verdict
        )
    if trace.kinds:
        attributes["vllm_guard.degenerate.kinds"] = list(trace.kinds)
    if trace.client_gone:
        attributes["vllm_guard.client_gone"] = True
    return attributes


def relayed_attempt(segment: Attempt, verdict: str, client_gone: bool) -> Attributes:
    """The attempt a released stream relayed last, at the stream's end: ``verdict`` is
    the request's ("recovered": this attempt, a continuation, ended clean)."""
    attributes: Attributes = {"vllm_guard.verdict": "clean" if verdict == "recovered" else verdict}
    attributes.update(usage_of(segment))
    if client_gone:
        attributes["vllm_guard.client_gone"] = True
    return attributes


def degenerate_after_release(kind: str) -> Attributes:
    """A released stream turned ``kind``: continued, cut or delivered (the request's
    verdict and the next attempt's cause say which)."""
    return {
        "vllm_guard.verdict": "degenerate",
        "vllm_guard.degenerate.kind": kind,
        "vllm_guard.degenerate.after_release": True,
    }


#: The request span's mark, set as its second attempt starts (``keep_retried``).
RETRIED_MARK: Attributes = {RETRIED: True}


def left_with(exc: BaseException) -> Attributes:
    """The request span of a request that left the guard with ``exc``, uncounted."""
    return {"vllm_guard.client_gone": True} if isinstance(exc, asyncio.CancelledError) else {}


def http_error_type(status: int) -> str:
    """``error.type`` of an attempt answered with an HTTP error: its status code (the
    HTTP semantic conventions' choice)."""
    return str(status)


def error_type(exc: BaseException) -> str:
    """``error.type``: the gateway's error code (what the client's JSON error says),
    else the exception's class (``CancelledError``: the client left)."""
    code = getattr(exc, "code", None)
    return code if isinstance(code, str) else type(exc).__name__
