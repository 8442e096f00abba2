"""Incremental Server-Sent Events parser that keeps each event's original bytes.

Events end at a blank line; lines end with CRLF, LF or CR (the SSE spec). The
relay forwards ``SSEEvent.raw`` untouched, and the guard reads ``SSEEvent.data``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

_EOL = rb"(?:\r\n|\n|\r(?!\n))"
_EVENT_END = re.compile(_EOL + _EOL)
_LINE_SPLIT = re.compile(rb"\r\n|\n|\r")

DONE = b"[DONE]"


@dataclass(frozen=True, slots=True)
class SSEEvent:
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


class SSEParser:
    """Feed bytes as they arrive; get complete events back."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> Iterator[SSEEvent]:
        buffer = self._buffer + chunk if self._buffer else chunk
        start = 0
        # A CR at the very end may be the first half of a CRLF: wait for more bytes.
        limit = len(buffer) - 1 if buffer.endswith(b"\r") else len(buffer)
        while True:
            match = _EVENT_END.search(buffer, start, limit)
            if match is None:
                break
            yield parse_event(buffer[start : match.end()])
            start = match.end()
        self._buffer = buffer[start:]

    def close(self) -> SSEEvent | None:
        """End of stream: a non-empty unterminated tail is returned as a last event."""
        tail, self._buffer = self._buffer, b""
        if tail.strip():
            return parse_event(tail)
        return None

    @property
    def pending(self) -> int:
        return len(self._buffer)
