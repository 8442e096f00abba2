"""The strip of the logprobs the gateway asked for (``gateway.wire.logprobs``),
property-tested against what vLLM writes without them.

vLLM 0.32 writes each event and body as pydantic's compact JSON, in its models'
field order; asking for logprobs changes only the logprobs values (and, in a
Responses object, the ``top_logprobs`` echo). The generators below write both
variants of one random event the same way (orjson, compact, the same key order,
vLLM's field names), so the strip of the first must be the second, byte for byte.
The texts are drawn to break a careless scanner: quotes, backslashes, JSON-looking
text (``,"logprobs":{``), control characters, non-ASCII. Seeded: deterministic.
(A real vLLM's both variants are compared in
tests/integration/test_nan_logits_vllm.py.)
"""

from __future__ import annotations

import random
from typing import Any

import orjson

from gateway.wire.logprobs import strip_choice_logprobs, strip_response_logprobs

PIECES = ['"', "\\", '\\"', ',"logprobs":{', '"logprobs":[', ',"top_logprobs":5', "{", "]",
          "日本", "é", "\n", "\t", "\x01", " ", "!", "a", "word", "null", "0.5"]  # fmt: skip


def text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))


def token_logprobs(rng: random.Random, chat: bool) -> list[dict[str, Any]]:
    tokens = []
    for _ in range(rng.randint(1, 3)):
        token = text(rng)
        logprob = rng.choice([None, -0.25, -9999.0, -1.5e-05, 0.0])
        top = [{"token": text(rng), "logprob": rng.choice([None, -2.0])}
               for _ in range(rng.randint(0, 2))]  # fmt: skip
        if chat:
            tokens.append({"token": token, "logprob": logprob,
                           "bytes": list(token.encode()), "top_logprobs": top})  # fmt: skip
        else:
            tokens.append({"token": token, "logprob": logprob, "top_logprobs": top})
    return tokens


def chunk_event(rng: random.Random, lp: random.Random, api: str, asked: bool) -> bytes:
    piece = text(rng)
    logprobs: Any = None
    if asked:
        if api == "chat":
            logprobs = {"content": token_logprobs(lp, chat=True)}
        else:
            logprobs = {"text_offset": [0], "token_logprobs": [lp.choice([None, -0.5])],
                        "tokens": [piece], "top_logprobs": [{piece: None}]}  # fmt: skip
    if api == "chat":
        choice = {"index": 0, "delta": {"content": piece}, "logprobs": logprobs,
                  "finish_reason": rng.choice([None, "stop"]), "token_ids": None}  # fmt: skip
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": None,
                  "stop_reason": None, "prompt_token_ids": None, "token_ids": None}  # fmt: skip
        kind = "text_completion"
    event = {"id": "chatcmpl-" + text(rng), "object": kind, "created": 1, "model": "m",
             "choices": [choice]}  # fmt: skip
    return b"data: " + orjson.dumps(event) + b"\n\n"


def chunk_body(rng: random.Random, lp: random.Random, api: str, asked: bool) -> bytes:
    content = text(rng)
    logprobs = {"content": token_logprobs(lp, chat=True)} if asked else None
    if api == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content,
                                  "refusal": None}, "logprobs": logprobs,
                                  "finish_reason": "length", "stop_reason": None}  # fmt: skip
    else:
        choice = {"index": 0, "text": content, "logprobs": logprobs, "finish_reason": "length",
                  "prompt_logprobs": None}  # fmt: skip
    body = {"id": "x", "object": "chat.completion", "model": "m", "choices": [choice],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}}  # fmt: skip
    return orjson.dumps(body)


def response_object(lp: random.Random, asked: bool, text_: str, top: int) -> dict[str, Any]:
    part = {"annotations": [], "text": text_, "type": "output_text",
            "logprobs": token_logprobs(lp, chat=False) if asked else None}  # fmt: skip
    # The client's own tools echoed: a parameter named like the fields the strip
    # rewrites is the client's, the same with and without the ask.
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "logprobs": {"type": "array", "items": {"type": "number"}, "default": [1, 2]},
        "top_logprobs": 5}}}  # fmt: skip
    return {"id": "resp_1", "object": "response", "output": [
        {"id": "msg_1", "content": [part], "role": "assistant", "type": "message"}],
        "tools": [tool], "text": None, "top_logprobs": top if asked else None,
        "truncation": "disabled"}  # fmt: skip


def response_event(rng: random.Random, lp: random.Random, asked: bool) -> bytes:
    kind = rng.choice(["delta", "part.added", "part.done", "item.done", "completed", "created"])
    piece = text(rng)
    if kind == "delta":
        event: dict[str, Any] = {
            "content_index": 0, "delta": piece, "item_id": "msg_1",
            "logprobs": token_logprobs(lp, chat=False) if asked else [],
            "output_index": 0, "sequence_number": 4, "type": "response.output_text.delta",
        }  # fmt: skip
    elif kind == "part.added":  # empty both ways
        event = {"part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []},
                 "type": "response.content_part.added"}  # fmt: skip
    elif kind == "part.done":
        event = {"part": {"annotations": [], "text": piece, "type": "output_text",
                          "logprobs": token_logprobs(lp, chat=False) if asked else None},
                 "type": "response.content_part.done"}  # fmt: skip
    else:
        top = rng.choice([0, 3])
        response = response_object(lp, asked, piece, top)
        if kind == "created":
            response["output"] = []
        event = {"response": response, "sequence_number": 9, "type": "response." + kind}
    return b"data: " + orjson.dumps(event) + b"\n\n"


def both(make: Any, seed: int, *args: Any) -> tuple[bytes, bytes]:
    """One random event written with and without the logprobs: every other field
    from the same draws (``rng``), the logprobs from their own (``lp``)."""
    asked = make(random.Random(seed), random.Random(~seed), *args, True)
    plain = make(random.Random(seed), random.Random(~seed), *args, False)
    return asked, plain


def test_the_strip_gives_vllms_bytes_without_logprobs_over_25000_events_and_bodies() -> None:
    rng = random.Random(40)
    differed = 0
    for _ in range(5000):
        for api in ("chat", "completions"):
            for make in (chunk_event, chunk_body):
                asked, plain = both(make, rng.randrange(2**32), api)
                assert strip_choice_logprobs(asked) == plain, asked
                differed += asked != plain
    for _ in range(5000):
        asked, plain = both(response_event, rng.randrange(2**32))
        assert strip_response_logprobs(asked) == plain, asked
        differed += asked != plain
    assert differed > 20000  # nearly every case had logprobs to take out
    # What has nothing to strip is left as it is (the same object, no copy).
    untouched = chunk_event(random.Random(1), random.Random(2), "chat", False)
    assert strip_choice_logprobs(untouched) is untouched
