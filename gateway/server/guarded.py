"""The guarded endpoints' handler: an ASGI request in, the guard's answer out.

Reads the body from raw ASGI messages (bounded), parses it for the request's API,
forwards the headers the backend should see, and runs ``Guard.handle`` under a
``ClientWatch`` (a client that leaves cancels the work and closes its upstream
request); the answer becomes an ASGI response, errors take the API's shape.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope

from gateway.apis import ApiAdapter
from gateway.config import Settings
from gateway.errors import GatewayError
from gateway.guard.request import parse_guarded
from gateway.observe import logs
from gateway.server.asgi import (
    error_response,
    header_value,
    new_request_id,
    read_body,
    set_request_id,
)
from gateway.server.auth import CLIENT_KEY_HEADERS, TrustedProxies, client_identity
from gateway.server.lifespan import Runtime
from gateway.server.relay import ClientGone, ClientWatch, answer_response
from gateway.upstream.pool import forward_headers

GuardedHandler = Callable[[Scope, Receive, ApiAdapter], Awaitable[Response]]

#: Never forwarded to vLLM on a guarded request: the client's compression
#: preference (the guard reads the body); with client keys on, also the client's key.
_ALWAYS_DROPPED = frozenset({"accept-encoding"})


def guarded_handler(settings: Settings, runtime: Callable[[], Runtime]) -> GuardedHandler:
    keys_on = bool(settings.auth.api_key_sha256)
    drop = _ALWAYS_DROPPED | (CLIENT_KEY_HEADERS if keys_on else frozenset())
    lead_messages = settings.guard.salt_reuse.fingerprint_messages
    max_body = settings.server.max_body_bytes
    api_key = settings.upstream.api_key
    proxies = TrustedProxies(settings.server.trusted_proxies)

    async def guarded(scope: Scope, receive: Receive, api: ApiAdapter) -> Response:
        started = time.perf_counter()
        guard = runtime().guard
        request_id = header_value(scope, b"x-request-id") or new_request_id()
        logs.request_id.set(request_id)
        try:
            raw = await read_body(scope, receive, max_body)
            parsed = parse_guarded(api, raw, lead_messages)
            headers = forward_headers(
                scope["headers"], request_id=request_id, api_key=api_key, drop=drop
            )
            watch = ClientWatch(scope, receive)
            client = client_identity(scope, by_key=keys_on, proxies=proxies)
            answer = await watch.guard(guard.handle(parsed, headers, started, client))
            response = answer_response(answer, watch)
        except GatewayError as exc:
            runtime().metrics.count_answered(api.name, exc)
            response = error_response(exc, api)
        except ClientGone:
            guard.client_left_before_response(parsed)
            return Response(status_code=499)
        except ClientDisconnect:  # left while still sending the body
            return Response(status_code=499)
        set_request_id(response, request_id)
        return response

    return guarded
