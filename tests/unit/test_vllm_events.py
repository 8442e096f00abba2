"""vLLM's text events read without JSON parsing: the same result as the general path.

``StreamState.take`` (the fast path, ``gateway/wire/vllm_events.py``) and
``StreamState._take_parsed`` (SSE parser + JSON + ``accept``) are fed the same
streams cut into the same network chunks; the forwarded bytes and everything the
inspector learned must be equal. The streams are built the way vLLM 0.32 writes
them (its serialisation, read off the real server: key order, null fields), with
unicode, escapes and control characters in the text, other servers' spellings,
events the fast path must refuse, and a usage event the client did not ask for.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import DetectorSettings
from gateway.detect import Detector, StreamInspector
from gateway.errors import UpstreamProtocolError
from gateway.guard.stream import StreamState
from gateway.wire.vllm_events import CONTENT_EVENT

DETECTOR = Detector(DetectorSettings())


def chat_event(text: str, *, finish: str | None = None, extra: bytes = b"") -> bytes:
    """A chat chunk as vLLM 0.32 serialises it (pydantic, exclude_unset)."""
    choice = (
        b'{"index":0,"delta":{"content":' + orjson.dumps(text) + b'},"logprobs":null,'
        b'"finish_reason":' + orjson.dumps(finish) + b',"token_ids":null}'
    )
    return (
        b'data: {"id":"chatcmpl-aa6e125256a909c4","object":"chat.completion.chunk",'
        b'"created":1796319639,"model":"tiny","choices":[' + choice + b"]" + extra + b"}\n\n"
    )


def completion_event(text: str) -> bytes:
    return (
        b'data: {"id":"cmpl-bc28fd6b860998c8","object":"text_completion","created":1796319639,'
        b'"model":"tiny","choices":[{"index":0,"text":' + orjson.dumps(text) + b',"logprobs":null,'
        b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}\n\n'
    )


ROLE = (
    b'data: {"id":"chatcmpl-aa6e125256a909c4","object":"chat.completion.chunk",'
    b'"created":1796319639,"model":"tiny","choices":[{"index":0,"delta":{"role":"assistant",'
    b'"content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,'
    b'"prompt_text":null}\n\n'
)
USAGE = (
    b'data: {"id":"chatcmpl-aa6e125256a909c4","object":"chat.completion.chunk",'
    b'"created":1796319639,"model":"tiny","choices":[],"usage":{"prompt_tokens":5,'
    b'"total_tokens":10,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":3}}}\n\n'
)
DONE = b"data: [DONE]\n\n"


def new_state(strip_usage: bool = True) -> StreamState:
    # The response and backend are only read by the network loop, not by take().
    return StreamState(None, None, StreamInspector(DETECTOR), strip_usage)  # type: ignore[arg-type]


def observed(state: StreamState, chunks: list[bytes], *, fast: bool) -> dict[str, Any]:
    forwarded: list[bytes] = []
    for chunk in chunks:
        forwarded += state.take(chunk) if fast else state._take_parsed(chunk)
    inspector = state.inspector
    return {
        "forwarded": b"".join(forwarded),
        "texts": {i: c.texts() for i, c in inspector.choices.items()},
        "finish": {i: c.finish_reason for i, c in inspector.choices.items()},
        "visible": inspector.visible_chars,
        "trackers": {
            i: (c.content.visible, c.content.run, c.content.run_char, c.content.counts)
            for i, c in inspector.choices.items()
        },
        "partial": inspector.partial_verdict(),
        "usage": state.usage,
        "done": state.done,
        "pending": state.parser.pending,
    }


def cut(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(stream) + 1) for c in cuts})
    pieces, last = [], 0
    for point in points:
        pieces.append(stream[last:point])
        last = point
    pieces.append(stream[last:])
    return [p for p in pieces if p]


texts = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from('!"\\\n'),
    max_size=12,
)
events = st.one_of(
    texts.map(chat_event),
    texts.map(completion_event),
    texts.map(lambda t: chat_event(t, finish="length")),
    texts.map(lambda t: chat_event(t, extra=b',"usage":null')),
    st.just(ROLE),
    st.just(USAGE),
    st.just(b": keep-alive\n\n"),
    texts.map(lambda t: chat_event(t).replace(b"data: ", b"data:")),  # no space: general
    texts.map(lambda t: chat_event(t).replace(b'"index":0', b'"index":1')),
)


# Seeded (conftest's profile): the same 300 examples on every run.
@settings(max_examples=300)
@given(
    body=st.lists(events, max_size=12),
    role_first=st.booleans(),
    cuts=st.lists(st.integers(0, 4000), max_size=8),
    strip_usage=st.booleans(),
)
def test_fast_path_equals_the_general_path(
    body: list[bytes], role_first: bool, cuts: list[int], strip_usage: bool
) -> None:
    stream = (ROLE if role_first else b"") + b"".join(body) + DONE
    chunks = cut(stream, cuts)
    fast = observed(new_state(strip_usage), chunks, fast=True)
    general = observed(new_state(strip_usage), chunks, fast=False)
    assert fast == general


def test_vllm_text_events_match_and_others_do_not() -> None:
    assert CONTENT_EVENT.fullmatch(chat_event(" 187"))
    assert CONTENT_EVENT.fullmatch(chat_event('say "hi"\\\n'))
    assert CONTENT_EVENT.fullmatch(completion_event(" 93"))
    assert CONTENT_EVENT.fullmatch(chat_event("x", extra=b',"usage":null'))
    for other in (
        ROLE,
        USAGE,
        DONE,
        chat_event("x", finish="stop"),
        chat_event("x", extra=b',"usage":{"completion_tokens":1}'),
        chat_event("x").replace(b'"index":0', b'"index":1'),
        chat_event("x").replace(b"\n\n", b"\r\n\r\n"),
        chat_event("x").replace(b'"content":"x"', b'"content":"x","tool_calls":[]'),
        chat_event("x").replace(b'"logprobs":null', b'"logprobs":{"content":[]}'),
        chat_event("x").replace(b'"id":"chatcmpl-', b'"id":"chat\\"cmpl-'),
        chat_event("x").replace(b'"content":"x"', b'"reasoning_content":"x"'),
        b'data: {"error":{"message":"boom"}}\n\n',
    ):
        assert CONTENT_EVENT.fullmatch(other) is None, other


def test_a_text_event_that_is_not_json_is_a_protocol_error_both_ways() -> None:
    """Bytes that are not UTF-8, or an escape JSON does not have: the general path
    refuses the event, and so does the fast path (on the stream's known head)."""
    for broken in (
        chat_event("ab").replace(b"ab", b"a\xffb"),
        chat_event("ab").replace(b"ab", b"a\\qb"),
    ):
        for fast in (True, False):
            state = new_state()
            state.take(ROLE)
            state.take(chat_event("ok"))  # the stream's head and tail are known now
            with pytest.raises(UpstreamProtocolError):
                (state.take if fast else state._take_parsed)(broken)
