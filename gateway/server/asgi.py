"""ASGI-level helpers of the server layer: request ids, reading a bounded body from
raw ASGI messages, and the gateway's own errors as responses, in the shape of the
API the client speaks."""

from __future__ import annotations

import logging
import random
import sys
import traceback

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope

from gateway.apis import ApiAdapter
from gateway.errors import GatewayError, InternalError, PayloadTooLarge, Unauthorized

log = logging.getLogger("vllm_guard")

JSON_MEDIA_TYPE = "application/json"


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
    not build a Starlette Request (its cost showed in profiles)."""
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


def set_request_id(response: Response, request_id: str) -> None:
    """``x-request-id`` on the answer, replacing any the backend sent (vLLM can echo
    its own). On the raw pairs: Starlette's ``MutableHeaders`` costs a few µs more."""
    raw = response.raw_headers
    if any(name == b"x-request-id" for name, _ in raw):
        raw[:] = [(name, value) for name, value in raw if name != b"x-request-id"]
    raw.append((b"x-request-id", request_id.encode("latin-1")))


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
