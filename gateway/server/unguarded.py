"""Every other path: proxied to a backend verbatim, the body read whole (bounded,
before anything goes upstream), the reply streamed back byte for byte, with its
Content-Length where the backend sent one. A reply that breaks off reaches the
client broken (``UpstreamBody``). A stored Responses answer's ``GET`` and
``cancel`` go to the backend that made it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.apis import BY_NAME
from gateway.config import Settings
from gateway.errors import GatewayError
from gateway.observe import logs
from gateway.server.asgi import error_response, new_request_id, read_body
from gateway.server.auth import CLIENT_KEY_HEADERS
from gateway.server.lifespan import Runtime
from gateway.server.paths import stored_answer_id
from gateway.server.relay import server_hooks
from gateway.upstream.pool import forward_headers, map_transport_errors, response_headers

log = logging.getLogger("vllm_guard")

ProxyRoute = Callable[[Request, str], Awaitable[Response]]

#: The API whose stored answers have paths of their own (``stored_answer_id``).
RESPONSES = BY_NAME["responses"]


def unguarded_proxy(settings: Settings, runtime: Callable[[Request], Runtime]) -> ProxyRoute:
    drop = CLIENT_KEY_HEADERS if settings.auth.api_key_sha256 else frozenset()
    max_body = settings.server.max_body_bytes

    async def proxy(request: Request, path: str) -> Response:
        state = runtime(request)
        request_id = request.headers.get("x-request-id") or new_request_id()
        logs.request_id.set(request_id)
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        try:
            # Read whole, within the body limit, before anything goes upstream: a
            # streamed body would reach the backend before the limit could refuse it.
            body = (
                await read_body(request.scope, request.receive, max_body)
                if request.method not in ("GET", "HEAD")
                else None
            )
            headers = forward_headers(
                request.headers.raw,
                request_id=request_id,
                api_key=settings.upstream.api_key,
                drop=drop,
            )
            stored = stored_answer_id(path)
            backend = (
                await state.guard.answer_homes.find(RESPONSES, stored, headers, param=None)
                if stored
                else None
            ) or state.pool.choose_first(0.0, state.guard.rng)
            upstream = await backend.open(
                request.method,
                raw_path.decode("latin-1"),
                headers=headers,
                body=body,
                params=request.url.query,
                on_resend=lambda: state.metrics.upstream_resends.labels(backend.name).inc(),
            )
        except GatewayError as exc:
            state.metrics.count_answered("other", exc)
            return error_response(exc)
        except ClientDisconnect:
            return Response(status_code=499)
        out_headers = response_headers(upstream, verbatim=True)
        if not any(name == b"x-request-id" for name, _ in out_headers):
            out_headers.append((b"x-request-id", request_id.encode("latin-1")))

        async def relay() -> AsyncIterator[bytes]:
            try:
                with map_transport_errors(backend):
                    async for chunk in upstream.content.iter_any():
                        yield chunk
            except GatewayError:
                log.warning("proxied response from %s broke off", backend.name)
                raise BrokeOff from None
            finally:
                upstream.close()

        response = UpstreamBody(relay(), status_code=upstream.status)
        response.raw_headers.extend(out_headers)  # raw pairs: repeated headers survive
        return response

    return proxy


class BrokeOff(Exception):
    """The backend's body broke off after the response started."""


class UpstreamBody(StreamingResponse):
    """A proxied body, relayed as it arrives. When it breaks off, the body is not ended:
    no terminating chunk, or fewer bytes than Content-Length, and the connection is
    closed, so the client's HTTP library reports the break instead of handing
    truncated JSON on as complete."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        except BrokeOff:
            hooks = server_hooks(self.scope)
            if hooks is not None:
                hooks.abort()
