"""OpenTelemetry traces (issue 43): the guard's spans against a scripted upstream,
read from the SDK's in-memory exporter. A request has one span, each attempt a child
span, and each upstream request a ``traceparent`` naming its own attempt's span.
The real vLLM nesting its spans under them: tests/integration/test_tracing_vllm.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from test_continuation import BANG_RUN, FIRST_TOKEN, paced
from test_guard_loop import (
    BANGS,
    CLEAN_TEXT,
    Script,
    answers_stream,
    answers_whole,
    guard_with,
    handle,
    header,
    relayed,
    request,
    stream_of,
)

from gateway.config import TracingSettings
from gateway.guard.loop import Guard
from gateway.observe.otel import OtelTracing, exporter_from_environment
from gateway.observe.tracing import start_tracing

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def traced(guard: Guard, **settings: Any) -> InMemorySpanExporter:
    """Tracing on for ``guard``, its spans exported as each ends into the returned list."""
    exporter = InMemorySpanExporter()
    tracing = OtelTracing(TracingSettings(enabled=True, **settings), exporter, batch=False)
    guard.tracing = tracing
    return exporter


def split(spans: tuple[ReadableSpan, ...]) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The one request span, and the attempt spans in the order they started."""
    requests = [s for s in spans if s.kind is SpanKind.SERVER]
    assert len(requests) == 1, [s.name for s in spans]
    attempts = sorted((s for s in spans if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time)
    assert len(requests) + len(attempts) == len(spans)
    return requests[0], attempts


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def sent_span_ids(script: Script) -> list[tuple[str, str, bool]]:
    """(trace id, parent span id, sampled) of each upstream request's traceparent
    (the flags' other bits: W3C level 2's random trace id)."""
    out = []
    for headers in script.headers:
        version, trace_id, span_id, flags = headers["traceparent"].split("-")
        assert version == "00"
        out.append((trace_id, span_id, bool(int(flags, 16) & 1)))
    return out


def hexed(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


def test_a_recovered_request_is_one_trace_of_a_request_and_its_two_attempts() -> None:
    async def scenario() -> None:
        script = Script([answers_whole(BANGS), answers_whole(CLEAN_TEXT)])
        async with guard_with(script) as guard:
            exporter = traced(guard)
            answer = await handle(guard)
            assert header(answer, "x-vllm-guard-verdict") == "recovered"
            root, (first, second) = split(exporter.get_finished_spans())
            trace_id, root_id = hexed(root)
            assert root.parent is None  # no client context: the trace starts here
            assert root.name == "chat m"
            for attempt in (first, second):
                assert attempt.parent is not None
                assert f"{attempt.parent.span_id:016x}" == root_id
                assert hexed(attempt)[0] == trace_id
            # Each upstream request named its own attempt's span, sampled.
            assert sent_span_ids(script) == [(*hexed(first), True), (*hexed(second), True)]
            backend = guard.pool.backends[0]
            host, port = backend.address.rsplit(":", 1)
            assert attrs(root) == {
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": "m",
                "vllm_guard.api": "chat",
                "vllm_guard.stream": False,
                "vllm_guard.request_id": "req-1",
                "vllm_guard.verdict": "recovered",
                "vllm_guard.attempts": 2,
                "vllm_guard.salt.rung": 1,
                "vllm_guard.continuations": 0,
                "vllm_guard.retried": True,
                "vllm_guard.backend": "b0",
                "vllm_guard.backend.address": backend.address,
                "vllm_guard.degenerate.kinds": ("punct_run",),
            }
            assert attrs(first) == {
                "vllm_guard.attempt.number": 1,
                "vllm_guard.attempt.cause": "first",
                "vllm_guard.backend": "b0",
                "vllm_guard.backend.address": backend.address,
                "vllm_guard.backend.identity": backend.identity,
                "server.address": host,
                "server.port": int(port),
                "vllm_guard.salted": False,
                "vllm_guard.salt.rung": 0,
                "http.response.status_code": 200,
                "vllm_guard.verdict": "degenerate",
                "vllm_guard.degenerate.kind": "punct_run",
                "gen_ai.usage.input_tokens": 9,
                "vllm_guard.retry.decision": "granted",
            }
            second_attrs = attrs(second)
            assert second_attrs["vllm_guard.attempt.cause"] == "retry"
            assert second_attrs["vllm_guard.attempt.number"] == 2
            assert second_attrs["vllm_guard.salted"] is True
            assert second_attrs["vllm_guard.salt.rung"] == 1
            assert second_attrs["vllm_guard.verdict"] == "clean"
            assert "vllm_guard.degenerate.kind" not in second_attrs
            # The attempts follow each other inside the request.
            assert root.start_time <= first.start_time  # type: ignore[operator]
            assert first.end_time <= second.start_time  # type: ignore[operator]
            assert second.end_time <= root.end_time  # type: ignore[operator]

    asyncio.run(scenario())


def test_the_clients_trace_context_is_the_request_spans_parent() -> None:
    async def scenario() -> None:
        script = Script([answers_whole(CLEAN_TEXT)])
        async with guard_with(script) as guard:
            exporter = traced(guard)
            headers: CIMultiDict[str] = CIMultiDict({
                "x-request-id": "req-1",
                "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
                "tracestate": "vendor=opaque",
            })  # fmt: skip
            await guard.handle(request(), headers, started=0.0)
            root, (attempt,) = split(exporter.get_finished_spans())
            assert root.parent is not None
            assert root.parent.is_remote
            assert f"{root.parent.span_id:016x}" == CLIENT_SPAN
            assert hexed(root)[0] == CLIENT_TRACE
            # vLLM is told the attempt's span, in the client's trace, with its state.
            assert sent_span_ids(script) == [(CLIENT_TRACE, hexed(attempt)[1], True)]
            assert script.headers[0]["tracestate"] == "vendor=opaque"

    asyncio.run(scenario())


def test_with_tracing_off_the_clients_traceparent_reaches_vllm_unchanged() -> None:
    async def scenario() -> None:
        script = Script([answers_whole(BANGS), answers_whole(CLEAN_TEXT)])
        async with guard_with(script) as guard:
            assert guard.tracing is None  # the default
            client = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
            headers: CIMultiDict[str] = CIMultiDict({"x-request-id": "r", "traceparent": client})
            await guard.handle(request(), headers, started=0.0)
            assert [h["traceparent"] for h in script.headers] == [client, client]

    asyncio.run(scenario())


def test_a_continued_stream_has_an_attempt_span_for_its_continuation() -> None:
    async def scenario() -> None:
        late = stream_of("Open", " the", " door", "\n", *BANG_RUN)
        script = Script([paced(late), answers_stream(stream_of(" settings."))])
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            exporter = traced(guard)
            await relayed(await handle(guard, stream=True))
            root, (released, continuation) = split(exporter.get_finished_spans())
            assert sent_span_ids(script) == [(*hexed(released), True), (*hexed(continuation), True)]
            assert attrs(released)["vllm_guard.verdict"] == "degenerate"
            assert attrs(released)["vllm_guard.degenerate.after_release"] is True
            assert attrs(released)["vllm_guard.retry.decision"] == "granted"
            cont = attrs(continuation)
            assert cont["vllm_guard.attempt.cause"] == "continuation"
            assert cont["vllm_guard.attempt.number"] == 2
            assert cont["vllm_guard.salted"] is True
            assert cont["vllm_guard.continuation.released_tokens"] == 3  # no /tokenize: events
            assert cont["vllm_guard.verdict"] == "clean"
            top = attrs(root)
            assert top["vllm_guard.verdict"] == "recovered"
            assert top["vllm_guard.continuations"] == 1
            assert top["vllm_guard.continuation.outcome"] == "clean"
            assert top["vllm_guard.stream"] is True
            assert top["vllm_guard.time_to_first_token_s"] >= 0

    asyncio.run(scenario())


def test_a_failover_is_an_attempt_span_with_the_transport_error() -> None:
    async def scenario() -> None:
        script = Script([answers_whole(CLEAN_TEXT)])
        async with guard_with(script, dead_first=True) as guard:
            guard.pool.choose_first = lambda *a, **k: guard.pool.backends[0]  # type: ignore[method-assign]
            exporter = traced(guard)
            await handle(guard)
            root, (failed, served) = split(exporter.get_finished_spans())
            assert attrs(failed)["error.type"] == "backend_unreachable"
            assert attrs(failed)["server.port"] == 9
            assert attrs(served)["vllm_guard.attempt.cause"] == "failover"
            assert sent_span_ids(script) == [(*hexed(served), True)]
            assert attrs(root)["vllm_guard.verdict"] == "clean"
            assert attrs(root)["vllm_guard.retried"] is True

    asyncio.run(scenario())


def test_keep_retried_exports_a_retried_trace_the_sampler_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")

    async def scenario() -> None:
        answers = [answers_whole(CLEAN_TEXT), answers_whole(BANGS), answers_whole(CLEAN_TEXT)]
        script = Script(answers)
        async with guard_with(script) as guard:
            exporter = traced(guard)
            await handle(guard)  # clean: left out, as sampled
            assert exporter.get_finished_spans() == ()
            await handle(guard)  # retried: kept whole
            root, attempts = split(exporter.get_finished_spans())
            assert len(attempts) == 2
            assert attrs(root)["vllm_guard.retried"] is True
            # vLLM was told the sampler's "no": its own spans follow that.
            assert {flags for _, _, flags in sent_span_ids(script)} == {False}
            assert isinstance(guard.tracing, OtelTracing)
            assert guard.tracing.keep_retried is not None
            assert guard.tracing.keep_retried.held == {}  # nothing left waiting

    asyncio.run(scenario())


def test_without_keep_retried_the_sampler_alone_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")

    async def scenario() -> None:
        script = Script([answers_whole(BANGS), answers_whole(CLEAN_TEXT)])
        async with guard_with(script) as guard:
            exporter = traced(guard, keep_retried=False)
            await handle(guard)
            assert exporter.get_finished_spans() == ()
            assert {flags for _, _, flags in sent_span_ids(script)} == {False}

    asyncio.run(scenario())


def test_tracing_off_imports_no_opentelemetry_sdk_of_its_own() -> None:
    """Off (the default), the gateway never imports its SDK side nor the SDK's trace
    pipeline (redis may import opentelemetry's metrics SDK where it is installed)."""
    code = (
        "import sys\n"
        "import gateway.server.app, gateway.guard.loop, gateway.cli\n"
        "from gateway.config import Settings\n"
        "from gateway.observe.tracing import start_tracing\n"
        "assert start_tracing(Settings().tracing) is None\n"
        "loaded = [m for m in sys.modules if m == 'gateway.observe.otel'\n"
        "          or m.startswith(('opentelemetry.sdk.trace', 'opentelemetry.exporter'))]\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=60)


def test_the_otlp_exporter_speaks_the_protocol_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    for protocol, module in [
        ("http/protobuf", "opentelemetry.exporter.otlp.proto.http.trace_exporter"),
        ("grpc", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"),
    ]:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
        exporter = exporter_from_environment()
        assert type(exporter).__module__ == module
        exporter.shutdown()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert exporter_from_environment() is None
    tracing = start_tracing(TracingSettings(enabled=True))  # spans made, none exported
    assert isinstance(tracing, OtelTracing)
    tracing.shutdown()
