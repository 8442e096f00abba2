"""OpenTelemetry traces end to end (issue 43): the gateway and a real vLLM, both with
tracing on, exporting OTLP (http/protobuf) to one receiver in the test.

The receiver is a small HTTP server that parses each ``POST /v1/traces`` body as the
OTLP ``ExportTraceServiceRequest`` protobuf message. vLLM (its own virtualenv, with
the OpenTelemetry SDK) is started with ``--otlp-traces-endpoint``; it exports gRPC
unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`` (vllm/tracing/otel.py),
and emits one ``llm_request`` span per request, whose parent is the request's
``traceparent``. A poisoned request must come back as one trace: the gateway's
request span, its two attempts, and vLLM's span under each attempt.
"""

from __future__ import annotations

import gzip
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import ARTIFACTS, GatewayFactory, RunningVLLM, openai_client, wait_for
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from support.servers import VLLMServer
from support.workload import is_corrupt
from test_guard_vllm import GENEROUS_BUDGET, fresh_messages, poison, warm

pytestmark = pytest.mark.vllm


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]


class OtlpReceiver:
    """An OTLP/HTTP trace receiver: every span it is sent, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.take(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def take(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received = ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        attributes={a.key: value_of(a.value) for a in span.attributes},
                    )
                    with self.lock:
                        self.spans.append(received)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [span for span in self.spans if span.trace_id == trace_id]


def value_of(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    receiver.thread.start()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def traced_vllm(tiny_model_dir: Path, receiver: OtlpReceiver) -> Iterator[RunningVLLM]:
    """A vLLM of its own (the session's has tracing off), exporting to ``receiver``."""
    server = VLLMServer(
        tiny_model_dir,
        ARTIFACTS / "vllm-traced.log",
        extra_args=["--otlp-traces-endpoint", receiver.endpoint],
        extra_env={
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",  # vLLM's default: grpc
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_SERVICE_NAME": "vllm",
        },
    )
    server.start()
    try:
        server.wait_ready()
        yield RunningVLLM(server.url, server)
    finally:
        server.stop()


def test_a_poisoned_request_is_one_trace_with_vllms_spans_under_each_attempt(
    traced_vllm: RunningVLLM,
    receiver: OtlpReceiver,
    gateway_for: GatewayFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The gateway's exporter, as a deployment sets it: the standard variables.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    gateway = gateway_for(traced_vllm.url, tracing={"enabled": True}, **GENEROUS_BUDGET)
    vllm = traced_vllm
    messages = fresh_messages()
    warm(vllm, messages)
    request_id = f"traced-{uuid.uuid4().hex[:12]}"
    raw = openai_client(gateway.url).chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, max_tokens=24, temperature=0,
        extra_body=poison(1.0), extra_headers={"x-request-id": request_id},
    )  # fmt: skip
    assert raw.headers["x-vllm-guard-attempts"] == "2"
    assert raw.headers["x-vllm-guard-verdict"] == "recovered"
    assert not is_corrupt(raw.parse().choices[0].message.content)

    def gateway_request() -> ReceivedSpan | None:
        with receiver.lock:
            for span in receiver.spans:
                if span.attributes.get("vllm_guard.request_id") == request_id:
                    return span
        return None

    assert wait_for(lambda: gateway_request() is not None, timeout_s=30), "no gateway span"
    root = gateway_request()
    assert root is not None
    assert root.service == "vllm-guard"
    assert root.attributes["vllm_guard.verdict"] == "recovered"
    assert root.attributes["gen_ai.request.model"] == vllm.model

    def attempts_of(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return sorted(
            (s for s in spans if s.service == "vllm-guard" and s.parent_id == root.span_id),
            key=lambda s: s.attributes["vllm_guard.attempt.number"],
        )

    def complete() -> bool:
        """Both attempts' spans, and vLLM's span under each of them, arrived."""
        spans = receiver.trace(root.trace_id)
        attempt_ids = {a.span_id for a in attempts_of(spans)}
        vllm_parents = {s.parent_id for s in spans if s.service == "vllm"}
        return len(attempt_ids) == 2 and attempt_ids <= vllm_parents

    # vLLM exports from its own processes, in its own batches.
    assert wait_for(complete, timeout_s=60), "vLLM's spans are not in the gateway's trace: " + str(
        [(s.trace_id, s.parent_id) for s in receiver.spans if s.name == "llm_request"]
    )
    spans = receiver.trace(root.trace_id)
    attempts = attempts_of(spans)
    assert [a.attributes["vllm_guard.verdict"] for a in attempts] == ["degenerate", "clean"]
    first, second = attempts
    assert first.attributes["vllm_guard.salted"] is False
    assert second.attributes["vllm_guard.salted"] is True
    assert second.attributes["vllm_guard.attempt.cause"] == "retry"
    assert first.attributes["server.port"] == int(vllm.url.rsplit(":", 1)[1])
    # vLLM's span for each attempt is that attempt's child, in the gateway's trace.
    vllm_spans = [s for s in spans if s.service == "vllm"]
    assert sorted(s.parent_id for s in vllm_spans) == sorted(a.span_id for a in attempts)
    assert {s.name for s in vllm_spans} == {"llm_request"}
    assert len(spans) == 1 + 2 + 2
