"""One adapter per generation API the guard serves (``gateway.apis.base``)."""

from __future__ import annotations

from gateway.apis.base import ApiAdapter, EventReader, EventSignal, Usage
from gateway.apis.messages import Messages
from gateway.apis.openai_chunks import ChatCompletions, TextCompletions
from gateway.apis.responses import Responses

CHAT = ChatCompletions()
COMPLETIONS = TextCompletions()
RESPONSES = Responses()
MESSAGES = Messages()

#: The guarded APIs by path (a bounded set: their names are metric label values).
ADAPTERS: dict[str, ApiAdapter] = {
    api.path: api for api in (CHAT, COMPLETIONS, RESPONSES, MESSAGES)
}
#: ... and by name.
BY_NAME: dict[str, ApiAdapter] = {api.name: api for api in ADAPTERS.values()}

__all__ = [
    "ADAPTERS", "BY_NAME", "CHAT", "COMPLETIONS", "MESSAGES", "RESPONSES",
    "ApiAdapter", "EventReader", "EventSignal", "Usage",
]  # fmt: skip
