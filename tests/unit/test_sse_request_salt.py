"""SSE parser, request parsing and body splicing, salts, retry budget, salt memory."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import SaltReuseSettings
from gateway.errors import BadRequest, InvalidCacheSalt
from gateway.guard.conversations import SaltMemory, conversation_key
from gateway.guard.request import attempt_overrides, body_with, parse_guarded
from gateway.guard.salt import EMPTY_SALT_MESSAGE, INVALID_SALT_MESSAGE, fresh_salt, salt_problem
from gateway.wire.sse import SSEParser

# -- SSE ------------------------------------------------------------------------------

payloads = st.lists(
    st.one_of(
        st.dictionaries(st.text(max_size=5), st.text(max_size=20), max_size=3).map(
            lambda d: orjson.dumps({"choices": [{"delta": d}]})
        ),
        st.just(b"[DONE]"),
    ),
    min_size=1,
    max_size=10,
)


def render(datas: list[bytes], eol: bytes, comments: bool) -> bytes:
    out = b""
    for data in datas:
        if comments:
            out += b": keep-alive" + eol + eol
        out += b"data: " + data + eol + eol
    return out


def parse_all(stream: bytes, cuts: list[int]) -> list[bytes | None]:
    parser = SSEParser()
    events = []
    start = 0
    for cut in sorted(set(cuts)):
        events += list(parser.feed(stream[start:cut]))
        start = max(start, cut)
    events += list(parser.feed(stream[start:]))
    tail = parser.close()
    if tail is not None:
        events.append(tail)
    return [e.data for e in events]


@settings(max_examples=300, deadline=None)
@given(
    datas=payloads,
    eol=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    comments=st.booleans(),
    cuts=st.lists(st.integers(0, 2000), max_size=20),
)
def test_chunk_boundaries_do_not_change_events(
    datas: list[bytes], eol: bytes, comments: bool, cuts: list[int]
) -> None:
    stream = render(datas, eol, comments)
    whole = parse_all(stream, [])
    assert parse_all(stream, cuts) == whole
    assert [d for d in whole if d is not None] == datas


def test_raw_bytes_are_kept_and_multiline_data_joined() -> None:
    parser = SSEParser()
    events = list(parser.feed(b"data: a\ndata: b\n\ndata:c\n\n: ping\n\n"))
    assert [e.data for e in events] == [b"a\nb", b"c", None]
    assert b"".join(e.raw for e in events) == b"data: a\ndata: b\n\ndata:c\n\n: ping\n\n"


def test_unterminated_tail_is_returned_on_close() -> None:
    parser = SSEParser()
    assert list(parser.feed(b"data: [DONE]")) == []
    tail = parser.close()
    assert tail is not None
    assert tail.data == b"[DONE]"


# -- request parsing -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'"text"', "JSON object"),
        (b'{"stream": "yes"}', "'stream'"),
        (b'{"n": 0}', "'n'"),
        (b'{"n": "2"}', "'n'"),
        (b'{"model": 5}', "'model'"),
        (b'{"stream_options": 3}', "stream_options"),
        (b"\xff\xfe{}", "not valid JSON"),
    ],
)
def test_bad_bodies_are_400(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        parse_guarded("chat", raw)
    assert info.value.status == 400
    assert json.loads(info.value.body())["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize(
    ("salt", "message"),
    [("", EMPTY_SALT_MESSAGE), (5, EMPTY_SALT_MESSAGE), ("a/b", INVALID_SALT_MESSAGE),
     ("x" * 129, INVALID_SALT_MESSAGE), ("a@b", INVALID_SALT_MESSAGE),
     ("a\\b", INVALID_SALT_MESSAGE), ("a\x00b", INVALID_SALT_MESSAGE)],
)  # fmt: skip
def test_client_salts_follow_vllms_rule(salt: object, message: str) -> None:
    with pytest.raises(InvalidCacheSalt) as info:
        parse_guarded("chat", orjson.dumps({"cache_salt": salt}))
    assert info.value.message == message
    assert info.value.param == "cache_salt"


def test_null_salt_and_null_stream_are_accepted() -> None:
    request = parse_guarded("chat", b'{"cache_salt": null, "stream": null, "n": null}')
    assert request.client_salt is None
    assert request.stream is False
    assert request.n == 1


def test_first_attempt_sends_the_clients_bytes() -> None:
    raw = b'{"model":"m",  "messages":[],"weird_field":{"x":1.50}}'
    request = parse_guarded("chat", raw)
    assert body_with(request, attempt_overrides(request, None)) == raw


def test_retry_salt_is_spliced_and_other_bytes_kept() -> None:
    raw = b'{"model":"m","messages":[],"weird_field":{"x":1.50}}'
    request = parse_guarded("chat", raw)
    body = body_with(request, attempt_overrides(request, "vg.abc"))
    assert body.endswith(b'"model":"m","messages":[],"weird_field":{"x":1.50}}')
    assert json.loads(body)["cache_salt"] == "vg.abc"
    assert body_with(parse_guarded("chat", b"{}"), {"cache_salt": "s"}) == b'{"cache_salt":"s"}'


def test_client_salt_is_replaced_not_duplicated() -> None:
    request = parse_guarded("chat", b'{"cache_salt":"tenant","stream":true}')
    body = json.loads(body_with(request, attempt_overrides(request, "vg.x.y")))
    assert body["cache_salt"] == "vg.x.y"
    assert body["stream_options"] == {"include_usage": True}


def test_client_stream_options_are_merged() -> None:
    request = parse_guarded(
        "chat", b'{"stream":true,"stream_options":{"continuous_usage_stats":true}}'
    )
    body = json.loads(body_with(request, attempt_overrides(request, None)))
    assert body["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}


# -- salts -------------------------------------------------------------------------------


@given(client=st.none() | st.text(min_size=1, max_size=128))
def test_fresh_salts_are_valid_fresh_and_tenant_bound(client: str | None) -> None:
    if client is not None and salt_problem(client) is not None:
        return
    a, b = fresh_salt(client), fresh_salt(client)
    assert salt_problem(a) is None
    assert salt_problem(b) is None
    assert a != b
    assert a != client
    if client is not None:
        assert a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0]  # same tenant part
        assert fresh_salt(client + "x").rsplit(".", 1)[0] != a.rsplit(".", 1)[0]


# -- retry budget and salt memory -------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_salt_memory_lru_ttl_and_rotation() -> None:
    clock = Clock()
    memory = SaltMemory(SaltReuseSettings(max_entries=2, ttl_s=60), clock)
    memory.remember("a", "s1", 1)
    memory.remember("b", "s2", 1)
    assert memory.get("a") == ("s1", 1)
    memory.remember("c", "s3", 2)  # evicts b (least recently used)
    assert memory.get("b") is None
    assert memory.get("a") == ("s1", 1)
    memory.forget("a", "other")
    assert memory.get("a") == ("s1", 1)
    memory.forget("a", "s1")
    assert memory.get("a") is None
    clock.now += 61
    assert memory.get("c") is None


def test_salt_memory_says_what_a_shared_copy_must_be_told() -> None:
    """``remember`` is news (a Redis write) for a new or changed rung, or an entry
    past half its TTL; a conversation that stays on its rung is not a write a turn."""
    clock = Clock()
    memory = SaltMemory(SaltReuseSettings(ttl_s=60), clock)
    assert memory.remember("a", "s1", 1) is True
    clock.now += 10
    assert memory.remember("a", "s1", 1) is False
    assert memory.remember("a", "s2", 2) is True
    clock.now += 31
    assert memory.remember("a", "s2", 2) is True  # 31 s of its 60: refresh the copy
    assert memory.remember("a", "s2", 2) is False
    assert memory.remember(None, "s2", 2) is False


def test_conversation_key_uses_leading_messages_and_client_salt() -> None:
    cfg = SaltReuseSettings(fingerprint_messages=2)
    base = {
        "model": "m",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    }
    longer = {**base, "messages": [*base["messages"], {"role": "assistant", "content": "a"}]}
    assert conversation_key("chat", base, None, cfg) == conversation_key("chat", longer, None, cfg)
    assert conversation_key("chat", base, None, cfg) != conversation_key("chat", base, "t", cfg)
    assert conversation_key("chat", {"messages": []}, None, cfg) is None


def test_conversation_key_ignores_sliding_screenshots() -> None:
    """Agents drop old screenshots from early messages: the key must not change."""
    cfg = SaltReuseSettings(fingerprint_messages=2)

    def turn(images: list[str]) -> dict[str, object]:
        content = [{"type": "text", "text": "open settings"}] + [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b}"}}
            for b in images
        ]
        return {"messages": [{"role": "system", "content": "agent"},
                             {"role": "user", "content": content}]}  # fmt: skip

    first = conversation_key("chat", turn(["A" * 100_000]), None, cfg)
    later = conversation_key("chat", turn([]), None, cfg)
    assert first == later
    other_text = turn([])
    other_text["messages"][1]["content"][0]["text"] = "open the menu"  # type: ignore[index]
    assert conversation_key("chat", other_text, None, cfg) != first
    long_text = {"messages": [{"role": "user", "content": "x" * 50_000}]}
    longer_text = {"messages": [{"role": "user", "content": "x" * 50_001}]}
    assert conversation_key("chat", long_text, None, cfg) != conversation_key(
        "chat", longer_text, None, cfg
    )


def test_a_huge_event_is_parsed_in_linear_time_and_bounded() -> None:
    """16 MiB of one event in 64 KiB pieces (10 s of CPU when every piece was appended
    to the buffer and the whole buffer searched again): the pieces are kept as they
    came, each searched once for an event end, and joined once at the end."""
    from gateway.wire.sse import EventTooLarge

    piece = b"x" * 65536
    parser = SSEParser(max_event_bytes=32 * 1024 * 1024)
    assert parser.feed(b"data: ") == []
    for _ in range(256):
        assert parser.feed(piece) == []
    assert len(parser._pending) == 257  # never joined while the event is unfinished
    assert parser.pending == 6 + 16 * 1024 * 1024
    events = parser.feed(b"\n\n")
    assert len(events) == 1
    assert len(events[0].data or b"") == 16 * 1024 * 1024
    assert parser.pending == 0
    bounded = SSEParser(max_event_bytes=1024 * 1024)
    for _ in range(16):
        bounded.feed(piece)
    with pytest.raises(EventTooLarge):
        bounded.feed(piece)


def test_replacing_a_field_keeps_every_other_byte_the_client_sent() -> None:
    """A seed beyond 64 bits reached vLLM as 1.844674407370955e19 when the decoded
    body was re-serialised to replace the client's salt."""
    raw = (
        b'{"model": "m", "seed": 18446744073709551617, "stream": true, '
        b'"stream_options": {"continuous_usage_stats": false}, "cache_salt": "tenant", '
        b'"messages": [{"role": "user", "content": "hi"}], "x": 1.50}'
    )
    request = parse_guarded("chat", raw)
    out = body_with(request, attempt_overrides(request, "vg.retry"))
    assert b'"seed": 18446744073709551617' in out
    assert b'"x": 1.50}' in out
    assert orjson.loads(out)["cache_salt"] == "vg.retry"
    assert orjson.loads(out)["stream_options"] == {
        "continuous_usage_stats": False,
        "include_usage": True,
    }


def test_the_salt_ladder_is_the_same_everywhere_and_keyed() -> None:
    """Every process with the same key computes the same rungs; the client's salt and
    the key change them all; every rung is a salt vLLM accepts."""
    from gateway.guard.salt import SaltLadder

    one, two = SaltLadder(b"shared-secret"), SaltLadder(b"shared-secret")
    rungs = [one.rung("conv", None, n) for n in range(1, 6)]
    assert rungs == [two.rung("conv", None, n) for n in range(1, 6)]
    assert len(set(rungs)) == 5
    assert all(salt_problem(r) is None and r.startswith("vg.") for r in rungs)
    assert one.rung("conv", "tenant-a", 1) != one.rung("conv", "tenant-b", 1)
    assert one.rung("conv", "tenant-a", 1) != one.rung("conv", None, 1)
    assert SaltLadder(b"other-secret").rung("conv", None, 1) != rungs[0]
    assert SaltLadder(None).rung("conv", None, 1) != SaltLadder(None).rung("conv", None, 1)
    assert one.shared
    assert not SaltLadder(None).shared
