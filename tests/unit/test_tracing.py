"""OpenTelemetry traces (issue 43): the guard's spans against a scripted upstream,
read from the SDK's in-memory exporter. A request has one span, each attempt a child
span, and each upstream request a ``traceparent`` naming its own attempt's span.
The real vLLM nesting its spans under them: tests/integration/test_tracing_vllm.py."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from packaging.requirements import Requirement
from test_continuation import BANG_RUN, FIRST_TOKEN, paced
from test_guard_loop import (
    BANGS,
    CLEAN_TEXT,
    Script,
    answers_stream,
    answers_whole,
    content_of,
    guard_with,
    handle,
    header,
    metric,
    relayed,
    request,
    stream_of,
    whole,
)

from gateway.config import TracingSettings
from gateway.errors import DegenerateResponse, NoHealthyBackend
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


def test_with_the_guard_off_nothing_is_called_clean(caplog: pytest.LogCaptureFixture) -> None:
    """``guard.mode: off`` judges no answer: a `!` run whole or streamed is relayed
    as it came and is ``unguarded`` in its header, its request and attempt spans and
    its token counters (never ``clean``), and leaves no outcome line; an answer vLLM
    refused stays an ``error``."""

    async def refused(_: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "no", "code": 500}}, status=500)

    async def cached_bangs(_: web.Request) -> web.StreamResponse:
        body = orjson.loads(whole(BANGS))
        body["usage"]["prompt_tokens_details"] = {"cached_tokens": 8}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def scenario() -> None:
        bang_stream = stream_of(*["!!!!"] * 10)
        script = Script([cached_bangs, answers_stream(bang_stream), refused])
        async with guard_with(script, mode="off") as guard:
            exporter = traced(guard)
            for stream in (False, True):
                answer = await handle(guard, stream=stream)
                assert header(answer, "x-vllm-guard-verdict") == "unguarded"
                if stream:
                    assert content_of(await relayed(answer)) == "!!!!" * 10
                else:
                    assert BANGS.encode() in answer.body  # type: ignore[attr-defined]
                root, (attempt,) = split(exporter.get_finished_spans())
                assert attrs(root)["vllm_guard.verdict"] == "unguarded"
                assert attrs(attempt)["vllm_guard.verdict"] == "unguarded"
                exporter.clear()
            answer = await handle(guard)
            assert header(answer, "x-vllm-guard-verdict") == "error"
            root, (attempt,) = split(exporter.get_finished_spans())
            assert attrs(attempt)["vllm_guard.verdict"] == "error"
            assert metric(guard, "vllm_guard_requests_total", verdict="unguarded") == 2
            assert metric(guard, "vllm_guard_requests_total", verdict="clean") == 0
            tokens = "vllm_guard_cached_prompt_tokens_total"
            assert metric(guard, tokens, verdict="unguarded") == 8
            assert metric(guard, tokens, verdict="clean") == 0

    with caplog.at_level(logging.INFO, logger="gateway.guard.accounting"):
        asyncio.run(scenario())
    outcomes = [
        r.getMessage()
        for r in caplog.records
        if r.name == "gateway.guard.accounting" and r.getMessage().startswith("request ")
    ]
    assert len(outcomes) == 1  # the error's alone
    assert ": error after 1 attempt" in outcomes[0]


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


# -- every request span ends, once, whatever becomes of the request ------------------


def spied_request_spans(guard: Guard) -> list[Any]:
    """The request spans ``guard`` starts, as they start."""
    started: list[Any] = []
    assert guard.tracing is not None
    start = guard.tracing.request

    def spy(*args: Any, **kwargs: Any) -> Any:
        spans = start(*args, **kwargs)
        started.append(spans)
        return spans

    guard.tracing.request = spy  # type: ignore[method-assign]
    return started


def test_a_request_no_backend_can_serve_ends_its_span_with_the_error() -> None:
    async def scenario() -> None:
        script = Script([answers_whole(CLEAN_TEXT)])
        async with guard_with(script) as guard:
            exporter = traced(guard)
            started = spied_request_spans(guard)
            for backend in guard.pool.backends:
                backend.healthy = False
            with pytest.raises(NoHealthyBackend):
                await handle(guard)  # the client gets a 503
            assert len(started) == 1
            root, attempts = split(exporter.get_finished_spans())
            assert attempts == []
            assert attrs(root)["error.type"] == "no_healthy_backend"
            assert root.status.status_code is StatusCode.ERROR

    asyncio.run(scenario())


def test_a_client_leaving_before_the_first_attempt_ends_the_request_span() -> None:
    """The client leaves while the first salt is looked up (Redis, shared salts)."""

    async def scenario() -> None:
        script = Script([answers_whole(CLEAN_TEXT)])
        async with guard_with(script) as guard:
            exporter = traced(guard)
            started = spied_request_spans(guard)
            looking_up = asyncio.Event()

            async def slow_lookup(trace: Any) -> str | None:
                looking_up.set()
                await asyncio.sleep(10)
                return None

            guard.salting.first_salt = slow_lookup  # type: ignore[method-assign]
            work = asyncio.ensure_future(handle(guard))
            await asyncio.wait_for(looking_up.wait(), 5)
            work.cancel()
            with pytest.raises(asyncio.CancelledError):
                await work
            assert len(started) == 1
            root, attempts = split(exporter.get_finished_spans())
            assert attempts == []
            assert attrs(root)["error.type"] == "CancelledError"
            assert attrs(root)["vllm_guard.client_gone"] is True
            assert script.received == []

    asyncio.run(scenario())


# -- keep_retried keeps every retried trace, however its request ends ---------------


def answers_after(delay_s: float) -> Any:
    async def answer(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(delay_s)
        return await answers_whole(CLEAN_TEXT)(request)

    return answer


def test_keep_retried_keeps_the_trace_of_a_client_that_left_mid_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")

    async def scenario() -> None:
        script = Script([answers_whole(BANGS), answers_after(10)])
        async with guard_with(script) as guard:
            exporter = traced(guard)
            work = asyncio.ensure_future(handle(guard))
            for _ in range(500):
                if len(script.received) == 2:
                    break
                await asyncio.sleep(0.01)
            assert len(script.received) == 2  # the retry is under way
            work.cancel()
            with pytest.raises(asyncio.CancelledError):
                await work
            root, (first, retry) = split(exporter.get_finished_spans())
            assert attrs(first)["vllm_guard.retry.decision"] == "granted"
            assert attrs(root)["vllm_guard.retried"] is True
            assert attrs(root)["vllm_guard.client_gone"] is True
            assert attrs(retry)["vllm_guard.attempt.cause"] == "retry"
            assert attrs(retry)["error.type"] == "CancelledError"
            assert isinstance(guard.tracing, OtelTracing)
            assert guard.tracing.keep_retried is not None
            assert guard.tracing.keep_retried.held == {}

    asyncio.run(scenario())


def test_keep_retried_keeps_a_retried_stream_whose_relay_never_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The retry's stream is released, and closed before its relay starts (the
    client left between the response's start and its body)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")

    async def scenario() -> None:
        script = Script(
            [answers_stream(stream_of(*["!!!!"] * 12)), answers_stream(stream_of(CLEAN_TEXT))]
        )
        async with guard_with(script) as guard:
            exporter = traced(guard)
            answer = await handle(guard, stream=True)
            assert header(answer, "x-vllm-guard-attempts") == "2"
            assert exporter.get_finished_spans() == ()  # the request is not over
            answer.on_close()  # type: ignore[attr-defined]
            root, attempts = split(exporter.get_finished_spans())
            assert len(attempts) == 2
            assert attrs(root)["vllm_guard.retried"] is True

    asyncio.run(scenario())


# -- a continuation that fails has a span of its own ----------------------------------


def answers_status(status: int) -> Any:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "overloaded"}}, status=status)

    return answer


def test_a_continuation_answered_with_an_error_ends_its_own_span_with_it() -> None:
    async def scenario() -> None:
        late = stream_of("Open", " the", " door", "\n", *BANG_RUN)
        script = Script([paced(late), answers_status(503)])
        async with guard_with(script, stream=FIRST_TOKEN) as guard:
            exporter = traced(guard)
            await relayed(await handle(guard, stream=True))
            root, (released, continuation) = split(exporter.get_finished_spans())
            cont = attrs(continuation)
            assert cont["vllm_guard.attempt.cause"] == "continuation"
            assert cont["http.response.status_code"] == 503
            assert cont["vllm_guard.verdict"] == "error"
            assert cont["error.type"] == "503"
            assert continuation.status.status_code is StatusCode.ERROR
            assert "gen_ai.usage.input_tokens" not in cont  # none of the released stream's
            assert "error.type" not in attrs(released)
            assert attrs(root)["vllm_guard.verdict"] == "error"

    asyncio.run(scenario())


# -- the process's stop is never held by a collector that is down ---------------------


class HangingExporter(SpanExporter):
    """A collector that does not answer: each export hangs until ``answer`` is set."""

    def __init__(self) -> None:
        self.answer = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.answer.wait(60)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def test_stopping_tracing_with_the_collector_down_is_bounded_and_off_the_event_loop() -> None:
    exporter = HangingExporter()
    tracing = OtelTracing(TracingSettings(enabled=True), exporter)  # batched, as served
    try:
        tracing.request("chat m", {}, {}).end()
        stopped: list[float] = []

        def stop() -> None:
            started = time.monotonic()
            tracing.shutdown()
            stopped.append(time.monotonic() - started)

        stopping = threading.Thread(target=stop, daemon=True)
        stopping.start()
        stopping.join(10)  # the SDK alone: 30 s, and on while the export hangs
        assert stopped, "tracing.shutdown() still waits for the collector"
        assert stopped[0] < 5

    finally:
        exporter.answer.set()


class SlowToStop:
    """A tracer whose shutdown blocks its caller for a while."""

    def shutdown(self) -> bool:
        time.sleep(0.5)
        return True


def test_the_server_stops_tracing_off_the_event_loop() -> None:
    from gateway.observe import tracing

    async def scenario() -> None:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.ensure_future(tick())
        await asyncio.wait_for(tracing.stop_tracing(SlowToStop()), 5)  # type: ignore[arg-type]
        ticker.cancel()
        assert ticks > 10  # the loop went on while the stop waited

    asyncio.run(scenario())


def test_the_tracing_extra_asks_for_an_sdk_that_has_what_the_gateway_imports() -> None:
    """``gateway.observe.otel`` imports ``AlwaysRecordSampler`` (``keep_retried``),
    first in opentelemetry-sdk 1.45.0 (1.44.0 lacks it); the OTLP exporters are
    released in step with the SDK. The image's lock pins releases in range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lock = (ROOT / "deploy" / "requirements.lock").read_text().splitlines()
    pins = dict(line.split("==", 1) for line in lock if "==" in line)
    extra = [Requirement(spec) for spec in project["project"]["optional-dependencies"]["tracing"]]
    assert {r.name for r in extra} == {
        "opentelemetry-sdk",
        "opentelemetry-exporter-otlp-proto-http",
        "opentelemetry-exporter-otlp-proto-grpc",
    }
    for requirement in extra:
        assert not requirement.specifier.contains("1.44.0"), requirement
        assert requirement.specifier.contains("1.45.0"), requirement
        assert requirement.specifier.contains(pins[requirement.name]), requirement


def test_keep_retried_exports_the_spans_it_kept_with_their_start_attributes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK's samplers drop a span's start attributes with their "no": the spans
    recorded anyway, and kept, carry them all the same."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")

    async def scenario() -> None:
        script = Script([answers_whole(BANGS), answers_whole(CLEAN_TEXT)])
        async with guard_with(script) as guard:
            exporter = traced(guard)
            await handle(guard)
            root, (first, second) = split(exporter.get_finished_spans())
            assert attrs(root)["gen_ai.request.model"] == "m"
            assert attrs(root)["vllm_guard.request_id"] == "req-1"
            assert attrs(first)["vllm_guard.attempt.cause"] == "first"
            assert attrs(second)["vllm_guard.attempt.cause"] == "retry"
            assert attrs(second)["vllm_guard.backend"] == "b0"

    asyncio.run(scenario())


def test_a_degenerate_answer_refused_by_on_exhausted_error_ends_its_span_as_an_error() -> None:
    """``guard.on_exhausted: error``: every attempt degenerate, the client answered 502
    ``degenerate_response``; the request span says so (it ended "ok" before)."""

    async def scenario() -> None:
        script = Script([answers_whole(BANGS), answers_whole(BANGS)])
        async with guard_with(script, max_attempts=2, on_exhausted="error") as guard:
            exporter = traced(guard)
            with pytest.raises(DegenerateResponse):
                await handle(guard)
            root, attempts = split(exporter.get_finished_spans())
            assert len(attempts) == 2
            assert attrs(root)["error.type"] == "degenerate_response"
            assert root.status.status_code is StatusCode.ERROR

    asyncio.run(scenario())


def test_spans_carry_the_resource_attributes_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chart names the pod in OTEL_RESOURCE_ATTRIBUTES (the downward API): the SDK's
    resource, on every span the gateway exports, carries it beside its own service."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=guard-7f9c,k8s.namespace.name=llm")
    tracing = OtelTracing(TracingSettings(enabled=True), InMemorySpanExporter(), batch=False)
    resource = dict(tracing.provider.resource.attributes)
    assert resource["k8s.pod.name"] == "guard-7f9c"
    assert resource["k8s.namespace.name"] == "llm"
    assert resource["service.name"] == "vllm-guard"


def test_a_stream_cut_in_band_after_release_ends_its_span_as_an_error() -> None:
    """``after_release: cut``: the client's stream ends with an in-band
    ``degenerate_response`` error; the request span says so (it ended unset)."""

    async def scenario() -> None:
        script = Script([answers_stream(stream_of(CLEAN_TEXT, *["!!!!"] * 20))])
        cut = {"after_release": "cut", "release": "first_token"}
        async with guard_with(script, stream=cut) as guard:
            exporter = traced(guard)
            body = await relayed(await handle(guard, stream=True))
            assert b'"code":"degenerate_response"' in body
            root, _ = split(exporter.get_finished_spans())
            assert attrs(root)["error.type"] == "degenerate_response"
            assert root.status.status_code is StatusCode.ERROR

    asyncio.run(scenario())
