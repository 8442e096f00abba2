"""The OpenTelemetry SDK side of ``gateway.observe.tracing``: imported only where
``tracing.enabled`` (the one module of the gateway that imports OpenTelemetry).

Configured by the SDK's standard environment, which its pieces read themselves:
the OTLP exporters ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT``, ``_HEADERS``,
``_TIMEOUT``, ``_COMPRESSION``, ``_CERTIFICATE``; the tracer provider the sampler
(``OTEL_TRACES_SAMPLER``/``_ARG``, default parent-based always-on), the batch
processor ``OTEL_BSP_*``, the resource ``OTEL_RESOURCE_ATTRIBUTES``. Only the choice
between the two OTLP exporters (``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``) and
``OTEL_TRACES_EXPORTER`` are read here: each exporter class speaks one protocol.

The tracer provider is the gateway's own, never the global one: the gateway's spans
are made with it alone, their parents passed explicitly (no context variables), so
nothing else in the process (a library's instrumentation, a test) shares or changes it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import AlwaysRecordSampler
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway import __version__
from gateway.config import ConfigError, TracingSettings
from gateway.observe.tracing import RETRIED, TRACE_HEADERS, Attributes

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()

#: Request spans whose unsampled traces wait for their request's end (``KeepRetried``):
#: past this many (requests that never ended?) the oldest are dropped.
MAX_HELD_REQUESTS = 10_000

#: How long the process's stop waits for the queued spans' export (``shutdown``).
SHUTDOWN_TIMEOUT_S = 3.0


class OtelTracing:
    """The process's tracer provider and tracer (``gateway.observe.tracing.Tracing``)."""

    def __init__(
        self,
        settings: TracingSettings,
        exporter: SpanExporter | None = None,
        *,
        batch: bool = True,
    ) -> None:
        """``exporter``: where spans go (default: from the environment); ``batch``
        False: exported as each span ends (tests), else in the SDK's batches, from
        its own thread."""
        resource = Resource.create(
            {
                "service.name": os.environ.get("OTEL_SERVICE_NAME") or "vllm-guard",
                "service.version": __version__,
            }
        )
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        if exporter is None:
            exporter = exporter_from_environment()
        processor: SpanProcessor | None = None
        #: The filter that keeps retried traces (``keep_retried``), when on.
        self.keep_retried: KeepRetried | None = None
        if exporter is not None:
            processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        if processor is not None and settings.keep_retried:
            # Sampling is decided when a span starts, before anyone knows whether its
            # request will be retried: every span is recorded (the sampler's "no"
            # becomes record-only, so vLLM is still told not to sample), and the
            # unsampled ones are exported at their request's end only if it was.
            # The environment's sampler, which the provider read, stays the judge.
            self.provider.sampler = AlwaysRecordSampler(self.provider.sampler)
            processor = self.keep_retried = KeepRetried(processor)
        if processor is not None:
            self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("vllm-guard", __version__)

    def request(
        self, name: str, parent_headers: Mapping[str, str], attributes: Attributes
    ) -> OtelRequestSpans:
        parent = _PROPAGATOR.extract(parent_headers) if "traceparent" in parent_headers else None
        span = _start(self.tracer, name, parent, SpanKind.SERVER, attributes)
        return OtelRequestSpans(self.tracer, span)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """The provider's shutdown (the queued spans exported), waited for up to
        ``timeout_s``: whether it finished. The SDK bounds neither (the batch
        processor waits up to 30 s for its worker, whose export to a collector that is
        down retries for the exporter's timeout; ``force_flush`` ignores its timeout),
        so it runs in a daemon thread that is left behind, never holding the process."""
        done = threading.Thread(
            target=self.provider.shutdown, name="vllm-guard-tracing-shutdown", daemon=True
        )
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            log.warning(
                "tracing: the spans still queued were not exported within %.1f s "
                "(is the OTLP collector reachable?); stopping without them",
                timeout_s,
            )
            return False
        return True


class OtelRequestSpans:
    """One request's spans (``gateway.observe.tracing.RequestSpans``)."""

    __slots__ = ("_attempt", "_context", "_ended", "_span", "_tracer")

    def __init__(self, tracer: trace_api.Tracer, span: trace_api.Span) -> None:
        self._tracer = tracer
        self._span = span
        #: The request span as a parent (attempts' spans are its children).
        self._context = trace_api.set_span_in_context(span)
        self._attempt: trace_api.Span | None = None
        self._ended = False

    def start_attempt(self, attributes: Attributes) -> None:
        self.end_attempt()
        self._attempt = _start(
            self._tracer, "vllm_guard.attempt", self._context, SpanKind.CLIENT, attributes
        )

    def annotate_attempt(self, attributes: Attributes) -> None:
        if self._attempt is not None:
            self._attempt.set_attributes(attributes)

    def end_attempt(self, attributes: Attributes | None = None, error: str | None = None) -> None:
        attempt = self._attempt
        if attempt is None:
            return
        self._attempt = None
        _end(attempt, attributes, error)

    def annotate(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def end(self, attributes: Attributes | None = None, error: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        self.end_attempt()
        _end(self._span, attributes, error)

    def inject(self, headers: MutableMapping[str, str]) -> None:
        for name in TRACE_HEADERS:  # the client's, every copy (tracestate may not be written)
            if name in headers:
                del headers[name]
        span = self._attempt or self._span
        _PROPAGATOR.inject(headers, trace_api.set_span_in_context(span))


def _start(
    tracer: trace_api.Tracer,
    name: str,
    parent: Context | None,
    kind: SpanKind,
    attributes: Attributes,
) -> trace_api.Span:
    span = tracer.start_span(name, parent, kind, attributes)
    if not span.get_span_context().trace_flags.sampled:
        # The sampler said no, and with it dropped the start's attributes (the SDK's
        # samplers do): a span recorded anyway (``keep_retried``) gets them here. Not
        # recorded, the call does nothing.
        span.set_attributes(attributes)
    return span


def _end(span: trace_api.Span, attributes: Attributes | None, error: str | None) -> None:
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        span.set_attribute("error.type", error)
        span.set_status(Status(StatusCode.ERROR))
    span.end()


class KeepRetried(SpanProcessor):
    """``tracing.keep_retried``: spans the sampler kept go on at once; a request's
    unsampled spans (recorded only) wait for its request span, and go on with it when
    the request was retried (``RETRIED``), else are dropped.

    Spans end on the event loop's thread: no lock. The request span is the SERVER
    span, its attempts CLIENT spans whose parent it is: held by the request span's id
    (a client may send several requests under one trace)."""

    def __init__(self, inner: SpanProcessor) -> None:
        self.inner = inner
        self.held: dict[int, list[ReadableSpan]] = {}

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context.trace_flags.sampled:
            self.inner.on_end(span)
            return
        if span.kind is not SpanKind.SERVER:
            if span.parent is not None:
                held = self.held.setdefault(span.parent.span_id, [])
                held.append(span)
                if len(self.held) > MAX_HELD_REQUESTS:
                    del self.held[next(iter(self.held))]
            return
        held = self.held.pop(context.span_id, [])
        if span.attributes and span.attributes.get(RETRIED):
            for kept in (*held, span):
                self.inner.on_end(_sampled(kept))

    def shutdown(self) -> None:
        self.held.clear()
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        flushed: bool = self.inner.force_flush(timeout_millis)
        return flushed


def _sampled(span: ReadableSpan) -> ReadableSpan:
    """The same span marked sampled: the SDK's processors export only those. Built
    with ``ReadableSpan``'s public constructor, every field carried over."""
    context = span.context
    return ReadableSpan(
        name=span.name,
        context=SpanContext(
            context.trace_id,
            context.span_id,
            context.is_remote,
            TraceFlags(context.trace_flags | TraceFlags.SAMPLED),
            context.trace_state,
        ),
        parent=span.parent,
        resource=span.resource,
        attributes=span.attributes,
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def exporter_from_environment() -> SpanExporter | None:
    """The exporter ``OTEL_TRACES_EXPORTER`` names (``otlp``, the default; ``console``;
    ``none``: spans made, not exported), over the protocol
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (else ``OTEL_EXPORTER_OTLP_PROTOCOL``) names:
    ``http/protobuf`` (the specification's default) or ``grpc``."""
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind == "none":
        return None
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        console: SpanExporter = ConsoleSpanExporter()
        return console
    if kind != "otlp":
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={kind!r}: the gateway exports otlp, console or none"
        )
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    elif protocol == "grpc":  # grpcio is heavy: imported only when asked for
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    else:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: use http/protobuf or grpc"
        )
    exporter: SpanExporter = OTLPSpanExporter()
    return exporter
