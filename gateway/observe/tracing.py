"""OpenTelemetry traces of guarded requests (``tracing.enabled``): what the guard asks
of them, and the switch.

Off (the default), ``start_tracing`` returns None, the guard keeps None, and the
OpenTelemetry packages are never imported: each hook in the guard is one ``is not
None`` check. On, the SDK side is ``gateway.observe.otel``, imported from here only
then; it is the one module of the gateway that imports OpenTelemetry (a contract in
pyproject.toml), so the ``tracing`` extra is needed only where tracing is on.

A request has one span (``RequestSpans``), its attempts one child span each, one open
at a time: a whole retry, a failover, a released stream's continuation. Each attempt
sends vLLM a ``traceparent`` naming its own span, so vLLM's spans nest under the
attempt that caused them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.config import TracingSettings

#: A span attribute's value (OpenTelemetry's primitive types, and lists of strings).
AttributeValue = str | bool | int | float | list[str]
Attributes = dict[str, AttributeValue]

#: The W3C trace context headers: replaced on each attempt while tracing is on (the
#: attempt's span is vLLM's parent), passed through untouched while it is off.
TRACE_HEADERS = ("traceparent", "tracestate")

#: The request span's attribute that says it needed more than one attempt (a retry,
#: a failover, a continuation): the traces ``tracing.keep_retried`` keeps.
RETRIED = "vllm_guard.retried"


class RequestSpans(Protocol):
    """One request's span and its attempts' spans (at most one attempt's open)."""

    def start_attempt(self, attributes: Attributes) -> None:
        """A new attempt's span, child of the request's; the one still open is ended."""
        ...

    def annotate_attempt(self, attributes: Attributes) -> None:
        """More about the open attempt (nothing when none is open)."""
        ...

    def end_attempt(self, attributes: Attributes | None = None, error: str | None = None) -> None:
        """End the open attempt's span (``error``: its error type, the span's status)."""
        ...

    def annotate(self, attributes: Attributes) -> None:
        """More about the request."""
        ...

    def end(self, attributes: Attributes | None = None, error: str | None = None) -> None:
        """End the request's span, and an attempt's still open (once: later calls do
        nothing)."""
        ...

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """Write the open attempt's trace context (else the request's) into ``headers``."""
        ...


class Tracing(Protocol):
    """The process's tracer (None where tracing is off)."""

    def request(
        self, name: str, parent_headers: Mapping[str, str], attributes: Attributes
    ) -> RequestSpans:
        """A request's span, child of the trace context in ``parent_headers`` (the
        client's ``traceparent``/``tracestate``) when there is one."""
        ...

    def shutdown(self) -> bool:
        """Export what is still queued (at the process's stop), waiting a bounded
        time (a collector that is down must not hold the stop): whether it finished.
        Blocking: the server runs it off the event loop (``stop_tracing``)."""
        ...


async def stop_tracing(tracing: Tracing) -> None:
    """``tracing.shutdown()`` in a worker thread: the event loop goes on meanwhile."""
    await asyncio.to_thread(tracing.shutdown)


def start_tracing(settings: TracingSettings) -> Tracing | None:
    """The tracer when ``tracing.enabled``, else None (nothing imported)."""
    if not settings.enabled:
        return None
    from gateway.observe import otel  # the only import of OpenTelemetry: lazy on purpose

    return otel.OtelTracing(settings)
