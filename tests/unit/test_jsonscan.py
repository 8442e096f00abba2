"""The top-level scanner agrees with a real JSON parser, and large requests are
routed and spliced exactly like small ones."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.guard.request import LARGE_BODY, attempt_overrides, body_with, parse_guarded
from gateway.wire.jsonscan import leading_messages, top_level_spans

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**60), 2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=15,
)
objects = st.dictionaries(st.text(max_size=8), values, max_size=6)


def encodings(obj: dict[str, Any]) -> list[bytes]:
    return [
        orjson.dumps(obj),
        json.dumps(obj).encode(),
        json.dumps(obj, indent=2, ensure_ascii=False).encode(),
        b" \n" + json.dumps(obj, separators=(" ,", " : ")).encode() + b"\r\n",
    ]


@settings(max_examples=300, deadline=None)
@given(obj=objects)
def test_spans_decode_to_the_same_values(obj: dict[str, Any]) -> None:
    for raw in encodings(obj):
        spans = top_level_spans(raw)
        assert spans is not None, raw
        assert {k: orjson.loads(raw[s:e]) for k, (s, e) in spans.items()} == obj


@settings(max_examples=200, deadline=None)
@given(obj=objects, before=st.binary(max_size=8), after=st.binary(max_size=8))
def test_a_window_is_scanned_in_place(obj: dict[str, Any], before: bytes, after: bytes) -> None:
    """Scanning raw[start:end] in place equals scanning a copy of it, shifted."""
    for inner in encodings(obj):
        raw = before + inner + after
        start, end = len(before), len(before) + len(inner)
        window = top_level_spans(raw, start, end)
        assert window is not None
        shifted = {k: (s - start, e - start) for k, (s, e) in window.items()}
        assert shifted == top_level_spans(inner)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_anything_else_is_refused_or_agrees(raw: bytes) -> None:
    spans = top_level_spans(raw)  # never raises
    try:
        decoded = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return  # may be accepted: only the routing fields are decoded, vLLM rejects the rest
    if spans is not None:
        assert {k: orjson.loads(raw[s:e]) for k, (s, e) in spans.items()} == decoded


def test_the_scanner_checks_only_what_it_walks() -> None:
    """Documented limit: a bad scalar outside the routing fields is left to vLLM."""
    assert top_level_spans(b'{"model": "m", "other": tru}') == {
        "model": (10, 13),
        "other": (24, 27),
    }
    assert top_level_spans(b'{"model": "m" "x": 1}') is None
    assert top_level_spans(b'["not", "an", "object"]') is None


@settings(max_examples=100, deadline=None, derandomize=True)
@given(items=st.lists(values, max_size=6), limit=st.integers(0, 8))
def test_leading_messages_walks_any_array(items: list[Any], limit: int) -> None:
    """Any JSON elements (``values`` has no ``content`` key, so nothing is reduced):
    the first ``limit`` come back decoded as they were (seeded)."""
    raw = json.dumps({"messages": items}, indent=1).encode()
    spans = top_level_spans(raw)
    assert spans is not None
    assert leading_messages(raw, spans["messages"], limit) == items[:limit]


def big_request(**fields: Any) -> dict[str, Any]:
    image = "A" * (LARGE_BODY + 1000)
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "agent"},
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": image}}]},
            {"role": "user", "content": "later"},
        ],
        **fields,
    }  # fmt: skip


def test_large_body_routes_like_a_small_one() -> None:
    body = big_request(stream=True, cache_salt="tenant", stream_options={"x": 1}, n=2)
    raw = json.dumps(body, indent=1).encode()
    large = parse_guarded("chat", raw)
    assert large.spans is not None  # the partial path was taken
    assert (large.model, large.stream, large.n, large.client_salt) == ("m", True, 2, "tenant")
    lead = large.body["messages"]
    assert lead[0] == body["messages"][0]
    assert lead[1]["content"] == [{"type": "text", "text": "hi"}, {"type": "image_url"}]
    assert large.full_body() == body
    from gateway.config import SaltReuseSettings
    from gateway.guard.conversations import conversation_key

    later = json.loads(json.dumps(body))  # a later turn: the screenshot has slid out
    later["messages"][1]["content"] = later["messages"][1]["content"][:1]
    small = parse_guarded("chat", orjson.dumps(later))
    assert small.spans is None
    keys = [conversation_key("chat", r.body, "tenant", SaltReuseSettings()) for r in (large, small)]
    assert keys[0] == keys[1]  # the same conversation, whichever path parsed it
    sent = orjson.loads(body_with(large, attempt_overrides(large, "vg.abc.def")))
    assert sent == {**body, "cache_salt": "vg.abc.def",
                    "stream_options": {"x": 1, "include_usage": True}}  # fmt: skip


def test_large_body_first_attempt_is_byte_for_byte() -> None:
    raw = json.dumps(big_request(), indent=1).encode()
    request = parse_guarded("chat", raw)
    assert body_with(request, attempt_overrides(request, None)) == raw
    spliced = body_with(request, attempt_overrides(request, "vg.x"))
    assert orjson.loads(spliced) == {**big_request(), "cache_salt": "vg.x"}


def test_large_malformed_body_falls_back_to_the_parser() -> None:
    import pytest

    from gateway.errors import BadRequest

    raw = b'{"model": "m", "messages": [' + b'"x",' * (LARGE_BODY // 4) + b"]"  # no closing }
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse_guarded("chat", raw)
