"""Parse only what routing needs from a guarded request; keep the body verbatim.

The first attempt sends the client's bytes unchanged whenever no field has to be
added. Fields the gateway adds (a retry salt, ``stream_options.include_usage``)
are spliced into the original bytes.

Bodies over ``LARGE_BODY`` (agent requests with screenshots) are not decoded
whole: ``gateway.wire.jsonscan`` finds the top-level fields, and only the routing
fields and the leading messages are decoded. The rest is checked by vLLM, which
answers malformed JSON with its own 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.apis import BY_NAME, ApiAdapter
from gateway.apis.base import COMMON_ROUTING_FIELDS
from gateway.errors import BadRequest, InvalidCacheSalt
from gateway.guard.salt import salt_problem
from gateway.wire.jsonscan import Spans, leading_messages, top_level_spans

LARGE_BODY = 512 * 1024


@dataclass(frozen=True, slots=True)
class GuardedRequest:
    api: ApiAdapter
    raw: bytes
    #: The decoded body; for a large body only the routing fields and the
    #: leading messages with their media parts reduced to their type (``spans``).
    body: dict[str, Any]
    model: str | None
    stream: bool
    n: int
    client_salt: str | None
    #: The client asked for the final usage chunk of a stream.
    client_wants_usage: bool
    #: Top-level value spans in ``raw`` when ``body`` is partial, else None.
    spans: Spans | None = None
    #: Why the answer cannot be inspected (Responses' ``background``), else None.
    unguardable: str | None = None

    @property
    def echoes_prompt(self) -> bool:
        """Each choice's stream starts with the prompt, echoed (``ApiAdapter.echoes_prompt``);
        a large body, whose last messages are not decoded, with ``echo`` is taken to."""
        if self.spans is not None:
            return self.body.get("echo") is True
        return self.api.echoes_prompt(self.body)

    @property
    def watches_nan(self) -> bool:
        """The answer's sampled tokens come with their logprobs, a NaN logit's null:
        the request asks for them, and no echoed prompt's (whose first token has
        none) comes with them."""
        return self.api.asks_logprobs(self.body) and not self.echoes_prompt

    @property
    def endpoint(self) -> str:
        """The API's name: a bounded label value."""
        return self.api.name

    @property
    def path(self) -> str:
        return self.api.path

    def full_body(self) -> dict[str, Any]:
        """The whole decoded body (decodes a large one now; for rare uses only)."""
        if self.spans is None:
            return self.body
        try:
            decoded = orjson.loads(self.raw)
        except orjson.JSONDecodeError:
            return self.body
        return decoded if isinstance(decoded, dict) else self.body


def _partial_body(
    api: ApiAdapter, raw: bytes, lead_messages: int
) -> tuple[dict[str, Any], Spans] | None:
    spans = top_level_spans(raw)
    if spans is None:
        return None
    fields = (*COMMON_ROUTING_FIELDS, *api.routing_fields)
    try:
        body = {k: orjson.loads(raw[s:e]) for k, (s, e) in spans.items() if k in fields}
    except orjson.JSONDecodeError:
        return None
    conversation = api.conversation_field
    if conversation is not None and conversation in spans:
        lead = leading_messages(raw, spans[conversation], lead_messages)
        if lead is None:
            return None  # not an array of messages (a string input): decoded whole
        body[conversation] = lead
    return body, spans


def parse_guarded(api: ApiAdapter | str, raw: bytes, lead_messages: int = 2) -> GuardedRequest:
    """Validate the few fields the gateway routes on; raise BadRequest otherwise.
    ``api``: the request's adapter, or its name."""
    if isinstance(api, str):
        api = BY_NAME[api]
    partial = _partial_body(api, raw, lead_messages) if len(raw) > LARGE_BODY else None
    spans: Spans | None = None
    if partial is not None:
        body, spans = partial
    else:
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
        api=api,
        raw=raw,
        body=body,
        model=model,
        stream=stream,
        n=n,
        client_salt=client_salt,
        client_wants_usage=wants_usage,
        spans=spans,
        unguardable=api.unguardable(body),
    )


def body_with(request: GuardedRequest, overrides: dict[str, Any]) -> bytes:
    """The request body with ``overrides`` applied, as close to the original bytes as possible."""
    if not overrides:
        return request.raw
    if request.spans is not None:
        return _splice(request.raw, request.spans, overrides)
    if any(key in request.body for key in overrides):
        # Replace the values in the client's bytes: re-serialising the decoded body
        # would change what the client sent (an integer beyond 64 bits decodes to a
        # float, key order and spacing change).
        spans = top_level_spans(request.raw)
        if spans is not None:
            return _splice(request.raw, spans, overrides)
        merged = {**request.body, **overrides}  # the scan gave up: decoded, as a last resort
        return json.dumps(merged, ensure_ascii=False).encode("utf-8")
    raw = request.raw
    brace = raw.index(b"{")
    extra = orjson.dumps(overrides)[1:-1]
    rest = raw[brace + 1 :]
    separator = b"" if rest.lstrip().startswith(b"}") else b","
    return raw[: brace + 1] + extra + separator + rest


def _splice(raw: bytes, spans: Spans, overrides: dict[str, Any]) -> bytes:
    """Replace existing top-level values in place and add the missing ones."""
    out = raw
    for start, end, key in sorted(((*spans[k], k) for k in overrides if k in spans), reverse=True):
        out = out[:start] + orjson.dumps(overrides[key]) + out[end:]
    missing = {k: v for k, v in overrides.items() if k not in spans}
    if missing:
        brace = out.index(b"{")
        separator = b"" if out[brace + 1 :].lstrip().startswith(b"}") else b","
        out = out[: brace + 1] + orjson.dumps(missing)[1:-1] + separator + out[brace + 1 :]
    return out


def attempt_overrides(request: GuardedRequest, salt: str | None) -> dict[str, Any]:
    """Fields the gateway must set for one attempt."""
    overrides: dict[str, Any] = {}
    if salt is not None and salt != request.client_salt:
        overrides["cache_salt"] = salt
    if request.stream and request.api.openai_chunks and not request.client_wants_usage:
        options = request.body.get("stream_options") or {}
        overrides["stream_options"] = {**options, "include_usage": True}
    return overrides
