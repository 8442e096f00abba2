"""The gateway's own errors, each knowing its HTTP status and OpenAI error ``type``.

    GatewayError
    ├── BadRequest                 400  invalid_request_error
    │   └── InvalidCacheSalt       400  (vLLM's own rule and message)
    ├── Unauthorized               401  authentication_error
    ├── Forbidden                  403  permission_error (a closed vLLM admin path)
    ├── PayloadTooLarge            413  invalid_request_error
    ├── HeadersTooLarge            431  invalid_request_error
    ├── UpstreamError              502  upstream_error
    │   ├── BackendUnreachable     502
    │   └── UpstreamProtocolError  502  (garbage from the backend)
    ├── DegenerateResponse         502  degenerate_response (guard gave up, policy "error")
    ├── InternalError              500  internal_error (a bug in the gateway, no details)
    ├── NoHealthyBackend           503  service_unavailable
    ├── ShuttingDown               503  (stream cut at the end of the shutdown grace)
    └── UpstreamTimeout            504  timeout

Rendered by ``error_body`` as ``{"error": {message, type, param, code}}``; on the
Anthropic Messages API by its adapter (``gateway.apis.messages``), in Anthropic's shape.
"""

from __future__ import annotations

import orjson


class GatewayError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None
    #: The gateway answers this itself, without a backend's answer (counted in
    #: ``vllm_guard_gateway_answered_total``); False for what a backend's attempts
    #: ended in, which the guard counts as the request's verdict.
    answered_by_gateway = True
    #: The request may have reached the backend (False only where that is proven:
    #: the connection to it never opened). A request that may have reached it is
    #: never sent again unless its method is idempotent (``gateway.upstream.pool``).
    may_have_reached_backend = True

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, self.type, param=self.param, code=self.code)


class BadRequest(GatewayError):
    status = 400
    type = "BadRequestError"
    code = "invalid_request"


class InvalidCacheSalt(BadRequest):
    code = "invalid_cache_salt"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class HeadersTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "headers_too_large"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class NotFound(GatewayError):
    status = 404
    type = "not_found"
    code = "not_found"


class TooManyConnections(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "too_many_connections"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "bad_gateway"
    answered_by_gateway = False


class BackendUnreachable(UpstreamError):
    code = "backend_unreachable"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"


class DegenerateResponse(GatewayError):
    status = 502
    type = "degenerate_response"
    code = "degenerate_response"
    answered_by_gateway = False


class InternalError(GatewayError):
    code = "internal_error"


class NoHealthyBackend(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_healthy_backend"


class ShuttingDown(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "shutting_down"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "timeout"
    code = "upstream_timeout"
    answered_by_gateway = False


def error_body(message: str, type_: str, *, param: str | None = None, code: str | None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


def sse_error_event(error: GatewayError) -> bytes:
    """An in-band error for a stream that has already started, then ``[DONE]``."""
    return b"data: " + error.body() + b"\n\ndata: [DONE]\n\n"
