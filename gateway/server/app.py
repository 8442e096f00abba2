"""``create_app(settings)``: the ASGI application, assembled.

Start with ``vllm-guard serve`` or ``uvicorn gateway.server.app:create_app --factory``.
``GatewayApp`` checks every request's headers, path and key first, then dispatches
the guarded APIs' paths (``gateway.apis``) straight to their handler
(``gateway.server.guarded``) and everything else through FastAPI's routing: health,
readiness, ``/metrics`` and the unguarded proxy (``gateway.server.unguarded``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway import __version__
from gateway.apis import ADAPTERS, ApiAdapter
from gateway.config import Settings, settings_from_environment
from gateway.errors import BadRequest, GatewayError, HeadersTooLarge, NotFound, Unauthorized
from gateway.observe import logs
from gateway.server import listeners
from gateway.server.asgi import (
    JSON_MEDIA_TYPE,
    error_response,
    header_value,
    internal_error_response,
    log_unexpected,
    unauthorized_response,
)
from gateway.server.auth import key_allowed
from gateway.server.guarded import GuardedHandler, guarded_handler
from gateway.server.lifespan import Runtime, runtime_lifespan
from gateway.server.paths import closed_paths, has_dot_segment, route_path
from gateway.server.relay import RelayResponse, hold_head
from gateway.server.unguarded import unguarded_proxy

access_log = logging.getLogger("vllm_guard.access")


class GatewayApp(FastAPI):
    """FastAPI, with a direct path for the guarded routes.

    FastAPI's per-request machinery (dependency solving and five middleware layers)
    cost about a third of the gateway's CPU per request (BENCHMARKS.md). The guarded
    routes need none of it: their handler parses its own body and renders every
    error itself, so they are dispatched here first. Everything else (proxy,
    health, metrics, OpenAPI) goes through FastAPI as usual. Middleware would
    therefore not see the guarded routes: ``add_middleware`` refuses, so that
    nobody adds one believing it applies (wrap the whole app instead).
    """

    guarded_handler: GuardedHandler | None = None

    #: Set by the lifespan: the HTTP pool, guard and metrics of this process.
    runtime: Runtime | None = None

    #: SHA-256 digests of the client keys; empty means no client authentication.
    client_key_hashes: tuple[str, ...] = ()

    #: Largest total size of a request's headers.
    max_header_bytes: int = 64 * 1024

    #: Paths answered by the gateway itself without a client key (GET and HEAD only).
    open_paths: frozenset[str] = frozenset({"/healthz", "/readyz"})

    #: Paths refused whatever the method, with the error to answer.
    closed_paths: dict[str, GatewayError] = {}  # noqa: RUF012 (set per app)

    def add_middleware(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "GatewayApp dispatches the guarded routes before FastAPI's middleware stack, "
            "so a middleware added here would not apply to them: wrap the ASGI app instead"
        )

    #: One log line per request (``server.access_log``).
    access_log: bool = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
        elif self.access_log:
            await self.logged(scope, receive, send)
        else:
            await self.dispatch(scope, receive, send)

    async def logged(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``dispatch``, then one access-log line with the status it answered."""
        started = time.perf_counter()
        status = 0

        async def noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.dispatch(scope, receive, noting_status)
        finally:
            elapsed_ms = round((time.perf_counter() - started) * 1000, 1)
            request_id = logs.request_id.get() or header_value(scope, b"x-request-id") or "-"
            fields = {"method": scope["method"], "path": scope["path"][:200],
                      "status": status or 499, "duration_ms": elapsed_ms,
                      "request_id": request_id}  # fmt: skip
            access_log.info(
                "%s %s %d %.1f ms %s", fields["method"], fields["path"], fields["status"],
                elapsed_ms, request_id, extra={"fields": fields},
            )  # fmt: skip

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope["path"])
        api = ADAPTERS.get(path)  # errors on a guarded API's path take its shape
        refusal = self.refusal(scope, path)
        if refusal is not None:
            self.count_answered(refusal, api)
            await error_response(refusal, api)(scope, receive, send)
        elif scope["method"] == "POST" and self.guarded_handler and api is not None:
            await self.guarded(scope, receive, send, api)
        else:
            await super().__call__(scope, receive, send)

    def refusal(self, scope: Scope, path: str) -> GatewayError | None:
        """The error a request gets before anything else runs, or None."""
        if sum(len(k) + len(v) for k, v in scope["headers"]) > self.max_header_bytes:
            return HeadersTooLarge(f"request headers exceed {self.max_header_bytes} bytes")
        if has_dot_segment(scope["path"]):
            return BadRequest("the request path must not contain '.' or '..' segments")
        if path in self.closed_paths:
            return self.closed_paths[path]
        if (
            self.client_key_hashes
            and not (scope["method"] in ("GET", "HEAD") and path in self.open_paths)
            and not key_allowed(scope, self.client_key_hashes)
        ):
            return Unauthorized("missing or invalid API key")
        return None

    def count_answered(self, error: GatewayError, api: ApiAdapter | None) -> None:
        """A request the gateway answered itself (``vllm_guard_gateway_answered_total``)."""
        if self.runtime is not None:
            self.runtime.metrics.count_answered(api.name if api else "other", error)

    async def guarded(self, scope: Scope, receive: Receive, send: Send, api: ApiAdapter) -> None:
        assert self.guarded_handler is not None
        scope["app"] = self
        in_flight = self.runtime.metrics.in_flight.labels(api.name) if self.runtime else None
        if in_flight is not None:
            in_flight.inc()
        try:
            try:
                response = await self.guarded_handler(scope, receive, api)
            except Exception:
                log_unexpected(scope["path"])
                response = internal_error_response(api)
            if not isinstance(response, RelayResponse):
                hold_head(scope)  # the whole body follows at once
            await response(scope, receive, send)
        finally:
            if in_flight is not None:
                in_flight.dec()


def runtime_of(request: Request) -> Runtime:
    # A plain attribute: Starlette's State lookup showed up in the profile.
    runtime: Runtime | None = request.app.runtime
    assert runtime is not None
    return runtime


def create_app(settings: Settings | None = None) -> FastAPI:
    # Without settings this is the process `vllm-guard serve` started (each worker
    # calls the factory): process-wide tuning is ours to do. Tests that embed the
    # app pass settings and keep their interpreter as it is.
    serving_process = settings is None
    settings = settings or settings_from_environment()
    if serving_process:
        # One of several workers with server.reuse_port: a listening socket of its own
        # on the port, before uvicorn listens (gateway.server.listeners).
        listeners.take_own_listener()

    def attach(app: FastAPI, runtime: Runtime) -> None:
        assert isinstance(app, GatewayApp)
        app.runtime = runtime

    app = GatewayApp(
        title="vllm-guard",
        version=__version__,
        lifespan=runtime_lifespan(settings, attach, tune=serving_process),
        docs_url=None,
        redoc_url=None,
    )

    def current_runtime() -> Runtime:
        assert app.runtime is not None
        return app.runtime

    app.guarded_handler = guarded_handler(settings, current_runtime)
    app.client_key_hashes = tuple(settings.auth.api_key_sha256)
    app.max_header_bytes = settings.server.max_header_bytes
    app.access_log = settings.server.access_log
    app.closed_paths = closed_paths(settings.server.allow_vllm_paths)
    if settings.metrics.enabled and settings.metrics.port is None:
        # Our own /metrics (it checks metrics.api_key_sha256 itself); otherwise a
        # keyless GET /metrics would reach vLLM's through the proxy.
        app.open_paths = app.open_paths | {"/metrics"}
    add_routes(app, settings)
    return app


def add_routes(app: GatewayApp, settings: Settings) -> None:
    # The guarded APIs are registered as routes too, for the OpenAPI description;
    # GatewayApp.__call__ answers them before FastAPI's routing does.
    for api in ADAPTERS.values():
        app.add_api_route(api.path, openapi_route(app, api), methods=["POST"], name=api.name)

    @app.api_route("/healthz", methods=["GET", "HEAD"])
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON_MEDIA_TYPE)

    @app.api_route("/readyz", methods=["GET", "HEAD"])
    async def readyz(request: Request) -> Response:
        """Ready once started, whatever the backends say. Readiness that followed the
        backends took every gateway pod out of its Service when vLLM was down, so
        clients got connection errors instead of the gateway's OpenAI-shaped 503. The
        backends' health is in the body, in vllm_guard_backend_up, and in that 503."""
        pool = runtime_of(request).pool
        states = {b.name: b.healthy for b in pool.backends}
        body = orjson.dumps(
            {"status": "ready", "any_backend_healthy": pool.any_healthy(), "backends": states}
        )
        return Response(body, media_type=JSON_MEDIA_TYPE)

    add_metrics_route(app, settings)
    app.add_api_route(
        "/{path:path}",
        unguarded_proxy(settings, runtime_of),
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
        include_in_schema=False,
    )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log_unexpected(request.url.path)
        return internal_error_response()


def openapi_route(app: GatewayApp, api: ApiAdapter) -> Any:
    async def route(request: Request) -> Response:
        assert app.guarded_handler is not None
        return await app.guarded_handler(request.scope, request.receive, api)

    return route


def add_metrics_route(app: GatewayApp, settings: Settings) -> None:
    if settings.metrics.port is not None:

        @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
        async def metrics_elsewhere() -> Response:
            # Not proxied to vLLM either: metrics live on their own port.
            return error_response(NotFound("metrics are served on a separate port"))

    elif settings.metrics.enabled:
        metric_keys = tuple(settings.metrics.api_key_sha256)

        @app.api_route("/metrics", methods=["GET", "HEAD"])
        async def metrics_endpoint(request: Request) -> Response:
            if metric_keys and not key_allowed(request.scope, metric_keys):
                return unauthorized_response()
            body, content_type = runtime_of(request).metrics.render()
            return Response(body, media_type=content_type)
