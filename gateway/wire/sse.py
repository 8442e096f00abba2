"""Incremental Server-Sent Events parser that keeps each event's original bytes.

Events end at a blank line; lines end with CRLF, LF or CR (the SSE spec). The
relay forwards ``SSEEvent.raw`` untouched, and the guard reads ``SSEEvent.data``.

Linear in the stream's size: each byte is searched for an event end once (a
buffered, unfinished event is not rescanned when more of it arrives), and an
event may not grow past ``max_event_bytes`` (``EventTooLarge``). vLLM's streams
(LF line ends, one ``data:`` line per event) take a fast path through
``bytes.split``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_EOL = rb"(?:\r\n|\n|\r(?!\n))"
_EVENT_END = re.compile(_EOL + _EOL)
_LINE_SPLIT = re.compile(rb"\r\n|\n|\r")

DONE = b"[DONE]"
DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024
#: An event end is at most 4 bytes (CRLF CRLF): rescan this much of the old buffer.
_END_OVERLAP = 3


class EventTooLarge(ValueError):
    """An event grew past the parser's ``max_event_bytes``."""


class SSEEvent(NamedTuple):
    raw: bytes
    #: The joined ``data:`` lines, or None for an event with no data (comment, keep-alive).
    data: bytes | None


def parse_event(raw: bytes) -> SSEEvent:
    data_lines: list[bytes] = []
    for line in _LINE_SPLIT.split(raw):
        if line.startswith(b"data:"):
            value = line[5:]
            data_lines.append(value[1:] if value.startswith(b" ") else value)
    return SSEEvent(raw, b"\n".join(data_lines) if data_lines else None)


def lf_event(body: bytes) -> SSEEvent:
    """One event of an LF-only stream, without its terminating blank line."""
    raw = body + b"\n\n"
    if body.startswith(b"data: ") and b"\n" not in body:
        return SSEEvent(raw, body[6:])
    return parse_event(raw)


#: Two line ends in a row, in every spelling an event end can take.
_END_CANDIDATES = (b"\n\n", b"\r\r", b"\n\r")


def _may_end_event(window: bytes) -> bool:
    return any(candidate in window for candidate in _END_CANDIDATES)


class SSEParser:
    """Feed bytes as they arrive; get complete events back."""

    __slots__ = ("_pending", "_pending_size", "max_event_bytes")

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        #: Chunks of an event still arriving: no event end among them.
        self._pending: list[bytes] = []
        self._pending_size = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._pending:
            tail = self._pending[-1][-_END_OVERLAP:]
            if not _may_end_event(tail + chunk):
                self._hold(chunk)
                return []
            buffer = b"".join(self._pending) + chunk
            self._pending.clear()
            self._pending_size = 0
        else:
            buffer = chunk
        if b"\r" not in buffer:  # vLLM's streams: LF line ends
            parts = buffer.split(b"\n\n")
            rest = parts.pop()
            events = [lf_event(part) for part in parts]
        else:
            events, rest = _split_general(buffer)
        if rest:
            self._hold(rest)
        return events

    def _hold(self, data: bytes) -> None:
        self._pending.append(data)
        self._pending_size += len(data)
        if self._pending_size > self.max_event_bytes:
            raise EventTooLarge(f"an SSE event is larger than {self.max_event_bytes} bytes")

    def close(self) -> SSEEvent | None:
        """End of stream: a non-empty unterminated tail is returned as a last event."""
        tail = b"".join(self._pending)
        self._pending.clear()
        self._pending_size = 0
        if tail.strip():
            return parse_event(tail)
        return None

    @property
    def pending(self) -> int:
        return self._pending_size


def _split_general(buffer: bytes) -> tuple[list[SSEEvent], bytes]:
    """Events of a buffer with CR or CRLF line ends, and what is left after them."""
    events = []
    start = 0
    # A CR at the very end may be the first half of a CRLF: wait for more bytes.
    limit = len(buffer) - 1 if buffer.endswith(b"\r") else len(buffer)
    while True:
        match = _EVENT_END.search(buffer, start, limit)
        if match is None:
            break
        events.append(parse_event(buffer[start : match.end()]))
        start = match.end()
    return events, buffer[start:]
