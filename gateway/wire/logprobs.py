"""Taking out the logprobs the gateway asked vLLM for and the client did not.

With ``ask_logprobs`` on a backend, every guarded request asks for its sampled
tokens' logprobs (a NaN logit is then seen on every answer: ``gateway.detect.logprobs``).
The client gets what vLLM would have sent without the ask, byte for byte: vLLM 0.32
writes the same JSON with and without them except for these values, so they are
replaced in the raw bytes, nothing else re-encoded:

* chat and completions: a choice's ``"logprobs":{...}`` becomes ``"logprobs":null``;
* Responses: a text delta's ``"logprobs":[...]`` becomes ``[]``, an ``output_text``
  part's becomes ``null`` (an empty list stays, as vLLM writes it both ways), and the
  response object's ``"top_logprobs":N`` becomes ``null`` (vLLM echoes the number
  only when the output's logprobs are included).

A key is recognised only where JSON puts keys: after ``{`` or ``,`` outside any
string (inside a string a quote is always escaped, ``\\"``, so the byte sequence
``,"logprobs":`` cannot occur there).
"""

from __future__ import annotations

import re
from collections.abc import Callable

_KEY = re.compile(rb'[{,]"logprobs":')
#: A JSON string, or one of the brackets that open and close values.
_STRING_OR_BRACKET = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_OPENERS = frozenset(b"[{")
_QUOTE = ord('"')
#: The response object's echo of ``top_logprobs`` (a number only when included).
_TOP_LOGPROBS = re.compile(rb',"top_logprobs":\d+(?=,"truncation":)')
#: What precedes a Responses ``output_text`` part's logprobs in vLLM's bytes.
_PART_TYPE = b'"type":"output_text",'
#: What precedes a text delta event's own logprobs: the event's ``item_id``.
_AFTER_ITEM_ID = re.compile(rb'"item_id":"[^"\\]*",\Z')


def value_end(raw: bytes, start: int) -> int:
    """Where the JSON array or object that starts at ``start`` ends."""
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(raw, start):
        first = raw[match.start()]
        if first == _QUOTE:
            continue
        depth += 1 if first in _OPENERS else -1
        if depth == 0:
            return match.end()
    raise ValueError("unterminated JSON value")


def _replace_logprobs(raw: bytes, replacement_for: Callable[[bytes, int], bytes | None]) -> bytes:
    out: list[bytes] = []
    position = 0
    for match in _KEY.finditer(raw):
        start = match.end()
        if start < position or raw[start] not in _OPENERS:
            continue  # inside a value already replaced; or null, a number: left
        end = value_end(raw, start)
        if end - start == 2:  # "[]" or "{}": written so both ways
            continue
        replacement = replacement_for(raw, match.start())
        if replacement is None:
            continue  # not a place vLLM writes the asked-for logprobs
        out += (raw[position:start], replacement)
        position = end
    if not out:
        return raw
    out.append(raw[position:])
    return b"".join(out)


def _null(raw: bytes, key_at: int) -> bytes:
    return b"null"


def _responses_value(raw: bytes, key_at: int) -> bytes | None:
    """An ``output_text`` part's logprobs were null without the ask; a text delta's
    (the key after the event's ``item_id``) an empty list. A key of that name
    anywhere else (a tool's parameters, a JSON schema, echoed in the response
    object) is the client's own, left as it is."""
    if raw.endswith(_PART_TYPE, 0, key_at + 1):
        return b"null"
    if _AFTER_ITEM_ID.search(raw, max(0, key_at - 200), key_at + 1):
        return b"[]"
    return None


def strip_choice_logprobs(raw: bytes) -> bytes:
    """A chat or completions event or body as vLLM writes it without logprobs."""
    if b'"logprobs":' not in raw:
        return raw
    return _replace_logprobs(raw, _null)


def strip_response_logprobs(raw: bytes) -> bytes:
    """A Responses event or body as vLLM writes it without included logprobs."""
    if b'"logprobs":' in raw:
        raw = _replace_logprobs(raw, _responses_value)
    if b'"top_logprobs":' in raw:
        raw = _TOP_LOGPROBS.sub(b',"top_logprobs":null', raw)
    return raw
