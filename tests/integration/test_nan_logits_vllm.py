"""Exact detection against the real vLLM (issue 40): a NaN logit shows as a null
logprob, per token, and the gateway recovers the answers no content rule may call
corrupt.

The ``nan`` poison (``tests/support/poison_scheduler.py``) writes NaN into the
cached KV of the last prefix-cache block an unsalted request reuses: vLLM's own
forward pass, sampler and logprobs do the rest (its logits are NaN, its sampler
picks token 0, ``!``, and its logprob is NaN). A salted request misses the block and
is clean.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import httpx
import pytest
from conftest import GatewayFactory, RunningVLLM, scraped_metric, wait_for
from support.workload import long_prompt

NAN_POISON = {"vg_poison_rate": 1.0, "vg_poison_kinds": "nan"}
NAN_400 = "Out of range float values are not JSON compliant"
#: Three '!': no content rule may call that corrupt ("!!!" is an answer).
SHORT = 3
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses"}  # fmt: skip


def body_for(api: str, text: str, max_tokens: int, **more: Any) -> dict[str, Any]:
    """A request for ``text`` asking for the sampled tokens' logprobs, each API's way."""
    if api == "chat":
        asked = {"messages": [{"role": "user", "content": text}], "logprobs": True,
                 "top_logprobs": 0, "max_tokens": max_tokens}  # fmt: skip
    elif api == "completions":
        asked = {"prompt": text, "logprobs": 0, "max_tokens": max_tokens}
    else:
        asked = {"input": text, "include": ["message.output_text.logprobs"], "store": False,
                 "max_output_tokens": max_tokens}  # fmt: skip
    return {**asked, **more}


def warmed(vllm: RunningVLLM, api: str) -> str:
    """A prompt no other test has sent, sent once: its blocks are now cached, and the
    next unsalted request for it reuses them (the poison's condition)."""
    text = f"{uuid.uuid4()} {long_prompt(seed=11, words=320)}"
    post(vllm.url, api, body_for(api, text, 1, model=vllm.model))
    return text


def post(url: str, api: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + PATHS[api], json=body, timeout=120)


def streamed(url: str, api: str, body: dict[str, Any]) -> tuple[str, list[float | None]]:
    """The text of a streamed answer and its sampled tokens' logprobs, in order."""
    import orjson

    text, logprobs = "", []
    with httpx.stream("POST", url + PATHS[api], json={**body, "stream": True},
                      timeout=120) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = orjson.loads(line[6:])
            if api == "responses":
                if event.get("type") == "response.output_text.delta":
                    text += event["delta"]
                    logprobs += [t["logprob"] for t in event["logprobs"]]
                continue
            for choice in event.get("choices", []):
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                given = choice.get("logprobs")
                if api == "chat" and given:
                    logprobs += [t["logprob"] for t in given["content"]]
                elif given:
                    logprobs += given["token_logprobs"]
    return text, logprobs


def test_vllm_reports_every_nan_token_as_a_null_logprob_and_no_healthy_one(
    vllm: RunningVLLM,
) -> None:
    """The signal, proved on the real server: on every API that has logprobs, greedy
    and sampled, every token of a poisoned answer has a null logprob and every token
    of the same prompt salted has a number; the same poisoned request not streamed is
    vLLM's 400 (its JSON encoder refuses the NaN). Messages has no logprobs in vLLM:
    it keeps the content rules only."""
    poisoned_tokens: list[float | None] = []
    healthy_tokens: list[float | None] = []
    for api in PATHS:
        for temperature in (0.0, 1.0):
            for _ in range(2):
                text = warmed(vllm, api)
                common = {"model": vllm.model, "temperature": temperature,
                          "vllm_xargs": NAN_POISON}  # fmt: skip
                answer, logprobs = streamed(vllm.url, api, body_for(api, text, 8, **common))
                assert answer == "!" * 8
                poisoned_tokens += logprobs
                salted = {**common, "cache_salt": uuid.uuid4().hex}
                answer, logprobs = streamed(vllm.url, api, body_for(api, text, 8, **salted))
                assert "!!!" not in answer
                assert logprobs
                healthy_tokens += logprobs
            whole = post(vllm.url, api, body_for(api, warmed(vllm, api), 8, **common))
            assert whole.status_code == 400
            assert NAN_400 in whole.text
    # 3 APIs x 2 temperatures x 2 requests x 8 tokens (a healthy answer may end
    # sooner, at its EOS).
    assert poisoned_tokens == [None] * 96
    assert len(healthy_tokens) > 48
    assert None not in healthy_tokens


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
def test_a_short_nan_answer_is_recovered_through_the_gateway(
    vllm: RunningVLLM, gateway_for: GatewayFactory, api: str, stream: bool
) -> None:
    """Three tokens of NaN logits ("!!!", which the content rules leave alone) from a
    client that asked for logprobs: through the gateway, one clean answer, the same
    text as a direct salted one (greedy); direct, the '!!!' (streamed) or vLLM's 400
    (not streamed). With ``nan_logits`` off the gateway passes on what vLLM sent."""
    on = gateway_for(vllm.url)
    off = gateway_for(vllm.url, guard={"detectors": {"nan_logits": False}})
    common = {"model": vllm.model, "temperature": 0, "vllm_xargs": NAN_POISON}
    for gateway, recovered in ((on, True), (off, False)):
        text = warmed(vllm, api)
        body = body_for(api, text, SHORT, **common)
        clean = streamed(vllm.url, api, {**body, "cache_salt": uuid.uuid4().hex})[0]
        if stream:
            answer, logprobs = streamed(gateway.url, api, body)
            assert answer == (clean if recovered else "!" * SHORT)
            assert (None in logprobs) is not recovered
            continue
        reply = post(gateway.url, api, body)
        if not recovered:
            assert reply.status_code == 400
            continue
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-vllm-guard-verdict"] == "recovered"
        payload = reply.json()
        if api == "responses":
            said = payload["output"][0]["content"][0]["text"]
        elif api == "chat":
            said = payload["choices"][0]["message"]["content"]
        else:
            said = payload["choices"][0]["text"]
        assert said == clean
    caught = scraped_metric(on.url, "vllm_guard_degenerate_responses_total", kind="nan_logits")
    assert caught == 1
    assert scraped_metric(off.url, "vllm_guard_degenerate_responses_total") == 0


#: What differs between two answers to the same request: ids and clocks.
_IDS = re.compile(rb"(chatcmpl|cmpl|resp|msg)[-_][0-9a-f]+")
_CLOCKS = re.compile(rb'"(created|created_at)":\d+')


def plain_request(api: str, text: str, max_tokens: int = 6, **more: Any) -> dict[str, Any]:
    """A request for ``text`` that does not ask for logprobs."""
    body = body_for(api, text, max_tokens, **more)
    for name in ("logprobs", "top_logprobs", "include"):
        body.pop(name, None)
    return body


def raw_answer(url: str, api: str, body: dict[str, Any]) -> bytes:
    with httpx.stream("POST", url + PATHS[api], json=body, timeout=120) as response:
        assert response.status_code == 200
        return _CLOCKS.sub(rb'"\1":0', _IDS.sub(rb"\1-x", response.read()))


def by_event(raw: bytes) -> tuple[str, list[Any]]:
    """A stream's text (its pieces joined) and its events other than the plain text
    pieces, their text and sequence numbers taken out."""
    import orjson

    text, others = "", []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = orjson.loads(line[6:])
        event.pop("sequence_number", None)
        if event.get("type") == "response.output_text.delta":
            text += event["delta"]
            continue
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            text += choice.pop("text", "") or delta.pop("content", "") or ""
            if choice.get("finish_reason") is None and not delta and not event.get("usage"):
                break  # a plain text piece
        else:
            others.append(event)
    return text, others


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
def test_a_backend_asked_for_logprobs_gives_the_client_vllms_own_bytes(
    vllm: RunningVLLM, gateway_for: GatewayFactory, api: str
) -> None:
    """``ask_logprobs``: the gateway asks vLLM for every answer's logprobs; a client
    that did not ask gets, streamed and not, the bytes it gets without the ask (ids
    and clocks aside; not streamed, vLLM's own bytes direct), and a NaN answer it
    never asked logprobs about is caught and recovered (the content rules leave its
    '!!!' alone)."""
    backends = [{"name": "vllm0", "url": vllm.url, "ask_logprobs": True}]
    gateway = gateway_for(vllm.url, backends=backends)
    without_ask = gateway_for(vllm.url)
    salt = uuid.uuid4().hex
    for stream in (False, True):
        body = plain_request(api, f"exact bytes {salt}", model=vllm.model, temperature=0,
                             cache_salt=salt, stream=stream)  # fmt: skip
        asked = raw_answer(gateway.url, api, body)
        assert b'"logprob"' not in asked
        if stream:
            # How many tokens one event carries varies from run to run (vLLM merges
            # the outputs an API server has not sent yet): the same events, the
            # text deltas joined, and every other event byte for byte.
            assert by_event(asked) == by_event(raw_answer(without_ask.url, api, body))
        else:
            assert asked == raw_answer(without_ask.url, api, body)
            assert asked == raw_answer(vllm.url, api, body)
    for stream in (False, True):
        body = plain_request(api, warmed(vllm, api), SHORT, model=vllm.model, temperature=0,
                             vllm_xargs=NAN_POISON)  # fmt: skip
        assert streamed(vllm.url, api, body) == ("!" * SHORT, [])  # direct: corrupt
        if stream:
            answer, logprobs = streamed(gateway.url, api, body)
            assert logprobs == []  # none the client did not ask for
        else:
            reply = post(gateway.url, api, body)
            assert reply.status_code == 200
            assert b'"logprob"' not in reply.content
            answer = reply.text
        assert "!!!" not in answer
    caught = scraped_metric(gateway.url, "vllm_guard_degenerate_responses_total", kind="nan_logits")
    assert caught == 2


def test_with_ask_logprobs_the_nan_verdicts_match_vllms_own_count(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """Ground truth: with every answer's logprobs asked for, each NaN answer is one
    ``nan_logits`` verdict, and a clean answer none. vLLM's own count of requests
    with NaN logits (``vllm:corrupted_requests``) rises by one per whole answer: an
    equality. It counts a request only when it finishes, and a stream the gateway
    drops at its first NaN token is aborted before: streamed, the verdicts are the
    better count (vLLM's rises by at most one each)."""
    backends = [{"name": "vllm0", "url": vllm.url, "ask_logprobs": True}]
    gateway = gateway_for(vllm.url, backends=backends,
                          guard={"budget": {"ratio": 1.0, "min_per_second": 5.0}})  # fmt: skip

    def vllm_count() -> float:
        return scraped_metric(vllm.url, "vllm:corrupted_requests_total")

    def verdicts() -> float:
        return scraped_metric(
            gateway.url, "vllm_guard_degenerate_responses_total", kind="nan_logits"
        )

    for api in PATHS:
        for stream in (True, False):
            body = plain_request(api, warmed(vllm, api), 16, model=vllm.model,
                                 temperature=0, vllm_xargs=NAN_POISON, stream=stream)  # fmt: skip
            before, judged = vllm_count(), verdicts()
            assert b"!!!" not in raw_answer(gateway.url, api, body)
            # Fixed and greedy: a sampled or random prompt's answer can be invisible
            # now and then (whitespace, an unfinished character), and an empty answer
            # is rightly retried: one degenerate response too many in the total below.
            clean = plain_request(api, "a clean request, answered in words", model=vllm.model,
                                  temperature=0, stream=stream)  # fmt: skip
            raw_answer(gateway.url, api, clean)
            assert verdicts() == judged + 1
            if stream:
                assert vllm_count() - before <= 1
            else:
                assert wait_for(lambda: vllm_count() == before + 1, timeout_s=10)  # noqa: B023
    assert scraped_metric(gateway.url, "vllm_guard_degenerate_responses_total") == 6
