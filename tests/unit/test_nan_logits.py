"""Exact detection (issue 40): a sampled token whose logprob is null had NaN logits,
the bug's own mechanism, whatever its text.

The stub streams model what vLLM 0.32 sends for a request that asked for logprobs
(``gateway.detect.logprobs`` names the shapes): a streamed event writes a NaN
logprob as ``null``; a whole body with one cannot be written, and vLLM answers HTTP
400 ``Out of range float values are not JSON compliant``. That is what the real
server does with the NaN poison (tests/integration/test_nan_logits_vllm.py); here
the token and its text are chosen freely, which a real poisoned server cannot do
(its NaN token is always ``!``, token 0).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict
from test_apis import message_item, response_body
from test_guard_loop import Script, answers_stream, content_of, guard_with, metric, relayed

from gateway.config import DetectorSettings
from gateway.detect import Detector, StreamInspector
from gateway.detect.logprobs import sampled_logprob_is_nan
from gateway.guard.loop import Guard
from gateway.guard.request import parse_guarded

USER = [{"role": "user", "content": "go"}]
NAN_400 = {
    "error": {"message": "Out of range float values are not JSON compliant",
              "type": "BadRequestError", "param": None, "code": 400},
}  # fmt: skip


def logprob_chunk(content: str, logprob: float | None, finish: str | None = None) -> bytes:
    """A chat chunk of one token with its logprob, as vLLM streams it."""
    token = {"token": content, "logprob": logprob, "bytes": list(content.encode()),
             "top_logprobs": []}  # fmt: skip
    choice = {"index": 0, "delta": {"content": content}, "logprobs": {"content": [token]},
              "finish_reason": finish}  # fmt: skip
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
            "choices": [choice]}  # fmt: skip
    return b"data: " + orjson.dumps(body) + b"\n\n"


def logprob_stream(*tokens: tuple[str, float | None]) -> list[bytes]:
    return [
        *(logprob_chunk(text, logprob) for text, logprob in tokens),
        logprob_chunk("", -0.1, finish="stop"),
        b"data: [DONE]\n\n",
    ]


HEALTHY = [("Open", -0.2), (" the", -0.1), (" settings", -0.3), (" page", -0.2)]


def chat(stream: bool, **more: Any) -> Any:
    body = {"model": "m", "stream": stream, "messages": USER, **more}
    return parse_guarded("chat", orjson.dumps(body))


async def handled(guard: Guard, request: Any) -> Any:
    return await guard.handle(request, CIMultiDict({"x-request-id": "r"}), started=0.0)


@pytest.mark.parametrize(
    ("logprobs", "nan"),
    [
        ({"content": [{"token": "!", "logprob": None, "top_logprobs": []}]}, True),  # chat
        ({"content": [{"token": "a", "logprob": -0.5, "top_logprobs": [
            {"token": "b", "logprob": None}]}]}, False),  # only a top logprob: not sampled
        ({"tokens": ["a", "!"], "token_logprobs": [-0.1, None], "top_logprobs": None}, True),
        ({"tokens": ["a"], "token_logprobs": [-9999.0]}, False),  # -inf is reported so
        ([{"token": "!", "logprob": None, "top_logprobs": []}], True),  # Responses
        ([{"token": "a", "logprob": -1.0, "top_logprobs": []}], False),
        (None, False),
        ({"content": None}, False),
    ],
)  # fmt: skip
def test_a_sampled_tokens_null_logprob_is_a_nan_logit(logprobs: object, nan: bool) -> None:
    assert sampled_logprob_is_nan(logprobs) is nan


def test_the_inspector_reads_logprobs_only_where_asked() -> None:
    """A null logprob is degenerate at once where the request asked for logprobs;
    nothing else reads them (a stream without logprobs costs nothing more)."""
    event = orjson.loads(logprob_chunk("!", None)[6:])
    for watch, kind in ((True, "nan_logits"), (False, None)):
        inspector = StreamInspector(Detector(DetectorSettings()), watch_nan=watch)
        inspector.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        inspector.feed(event)
        assert inspector.partial_verdict().kind == kind
    off = StreamInspector(Detector(DetectorSettings(nan_logits=False)), watch_nan=True)
    off.feed(event)
    assert off.partial_verdict().kind is None


def test_a_short_nan_answer_held_back_is_retried_whole() -> None:
    """Four tokens of NaN logits ("!!!!"): no content rule may call that corrupt
    ("Wow!!!!" is an answer), the logprobs do. Held, retried, the clean answer sent."""

    async def scenario() -> None:
        script = Script([
            answers_stream(logprob_stream(*[("!", None)] * 4)),
            answers_stream(logprob_stream(*HEALTHY)),
        ])  # fmt: skip
        async with guard_with(script) as guard:
            sent = await relayed(await handled(guard, chat(True, logprobs=True)))
            assert content_of(sent) == "Open the settings page"
            assert len(script.received) == 2
            assert script.received[1]["cache_salt"]  # a fresh salt misses the poison
            assert metric(guard, "vllm_guard_degenerate_responses_total", kind="nan_logits") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("nan_text", ["!", " zap"])
def test_one_nan_token_after_release_is_dropped_and_continued(nan_text: str) -> None:
    """Released at its first token, the stream's NaN-logit token is held from its
    first character whatever its text (" zap" ends settled: no content rule holds
    it), dropped, and the answer continued."""

    async def scenario() -> None:
        turned = [*HEALTHY, (nan_text, None), (" more", -0.2), (" text", -0.1)]
        script = Script([
            answers_stream(logprob_stream(*turned), gap_s=0.005),
            answers_stream(logprob_stream((" and", -0.1), (" click", -0.2))),
        ])  # fmt: skip
        async with guard_with(script, stream={"release": "first_token"}) as guard:
            sent = await relayed(await handled(guard, chat(True, logprobs=True)))
            assert content_of(sent) == "Open the settings page and click"
            assert len(script.received) == 2
            assert script.received[1]["messages"][-1] == {
                "role": "assistant", "content": "Open the settings page",
            }  # fmt: skip
            assert metric(guard, "vllm_guard_continuations_total", outcome="clean") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("logprob", [-0.01, None])
def test_wow_is_an_answer_unless_its_logits_were_nan(logprob: float | None) -> None:
    """ "Wow!!!!" with numbers for logprobs is delivered as it is; the same text with
    a null one is the bug."""

    async def scenario() -> None:
        wow = [("Wow", -0.3), ("!!!!", logprob)]
        script = Script([
            answers_stream(logprob_stream(*wow)),
            answers_stream(logprob_stream(("Wow", -0.3), ("!", -0.2))),
        ])  # fmt: skip
        async with guard_with(script) as guard:
            sent = await relayed(await handled(guard, chat(True, logprobs=True)))
            assert content_of(sent) == ("Wow!!!!" if logprob is not None else "Wow!")
            assert len(script.received) == (1 if logprob is not None else 2)

    asyncio.run(scenario())


def answers_json(status: int, body: dict[str, Any]) -> Any:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")

    return answer


def whole_answer(text: str) -> dict[str, Any]:
    token = {"token": text, "logprob": -0.1, "top_logprobs": []}
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": {"content": [token]},
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
    }  # fmt: skip


@pytest.mark.parametrize("asks", [True, False])
def test_vllms_nan_400_on_a_logprobs_request_is_retried(asks: bool) -> None:
    """A whole answer with a NaN logprob cannot be written: vLLM answers 400 "Out of
    range float values are not JSON compliant". On a request that asked for logprobs
    that is the bug, retried with a fresh salt (the client got the 400 before); on
    one that did not, the 400 is vLLM's and passes through."""

    async def scenario() -> None:
        script = Script([answers_json(400, NAN_400), answers_json(200, whole_answer("Open"))])
        async with guard_with(script) as guard:
            more = {"logprobs": True} if asks else {}
            answer = await handled(guard, chat(False, **more))
            assert answer.status == (200 if asks else 400)
            assert len(script.received) == (2 if asks else 1)

    asyncio.run(scenario())


def test_a_whole_body_with_a_null_sampled_logprob_is_degenerate() -> None:
    """A server that writes the NaN as null in a whole body (not vLLM 0.32's 400)."""

    async def scenario() -> None:
        nan = whole_answer("Open")
        nan["choices"][0]["logprobs"]["content"][0]["logprob"] = None
        script = Script([answers_json(200, nan), answers_json(200, whole_answer("Close"))])
        async with guard_with(script) as guard:
            answer = await handled(guard, chat(False, logprobs=True))
            assert b"Close" in answer.body
            assert len(script.received) == 2

    asyncio.run(scenario())


def test_an_echoed_prompts_null_logprob_is_not_a_nan() -> None:
    """vLLM has no logprob for a prompt's first token: with ``echo`` the first
    ``token_logprobs`` entry is null, and such a request is not judged by them."""
    request = parse_guarded(
        "completions", orjson.dumps({"model": "m", "prompt": "go", "logprobs": 0, "echo": True})
    )
    assert not request.watches_nan
    request = parse_guarded("completions", orjson.dumps({"model": "m", "prompt": "go",
                                                         "logprobs": 0}))  # fmt: skip
    assert request.watches_nan


ASK = {"ask_logprobs": True}


def plain_chunk(content: str, finish: str | None = None) -> bytes:
    """``logprob_chunk`` as vLLM writes it when no logprobs were asked for."""
    choice = {"index": 0, "delta": {"content": content}, "logprobs": None,
              "finish_reason": finish}  # fmt: skip
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
            "choices": [choice]}  # fmt: skip
    return b"data: " + orjson.dumps(body) + b"\n\n"


def test_a_backend_asked_for_logprobs_catches_nan_the_client_never_asked_about() -> None:
    """``ask_logprobs``: every guarded request asks vLLM for its sampled tokens'
    logprobs; a NaN answer the client did not ask logprobs for is caught, and the
    client gets the clean answer as vLLM writes it without them, byte for byte."""

    async def scenario() -> None:
        script = Script([
            answers_stream(logprob_stream(*[("!", None)] * 3)),
            answers_stream(logprob_stream(*HEALTHY)),
        ])  # fmt: skip
        async with guard_with(script, backend=ASK) as guard:
            sent = await relayed(await handled(guard, chat(True)))
            assert [r.get("logprobs") for r in script.received] == [True, True]
            assert [r.get("top_logprobs") for r in script.received] == [0, 0]
            plain = [plain_chunk(text) for text, _ in HEALTHY]
            assert sent == b"".join([*plain, plain_chunk("", "stop"), b"data: [DONE]\n\n"])
            assert metric(guard, "vllm_guard_degenerate_responses_total", kind="nan_logits") == 1

    asyncio.run(scenario())


def test_a_client_that_asked_gets_its_own_logprobs_and_a_body_without_them_when_not() -> None:
    """The ask adds nothing to a client that asked itself (its own ``top_logprobs``
    kept), and a whole body's logprobs are taken out for a client that did not."""

    async def scenario() -> None:
        script = Script([answers_json(200, whole_answer("Open")),
                         answers_json(200, whole_answer("Open"))])  # fmt: skip
        async with guard_with(script, backend=ASK) as guard:
            answer = await handled(guard, chat(False))
            assert orjson.loads(answer.body)["choices"][0]["logprobs"] is None
            answer = await handled(guard, chat(False, logprobs=True, top_logprobs=3))
            assert orjson.loads(answer.body)["choices"][0]["logprobs"] is not None
            assert script.received[1]["top_logprobs"] == 3

    asyncio.run(scenario())


def vllm_with_nan(text: str) -> Any:
    """vLLM on a poisoned cache, not streamed: asked for logprobs it cannot write the
    NaN (400); not asked, it answers 200 with the degenerate text."""

    async def answer(request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("logprobs"):
            return web.Response(status=400, body=orjson.dumps(NAN_400),
                                content_type="application/json")  # fmt: skip
        plain = whole_answer(text)
        plain["choices"][0]["logprobs"] = None
        return web.Response(body=orjson.dumps(plain), content_type="application/json")

    return answer


@pytest.mark.parametrize("guard", [{"mode": "observe"}, {"detectors": {"nan_logits": False}}])
def test_no_ask_where_the_verdict_cannot_act(guard: dict[str, Any]) -> None:
    """Asked, vLLM answers a NaN it cannot write with a 400: in observe mode, or with
    ``nan_logits`` off, the gateway asks nothing (the client got vLLM's 400 for
    logprobs it never asked for, where it gets a 200 without the gateway)."""

    async def scenario() -> None:
        script = Script([vllm_with_nan("!!!")])
        async with guard_with(script, backend=ASK, **guard) as guard_:
            answer = await handled(guard_, chat(False))
            assert "logprobs" not in script.received[0]
            assert answer.status == 200

    asyncio.run(scenario())


def test_a_nan_answer_delivered_is_what_vllm_answers_without_the_ask() -> None:
    """Retries exhausted with ``on_exhausted: deliver``: the client gets the answer
    vLLM gives its request as sent (the degenerate text, 200, counted delivered),
    not the 400 the gateway's own ask drew (the request is sent once more without
    it)."""

    async def scenario() -> None:
        script = Script([vllm_with_nan("!!!"), vllm_with_nan("!!!")])
        async with guard_with(script, backend=ASK, max_attempts=1,
                              on_exhausted="deliver") as guard:  # fmt: skip
            answer = await handled(guard, chat(False))
            assert answer.status == 200
            assert b"!!!" in answer.body
            assert [r.get("logprobs") for r in script.received] == [True, None]
            assert dict(answer.headers)[b"x-vllm-guard-verdict"] == b"degenerate"
            assert metric(guard, "vllm_guard_degenerate_delivered_total", kind="nan_logits") == 1

    asyncio.run(scenario())


def test_the_responses_ask_sets_its_own_top_logprobs_and_skips_stored_answers() -> None:
    """vLLM acts on a client's ``top_logprobs`` only with the include (over its
    ``--max-logprobs``: a 400), so the ask sets 0; a stored answer would keep the
    logprobs for a later GET, so only ``store: false`` is asked."""
    responses = parse_guarded("responses", b'{"model":"m","input":"go","store":false}')
    assert responses.api.logprobs_ask({"input": "go", "store": False, "top_logprobs": 50}) == {
        "include": ["message.output_text.logprobs"], "top_logprobs": 0,
    }  # fmt: skip
    assert responses.api.logprobs_ask({"input": "go"}) is None  # stored by default
    # ...unless the backend keeps no answers: vLLM drops store: true, so it is asked.
    asked = responses.api.logprobs_ask({"input": "go"}, backend_keeps_answers=False)
    assert asked == {"include": ["message.output_text.logprobs"], "top_logprobs": 0}
    assert responses.api.logprobs_ask({"input": "go"}, backend_keeps_answers=None) is None
    assert responses.api.logprobs_ask({"input": "go"}, backend_keeps_answers=True) is None
    assert responses.api.logprobs_ask({"input": "go", "store": False, "include": "x"}) is None


@pytest.mark.parametrize("keeps", [False, None])
def test_a_backend_that_keeps_no_responses_is_asked_for_their_logprobs(keeps: bool | None) -> None:
    """A Responses request with the default ``store`` is asked for its logprobs where
    the backend keeps no answers (vLLM without VLLM_ENABLE_RESPONSES_API_STORE drops
    ``store: true``): its NaN 400 is the bug, retried. Where that is not known, it is
    not asked (a stored answer would keep them), and the 400 is vLLM's own."""

    async def scenario() -> None:
        clean = response_body([message_item("Open the settings page.")])
        script = Script([answers_json(400, NAN_400), answers_json(200, clean)])
        backend = {**ASK, "keeps_responses": keeps}
        async with guard_with(script, backend=backend) as guard:
            request = parse_guarded("responses", b'{"model":"m","input":"Open the settings"}')
            answer = await handled(guard, request)
            asked = script.received[0].get("include")
            if keeps is False:
                assert asked == ["message.output_text.logprobs"]
                assert (answer.status, len(script.received)) == (200, 2)
            else:
                assert asked is None
                assert (answer.status, len(script.received)) == (400, 1)

    asyncio.run(scenario())


def test_a_backend_that_refuses_the_ask_answers_the_request_the_client_sent() -> None:
    """vLLM refuses the logprobs include for some models (gpt-oss on Responses: a 400
    "logprobs are not supported"). That 400 answers the gateway's own ask, which the
    client never sent: the request goes once more without it, and later attempts
    (here a retry of the degenerate answer) are not asked again."""

    refusal = {"error": {"message": "logprobs are not supported with gpt-oss models",
                         "type": "BadRequestError", "param": "logprobs", "code": 400}}  # fmt: skip
    clean = response_body([message_item("Open the settings page.")])

    async def scenario() -> None:
        script = Script([
            answers_json(400, refusal),
            answers_json(200, response_body([message_item("!" * 24)])),
            answers_json(200, clean),
        ])  # fmt: skip
        backend = {**ASK, "keeps_responses": False}
        async with guard_with(script, backend=backend) as guard:
            request = parse_guarded("responses", b'{"model":"m","input":"Open the settings"}')
            answer = await handled(guard, request)
            assert answer.status == 200
            assert [r.get("include") for r in script.received] == [
                ["message.output_text.logprobs"], None, None,
            ]  # fmt: skip
            assert b"Open the settings page." in answer.body

    asyncio.run(scenario())
