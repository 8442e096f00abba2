"""Chat completions and text completions: OpenAI's ``choices`` bodies and chunk
streams (``data: {chunk}`` ... ``data: [DONE]``).

Their streams are read by ``gateway.guard.stream.StreamState`` itself: nearly every event
is one choice's next piece of text, recognised without parsing its JSON
(``gateway.wire.vllm_events``). What else differs lives here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from gateway.apis.base import (
    ApiAdapter,
    ContinuationPlan,
    EventSplice,
    ReleasedPart,
    RenderedPrompt,
    Usage,
    event_payload,
    integer,
    json_events,
    remaining_tokens,
)
from gateway.config import SaltReuseSettings
from gateway.detect import ChoiceOutput, Detector, Verdict, as_text, choice_index
from gateway.detect.logprobs import sampled_logprob_is_nan
from gateway.wire.logprobs import strip_choice_logprobs

#: Request fields under which a continuation would not continue the same answer:
#: a grammar (structured outputs) restarts at the continuation's first token; an
#: echo or the prompt's logprobs and token ids would cover the continued prefix.
_NOT_CONTINUABLE = (
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "echo", "prompt_logprobs", "return_token_ids", "suffix",
)  # fmt: skip
#: The fields of a chunk that name its answer: a continuation's carry the original's.
_IDENTITY = ("id", "created", "model", "system_fingerprint")
#: vLLM's default max_tokens for text completions (CompletionRequest).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


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


def continuable(body: Mapping[str, Any]) -> bool:
    """Whether a continuation of this request's answer is the same answer, longer."""
    if any(body.get(name) not in (None, False) for name in _NOT_CONTINUABLE):
        return False
    if (integer(body.get("n")) or 1) > 1 or (integer(body.get("best_of")) or 1) > 1:
        return False
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        return False
    tool_choice = body.get("tool_choice")
    return not (tool_choice == "required" or isinstance(tool_choice, dict))


@dataclass(slots=True)
class ChunkSplice:
    """A continuation's chunk stream rewritten into the client's (``EventSplice``):
    the original's id, created, model and system fingerprint on every chunk; the
    opening role chunk dropped (the client has one); usage of one answer
    (``ReleasedPart.usage_of_one_answer``)."""

    identity: dict[str, Any]
    released: ReleasedPart

    @classmethod
    def of(cls, released: ReleasedPart) -> ChunkSplice | None:
        first = next(iter(json_events(released.opening)), None)
        if first is None:
            return None
        identity = {k: first[k] for k in _IDENTITY if k in first}
        return cls(identity, released)

    def event(self, raw: bytes) -> bytes | None:
        payload = event_payload(raw)  # StreamState has parsed it once already
        if payload is None:
            return raw
        choices = payload.get("choices")
        if isinstance(choices, list) and choices:
            for choice in choices:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict):
                    delta.pop("role", None)
            if all(_says_nothing(c) for c in choices) and payload.get("usage") is None:
                return None
        for key in _IDENTITY:
            if key in self.identity:
                payload[key] = self.identity[key]
        self.released.usage_of_one_answer(
            payload.get("usage"), "prompt_tokens", "completion_tokens"
        )
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def error(self, raw: bytes) -> bytes:
        return raw  # chunk streams do not number their events


def _says_nothing(choice: object) -> bool:
    """A chunk choice with no text, no finish and no logprobs (the role chunk's rest)."""
    if not isinstance(choice, dict):
        return False
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return all(value in (None, "", []) for value in delta.values())
    return not choice.get("text")


@dataclass(frozen=True, slots=True)
class ChatContinuation(ContinuationPlan):
    """A conversation continued by its last assistant message: vLLM continues one
    with both ``continue_final_message`` and ``add_generation_prompt: false`` (one
    alone is a 400). A client that continues its own assistant message has the
    released text appended to it."""

    body: Mapping[str, Any]
    prompt_check: RenderedPrompt | None = None

    def request_fields(
        self, released: str, released_tokens: int, prompt_token_ids: list[int] | None
    ) -> dict[str, Any]:
        messages = self.body["messages"]
        last = messages[-1]
        if self.body.get("continue_final_message") is True:
            continued = [*messages[:-1], {**last, "content": last["content"] + released}]
        else:
            continued = [*messages, {"role": "assistant", "content": released}]
        return {
            "messages": continued,
            "continue_final_message": True,
            "add_generation_prompt": False,
            **remaining_tokens(
                self.body, released_tokens, ("max_completion_tokens", "max_tokens"), None
            ),
        }

    def splice(self, released: ReleasedPart) -> EventSplice | None:
        return ChunkSplice.of(released)


@dataclass(frozen=True, slots=True)
class CompletionsContinuation(ContinuationPlan):
    """The prompt and the released text, as one prompt."""

    prompt: str
    body: Mapping[str, Any]
    prompt_check: RenderedPrompt | None = None

    def request_fields(
        self, released: str, released_tokens: int, prompt_token_ids: list[int] | None
    ) -> dict[str, Any]:
        return {
            "prompt": self.prompt + released,
            **remaining_tokens(
                self.body, released_tokens, ("max_tokens",), COMPLETIONS_DEFAULT_MAX_TOKENS
            ),
        }

    def splice(self, released: ReleasedPart) -> EventSplice | None:
        return ChunkSplice.of(released)


class _OpenAIChoices(ApiAdapter):
    openai_chunks: ClassVar[bool] = True

    def outputs(self, payload: Mapping[str, Any]) -> Iterable[tuple[int, ChoiceOutput]]:
        return body_choices(payload)

    def strip_logprobs(self, raw: bytes) -> bytes:
        return strip_choice_logprobs(raw)

    def sampled_nan(self, payload: Mapping[str, Any]) -> int | None:
        choices = payload.get("choices")
        for position, choice in enumerate(choices if isinstance(choices, list) else ()):
            if isinstance(choice, dict) and sampled_logprob_is_nan(choice.get("logprobs")):
                return choice_index(choice, position)
        return None

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

    def asks_logprobs(self, body: Mapping[str, Any]) -> bool:
        return body.get("logprobs") is True

    def logprobs_ask(
        self, body: Mapping[str, Any], *, backend_keeps_answers: bool | None = None
    ) -> dict[str, Any] | None:
        """``top_logprobs: 0``: the sampled token's alone. Not where the client sent
        ``top_logprobs`` itself (without ``logprobs`` that is vLLM's 400 to give)."""
        if self.asks_logprobs(body) or body.get("top_logprobs") is not None:
            return None
        return {"logprobs": True, "top_logprobs": 0}

    def echoes_prompt(self, body: Mapping[str, Any]) -> bool:
        """vLLM echoes a trailing assistant message with content (serving_chat: the
        last message's role is the answer's)."""
        messages = body.get("messages")
        if body.get("echo") is not True or not isinstance(messages, list) or not messages:
            return False
        last = messages[-1]
        return (
            isinstance(last, dict) and last.get("role") == "assistant" and bool(last.get("content"))
        )

    def continuation_plan(self, body: Mapping[str, Any]) -> ContinuationPlan | None:
        """A conversation whose answer is the same answer longer (``continuable``); a
        client continuing its own assistant message only when its content is a string
        (the released text is appended to it)."""
        messages = body.get("messages")
        if not continuable(body) or not isinstance(messages, list) or not messages:
            return None
        last = messages[-1]
        if body.get("continue_final_message") is True and not (
            isinstance(last, dict) and isinstance(last.get("content"), str)
        ):
            return None
        return ChatContinuation(body)


class TextCompletions(_OpenAIChoices):
    name: ClassVar[str] = "completions"
    path: ClassVar[str] = "/v1/completions"
    routing_fields: ClassVar[tuple[str, ...]] = ("prompt",)

    def conversation_lead(self, body: Mapping[str, Any], settings: SaltReuseSettings) -> object:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            return None
        return prompt[: settings.fingerprint_prompt_chars]

    def asks_logprobs(self, body: Mapping[str, Any]) -> bool:
        """``logprobs: N`` (0 included: the sampled token's alone)."""
        logprobs = body.get("logprobs")
        return isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs >= 0

    def logprobs_ask(
        self, body: Mapping[str, Any], *, backend_keeps_answers: bool | None = None
    ) -> dict[str, Any] | None:
        return None if body.get("logprobs") is not None else {"logprobs": 0}

    def echoes_prompt(self, body: Mapping[str, Any]) -> bool:
        return body.get("echo") is True

    def continuation_plan(self, body: Mapping[str, Any]) -> ContinuationPlan | None:
        """A string prompt (one prompt; token ids are not continued as text)."""
        prompt = body.get("prompt")
        if not continuable(body) or not isinstance(prompt, str):
            return None
        return CompletionsContinuation(prompt, body)
