"""OpenAI Responses (``POST /v1/responses``), as vLLM serves it.

A whole answer is a ``response`` object whose ``output`` items are read as one
output: ``message`` items' ``output_text`` (and ``refusal``) parts are its text,
``reasoning`` items its reasoning, ``function_call`` items its tool calls (their
``arguments`` must be JSON). A stream is typed events (``event: <type>``), from
``response.created`` to the terminal ``response.completed`` (vLLM sends it also
for an ``incomplete`` answer; ``response.incomplete`` and ``response.failed`` end
other servers' streams); each carries a ``sequence_number`` from 0. An attempt's
events are held back until the guard decides and a discarded attempt's are never
sent, so the client sees one response: one id, its sequence numbers in order.

Stateful parts (docs/guard.md, "Responses and Messages"):

* ``store``: every attempt is stored by vLLM (when its store is on); a discarded
  attempt's id is never given to the client, so nothing refers to it.
* ``previous_response_id``: the history lives in the vLLM that stored the
  previous answer, so the request's own ``input`` is only the new turn. A
  response the guard released remembers its conversation and its backend
  (``gateway.guard.conversations.AnswerChains``): a request continuing it inherits the
  conversation (salt memory) and goes to that backend, as do ``GET`` and
  ``cancel`` of the id (``AnswerHomes.find``: remembered, shared through Redis,
  or found by asking the pods, ``stored_path``).
* ``background: true``: vLLM answers "queued" at once and generates later;
  there is no answer to inspect. Passed through unguarded, counted with the
  verdict ``unguarded``.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gateway.apis.base import (
    BACKEND_ERROR,
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
    json_events,
    remaining_tokens,
    text,
)
from gateway.config import SaltReuseSettings
from gateway.detect import ChoiceOutput, StreamInspector
from gateway.detect.logprobs import sampled_logprob_is_nan
from gateway.errors import GatewayError
from gateway.wire.logprobs import strip_response_logprobs

#: Events that end a Responses stream.
TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
#: The ``include`` value that asks for the output text's logprobs.
OUTPUT_LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = ("output_text", "refusal")


def finish_reason(response: Mapping[str, Any]) -> str | None:
    """A response's status in chat terms: "stop" when completed, "length" when cut
    at ``max_output_tokens``."""
    status = response.get("status")
    if status == "completed":
        return "stop"
    if status == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return "length" if reason == "max_output_tokens" else "incomplete"
    return None


def _part_text(part: object) -> str:
    if not isinstance(part, dict):
        return ""
    return text(part.get("text")) or text(part.get("refusal"))


def response_output(response: Mapping[str, Any]) -> ChoiceOutput:
    """Everything a response said, as one output."""
    content: list[str] = []
    reasoning: list[str] = []
    tool_arguments: list[str] = []
    items = response.get("output")
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        parts = item.get("content")
        parts = parts if isinstance(parts, list) else []
        if kind == "message":
            content.extend(
                _part_text(p) for p in parts if isinstance(p, dict) and p.get("type") in _TEXT_PARTS
            )
        elif kind == "reasoning":
            reasoning.extend(_part_text(p) for p in parts)
            summary = item.get("summary")
            reasoning.extend(_part_text(p) for p in (summary if isinstance(summary, list) else ()))
        elif kind == "function_call":
            tool_arguments.append(text(item.get("arguments")))
    usage = response.get("usage")
    tokens = integer(usage.get("output_tokens")) if isinstance(usage, dict) else None
    return ChoiceOutput(
        content="".join(content),
        reasoning="".join(reasoning),
        tool_arguments=tuple(tool_arguments),
        finish_reason=finish_reason(response),
        tokens=tokens,
    )


def read_response_usage(response: Mapping[str, Any]) -> Usage | None:
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = integer(usage.get("input_tokens"))
    if prompt is None:
        return None
    details = usage.get("input_tokens_details")
    cached = integer(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt, cached)


@dataclass(slots=True)
class ResponsesEventReader(EventReader):
    inspector: StreamInspector
    answer_id: str | None = None
    #: The last sequence number the backend gave: an error the gateway ends the
    #: stream with takes the next one.
    sequence_number: int = -1

    def read(self, payload: dict[str, Any]) -> EventSignal:
        number = payload.get("sequence_number")
        if type(number) is int:
            self.sequence_number = number
        kind = payload.get("type")
        inspector = self.inspector
        if kind == "response.output_text.delta":
            delta = text(payload.get("delta"))
            inspector.feed_output(0, content=delta, logprobs=payload.get("logprobs"))
        elif kind == "response.refusal.delta":
            inspector.feed_output(0, content=text(payload.get("delta")))
        elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            inspector.feed_output(0, reasoning=text(payload.get("delta")))
        elif kind == "response.function_call_arguments.delta":
            index = integer(payload.get("output_index")) or 0
            inspector.feed_output(0, tool_index=index, tool_arguments=text(payload.get("delta")))
        elif kind == "response.output_item.added":
            item = payload.get("item")
            if isinstance(item, dict) and item.get("type") == "function_call":
                index = integer(payload.get("output_index")) or 0
                inspector.feed_output(0, tool_index=index, tool_arguments="")
        elif kind == "response.created":
            inspector.open_choice(0)
            response = payload.get("response")
            if isinstance(response, dict):
                self.answer_id = text(response.get("id")) or None
        elif kind in TERMINAL_EVENTS:
            response = payload.get("response")
            response = response if isinstance(response, dict) else {}
            inspector.feed_output(0, finish_reason=finish_reason(response) or "incomplete")
            usage = response.get("usage")
            if isinstance(usage, dict):
                inspector.completion_tokens = integer(usage.get("output_tokens"))
            return EventSignal(ends=True, usage=read_response_usage(response))
        elif kind == "error":
            return BACKEND_ERROR
        return NO_SIGNAL

    def error_event(self, error: GatewayError) -> bytes:
        return event_bytes(
            "error",
            {
                "type": "error",
                "code": error.code,
                "message": error.message,
                "param": error.param,
                "sequence_number": self.sequence_number + 1,
            },
        )


#: A continuation's opening events: the client has the original's.
_OPENING_EVENTS = frozenset({
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added",
})  # fmt: skip


@dataclass(slots=True)
class ResponsesSplice(EventSplice):
    """A continuation's events rewritten into the client's Responses stream: its
    opening events dropped, the original response and message ids, sequence numbers
    going on from the last one the client has, the released text before the
    continuation's in every event that carries the whole text, and usage of one
    answer."""

    response_id: str
    created_at: object
    item_id: str
    released: ReleasedPart
    next_sequence: int

    @classmethod
    def of(cls, released: ReleasedPart) -> ResponsesSplice | None:
        opening = json_events(released.opening)
        response = next(
            (e.get("response") for e in opening if e.get("type") == "response.created"), None
        )
        item = next(
            (e.get("item") for e in opening if e.get("type") == "response.output_item.added"), None
        )
        latest = [e.get("sequence_number") for e in json_events(released.latest)]
        if not isinstance(response, dict) or not isinstance(item, dict) or not latest:
            return None
        last = latest[-1]
        if not isinstance(last, int) or not isinstance(item.get("id"), str):
            return None
        return cls(
            text(response.get("id")), response.get("created_at"), item["id"], released, last + 1
        )

    def event(self, raw: bytes) -> bytes | None:
        payload = event_payload(raw)  # StreamState has parsed it once already
        if payload is None:
            return raw
        kind = payload.get("type")
        if kind in _OPENING_EVENTS:
            return None
        if "item_id" in payload:
            payload["item_id"] = self.item_id
        before = self.released.text
        if kind == "response.output_text.done":
            payload["text"] = before + text(payload.get("text"))
        elif kind == "response.content_part.done":
            self._prefix_part(payload.get("part"))
        elif kind == "response.output_item.done":
            self._rewrite_item(payload.get("item"))
        elif kind in TERMINAL_EVENTS and isinstance(response := payload.get("response"), dict):
            response["id"] = self.response_id
            response["created_at"] = self.created_at
            for item in response.get("output") or ():
                self._rewrite_item(item)
            self.released.usage_of_one_answer(
                response.get("usage"), "input_tokens", "output_tokens"
            )
        if "sequence_number" in payload:
            payload["sequence_number"] = self.next_sequence
            self.next_sequence += 1
        return event_bytes(str(kind), payload)

    def error(self, raw: bytes) -> bytes:
        """Numbered on from the client's last event, as every spliced event is."""
        return self.event(raw) or raw

    def _rewrite_item(self, item: object) -> None:
        if isinstance(item, dict) and item.get("type") == "message":
            item["id"] = self.item_id
            parts = item.get("content")
            if isinstance(parts, list) and parts:
                self._prefix_part(parts[0])

    def _prefix_part(self, part: object) -> None:
        if isinstance(part, dict) and part.get("type") == "output_text":
            part["text"] = self.released.text + text(part.get("text"))


class Responses(ApiAdapter):
    name: ClassVar[str] = "responses"
    path: ClassVar[str] = "/v1/responses"
    routing_fields: ClassVar[tuple[str, ...]] = (
        "instructions", "previous_response_id", "background", "store", "include",
    )  # fmt: skip
    conversation_field: ClassVar[str | None] = "input"

    def conversation_lead(self, body: Mapping[str, Any], settings: SaltReuseSettings) -> object:
        given = body.get("input")
        if isinstance(given, str) and given:
            lead: object = given[: settings.fingerprint_prompt_chars]
        elif isinstance(given, list) and given:
            lead = given[: settings.fingerprint_messages]
        else:
            return None
        return [body.get("instructions"), lead]

    def continues(self, body: Mapping[str, Any]) -> str | None:
        previous = body.get("previous_response_id")
        return previous if isinstance(previous, str) and previous else None

    def answer_id(self, payload: Mapping[str, Any]) -> str | None:
        answer_id = payload.get("id")
        return answer_id if isinstance(answer_id, str) else None

    def stored_path(self, answer_id: str) -> str | None:
        return "/v1/responses/" + urllib.parse.quote(answer_id, safe="")

    def unguardable(self, body: Mapping[str, Any]) -> str | None:
        return "background" if body.get("background") is True else None

    def asks_logprobs(self, body: Mapping[str, Any]) -> bool:
        include = body.get("include")
        return isinstance(include, list) and OUTPUT_LOGPROBS in include

    def logprobs_ask(
        self, body: Mapping[str, Any], *, backend_keeps_answers: bool | None = None
    ) -> dict[str, Any] | None:
        """The include, with ``top_logprobs: 0`` (vLLM acts on a client's own
        ``top_logprobs`` only with the include: a value over its ``--max-logprobs``
        would become a 400). Only for an answer vLLM does not store: a stored one
        would keep the logprobs, and a GET return them. Not stored: ``store: false``,
        or a backend known to keep no answers (vLLM without
        VLLM_ENABLE_RESPONSES_API_STORE drops ``store: true`` silently)."""
        include = body.get("include")
        stored = body.get("store") is not False and backend_keeps_answers is not False
        if stored or (include is not None and not isinstance(include, list)):
            return None
        if include is not None and OUTPUT_LOGPROBS in include:
            return None
        return {"include": [*(include or ()), OUTPUT_LOGPROBS], "top_logprobs": 0}

    def strip_logprobs(self, raw: bytes) -> bytes:
        return strip_response_logprobs(raw)

    def sampled_nan(self, payload: Mapping[str, Any]) -> int | None:
        for item in payload.get("output") or ():
            parts = item.get("content") if isinstance(item, dict) else None
            for part in parts if isinstance(parts, list) else ():
                if isinstance(part, dict) and sampled_logprob_is_nan(part.get("logprobs")):
                    return 0
        return None

    def outputs(self, payload: Mapping[str, Any]) -> Iterable[tuple[int, ChoiceOutput]]:
        return [(0, response_output(payload))]

    def read_usage(self, payload: Mapping[str, Any]) -> Usage | None:
        return read_response_usage(payload)

    def event_reader(self, inspector: StreamInspector) -> EventReader:
        return ResponsesEventReader(inspector)

    def continuation_plan(self, body: Mapping[str, Any]) -> ContinuationPlan | None:
        """Only an answer vLLM does not store: a stored answer is kept under the id
        the client has, which would then name the degenerate original, not the
        continued answer. ``store: false`` says so; otherwise the backend must keep
        nothing (``holds_on``): vLLM ignores ``store`` unless started with
        ``VLLM_ENABLE_RESPONSES_API_STORE=1``, so the Agents SDK's default ``store``
        is continued on most deployments. No structured output, no forced tool."""
        given = body.get("input")
        text_options = body.get("text")
        answer_format = text_options.get("format") if isinstance(text_options, dict) else None
        tool_choice = body.get("tool_choice")
        if (
            isinstance(given, (str, list))
            and body.get("background") is not True
            and (answer_format is None or (isinstance(answer_format, dict)
                                           and answer_format.get("type") == "text"))
            and not (tool_choice == "required" or isinstance(tool_choice, dict))
        ):  # fmt: skip
            return ResponsesContinuation(given, body)
        return None


@dataclass(frozen=True, slots=True)
class ResponsesContinuation(ContinuationPlan):
    """The input with the released text as a last assistant message whose status is
    ``in_progress``: vLLM continues it (``should_continue_final_message``)."""

    given: str | list[Any]
    body: Mapping[str, Any]
    prompt_check: RenderedPrompt | None = None

    def request_fields(
        self, released: str, released_tokens: int, prompt_token_ids: list[int] | None
    ) -> dict[str, Any]:
        given = self.given
        if isinstance(given, str):
            given = [{"role": "user", "content": given}]
        part = {"type": "output_text", "text": released, "annotations": []}
        partial = {"type": "message", "role": "assistant", "status": "in_progress",
                   "content": [part]}  # fmt: skip
        return {
            "input": [*given, partial],
            # The continuation's own id is never given to the client: nothing to keep.
            "store": False,
            **remaining_tokens(self.body, released_tokens, ("max_output_tokens",), None),
        }

    def splice(self, released: ReleasedPart) -> EventSplice | None:
        return ResponsesSplice.of(released)

    def holds_on(self, backend_keeps_answers: bool | None) -> bool:
        """A client's ``store: false`` holds; otherwise only on a backend known to
        keep nothing (one that stores, or is not known, is held adaptively)."""
        return self.body.get("store") is False or backend_keeps_answers is False
