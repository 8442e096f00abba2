"""``create_app(settings)``: routes, limits, and the lifespan that owns the HTTP pool.

Start with ``vllm-guard serve`` or ``uvicorn gateway.app:create_app --factory``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from gateway import __version__
from gateway.config import Settings, load_settings
from gateway.errors import GatewayError, PayloadTooLarge, error_body
from gateway.guard import Guard
from gateway.metrics import Metrics
from gateway.request import parse_guarded
from gateway.scrape import BackendScraper
from gateway.upstream import (
    BackendPool,
    forward_headers,
    map_transport_errors,
    new_session,
    response_headers,
)

log = logging.getLogger("vllm_guard")

RESOLVED_SETTINGS_ENV = "VLLM_GUARD_RESOLVED_SETTINGS"
JSON_MEDIA_TYPE = "application/json"
_T = TypeVar("_T")


@dataclass(slots=True)
class Runtime:
    settings: Settings
    session: aiohttp.ClientSession
    pool: BackendPool
    metrics: Metrics
    guard: Guard
    scraper: BackendScraper


class ClientGone(Exception):
    """The client disconnected before the response started."""


def settings_from_environment() -> Settings:
    resolved = os.environ.get(RESOLVED_SETTINGS_ENV)
    if resolved:
        return Settings.model_validate_json(resolved)
    return load_settings(os.environ.get("VLLM_GUARD_CONFIG"))


def error_response(exc: GatewayError) -> Response:
    return Response(exc.body(), status_code=exc.status, media_type=JSON_MEDIA_TYPE)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is larger than the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnect(request: Request, work: Awaitable[_T]) -> _T:
    """Run ``work``; cancel it (closing its upstream request) if the client leaves."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:  # the attempt failed while it was being cancelled
        log.debug("attempt failed during client disconnect", exc_info=True)
    raise ClientGone


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or settings_from_environment()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        session = new_session(settings.upstream)
        pool = BackendPool(settings.upstream, session)
        metrics = Metrics(CollectorRegistry(), models=settings.models, backends=pool.names)
        scraper = BackendScraper(pool, metrics, settings.upstream)
        runtime = Runtime(settings, session, pool, metrics, Guard(settings, pool, metrics), scraper)
        app.state.runtime = runtime
        await pool.check_all()
        await scraper.scrape_once()
        pool.start()
        scraper.start()
        log.info("vllm-guard %s ready; backends: %s", __version__, ", ".join(pool.names))
        try:
            yield
        finally:
            await scraper.stop()
            await pool.stop()
            await session.close()

    app = FastAPI(
        title="vllm-guard",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )

    def runtime_of(request: Request) -> Runtime:
        runtime: Runtime = request.app.state.runtime
        return runtime

    async def guarded(request: Request, endpoint: str) -> Response:
        started = time.perf_counter()
        runtime = runtime_of(request)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            raw = await read_body(request, settings.server.max_body_bytes)
            parsed = parse_guarded(endpoint, raw)
            headers = forward_headers(
                request.headers.items(),
                request_id=request_id,
                api_key=settings.upstream.api_key,
                drop=frozenset({"accept-encoding"}),
            )
            response = await until_disconnect(
                request, runtime.guard.handle(parsed, headers, started)
            )
        except GatewayError as exc:
            response = error_response(exc)
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)
        response.headers["x-request-id"] = request_id
        return response

    @app.post("/v1/chat/completions", include_in_schema=True)
    async def chat_completions(request: Request) -> Response:
        return await guarded(request, "chat")

    @app.post("/v1/completions", include_in_schema=True)
    async def completions(request: Request) -> Response:
        return await guarded(request, "completions")

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON_MEDIA_TYPE)

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        pool = runtime_of(request).pool
        states = {b.name: b.healthy for b in pool.backends}
        ready = pool.any_healthy()
        body = error_body("no backend answers /health", "service_unavailable", code="not_ready")
        if ready:
            body = (
                b'{"status":"ready","backends":{'
                + b",".join(f'"{name}":{str(ok).lower()}'.encode() for name, ok in states.items())
                + b"}}"
            )
        return Response(body, status_code=200 if ready else 503, media_type=JSON_MEDIA_TYPE)

    if settings.metrics.enabled:

        @app.get("/metrics")
        async def metrics_endpoint(request: Request) -> Response:
            body, content_type = runtime_of(request).metrics.render()
            return Response(body, media_type=content_type)

    @app.api_route(
        "/{path:path}",
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
        include_in_schema=False,
    )
    async def proxy(request: Request, path: str) -> Response:
        """Any other path: proxied verbatim, bodies streamed both ways."""
        runtime = runtime_of(request)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        try:
            backend = runtime.pool.choose_first(0.0, runtime.guard.rng)
            body = request.stream() if request.method not in ("GET", "HEAD") else None
            headers = forward_headers(
                request.headers.items(), request_id=request_id, api_key=settings.upstream.api_key
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
        out_headers.setdefault("x-request-id", request_id)

        async def relay() -> AsyncIterator[bytes]:
            try:
                with map_transport_errors(backend):
                    async for chunk in upstream.content.iter_any():
                        yield chunk
            except GatewayError:
                log.warning("proxied response from %s broke off", backend.name)
            finally:
                upstream.close()

        return StreamingResponse(relay(), status_code=upstream.status, headers=out_headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return Response(
            error_body("internal gateway error", "internal_error", code="internal_error"),
            status_code=500,
            media_type=JSON_MEDIA_TYPE,
        )

    return app
