"""``create_app(settings)``: routes, limits, and the lifespan that owns the HTTP pool.

Start with ``vllm-guard serve`` or ``uvicorn gateway.server.app:create_app --factory``.
"""

from __future__ import annotations

import gc
import hashlib
import hmac
import logging
import os
import random
import re
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import orjson
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway import __version__
from gateway.apis import ADAPTERS, ApiAdapter
from gateway.config import Settings, load_settings
from gateway.errors import (
    BadRequest,
    Forbidden,
    GatewayError,
    HeadersTooLarge,
    InternalError,
    PayloadTooLarge,
    Unauthorized,
    error_body,
)
from gateway.guard.loop import Guard
from gateway.guard.request import parse_guarded
from gateway.observe import logs
from gateway.observe.evidence import EvidenceStore
from gateway.observe.metrics import Metrics
from gateway.server.relay import (
    ClientGone,
    ClientWatch,
    RelayResponse,
    answer_response,
    hold_head,
)
from gateway.upstream.pool import (
    Backend,
    BackendPool,
    forward_headers,
    map_transport_errors,
    response_headers,
)
from gateway.upstream.scrape import BackendScraper

log = logging.getLogger("vllm_guard")

RESOLVED_SETTINGS_ENV = "VLLM_GUARD_RESOLVED_SETTINGS"
JSON_MEDIA_TYPE = "application/json"


@dataclass(slots=True)
class Runtime:
    settings: Settings
    session: aiohttp.ClientSession
    pool: BackendPool
    metrics: Metrics
    guard: Guard
    scraper: BackendScraper


def settings_from_environment() -> Settings:
    resolved = os.environ.get(RESOLVED_SETTINGS_ENV)
    if resolved:
        return Settings.model_validate_json(resolved)
    return load_settings(os.environ.get("VLLM_GUARD_CONFIG"))


def error_response(exc: GatewayError, api: ApiAdapter | None = None) -> Response:
    """The gateway's error in the shape of the API the client speaks (``api``: the
    guarded API of the request's path; OpenAI's shape for every other path)."""
    body = api.error_body(exc) if api is not None else exc.body()
    return Response(body, status_code=exc.status, media_type=JSON_MEDIA_TYPE)


def new_request_id() -> str:
    """128 random bits in hex, for a request that came without an ``x-request-id``.
    An identifier, not a secret: Python's generator (reseeded in every forked or
    spawned worker) instead of a getrandom syscall per request."""
    return random.getrandbits(128).to_bytes(16).hex()


def header_value(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (``name`` in lower case), from the raw scope."""
    for key, value in scope["headers"]:
        if key == name:
            decoded: str = value.decode("latin-1")
            return decoded
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, within ``limit`` bytes; ClientDisconnect if the client
    leaves while sending it. Reads ASGI messages directly: the guarded routes do
    not build a Starlette Request (profiled at about 15 µs per request)."""
    declared = header_value(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is larger than the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


GuardedHandler = Callable[[Scope, Receive, ApiAdapter], Awaitable[Response]]
_REPEATED_SLASHES = re.compile(r"/{2,}")


#: vLLM's administrative and development endpoints (vLLM 0.32's routes, and older
#: spellings): they pause, reset, profile, reload or reconfigure the server, or
#: describe it. Closed unless listed in ``server.allow_vllm_paths``.
VLLM_ADMIN_PATHS = frozenset(
    {
        "/abort_requests", "/inference/v1/abort_requests", "/collective_rpc",
        "/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping",
        "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache",
        "/release_kv_cache_memory", "/start_profile", "/stop_profile",
        "/scale_elastic_ep", "/is_scaling_elastic_ep", "/server_info", "/get_world_size",
        "/kv_event_sources", "/update_weights", "/update_weight_version",
        "/start_weight_update", "/start_draft_weight_update", "/finish_weight_update",
        "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
        "/weight_checker", "/weight_info", "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)  # fmt: skip
#: Other ways into vLLM's chat and completions handlers: SageMaker's /invocations
#: dispatches on the body to the same code, and the batch route runs it per item.
#: The guard cannot inspect them, so they are refused unless allowed.
UNGUARDED_SPELLINGS = frozenset({"/invocations", "/v1/chat/completions/batch"})


#: ``/v1/responses/{id}`` and ``/v1/responses/{id}/cancel`` (and ``/input_items``):
#: a stored answer, which lives on the backend that made it.
_STORED_RESPONSE = re.compile(r"v1/responses/([^/]+)(?:/[a-z_]+)?")


def stored_answer_backend(runtime: Runtime, path: str) -> Backend | None:
    match = _STORED_RESPONSE.fullmatch(route_path("/" + path).lstrip("/"))
    return runtime.guard.backend_storing_answer(match[1]) if match else None


def set_request_id(response: Response, request_id: str) -> None:
    """``x-request-id`` on the answer, replacing any the backend sent (vLLM can echo
    its own). On the raw pairs: Starlette's ``MutableHeaders`` costs a few µs more."""
    raw = response.raw_headers
    if any(name == b"x-request-id" for name, _ in raw):
        raw[:] = [(name, value) for name, value in raw if name != b"x-request-id"]
    raw.append((b"x-request-id", request_id.encode("latin-1")))


def has_dot_segment(path: str) -> bool:
    """``.`` or ``..`` as a path segment (``path`` is already percent-decoded, so
    ``%2e%2e`` counts too). Such a path never reaches a backend: vLLM's router and
    any proxy in between may resolve it differently from the gateway."""
    return any(segment in (".", "..") for segment in path.split("/"))


def route_path(path: str) -> str:
    """The path as routing sees it: repeated slashes collapsed, no trailing slash, so
    ``//v1//chat/completions/`` cannot reach a guarded endpoint unguarded."""
    collapsed = _REPEATED_SLASHES.sub("/", path)
    return collapsed.rstrip("/") or "/"


class GatewayApp(FastAPI):
    """FastAPI, with a direct path for the two guarded routes.

    Profiling showed FastAPI's per-request machinery (dependency solving and five
    middleware layers) at about a third of the gateway's CPU per request. The
    guarded routes need none of it: their handler parses its own body and renders
    every error itself, so they are dispatched here first. Everything else
    (proxy, health, metrics, OpenAPI) goes through FastAPI as usual.
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        path = route_path(scope["path"])
        api = ADAPTERS.get(path)  # errors on a guarded API's path take its shape
        if sum(len(k) + len(v) for k, v in scope["headers"]) > self.max_header_bytes:
            too_large = HeadersTooLarge(f"request headers exceed {self.max_header_bytes} bytes")
            await error_response(too_large, api)(scope, receive, send)
            return
        if has_dot_segment(scope["path"]):
            bad = BadRequest("the request path must not contain '.' or '..' segments")
            await error_response(bad)(scope, receive, send)
            return
        if path in self.closed_paths:
            await error_response(self.closed_paths[path])(scope, receive, send)
            return
        if (
            self.client_key_hashes
            and not (scope["method"] in ("GET", "HEAD") and path in self.open_paths)
            and not key_allowed(scope, self.client_key_hashes)
        ):
            await unauthorized_response(api)(scope, receive, send)
            return
        if scope["method"] == "POST" and self.guarded_handler and api is not None:
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
            return
        await super().__call__(scope, receive, send)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


_KEY_DIGEST = "vllm_guard.key_digest"


def bearer_digest(scope: Scope) -> str | None:
    """SHA-256 of the client's key (None without one), computed once per request:
    auth checks it, the retry budget keys clients by it. The key is the Bearer token
    of the Authorization header, or the ``x-api-key`` header (Anthropic's SDKs)."""
    if _KEY_DIGEST in scope:
        digest: str | None = scope[_KEY_DIGEST]
        return digest
    scheme, _, key = (header_value(scope, b"authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and key:
        digest = hash_key(key.strip())
    else:
        api_key = (header_value(scope, b"x-api-key") or "").strip()
        digest = hash_key(api_key) if api_key else None
    scope[_KEY_DIGEST] = digest
    return digest


def key_allowed(scope: Scope, allowed: Sequence[str]) -> bool:
    """Bearer key from the Authorization header, checked in constant time."""
    digest = bearer_digest(scope)
    if digest is None:
        return False
    # Compare against every configured hash, without stopping early.
    return sum(hmac.compare_digest(digest, h) for h in allowed) > 0


def client_identity(scope: Scope) -> str:
    """Who is asking, for the retry budget's fair share: the API key's digest when
    the gateway checks keys (a verified identity), else the client's address."""
    app = scope.get("app")
    if isinstance(app, GatewayApp) and app.client_key_hashes:
        return "key:" + (bearer_digest(scope) or "")[:32]
    client = scope.get("client")
    return "addr:" + (client[0] if client else "unknown")


def unauthorized_response(api: ApiAdapter | None = None) -> Response:
    return error_response(Unauthorized("missing or invalid API key"), api)


def log_unexpected(path: str) -> None:
    """One line per unexpected error, however deep its traceback: where it was raised
    and what it says (truncated). A request that trips a bug repeatedly must not
    turn every call into a 200 KB log entry. The traceback is at debug level."""
    exc = sys.exc_info()[1]
    frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
    where = f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else ""
    message = str(exc)[:200] if exc is not None else ""
    log.error("unexpected error on %s: %s: %s%s", path[:200], type(exc).__name__, message, where)
    log.debug("traceback of the unexpected error", exc_info=True)


def internal_error_response(api: ApiAdapter | None = None) -> Response:
    return error_response(InternalError("internal gateway error"), api)


def tune_gc() -> None:
    """Move everything alive after startup out of the collector's sight and collect
    the young generation less often. Measured (BENCHMARKS.md): the default
    thresholds put full collections in the tail, p99/p50 3.3-3.8 for small requests
    at c=32; tuned 1.5-1.8, CPU per request unchanged."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def create_app(settings: Settings | None = None) -> FastAPI:
    # Without settings this is the process `vllm-guard serve` started (each worker
    # calls the factory): process-wide tuning is ours to do. Tests that embed the
    # app pass settings and keep their interpreter as it is.
    serving_process = settings is None
    settings = settings or settings_from_environment()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = BackendPool(settings.upstream)
        metrics = Metrics(CollectorRegistry(), models=settings.models, backends=pool.names)
        guard_settings = settings.guard
        metrics.config_info.labels(
            guard_settings.mode,
            guard_settings.on_exhausted,
            guard_settings.stream.after_release,
            guard_settings.retry_target,
        ).set(1)
        scraper = BackendScraper(pool, metrics, settings.upstream)
        evidence = (
            EvidenceStore(settings.evidence, per_process=settings.server.workers > 1)
            if settings.evidence.enabled
            else None
        )
        guard = Guard(settings, pool, metrics, evidence=evidence, version_of=scraper.version_of)
        runtime = Runtime(settings, pool.session, pool, metrics, guard, scraper)
        assert isinstance(app, GatewayApp)
        app.runtime = runtime
        if guard.shared_salts is not None:
            await guard.shared_salts.connect()
        await pool.check_all(initial=True)
        await scraper.scrape_once()
        pool.start()
        scraper.start()
        if serving_process:
            tune_gc()
        log.info("vllm-guard %s ready; backends: %s", __version__, ", ".join(pool.names))
        if not guard.ladder.shared:
            log.info(
                "guard.salt_reuse.key is not set: this process draws its own retry-salt key, "
                "so other workers and replicas retry a conversation in other cache "
                "namespaces (set the key to share them)"
            )
        if settings.server.workers > 1 and guard.shared_salts is None:
            log.info(
                "state.redis_url is not set: the %d workers each keep their own conversation "
                "memory (a turn on another worker retries before it finds the clean salt)",
                settings.server.workers,
            )
        try:
            yield
        finally:
            await scraper.stop()
            await pool.stop()
            if guard.shared_salts is not None:
                await guard.shared_salts.close()

    app = GatewayApp(
        title="vllm-guard",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )

    def runtime_of(request: Request) -> Runtime:
        # A plain attribute: Starlette's State lookup showed up in the profile.
        runtime: Runtime = request.app.runtime
        return runtime

    # With client keys on, the client's key is ours, never the backend's.
    client_auth = (
        frozenset({"authorization", "x-api-key"}) if settings.auth.api_key_sha256 else frozenset()
    )
    guarded_drop = frozenset({"accept-encoding"}) | client_auth

    lead_messages = settings.guard.salt_reuse.fingerprint_messages

    async def guarded(scope: Scope, receive: Receive, api: ApiAdapter) -> Response:
        started = time.perf_counter()
        runtime: Runtime = scope["app"].runtime
        request_id = header_value(scope, b"x-request-id") or new_request_id()
        logs.request_id.set(request_id)
        try:
            raw = await read_body(scope, receive, settings.server.max_body_bytes)
            parsed = parse_guarded(api, raw, lead_messages)
            headers = forward_headers(
                scope["headers"],
                request_id=request_id,
                api_key=settings.upstream.api_key,
                drop=guarded_drop,
            )
            watch = ClientWatch(scope, receive)
            answer = await watch.guard(
                runtime.guard.handle(parsed, headers, started, client_identity(scope))
            )
            response = answer_response(answer, watch)
        except GatewayError as exc:
            response = error_response(exc, api)
        except ClientGone:
            runtime.guard.client_left_before_response(parsed)
            return Response(status_code=499)
        except ClientDisconnect:  # left while still sending the body
            return Response(status_code=499)
        set_request_id(response, request_id)
        return response

    app.guarded_handler = guarded
    app.client_key_hashes = tuple(settings.auth.api_key_sha256)
    app.max_header_bytes = settings.server.max_header_bytes
    allowed = set(settings.server.allow_vllm_paths)
    app.closed_paths = {
        **{
            path: Forbidden(
                f"{path} is one of vLLM's administrative endpoints; the gateway does not "
                "proxy it unless server.allow_vllm_paths lists it"
            )
            for path in VLLM_ADMIN_PATHS - allowed
        },
        **{
            path: BadRequest(
                f"{path} would reach vLLM's generation handlers without the guard; use "
                "/v1/chat/completions or /v1/completions (or list it in "
                "server.allow_vllm_paths to proxy it unguarded)"
            )
            for path in UNGUARDED_SPELLINGS - allowed
        },
    }
    if settings.metrics.enabled and settings.metrics.port is None:
        # Our own /metrics (it checks metrics.api_key_sha256 itself); otherwise a
        # keyless GET /metrics would reach vLLM's through the proxy.
        app.open_paths = app.open_paths | {"/metrics"}

    # Also registered as routes, for the OpenAPI description; GatewayApp.__call__
    # answers them before FastAPI's routing does.
    def guarded_route(api: ApiAdapter) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            return await guarded(request.scope, request.receive, api)

        return route

    for guarded_api in ADAPTERS.values():
        app.add_api_route(
            guarded_api.path, guarded_route(guarded_api), methods=["POST"], name=guarded_api.name
        )

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

    if settings.metrics.port is not None:

        @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
        async def metrics_elsewhere() -> Response:
            # Not proxied to vLLM either: metrics live on their own port.
            return Response(
                error_body("metrics are served on a separate port", "not_found", code="not_found"),
                status_code=404,
                media_type=JSON_MEDIA_TYPE,
            )

    elif settings.metrics.enabled:
        metric_keys = tuple(settings.metrics.api_key_sha256)

        @app.api_route("/metrics", methods=["GET", "HEAD"])
        async def metrics_endpoint(request: Request) -> Response:
            if metric_keys and not key_allowed(request.scope, metric_keys):
                return unauthorized_response()
            body, content_type = runtime_of(request).metrics.render()
            return Response(body, media_type=content_type)

    @app.api_route(
        "/{path:path}",
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
        include_in_schema=False,
    )
    async def proxy(request: Request, path: str) -> Response:
        """Any other path: proxied verbatim; the body read whole (bounded), reply streamed."""
        runtime = runtime_of(request)
        request_id = request.headers.get("x-request-id") or new_request_id()
        logs.request_id.set(request_id)
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        try:
            # Read whole, within the body limit, before anything goes upstream: a
            # streamed body would reach the backend before the limit could refuse it.
            body = (
                await read_body(request.scope, request.receive, settings.server.max_body_bytes)
                if request.method not in ("GET", "HEAD")
                else None
            )
            backend = stored_answer_backend(runtime, path) or runtime.pool.choose_first(
                0.0, runtime.guard.rng
            )
            headers = forward_headers(
                request.headers.raw,
                request_id=request_id,
                api_key=settings.upstream.api_key,
                drop=client_auth,
            )
            upstream = await backend.open(
                request.method,
                raw_path.decode("latin-1"),
                headers=headers,
                body=body,
                params=request.url.query,
            )
        except GatewayError as exc:
            return error_response(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        out_headers = response_headers(upstream, keep_encoding=True)
        if not any(name == b"x-request-id" for name, _ in out_headers):
            out_headers.append((b"x-request-id", request_id.encode("latin-1")))

        async def relay() -> AsyncIterator[bytes]:
            try:
                with map_transport_errors(backend):
                    async for chunk in upstream.content.iter_any():
                        yield chunk
            except GatewayError:
                log.warning("proxied response from %s broke off", backend.name)
            finally:
                upstream.close()

        response = StreamingResponse(relay(), status_code=upstream.status)
        response.raw_headers.extend(out_headers)  # raw pairs: repeated headers survive
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log_unexpected(request.url.path)
        return internal_error_response()

    return app
