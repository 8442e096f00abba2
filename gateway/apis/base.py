"""What differs between the generation APIs the guard serves, behind one interface.

The guard loop (``gateway.guard.loop``) never asks which API it runs: it asks the
request's ``ApiAdapter`` which fields route and salt the request, how an answer's
outputs and usage are read, how a stream's events are read and which one ends it,
and how an error is written in the API's own shape. One adapter per API:

* ``chat`` (``/v1/chat/completions``) and ``completions`` (``/v1/completions``):
  OpenAI chunk streams, read by ``StreamState``'s own fast path (``openai_chunks``);
* ``responses`` (``/v1/responses``): OpenAI Responses, typed events;
* ``messages`` (``/v1/messages``): Anthropic Messages, typed events, Anthropic errors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import orjson

from gateway.config import SaltReuseSettings
from gateway.detect import ChoiceOutput, Detector, StreamInspector, Verdict, as_text
from gateway.errors import GatewayError
from gateway.wire.sse import DONE, lf_event

#: Request fields every API routes on (parsed by ``gateway.guard.request``).
COMMON_ROUTING_FIELDS = ("model", "stream", "n", "cache_salt", "stream_options", "echo")


@dataclass(slots=True)
class Usage:
    """An attempt's prompt tokens and how many of them vLLM's prefix cache served
    (None: the backend does not report it)."""

    prompt_tokens: int
    cached_tokens: int | None


@dataclass(frozen=True, slots=True)
class EventSignal:
    """What one stream event means to the guard, besides the text it carries."""

    #: The stream's last event (``[DONE]``, ``response.completed``, ``message_stop``).
    ends: bool = False
    #: An in-band error from the backend: the stream ends with it.
    error: bool = False
    #: The attempt's usage, when this event carries it.
    usage: Usage | None = None


NO_SIGNAL = EventSignal()
ENDS = EventSignal(ends=True)
BACKEND_ERROR = EventSignal(error=True)


class EventReader(Protocol):
    """Reads one stream of typed events (Responses, Messages) into an inspector."""

    #: The id the backend gave the answer, once an event said it (Responses chains).
    answer_id: str | None

    def read(self, payload: dict[str, Any]) -> EventSignal:
        """Feed one event's JSON to the inspector; say what else it means."""
        ...

    def error_event(self, error: GatewayError) -> bytes:
        """An in-band error in this API's event shape, ending the client's stream."""
        ...


@dataclass(frozen=True, slots=True)
class ReleasedPart:
    """What the client has been sent of an answer that is being continued."""

    #: The first and the latest bytes sent (the stream's opening events: the answer's
    #: identity; its latest: where its numbering stands).
    opening: bytes
    latest: bytes
    #: The text sent, the events (tokens) that carried it, and the tokens it takes in
    #: the continuation's prompt (vLLM's own count).
    text: str
    generated: int
    in_prompt: int

    def usage_of_one_answer(self, usage: object, prompt_key: str, completion_key: str) -> None:
        """A continuation's usage as the whole answer's: the released text taken out of
        the prompt, where the continuation counts it, and its generated tokens added
        to the completion (``total_tokens`` made their sum)."""
        if not isinstance(usage, dict):
            return
        prompt, completion = integer(usage.get(prompt_key)), integer(usage.get(completion_key))
        if prompt is None or completion is None:
            return
        usage[prompt_key] = max(0, prompt - self.in_prompt)
        usage[completion_key] = completion + self.generated
        usage["total_tokens"] = usage[prompt_key] + usage[completion_key]


def event_payload(raw: bytes) -> Any:
    """The JSON of one SSE event's data (the bytes of one event, as ``StreamState``
    forwards them), or None for an event without data and for ``[DONE]``."""
    data = lf_event(raw.rstrip(b"\r\n")).data
    return None if data is None or data == DONE else orjson.loads(data)


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A request's prompt as vLLM renders it: ``tokenize`` is a ``/tokenize`` body,
    ``count_path`` an endpoint that counts the request's prompt tokens the API's own
    way (its answer's ``input_tokens``), ``count_body`` what it is sent."""

    tokenize: dict[str, Any]
    count_path: str
    count_body: dict[str, Any]


class EventSplice(Protocol):
    """Rewrites a continuation's stream into the client's stream: its events carry
    the original answer's identity (id, created, ...), its opening events are not
    sent again, and its usage counts the released tokens as completion tokens."""

    def event(self, raw: bytes) -> bytes | None:
        """One of the continuation's events as the client gets it (None: dropped)."""
        ...

    def error(self, raw: bytes) -> bytes:
        """The gateway's in-band error ending the continued stream (the stream's
        ``error_event``), numbered on from what the client has where the API
        numbers its events."""
        ...


class ApiAdapter(ABC):
    """One generation API. Subclasses are stateless singletons (``gateway.apis.ADAPTERS``)."""

    #: The bounded label value and log name ("chat", "completions", ...).
    name: ClassVar[str]
    #: The path the client posts to, and the backend's path for it.
    path: ClassVar[str]
    #: Top-level fields decoded from a large body besides COMMON_ROUTING_FIELDS.
    routing_fields: ClassVar[tuple[str, ...]] = ()
    #: The top-level array whose leading elements identify a conversation (decoded
    #: with their media parts reduced to their type), if any.
    conversation_field: ClassVar[str | None] = None
    #: Streams are OpenAI chunk streams ending in ``[DONE]``: ``StreamState`` reads
    #: them itself (its fast path) and asks for ``stream_options.include_usage``.
    openai_chunks: ClassVar[bool] = False

    # -- requests -------------------------------------------------------------------

    @abstractmethod
    def conversation_lead(self, body: Mapping[str, Any], settings: SaltReuseSettings) -> object:
        """The leading part of the conversation (fingerprinted for salt reuse and
        affinity), or None when the request has none."""

    def continues(self, body: Mapping[str, Any]) -> str | None:
        """The id of an earlier answer whose conversation this request continues, when
        the history lives in the backend (Responses' ``previous_response_id``)."""
        return None

    def unguardable(self, body: Mapping[str, Any]) -> str | None:
        """Why the answer to this request cannot be inspected (None: it can)."""
        return None

    # -- answers --------------------------------------------------------------------

    @abstractmethod
    def outputs(self, payload: Mapping[str, Any]) -> Iterable[tuple[int, ChoiceOutput]]:
        """Each output (choice) of a whole answer, with its index."""

    def inspect_body(self, detector: Detector, payload: Mapping[str, Any]) -> Verdict:
        return detector.inspect_choices(self.outputs(payload))

    @abstractmethod
    def read_usage(self, payload: Mapping[str, Any]) -> Usage | None:
        """Prompt and cached tokens of a whole answer (or a stream's usage event)."""

    def answer_id(self, payload: Mapping[str, Any]) -> str | None:
        """The id of a whole answer that a later request may continue (``continues``)."""
        return None

    def stored_path(self, answer_id: str) -> str | None:
        """The path that reads a stored answer back (``GET``), which only the backend
        holding it answers with 200; None where answers are not stored."""
        return None

    def event_reader(self, inspector: StreamInspector) -> EventReader | None:
        """A reader for one stream of this API (None: ``openai_chunks``)."""
        return None

    # -- continuing an answer after release ----------------------------------------

    def can_continue(self, body: Mapping[str, Any]) -> bool:
        """Whether this request's answer may be continued after release (its stream's
        unsettled end is then held back: ``gateway.guard.tail``)."""
        return False

    def continuation(
        self,
        body: Mapping[str, Any],
        released: str,
        released_tokens: int,
        prompt_token_ids: list[int] | None = None,
    ) -> dict[str, Any] | None:
        """The request fields that ask the backend to continue this request's answer
        from ``released`` (the text the client has, ``released_tokens`` tokens of
        it), or None where this API or this request cannot be continued. An API
        continued by token ids (``rendered_prompt``) gets the prompt's ids followed
        by the released text's as ``prompt_token_ids``."""
        return None

    def rendered_prompt(self, body: Mapping[str, Any]) -> RenderedPrompt | None:
        """For an API that is continued by token ids (vLLM's
        ``kv_transfer_params.prompt_token_ids``): how to have vLLM render this
        request's prompt (``/tokenize``) and check it against vLLM's own count for
        the request; None where the API continues by its own fields."""
        return None

    def splice(self, released: ReleasedPart) -> EventSplice | None:
        """The rewriter of a continuation's events into the stream the client has;
        None where ``continuation`` is None."""
        return None

    # -- errors ---------------------------------------------------------------------

    def error_body(self, error: GatewayError) -> bytes:
        """The gateway's error in this API's shape (OpenAI's by default)."""
        return error.body()


#: A JSON value that should be a string, or "" (the detectors' own reading).
text = as_text


def integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def event_bytes(event: str, payload: Mapping[str, Any]) -> bytes:
    """One typed SSE event (``event:`` line and JSON data)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def remaining_tokens(
    body: Mapping[str, Any], used: int, fields: tuple[str, ...], default: int | None
) -> dict[str, Any]:
    """The token limits of a continuation: what the released tokens left of each."""
    out: dict[str, Any] = {}
    for name in fields:
        limit = integer(body.get(name))
        if limit is None and name == fields[-1] and default is not None and not out:
            limit = default
        if limit is not None:
            out[name] = max(1, limit - used)
    min_tokens = integer(body.get("min_tokens"))
    if min_tokens:
        out["min_tokens"] = max(0, min_tokens - used)
    return out


def json_events(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of the complete SSE events in ``data`` (bytes the client was
    sent: whole events), in order; events that are not JSON objects are skipped."""
    out = []
    for raw in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        payload = lf_event(raw).data if raw.strip() else None
        if not payload or payload == DONE:
            continue
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out
