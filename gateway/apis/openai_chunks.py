"""Chat completions and text completions: OpenAI's ``choices`` bodies and chunk
streams (``data: {chunk}`` ... ``data: [DONE]``).

Their streams are read by ``gateway.guard.StreamState`` itself: nearly every event
is one choice's next piece of text, recognised without parsing its JSON
(``gateway.vllmevents``). What else differs lives here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from gateway.apis.base import ApiAdapter, Usage
from gateway.config import SaltReuseSettings
from gateway.detect import ChoiceOutput, Detector, Verdict, body_choices


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
        return detector.inspect_body(payload)

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
