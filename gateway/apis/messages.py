"""Anthropic Messages (``POST /v1/messages``), as vLLM serves it.

A whole answer's ``content`` blocks are read as one output: ``text`` blocks are
its text, ``thinking`` blocks its reasoning, ``tool_use`` blocks its tool calls
(their ``input``, as JSON). ``stop_reason`` stands for the finish reason
(``max_tokens`` is "length"). A stream is typed events: ``message_start``,
``content_block_start`` / ``content_block_delta`` (``text_delta``,
``thinking_delta``, ``input_json_delta``) / ``content_block_stop``,
``message_delta`` (the stop reason and the final usage), ``message_stop`` (the
end; there is no ``[DONE]``), ``ping``, and ``error``.

Usage: vLLM reports ``input_tokens`` *without* the cached ones, as Anthropic
defines it (total = ``input_tokens + cache_read_input_tokens +
cache_creation_input_tokens``); ``cache_read_input_tokens`` is absent when vLLM
runs without ``--enable-prompt-tokens-details``.

Errors are Anthropic's: ``{"type": "error", "error": {"type", "message"}}``, and
in a stream an ``event: error`` with the same body.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from gateway.apis.base import (
    BACKEND_ERROR,
    ENDS,
    NO_SIGNAL,
    ApiAdapter,
    EventReader,
    EventSignal,
    Usage,
    event_bytes,
    integer,
    text,
)
from gateway.config import SaltReuseSettings
from gateway.detect import ChoiceOutput, StreamInspector
from gateway.errors import GatewayError

#: Anthropic's stop reasons in chat terms (the detectors read finish reasons).
FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "pause_turn": "stop",
    "refusal": "stop",
}

#: Anthropic's error types by HTTP status (their API's list; 5xx other than 503:
#: ``api_error``).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(error: GatewayError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(
        error.status, "invalid_request_error" if error.status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def read_anthropic_usage(usage: object) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    uncached = integer(usage.get("input_tokens"))
    if uncached is None:
        return None
    cached = integer(usage.get("cache_read_input_tokens"))
    created = integer(usage.get("cache_creation_input_tokens")) or 0
    return Usage(uncached + (cached or 0) + created, cached)


def _stop_reason(value: object) -> str | None:
    return FINISH_REASONS.get(value, "stop") if isinstance(value, str) else None


@dataclass(slots=True)
class MessagesEventReader(EventReader):
    inspector: StreamInspector
    answer_id: str | None = None

    def read(self, payload: dict[str, Any]) -> EventSignal:
        kind = payload.get("type")
        inspector = self.inspector
        if kind == "content_block_delta":
            delta = payload.get("delta")
            if not isinstance(delta, dict):
                return NO_SIGNAL
            delta_type = delta.get("type")
            if delta_type == "text_delta":
                inspector.feed_output(0, content=text(delta.get("text")))
            elif delta_type == "thinking_delta":
                inspector.feed_output(0, reasoning=text(delta.get("thinking")))
            elif delta_type == "input_json_delta":
                index = integer(payload.get("index")) or 0
                inspector.feed_output(
                    0, tool_index=index, tool_arguments=text(delta.get("partial_json"))
                )
        elif kind == "content_block_start":
            block = payload.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                index = integer(payload.get("index")) or 0
                inspector.feed_output(0, tool_index=index, tool_arguments="")
        elif kind == "message_start":
            inspector.open_choice(0)
        elif kind == "message_delta":
            delta = payload.get("delta")
            stop = _stop_reason(delta.get("stop_reason")) if isinstance(delta, dict) else None
            if stop is not None:
                inspector.feed_output(0, finish_reason=stop)
            usage = payload.get("usage")
            if isinstance(usage, dict):
                inspector.completion_tokens = integer(usage.get("output_tokens"))
            return EventSignal(usage=read_anthropic_usage(usage))
        elif kind == "message_stop":
            return ENDS
        elif kind == "error":
            return BACKEND_ERROR
        return NO_SIGNAL

    def error_event(self, error: GatewayError) -> bytes:
        return event_bytes("error", anthropic_error(error))


class Messages(ApiAdapter):
    name: ClassVar[str] = "messages"
    path: ClassVar[str] = "/v1/messages"
    routing_fields: ClassVar[tuple[str, ...]] = ("system",)
    conversation_field: ClassVar[str | None] = "messages"

    def conversation_lead(self, body: Mapping[str, Any], settings: SaltReuseSettings) -> object:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        return [body.get("system"), messages[: settings.fingerprint_messages]]

    def outputs(self, payload: Mapping[str, Any]) -> Iterable[tuple[int, ChoiceOutput]]:
        content: list[str] = []
        reasoning: list[str] = []
        tool_arguments: list[str] = []
        blocks = payload.get("content")
        for block in blocks if isinstance(blocks, list) else ():
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text":
                content.append(text(block.get("text")))
            elif kind == "thinking":
                reasoning.append(text(block.get("thinking")))
            elif kind == "tool_use":
                tool_arguments.append(orjson.dumps(block.get("input", {})).decode())
        usage = payload.get("usage")
        tokens = integer(usage.get("output_tokens")) if isinstance(usage, dict) else None
        output = ChoiceOutput(
            content="".join(content),
            reasoning="".join(reasoning),
            tool_arguments=tuple(tool_arguments),
            finish_reason=_stop_reason(payload.get("stop_reason")),
            tokens=tokens,
        )
        return [(0, output)]

    def read_usage(self, payload: Mapping[str, Any]) -> Usage | None:
        return read_anthropic_usage(payload.get("usage"))

    def event_reader(self, inspector: StreamInspector) -> EventReader:
        return MessagesEventReader(inspector)

    def error_body(self, error: GatewayError) -> bytes:
        return orjson.dumps(anthropic_error(error))
