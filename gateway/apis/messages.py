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
    ContinuationPlan,
    EventReader,
    EventSignal,
    EventSplice,
    ReleasedPart,
    RenderedPrompt,
    Usage,
    event_bytes,
    event_payload,
    integer,
    remaining_tokens,
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


#: Request fields whose rendering the gateway does not reproduce for ``/tokenize``
#: (vLLM's Anthropic conversion turns them into template arguments or tools).
_NOT_RENDERED = ("tools", "tool_choice", "thinking", "output_config", "mcp_servers")
#: vLLM drops system blocks that start so (a per-request hash; serving.py).
_BILLING_HEADER = "x-anthropic-billing-header"


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """A text-only Messages conversation as the OpenAI chat messages vLLM converts it
    to (``AnthropicServingMessages.to_chat_completion_request``: the system text
    first, one message per turn, a single text block as a string, several as text
    parts); None for anything else (tools, images, thinking, inline system turns)."""
    if any(body.get(name) is not None for name in _NOT_RENDERED):
        return None
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    elif isinstance(system, list):
        texts = _block_texts(system)
        if texts is None:
            return None
        joined = "".join(t for t in texts if not t.startswith(_BILLING_HEADER))
        if joined:
            out.append({"role": "system", "content": joined})
    elif system is not None and system != "":
        return None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            return None
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        texts = _block_texts(content) if isinstance(content, list) else None
        if texts is None:
            return None
        texts = [t for t in texts if t]
        if len(texts) == 1:
            out.append({"role": role, "content": texts[0]})
        elif texts:
            out.append({"role": role, "content": [{"type": "text", "text": t} for t in texts]})
        elif role == "assistant":
            return None  # vLLM keeps an empty assistant turn in a shape not reproduced here
    return out


def _block_texts(blocks: list[Any]) -> list[str] | None:
    texts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text":
            return None
        value = block.get("text")
        if not isinstance(value, str):
            return None
        texts.append(value)
    return texts


@dataclass(slots=True)
class MessagesSplice(EventSplice):
    """A continuation's Messages events rewritten into the client's stream: its
    ``message_start`` and the opening of its text block dropped (the client has both;
    the block is still open there), usage of one answer in ``message_delta``."""

    released: ReleasedPart

    def event(self, raw: bytes) -> bytes | None:
        payload = event_payload(raw)  # StreamState has parsed it once already
        if payload is None:
            return raw
        kind = payload.get("type")
        if kind == "message_start":
            return None
        if kind == "content_block_start" and payload.get("index") == 0:
            return None
        if kind != "message_delta":
            return raw
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self._one_answers_usage(usage)
        return event_bytes("message_delta", payload)

    def error(self, raw: bytes) -> bytes:
        return raw  # Messages streams do not number their events

    def _one_answers_usage(self, usage: dict[str, Any]) -> None:
        output = integer(usage.get("output_tokens"))
        if output is None or integer(usage.get("input_tokens")) is None:
            return
        # Anthropic splits the prompt into tokens read from the cache, written to it,
        # and neither (input_tokens). The released text ends the continuation's
        # prompt, and a prompt's end is the last part to be cached: its tokens are
        # taken from the uncached part first, then from the writes, then the reads.
        left = self.released.tokens
        for key in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"):
            value = integer(usage.get(key))
            if value is not None and left:
                taken = min(value, left)
                usage[key], left = value - taken, left - taken
        usage["output_tokens"] = output + self.released.tokens


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

    def continuation_plan(self, body: Mapping[str, Any]) -> ContinuationPlan | None:
        """A text-only conversation: vLLM's Messages API does not continue a trailing
        assistant message, so the answer is continued by token ids, and the gateway
        can have vLLM render only such a prompt (``chat_messages``)."""
        messages = chat_messages(body)
        transfer = body.get("kv_transfer_params")
        if messages is None or not (transfer is None or isinstance(transfer, dict)):
            return None
        tokenize: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
        count: dict[str, Any] = {"messages": body.get("messages")}
        for name in ("model", "system", "chat_template_kwargs"):
            if body.get(name) is not None:
                count[name] = body[name]
                if name != "system":
                    tokenize[name] = body[name]
        check = RenderedPrompt(tokenize, "/v1/messages/count_tokens", count)
        return MessagesContinuation(transfer or {}, body, check)


@dataclass(frozen=True, slots=True)
class MessagesContinuation(ContinuationPlan):
    """The same request with its prompt given as token ids: the rendered prompt
    followed by the released text's (``kv_transfer_params.prompt_token_ids``, which
    vLLM uses instead of rendering the messages)."""

    transfer: Mapping[str, Any]
    body: Mapping[str, Any]
    prompt_check: RenderedPrompt | None

    def request_fields(
        self, released: str, released_tokens: int, prompt_token_ids: list[int] | None
    ) -> dict[str, Any] | None:
        if prompt_token_ids is None:
            return None
        return {
            "kv_transfer_params": {**self.transfer, "prompt_token_ids": prompt_token_ids},
            **remaining_tokens(self.body, released_tokens, ("max_tokens",), None),
        }

    def splice(self, released: ReleasedPart) -> EventSplice | None:
        return MessagesSplice(released)
