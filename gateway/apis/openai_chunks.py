"""Chat completions and text completions: OpenAI's ``choices`` bodies and chunk
streams (``data: {chunk}`` ... ``data: [DONE]``).

Their streams are read by ``gateway.guard.stream.StreamState`` itself: nearly every event
is one choice's next piece of text, recognised without parsing its JSON
(``gateway.wire.vllm_events``). What else differs lives here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from gateway.apis.base import ApiAdapter, Usage
from gateway.config import SaltReuseSettings
from gateway.detect import ChoiceOutput, Detector, Verdict, as_text, choice_index


def body_choices(body: Mapping[str, Any]) -> list[tuple[int, ChoiceOutput]]:
    """Each choice of a chat.completion or text_completion body, with its index."""
    choices = body.get("choices")
    if not isinstance(choices, list):
        return []
    usage = body.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    # Usage counts every choice's tokens: it is one choice's only when there is one.
    known = tokens if isinstance(tokens, int) and len(choices) == 1 else None
    return [
        (choice_index(c, i), choice_output(c, tokens=known))
        for i, c in enumerate(choices)
        if isinstance(c, dict)
    ]


def choice_output(choice: Mapping[str, Any], tokens: int | None = None) -> ChoiceOutput:
    """Read one choice of a chat or completions body (non-streaming)."""
    message = choice.get("message")
    finish = choice.get("finish_reason")
    finish_reason = finish if isinstance(finish, str) else None
    if isinstance(message, dict):
        return ChoiceOutput(
            content=as_text(message.get("content")),
            reasoning=as_text(message.get("reasoning_content"))
            or as_text(message.get("reasoning")),
            tool_arguments=_tool_arguments(message.get("tool_calls")),
            finish_reason=finish_reason,
            tokens=tokens,
        )
    return ChoiceOutput(
        content=as_text(choice.get("text")), finish_reason=finish_reason, tokens=tokens
    )


def _tool_arguments(tool_calls: object) -> tuple[str, ...]:
    if not isinstance(tool_calls, list):
        return ()
    out = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            out.append(as_text(function.get("arguments")))
    return tuple(out)


def read_openai_usage(payload: Mapping[str, Any]) -> Usage | None:
    """``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``."""
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    if not isinstance(prompt, int):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt, cached if isinstance(cached, int) else None)


class _OpenAIChoices(ApiAdapter):
    openai_chunks: ClassVar[bool] = True

    def outputs(self, payload: Mapping[str, Any]) -> Iterable[tuple[int, ChoiceOutput]]:
        return body_choices(payload)

    def inspect_body(self, detector: Detector, payload: Mapping[str, Any]) -> Verdict:
        return detector.inspect_choices(body_choices(payload))

    def read_usage(self, payload: Mapping[str, Any]) -> Usage | None:
        return read_openai_usage(payload)


class ChatCompletions(_OpenAIChoices):
    name: ClassVar[str] = "chat"
    path: ClassVar[str] = "/v1/chat/completions"
    conversation_field: ClassVar[str | None] = "messages"

    def conversation_lead(self, body: Mapping[str, Any], settings: SaltReuseSettings) -> object:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        return messages[: settings.fingerprint_messages]


class TextCompletions(_OpenAIChoices):
    name: ClassVar[str] = "completions"
    path: ClassVar[str] = "/v1/completions"
    routing_fields: ClassVar[tuple[str, ...]] = ("prompt",)

    def conversation_lead(self, body: Mapping[str, Any], settings: SaltReuseSettings) -> object:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            return None
        return prompt[: settings.fingerprint_prompt_chars]
