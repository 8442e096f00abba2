"""Parse only what routing needs from a guarded request; keep the body verbatim.

The first attempt sends the client's bytes unchanged whenever no field has to be
added. Fields the gateway adds (a retry salt, ``stream_options.include_usage``)
are spliced into the original bytes when the client did not send them, and the
body is re-serialised only when an existing field must change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import BadRequest, InvalidCacheSalt
from gateway.salt import salt_problem

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True, slots=True)
class GuardedRequest:
    endpoint: str  # "chat" | "completions"
    raw: bytes
    body: dict[str, Any]
    model: str | None
    stream: bool
    n: int
    client_salt: str | None
    #: The client asked for the final usage chunk of a stream.
    client_wants_usage: bool

    @property
    def path(self) -> str:
        return ENDPOINT_PATHS[self.endpoint]


def parse_guarded(endpoint: str, raw: bytes) -> GuardedRequest:
    """Validate the few fields the gateway routes on; raise BadRequest otherwise."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc.args[0]}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BadRequest("'n' must be an integer of at least 1", param="n")
    client_salt = body.get("cache_salt")
    if client_salt is not None:
        problem = salt_problem(client_salt)
        if problem is not None:
            raise InvalidCacheSalt(problem, param="cache_salt")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    wants_usage = bool(stream_options and stream_options.get("include_usage") is True)
    return GuardedRequest(
        endpoint=endpoint,
        raw=raw,
        body=body,
        model=model,
        stream=stream,
        n=n,
        client_salt=client_salt,
        client_wants_usage=wants_usage,
    )


def body_with(request: GuardedRequest, overrides: dict[str, Any]) -> bytes:
    """The request body with ``overrides`` applied, as close to the original bytes as possible."""
    if not overrides:
        return request.raw
    if any(key in request.body for key in overrides):
        merged = {**request.body, **overrides}
        try:
            return orjson.dumps(merged)
        except TypeError:  # integers beyond 64 bits: orjson refuses, json does not
            return json.dumps(merged, ensure_ascii=False).encode("utf-8")
    raw = request.raw
    brace = raw.index(b"{")
    extra = orjson.dumps(overrides)[1:-1]
    rest = raw[brace + 1 :]
    separator = b"" if rest.lstrip().startswith(b"}") else b","
    return raw[: brace + 1] + extra + separator + rest


def attempt_overrides(request: GuardedRequest, salt: str | None) -> dict[str, Any]:
    """Fields the gateway must set for one attempt."""
    overrides: dict[str, Any] = {}
    if salt is not None and salt != request.client_salt:
        overrides["cache_salt"] = salt
    if request.stream and not request.client_wants_usage:
        options = request.body.get("stream_options") or {}
        overrides["stream_options"] = {**options, "include_usage": True}
    return overrides
