"""Find the byte spans of a JSON object's top-level values without decoding them.

A 3 MB agent request is mostly three base64 screenshots inside ``messages``; the
gateway routes on five small top-level fields. Decoding the whole body costs
about 7 ms and a second copy of every screenshot; skipping a string is one
``bytes.find`` per quote. The scan checks structure only as far as it walks it:
anything it does not understand returns None and the caller decodes the body
whole, so malformed input is still rejected by a real parser (ours or vLLM's).
"""

from __future__ import annotations

import re

import orjson

#: Content parts that are media (screenshots, audio, files), in every guarded API's
#: spelling: chat's ``image_url`` / ``input_audio`` / ``video_url`` / ``file``,
#: Responses' ``input_image`` / ``input_file``, Anthropic's ``image`` / ``document``.
#: A conversation's fingerprint leaves them out; everything else (text parts, and
#: Responses' ``message`` / ``function_call`` items) is part of it.
MEDIA_PART_TYPES = frozenset(
    {"image_url", "input_audio", "video_url", "file", "input_image", "input_file",
     "image", "document", "audio"}
)  # fmt: skip

_STRUCTURE = re.compile(rb'["{}\[\]]')
_WHITESPACE = re.compile(rb"[ \t\r\n]*")
_SCALAR = re.compile(rb"[^,}\]\s]+")

Spans = dict[str, tuple[int, int]]


class _Malformed(Exception):
    pass


def _skip_ws(raw: bytes, pos: int) -> int:
    match = _WHITESPACE.match(raw, pos)
    return match.end() if match else pos


def _string_end(raw: bytes, start: int) -> int:
    """``raw[start]`` is a quote; return the index just past the closing quote."""
    pos = start + 1
    while True:
        quote = raw.find(b'"', pos)
        if quote < 0:
            raise _Malformed
        backslashes = 0
        while raw[quote - 1 - backslashes] == 0x5C:  # "\"
            backslashes += 1
        if backslashes % 2 == 0:
            return quote + 1
        pos = quote + 1


def _value_end(raw: bytes, start: int) -> int:
    if start >= len(raw):
        raise _Malformed
    first = raw[start]
    if first == 0x22:  # '"'
        return _string_end(raw, start)
    if first in (0x7B, 0x5B):  # '{' '['
        depth, pos = 0, start
        while True:
            match = _STRUCTURE.search(raw, pos)
            if match is None:
                raise _Malformed
            char = raw[match.start()]
            if char == 0x22:
                pos = _string_end(raw, match.start())
                continue
            depth += 1 if char in (0x7B, 0x5B) else -1
            pos = match.end()
            if depth == 0:
                return pos
    match = _SCALAR.match(raw, start)
    if match is None:
        raise _Malformed
    return match.end()


def _elements(raw: bytes, span: tuple[int, int], limit: int) -> list[tuple[int, int]]:
    """Spans of the first ``limit`` elements of the array at ``span``."""
    start, end = span
    if raw[start] != 0x5B:
        raise _Malformed
    out: list[tuple[int, int]] = []
    pos = _skip_ws(raw, start + 1)
    while len(out) < limit and pos < end and raw[pos] != 0x5D:
        value_end = _value_end(raw, pos)
        out.append((pos, value_end))
        pos = _skip_ws(raw, value_end)
        if raw[pos] == 0x2C:  # ','
            pos = _skip_ws(raw, pos + 1)
    return out


def top_level_spans(raw: bytes, start: int = 0, end: int | None = None) -> Spans | None:
    """Key -> (start, end) of each top-level value, or None if ``raw[start:end]`` is
    not a JSON object this scanner is sure about. Spans index ``raw`` itself: a
    window is scanned in place, never copied (a message holds megabytes)."""
    end = len(raw) if end is None else end
    try:
        pos = _skip_ws(raw, start)
        if pos >= end or raw[pos] != 0x7B:
            return None
        pos = _skip_ws(raw, pos + 1)
        spans: Spans = {}
        if raw[pos] == 0x7D:
            pos += 1
        else:
            while True:
                if raw[pos] != 0x22:
                    return None
                key_end = _string_end(raw, pos)
                key = orjson.loads(raw[pos:key_end])
                pos = _skip_ws(raw, key_end)
                if raw[pos] != 0x3A:  # ':'
                    return None
                value_start = _skip_ws(raw, pos + 1)
                value_end = _value_end(raw, value_start)
                spans[key] = (value_start, value_end)  # the last duplicate wins, as in orjson
                pos = _skip_ws(raw, value_end)
                if raw[pos] == 0x2C:
                    pos = _skip_ws(raw, pos + 1)
                    continue
                if raw[pos] == 0x7D:
                    pos += 1
                    break
                return None
        trailing = _WHITESPACE.match(raw, pos, end)
        if pos > end or trailing is None or trailing.end() != end:
            return None
        return spans
    except (_Malformed, IndexError, orjson.JSONDecodeError):
        return None


def leading_messages(raw: bytes, span: tuple[int, int], limit: int) -> list[object] | None:
    """The first ``limit`` chat messages, with every media content part
    (screenshots) reduced to its ``type``: what the conversation fingerprint reads,
    without decoding megabytes of base64. None if unsure."""
    try:
        return [_message(raw, s, e) for s, e in _elements(raw, span, limit)]
    except (_Malformed, IndexError, orjson.JSONDecodeError):
        return None


def _message(raw: bytes, start: int, end: int) -> object:
    spans = top_level_spans(raw, start, end)
    if spans is None or "content" not in spans or raw[spans["content"][0]] != 0x5B:
        return orjson.loads(raw[start:end])
    message = {k: orjson.loads(raw[s:e]) for k, (s, e) in spans.items() if k != "content"}
    parts: list[object] = []
    for part_start, part_end in _elements(raw, spans["content"], limit=1 << 30):
        part_spans = top_level_spans(raw, part_start, part_end)
        if part_spans is None or "type" not in part_spans:
            parts.append(orjson.loads(raw[part_start:part_end]))
            continue
        kind = orjson.loads(raw[slice(*part_spans["type"])])
        media = kind in MEDIA_PART_TYPES
        parts.append({"type": kind} if media else orjson.loads(raw[part_start:part_end]))
    message["content"] = parts
    return message
