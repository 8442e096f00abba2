"""vLLM's common stream event, recognised without parsing its JSON.

Nearly every event of a vLLM stream is one choice's next piece of text, in one
fixed shape (vLLM 0.32, chat and completions; ``token_ids`` and the other null
fields vary by release and are all allowed)::

    data: {"id":"chatcmpl-…","object":"chat.completion.chunk","created":1796319639,
    "model":"tiny","choices":[{"index":0,"delta":{"content":" 187"},"logprobs":null,
    "finish_reason":null,"token_ids":null}]}

    data: {"id":"cmpl-…","object":"text_completion","created":1796319639,"model":"tiny",
    "choices":[{"index":0,"text":" 93","logprobs":null,"finish_reason":null,
    "stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}

``CONTENT_EVENT`` matches exactly that shape (one whole event: ``data: `` and the
blank line included) and captures the text still JSON-escaped; ``piece_text``
decodes it. Exact by construction: every key is named, every value other than the
text is a plain string, an integer or ``null``, so the general path (parse the
JSON, read the event) would find the same text and nothing else: no error, no
usage, no finish reason, no tool call, no reasoning. Any other event (the role
event, the finish event, usage, errors, other servers' spellings, CR line ends,
an escape in the id) does not match and takes the general path. Parsing each
event's JSON was the largest part of a streamed token's CPU (BENCHMARKS.md); a
match costs a fraction of that.

Within one stream every text event has the same bytes around its text (id,
created, model, null fields): ``TextEventReader`` remembers them from the first
match and then only checks that the next event starts with the same head and
that what lies before the same tail is one JSON string's contents (plain, or with
escapes such as a newline's, unescaped by orjson): the event is then one
``CONTENT_EVENT`` would match, found for half the cost.
"""

from __future__ import annotations

import re

import orjson

#: A JSON string's contents: no quote, backslash or control character unless escaped.
_JSON_STRING = rb'[^"\\\x00-\x1f]*(?:\\.[^"\\\x00-\x1f]*)*'
#: JSON string contents with nothing escaped (and so nothing to unescape).
_PLAIN_TEXT = re.compile(rb'[^"\\\x00-\x1f]*')
#: A plain JSON string value with nothing escaped (ids, model names).
_PLAIN_STRING = rb'"[^"\\\x00-\x1f]*"'
_NULL_FIELDS = rb"(?:,\"(?:%s)\":null)*"

CONTENT_EVENT = re.compile(
    rb'data: \{"id":' + _PLAIN_STRING
    + rb',"object":"(?:chat\.completion\.chunk|text_completion)","created":\d+,"model":'
    + _PLAIN_STRING
    + rb',"choices":\[\{"index":0,(?:"delta":\{"content":"(' + _JSON_STRING + rb')"\}'
    + rb'|"text":"(' + _JSON_STRING + rb')")'
    + _NULL_FIELDS % rb"logprobs|finish_reason|stop_reason|token_ids|prompt_token_ids"
    + rb"\}\]"
    + _NULL_FIELDS % rb"usage|prompt_token_ids|prompt_text|system_fingerprint"
    + rb"\}\n\n"
)  # fmt: skip


class NotText(ValueError):
    """A matched piece that is not valid JSON string contents (bad UTF-8 or escape)."""


def piece_text(match: re.Match[bytes]) -> str:
    """The decoded text of a ``CONTENT_EVENT`` match."""
    text = string_contents(match[match.lastindex or 1])
    if text is None:  # the match excludes unescaped quotes: a bad escape or bad UTF-8
        raise NotText
    return text


def plain_text(raw: bytes) -> str | None:
    """``raw`` decoded when it is plain JSON string contents (nothing escaped, so
    nothing to unescape), else None. Raises NotText for invalid UTF-8."""
    if _PLAIN_TEXT.fullmatch(raw) is None:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise NotText from None


def string_contents(raw: bytes) -> str | None:
    """``raw`` decoded when it is the contents of one JSON string, plain or with
    escapes (a newline in the text is one), else None: it holds an unescaped quote,
    so it is more than one string, or something else is wrong with it, which the
    full match (``CONTENT_EVENT``, ``piece_text``) then reports. Raises NotText as
    ``plain_text`` does."""
    text = plain_text(raw)
    if text is not None or b"\\" not in raw:
        return text
    try:
        unescaped = orjson.loads(b'"' + raw + b'"')
    except orjson.JSONDecodeError:
        return None
    return unescaped if type(unescaped) is str else None


class TextEventReader:
    """Reads one stream's text events: ``CONTENT_EVENT``, then the stream's own head
    and tail once a first event showed them."""

    __slots__ = ("head", "tail")

    def __init__(self) -> None:
        self.head: bytes | None = None
        self.tail = b""

    def read_run(self, chunk: bytes, pos: int, pieces: list[str]) -> int:
        """Read the text events that follow one another from ``chunk[pos]`` on (a
        network read that brought many): their texts go to ``pieces``, the position
        after the last is returned (``pos`` when none starts there). Raises NotText
        as ``read`` does.

        Once the stream's head and tail are known, a run is cut at them first and its
        texts checked for plain text all at once (a text is plain exactly when the
        run's texts joined are); a run with anything escaped is read event by event."""
        head = self.head
        if head is None:  # the stream's first text event shows its head and tail
            found = self.read(chunk, pos)
            if found is None:
                return pos
            pieces.append(found[0])
            pos, head = found[1], self.head
            assert head is not None
        tail, head_len, tail_len = self.tail, len(head), len(self.tail)
        raws: list[bytes] = []
        at = pos
        while chunk.startswith(head, at):
            start = at + head_len
            stop = chunk.find(tail, start)  # the tail starts with the closing quote
            if stop < 0:
                break
            raws.append(chunk[start:stop])
            at = stop + tail_len
        if not raws:
            return pos
        if _PLAIN_TEXT.fullmatch(raws[0] if len(raws) == 1 else b"".join(raws)) is not None:
            try:
                pieces.extend(map(bytes.decode, raws))
            except UnicodeDecodeError:
                raise NotText from None
            return at
        # Something escaped in the run: event by event.
        end = len(chunk)
        while pos < end and (found := self.read(chunk, pos)) is not None:
            pieces.append(found[0])
            pos = found[1]
        return pos

    def read(self, chunk: bytes, pos: int) -> tuple[str, int] | None:
        """The text of the text event starting at ``chunk[pos]`` and the position after
        it, or None if no text event starts there. Raises NotText for a text event
        whose text is not valid JSON string contents."""
        head = self.head
        if head is not None and chunk.startswith(head, pos):
            start = pos + len(head)
            stop = chunk.find(self.tail, start)  # the tail starts with the closing quote
            if stop >= 0:
                # One string's contents hold no unescaped quote: the first tail ends it.
                text = string_contents(chunk[start:stop])
                if text is not None:
                    return text, stop + len(self.tail)
        found = CONTENT_EVENT.match(chunk, pos)
        if found is None:
            return None
        group = found.lastindex or 1
        self.head = chunk[pos : found.start(group)]
        self.tail = chunk[found.end(group) : found.end()]
        return piece_text(found), found.end()
