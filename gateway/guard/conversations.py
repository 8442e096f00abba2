"""Retry policy state: the per-conversation salt memory (the budget is gateway.guard.budget).

Per process (per worker, per replica): see docs/state.md.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.apis import BY_NAME
from gateway.config import SaltReuseSettings
from gateway.wire.jsonscan import MEDIA_PART_TYPES


def conversation_key(
    endpoint: str, body: Mapping[str, Any], client_salt: str | None, settings: SaltReuseSettings
) -> str | None:
    """A fingerprint of the leading part of a conversation, or None if there is none.
    What the leading part is depends on the API (``ApiAdapter.conversation_lead``)."""
    lead = BY_NAME[endpoint].conversation_lead(body, settings)
    if lead is None:
        return None
    try:
        encoded = orjson.dumps([endpoint, body.get("model"), client_salt, _bounded(lead)])
    except TypeError:
        return None
    return hashlib.blake2b(encoded, digest_size=16).hexdigest()


_LONG_STRING = 4096


_MAX_DEPTH = 32


def _bounded(value: object, depth: int = 0) -> object:
    """A small stand-in for the leading messages: their text only.

    Media parts (``jsonscan.MEDIA_PART_TYPES``: screenshots, audio) are left out: agents
    keep a sliding window of images, so the first messages lose theirs as the
    conversation goes on, and a fingerprint that included them would change every
    turn. Long strings become their length, head and tail, so fingerprinting a
    3 MB request hashes kilobytes. Nesting deeper than any real message is cut
    off (a 1,000-deep list is vLLM's to refuse, not a reason to recurse)."""
    if isinstance(value, str):
        if len(value) > _LONG_STRING:
            return ["\x00long", len(value), value[:1024], value[-1024:]]
        return value
    if depth >= _MAX_DEPTH and isinstance(value, list | dict):
        return "\x00deep"
    if isinstance(value, list):
        return [_bounded(item, depth + 1) for item in value if not _is_media_part(item)]
    if isinstance(value, dict):
        return {key: _bounded(item, depth + 1) for key, item in value.items()}
    return value


def _is_media_part(item: object) -> bool:
    return isinstance(item, dict) and item.get("type") in MEDIA_PART_TYPES


class SaltMemory:
    """Bounded LRU with TTL: conversation fingerprint -> the ladder rung (salt, n) that
    last gave a clean answer."""

    def __init__(
        self, settings: SaltReuseSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._entries: OrderedDict[str, tuple[str, int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str | None) -> tuple[str, int] | None:
        if key is None:
            return None
        entry = self._entries.get(key)
        if entry is None:
            return None
        salt, rung, expires = entry
        if expires < self.clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return salt, rung

    def remember(self, key: str | None, salt: str, rung: int = 0) -> bool:
        """Remember the clean rung; whether it is news: a new or changed entry, or one
        past half its time to live (what a shared copy must be told)."""
        if key is None:
            return False
        now, ttl = self.clock(), self.settings.ttl_s
        previous = self._entries.get(key)
        news = previous is None or previous[:2] != (salt, rung) or previous[2] - now < ttl / 2
        self._entries[key] = (salt, rung, now + ttl)
        self._entries.move_to_end(key)
        while len(self._entries) > self.settings.max_entries:
            self._entries.popitem(last=False)
        return news

    def forget(self, key: str | None, salt: str) -> None:
        """Corruption recurred under this salt: rotate it out."""
        if key is not None and (entry := self._entries.get(key)) and entry[0] == salt:
            del self._entries[key]


@dataclass(frozen=True, slots=True)
class ChainLink:
    """Where a stored answer lives: its conversation's fingerprint (None: unknown) and
    the backend that made it, by ``Backend.identity`` (its URL: every replica and
    worker names a pod alike, whatever slot it gave it)."""

    conversation: str | None
    backend: str


class AnswerChains:
    """Bounded LRU: an answer's id -> its ``ChainLink``.

    A Responses request with ``previous_response_id`` carries only its new turn; its
    history lives in the vLLM that stored the previous answer. The guard remembers,
    for each answer it released, its conversation (so the next turn is keyed on it:
    salt memory, affinity) and its backend (so the next turn, and ``GET`` or
    ``cancel`` of the answer, go where it is stored). Per process; shared through
    Redis by ``gateway.guard.shared_state.SharedAnswerChains``. An id nobody knows
    keys the conversation on the id itself, and its backend is found by asking
    (``AnswerHomes.find``)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, ChainLink] = OrderedDict()

    def get(self, answer_id: str) -> ChainLink | None:
        entry = self._entries.get(answer_id)
        if entry is not None:
            self._entries.move_to_end(answer_id)
        return entry

    async def lookup(self, answer_id: str) -> ChainLink | None:
        return self.get(answer_id)

    def conversation_of(self, answer_id: str) -> str:
        entry = self.get(answer_id)
        if entry is None or entry.conversation is None:
            return hashlib.blake2b(answer_id.encode(), digest_size=16).hexdigest()
        return entry.conversation

    def remember(self, answer_id: str, conversation: str | None, backend: str) -> None:
        self._entries[answer_id] = ChainLink(conversation, backend)
        self._entries.move_to_end(answer_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
