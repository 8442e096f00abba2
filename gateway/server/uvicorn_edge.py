"""uvicorn's HTTP protocol with the limits an internet-facing proxy needs.

uvicorn (with httptools) has no bound on a request head while it is being read,
and no timeout for reading one or a body: three connections sending header lines
that never end took the gateway from 69 to 517 MiB, and hundreds of silent or
half-sent connections stayed open indefinitely. ``EdgeHttpToolsProtocol``:

* counts the bytes of a request head *as they arrive* and answers 431 once they
  pass ``server.max_header_bytes`` (the parser holds at most one read more);
* closes a connection that has not finished sending a request head within
  ``server.header_timeout_s`` (from the connection, or from the last response:
  silent and half-sent connections alike), answering 408 if it had started one;
* closes a connection whose body has not arrived within ``server.body_timeout_s``
  of its head (the app sees the client leave); both timeouts are deadlines that
  one sweep per event loop checks (``connection_deadlines``), not timer handles
  created and cancelled per request;
* answers uvicorn's "too many connections" 503 (``server.max_connections``) in
  OpenAI's error shape instead of plain text;
* and, from ``ServerHooksProtocol`` (which the test gateways run too), puts
  ``ServerHooks`` in each request's scope: the app hears from ``connection_lost``
  that its client left (no watcher task per request), and writes a released
  stream's chunks straight to the transport while uvicorn's ``send()`` would write
  them at once anyway (no ASGI message and await per streamed event).

``vllm-guard serve`` selects it through ``edge_protocol()``, the one gate in front of
uvicorn's internals: on a uvicorn release outside ``TESTED_UVICORN``, or one missing
a name this module overrides or reads, it logs one WARNING and serves with
uvicorn's stock httptools protocol instead. Each worker reads the limits from the
settings the CLI resolved into its environment.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.errors import (
    GatewayError,
    HeadersTooLarge,
    RequestTimeout,
    TooManyConnections,
)
from gateway.periodic import Sweep
from gateway.server.relay import SERVER_HOOKS, ServerHooks, server_hooks

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float


@functools.cache
def edge_limits() -> EdgeLimits:
    """This process's limits, from the settings ``vllm-guard serve`` resolved."""
    from gateway.config import settings_from_environment

    server = settings_from_environment().server
    return EdgeLimits(server.max_header_bytes, server.header_timeout_s, server.body_timeout_s)


def connection_limit(configured: int | None) -> int:
    """Client connections per worker: as configured, or half the open-file limit
    (each client request may hold an upstream connection, and logs and metrics
    files need descriptors too)."""
    if configured is not None:
        return configured
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, soft // 2) if soft != resource.RLIM_INFINITY else 4096


def _raw_error(error: GatewayError) -> bytes:
    """A whole HTTP response carrying the error, for the protocol to write itself
    (no request has reached the app)."""
    body = error.body()
    reason = HTTPStatus(error.status).phrase
    return (
        f"HTTP/1.1 {error.status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode("latin-1") + body


async def service_unavailable(scope: Any, receive: Any, send: Any) -> None:
    """uvicorn's answer when ``limit_concurrency`` is reached, in OpenAI's shape."""
    body = TooManyConnections("the gateway is at its connection limit; retry shortly").body()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                (b"retry-after", b"1"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


#: The uvicorn releases this module was tested on (pyproject.toml pins the same).
TESTED_UVICORN = ((0, 55), (0, 56))

#: What the edge reads or overrides inside uvicorn: the protocol's methods, the
#: attributes a request-response cycle sets in its ``__init__``, flow control's
#: ``write_paused``, and the module-level ``service_unavailable`` it calls.
_OVERRIDDEN_METHODS = (
    "connection_made", "connection_lost", "data_received", "on_message_begin",
    "on_headers_complete", "on_message_complete", "on_response_complete",
)  # fmt: skip
_CYCLE_ATTRIBUTES = (
    "chunked_encoding", "flow", "disconnected", "response_complete", "response_started",
    "transport", "scope",
)  # fmt: skip


def uvicorn_incompatibility() -> str | None:
    """Why the installed uvicorn cannot carry the edge protocol, or None if it can: a
    release outside the tested range, or a name the edge relies on that is gone."""
    version = _release(uvicorn.__version__)
    low, high = TESTED_UVICORN
    if not low <= version < high:
        return f"uvicorn {uvicorn.__version__} is outside the tested range {_span(low, high)}"
    missing = [
        *(f"HttpToolsProtocol.{name}" for name in _OVERRIDDEN_METHODS
          if not callable(getattr(HttpToolsProtocol, name, None))),
        *(f"RequestResponseCycle.{name}" for name in _CYCLE_ATTRIBUTES
          if name not in RequestResponseCycle.__init__.__code__.co_names),
        *(["FlowControl.write_paused"]
          if "write_paused" not in FlowControl.__init__.__code__.co_names
          else []),
        *([] if hasattr(httptools_impl, "service_unavailable")
          else ["httptools_impl.service_unavailable"]),
    ]  # fmt: skip
    if missing:
        return f"uvicorn {uvicorn.__version__} lacks {', '.join(missing)}"
    return None


def edge_protocol() -> type[asyncio.Protocol] | str:
    """The HTTP protocol ``vllm-guard serve`` gives uvicorn: the edge, or, when the
    installed uvicorn is not one it was tested on, uvicorn's own httptools protocol
    (one WARNING; its stock limits apply: ``limit_concurrency``, keep-alive timeout)
    rather than an AttributeError on every request or a silently changed behaviour."""
    problem = uvicorn_incompatibility()
    if problem is not None:
        log.warning(
            "%s: serving with uvicorn's stock HTTP protocol, without the edge limits "
            "(request-head size and timeouts, body timeout, JSON 503 at the connection "
            "limit) and without the server hooks (a watcher task per request instead)",
            problem,
        )
        return "httptools"
    # uvicorn looks this up in its module on every over-limit request.
    httptools_impl.service_unavailable = service_unavailable  # type: ignore[attr-defined]
    return EdgeHttpToolsProtocol


def _release(version: str) -> tuple[int, int]:
    major, minor, *_ = [*(int(p) if p.isdigit() else 0 for p in version.split(".")), 0, 0]
    return major, minor


def _span(low: tuple[int, int], high: tuple[int, int]) -> str:
    return f">={low[0]}.{low[1]},<{high[0]}.{high[1]}"


class ServerHooksProtocol(HttpToolsProtocol):
    """uvicorn's protocol with ``ServerHooks`` (``gateway.server.relay``) in each request's
    scope: the app is told from ``connection_lost`` when its client leaves before the
    response completed, may write a streamed response's chunks straight to the
    transport, and may have a response head wait for the body (``CycleHooks``)."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade
            # The app has not run yet: its task starts on the next loop iteration.
            self.scope[SERVER_HOOKS] = CycleHooks(cycle)  # type: ignore[literal-required]

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:  # lost before the response completed
            hooks = server_hooks(cycle.scope)
            if hooks is not None and hooks.on_client_gone is not None:
                hooks.on_client_gone()


class CycleHooks(ServerHooks):
    """``ServerHooks`` of one uvicorn request-response cycle."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        super().__init__()
        self.cycle = cycle

    def write_body(self, chunk: bytes) -> bool:
        """Writes a chunk as uvicorn's ``send()`` frames it in chunked encoding, when
        ``send()`` would write it at once too: the response has started chunked and
        is not complete, the client is there, and the connection is not paused for
        flow control (``send()`` would wait for it to drain: False, and the caller
        awaits ``send()``)."""
        cycle = self.cycle
        if (
            not cycle.chunked_encoding
            or cycle.flow.write_paused
            or cycle.disconnected
            or cycle.response_complete
        ):
            return False
        if chunk:  # an empty chunk would end the body: send() writes nothing for it
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True

    def hold_head(self) -> None:
        """The head that ``send()`` writes next waits for the response's first body
        bytes and goes out with them (``_HeadHolder``)."""
        cycle = self.cycle
        if not cycle.response_started and cycle.scope["method"] != "HEAD":
            cycle.transport = _HeadHolder(cycle)  # type: ignore[assignment]

    def abort(self) -> None:
        """The response broke off: close the connection without ending the body (no
        terminating chunk, fewer bytes than Content-Length). Marked disconnected
        first, as a lost client would be, so uvicorn neither writes the body's end
        nor reports an incomplete response as an app error."""
        cycle = self.cycle
        if not cycle.response_complete:
            cycle.disconnected = True
            cycle.transport.close()


class _HeadHolder:
    """Stands in for a response cycle's transport from the response head to its first
    body bytes, so that both leave in one write: one syscall and one TCP segment,
    not two (uvicorn's ``send()`` writes the head on its own). Then steps aside."""

    __slots__ = ("_cycle", "_head", "_transport")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self._transport = cycle.transport
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._head is None:  # send() of http.response.start
            self._head = data
            return
        self._cycle.transport = self._transport
        self._transport.write(self._head + data)

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._cycle.transport = self._transport
        if self._head is not None and not self._transport.is_closing():
            self._transport.write(self._head)
        self._transport.close()


def _past_deadline(connection: EdgeHttpToolsProtocol, now: float) -> bool:
    """A connection past its head or body deadline is timed out; it stays in the sweep
    until ``connection_lost`` takes it out."""
    if connection.deadline and now >= connection.deadline:
        connection.timed_out()
    return False


_deadlines: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Sweep[EdgeHttpToolsProtocol]] = (
    weakref.WeakKeyDictionary()
)


def connection_deadlines(
    loop: asyncio.AbstractEventLoop, limits: EdgeLimits
) -> Sweep[EdgeHttpToolsProtocol]:
    """The head and body timeouts of every connection one event loop serves, checked
    by one sweep (one per event loop: a test may run several), every quarter of the
    shorter timeout (at most 1 s), so a timeout fires within 1.25 x its setting."""
    deadlines = _deadlines.get(loop)
    if deadlines is None:
        period = min(limits.header_timeout_s, limits.body_timeout_s, 4.0) / 4
        deadlines = _deadlines[loop] = Sweep(period, _past_deadline)
    return deadlines


class EdgeHttpToolsProtocol(ServerHooksProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = edge_limits()
        self._head_bytes = 0
        self._reading_head = True
        self._deadlines = connection_deadlines(self.loop, self.limits)
        #: Loop time by which the head (or body) must have arrived; 0: none pending.
        self.deadline = 0.0
        self._phase = "head"

    # -- timeouts ----------------------------------------------------------------------

    def _arm(self, delay: float, phase: str) -> None:
        self.deadline = self.loop.time() + delay
        self._phase = phase

    def _disarm(self) -> None:
        self.deadline = 0.0

    def timed_out(self) -> None:
        """Called by the loop's deadline sweep once ``deadline`` has passed."""
        self.deadline = 0.0
        if self.transport.is_closing():
            return
        if self._phase == "head" and self._head_bytes:
            self.transport.write(
                _raw_error(
                    RequestTimeout(
                        f"the request head did not arrive within {self.limits.header_timeout_s:g} s"
                    )
                )
            )
        # A silent connection is closed without a word; a slow body's request is
        # already with the app, which sees the client leave.
        self.transport.close()

    # -- protocol events -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, "head")
        self._deadlines.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._deadlines.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        reading_head = self._reading_head
        super().data_received(data)
        if reading_head and self._reading_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._disarm()
                self.transport.write(
                    _raw_error(
                        HeadersTooLarge(
                            f"request headers exceed {self.limits.max_header_bytes} bytes"
                        )
                    )
                )
                self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # A pipelined request's head is bounded and timed like any other.
        self._reading_head = True
        if not self.deadline:
            self._arm(self.limits.header_timeout_s, "head")

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._head_bytes = 0
        self._arm(self.limits.body_timeout_s, "body")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._reading_head = True
            self._arm(self.limits.header_timeout_s, "head")
