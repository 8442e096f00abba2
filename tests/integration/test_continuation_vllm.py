"""A stream that goes bad after its first byte, recovered by continuing it (issue 33),
against the real tiny vLLM with the official SDK.

The corruption is the test scheduler's ``vg_poison_after`` (``support.poison_scheduler``):
an unsalted generation turns to token 0 (``!``) after N healthy tokens, as the async
accepted-count race does mid-generation; a salted request is immune, as a fresh salt
misses the poisoned blocks. The gateway holds the stream's unsettled end back, drops
the ``!`` run, and asks vLLM to continue the answer from the text the client has,
with a fresh salt. ``vg_log_prompt`` makes the scheduler log each request's prompt
token ids and whether it is salted: what the gateway asked vLLM for.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import GatewayFactory, RunningVLLM, openai_client, scraped_metric

from gateway.config import DetectorSettings
from gateway.detect import Detector

#: A fixed prompt: greedy decoding of the tiny model then gives the same answer on
#: every run, so the test is deterministic (no probabilistic outcome to bound).
PROMPT = "continuation test: describe the settings page of the router"
HEALTHY_TOKENS = 10
MAX_TOKENS = 40
#: Released at the first token, as the default will be: the corruption starts after
#: ten healthy tokens, well after release.
STREAM = {"release": "first_token"}


def _prompts_logged(vllm: RunningVLLM, tag: str) -> list[tuple[bool, list[int]]]:
    """(salted, prompt token ids) of each request vLLM received with ``tag``."""
    found = re.findall(rf"vg_prompt tag={tag} salted=(\w+) ids=([\d,]*)", vllm.log_text())
    return [(salted == "True", [int(i) for i in ids.split(",") if i]) for salted, ids in found]


def _tokenize(vllm: RunningVLLM, **body: object) -> list[int]:
    reply = httpx.post(vllm.url + "/tokenize", json={"model": vllm.model, **body}, timeout=30)
    ids: list[int] = reply.json()["tokens"]
    return ids


def _stream_chat(client: openai.OpenAI, **common: Any) -> tuple[str, list[Any]]:
    messages = [{"role": "user", "content": PROMPT}]
    chunks = list(
        client.chat.completions.create(  # type: ignore[call-overload]
            messages=messages, stream=True, stream_options={"include_usage": True}, **common
        )
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def _stream_completions(client: openai.OpenAI, **common: Any) -> tuple[str, list[Any]]:
    chunks = list(
        client.completions.create(  # type: ignore[call-overload]
            prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **common
        )
    )
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def _stream_responses(client: openai.OpenAI, **common: Any) -> tuple[str, list[Any]]:
    """Responses with ``store: false``: the answers vLLM does not store, which the
    gateway continues (a stored answer would keep the degenerate original's id)."""
    events = list(
        client.responses.create(  # type: ignore[call-overload]
            input=PROMPT, stream=True, store=False,
            max_output_tokens=common.pop("max_tokens"), **common,
        )
    )  # fmt: skip
    return "".join(e.delta for e in events if e.type == "response.output_text.delta"), events


def _stream_messages(base_url: str, **common: Any) -> tuple[str, list[Any]]:
    """Anthropic Messages, with the official ``anthropic`` SDK: vLLM does not continue
    a trailing assistant message there, so the gateway continues it by token ids."""
    client = anthropic.Anthropic(base_url=base_url, api_key="test-key", max_retries=0)
    # This SDK's create() has no temperature: greedy decoding goes in the body.
    extra = {**common.pop("extra_body"), "temperature": common.pop("temperature")}
    events = list(
        client.messages.create(  # type: ignore[call-overload]
            messages=[{"role": "user", "content": PROMPT}], stream=True, extra_body=extra,
            **common,
        )
    )  # fmt: skip
    text = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    return text, events


@pytest.mark.parametrize(
    ("api", "stream_interval"),
    [("chat", None), ("completions", None), ("responses", None), ("messages", None),
     # vLLM's own packing of several tokens into one event (``stream_interval``, as
     # MTP does): the '!' arrives in the same event as healthy tokens, and the
     # released part is counted in tokens, not events (issue 39).
     ("chat", 4), ("completions", 4)],
)  # fmt: skip
def test_a_stream_corrupted_after_release_reaches_the_client_as_one_answer(
    vllm: RunningVLLM,
    gateway_for: GatewayFactory,
    api: str,
    stream_interval: int | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gateway = gateway_for(vllm.url, guard={"stream": STREAM})
    stream = {"chat": _stream_chat, "completions": _stream_completions,
              "responses": _stream_responses, "messages": _stream_messages}[api]  # fmt: skip
    client_for = (lambda url: url) if api == "messages" else openai_client
    tag = f"{api}-{uuid.uuid4().hex[:8]}"  # this run's requests in the log
    common = {"model": vllm.model, "max_tokens": MAX_TOKENS, "temperature": 0}
    packed = {} if stream_interval is None else {"stream_interval": stream_interval}
    healthy, direct = stream(
        client_for(vllm.url), **common, extra_body={"ignore_eos": True, **packed}
    )
    xargs = {"vg_poison_after": HEALTHY_TOKENS, "vg_log_prompt": tag}
    with caplog.at_level("INFO", logger="gateway.guard.accounting"):
        text, chunks = stream(
            client_for(gateway.url),
            **common,
            extra_body={"ignore_eos": True, "vllm_xargs": xargs, **packed},
            extra_headers={"x-request-id": tag},
        )
    if stream_interval is not None:  # several tokens an event, as the test means
        assert len([c for c in direct if c.choices]) < MAX_TOKENS // 2

    # One coherent answer: no '!' run, one id, one finish reason, usage of one answer.
    assert "!!!" not in text
    if api == "responses":
        _assert_one_response(text, chunks, direct)
    elif api == "messages":
        _assert_one_message(chunks, direct)
    else:
        assert len({c.id for c in chunks}) == 1
        assert len({c.created for c in chunks}) == 1
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert [f for f in finishes if f] == ["length"]
        usage = chunks[-1].usage
        assert usage is not None
        assert usage.prompt_tokens == direct[-1].usage.prompt_tokens
        assert usage.completion_tokens == MAX_TOKENS  # released + continued: max_tokens held
    if api == "chat":
        roles = [c.choices[0].delta.role for c in chunks if c.choices]
        assert [r for r in roles if r] == ["assistant"]

    # What vLLM was asked: the poisoned generation, then a salted continuation whose
    # prompt is the original prompt followed by exactly the text the client had.
    (first_salted, first_ids), (salted, continued_ids) = _prompts_logged(vllm, tag)
    assert not first_salted
    assert salted
    assert continued_ids[: len(first_ids)] == first_ids
    released_ids = continued_ids[len(first_ids) :]
    released = httpx.post(
        vllm.url + "/detokenize", json={"model": vllm.model, "tokens": released_ids}, timeout=30
    ).json()["prompt"]
    assert released_ids == _tokenize(vllm, prompt=released, add_special_tokens=False)
    assert text.startswith(released)
    assert len(released) < len(text)
    # The released text is the healthy answer's start (tokens before the corruption),
    # and the continuation goes on from it instead of starting the answer again.
    assert healthy.startswith(released)
    assert not text[len(released) :].startswith(healthy[: len(released)])
    assert scraped_metric(gateway.url, "vllm_guard_continuations_total", api=api,
                          outcome="clean") == 1  # fmt: skip
    assert scraped_metric(gateway.url, "vllm_guard_stream_cut_total") == 0
    (outcome,) = [getattr(r, "fields", {}) for r in caplog.records if tag in r.message]
    assert (outcome["outcome"], outcome["attempts"], outcome["continuations"]) == (
        "recovered", 2, 1,
    )  # fmt: skip


LOOP_AFTER, LOOP_UNIT, LOOP_MAX_TOKENS = 10, 3, 120


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
def test_a_stream_that_loops_after_release_reaches_the_client_as_one_answer(
    vllm: RunningVLLM, gateway_for: GatewayFactory, api: str
) -> None:
    """A generation that falls into a loop after a healthy start (the scheduler's
    ``vg_loop_after``: its last three tokens over and over) is released at its first
    token, its copies after the first are held as they come, and once the detector
    calls them a loop they are dropped and the answer continued with a fresh salt:
    the client gets the healthy start and a clean continuation, never the loop
    (issue 39: it was relayed and counted). Greedy: deterministic."""
    gateway = gateway_for(vllm.url)  # the defaults: release auto, after_release continue
    stream = {"chat": _stream_chat, "completions": _stream_completions,
              "responses": _stream_responses, "messages": _stream_messages}[api]  # fmt: skip
    client_for = (lambda url: url) if api == "messages" else openai_client
    tag = f"loop-{api}-{uuid.uuid4().hex[:8]}"
    common = {"model": vllm.model, "max_tokens": LOOP_MAX_TOKENS, "temperature": 0}
    xargs = {"vg_loop_after": LOOP_AFTER, "vg_loop_unit": LOOP_UNIT, "vg_log_prompt": tag}
    looping, _ = stream(
        client_for(vllm.url), **common, extra_body={"ignore_eos": True, "vllm_xargs": xargs}
    )
    detector = Detector(DetectorSettings())
    assert detector.text_kind(looping) == "token_loop"  # what reaches a client direct
    text, _ = stream(
        client_for(gateway.url), **common,
        extra_body={"ignore_eos": True, "vllm_xargs": xargs}, extra_headers={"x-request-id": tag},
    )  # fmt: skip
    assert detector.text_kind(text) is None, text
    logged = _prompts_logged(vllm, tag)
    assert [salted for salted, _ in logged] == [False, False, True]  # direct, gateway, continued
    first_ids, continued_ids = logged[1][1], logged[2][1]
    released = httpx.post(
        vllm.url + "/detokenize",
        json={"model": vllm.model, "tokens": continued_ids[len(first_ids) :]},
        timeout=30,
    ).json()["prompt"]
    # Continued from the healthy start and at most the first characters of the loop's
    # second copy: the client never had the loop.
    assert text.startswith(released)
    assert looping.startswith(released)
    assert detector.token_loop(released) is False
    assert scraped_metric(gateway.url, "vllm_guard_continuations_total", api=api,
                          outcome="clean") == 1  # fmt: skip
    assert scraped_metric(gateway.url, "vllm_guard_degenerate_delivered_total") == 0


def _assert_one_response(text: str, events: list[Any], direct: list[Any]) -> None:
    """One Responses stream: sequence numbers 0, 1, 2, ...; one response id and one
    message id throughout; one ``response.completed`` whose output is the whole text;
    usage of one answer."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types.count("response.created") == 1
    assert types.count("response.output_item.added") == 1
    assert types[-1] == "response.completed"
    assert types.count("response.completed") == 1
    completed, created = events[-1].response, events[0].response
    assert completed.id == created.id
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {completed.output[0].id}
    assert completed.output[0].content[0].text == text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    assert completed.usage.input_tokens == direct[-1].response.usage.input_tokens
    assert completed.usage.output_tokens == MAX_TOKENS
    assert completed.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("released", ["The settings", "The settings \n\n", " 日本語 café"])
def test_the_template_path_asks_vllm_for_what_the_token_exact_path_does(
    vllm: RunningVLLM, released: str
) -> None:
    """The evidence for continuing chat and Responses by their documented fields: on
    this vLLM, a continued assistant message (chat: ``continue_final_message`` with
    ``add_generation_prompt: false``; Responses: an ``in_progress`` message item)
    reaches the engine as exactly the token-exact path's prompt, the rendered prompt
    followed by the released text's own tokens (``kv_transfer_params.prompt_token_ids``),
    trailing whitespace and multi-byte characters included."""
    messages = [{"role": "user", "content": PROMPT}]
    tag = f"paths-{uuid.uuid4().hex[:8]}"
    body = {"model": vllm.model, "max_tokens": 1, "cache_salt": tag,
            "vllm_xargs": {"vg_log_prompt": tag}}  # fmt: skip
    rendered = _tokenize(vllm, messages=messages, add_generation_prompt=True)
    exact = rendered + _tokenize(vllm, prompt=released, add_special_tokens=False)
    continued = [*messages, {"role": "assistant", "content": released}]
    requests = [
        ("/v1/chat/completions", {"messages": continued, "continue_final_message": True,
                                  "add_generation_prompt": False}),
        ("/v1/chat/completions", {"messages": messages,
                                  "kv_transfer_params": {"prompt_token_ids": exact}}),
        ("/v1/responses", {"input": [*messages, {
            "type": "message", "role": "assistant", "status": "in_progress",
            "content": [{"type": "output_text", "text": released, "annotations": []}]}],
            "store": False, "max_output_tokens": 1}),
    ]  # fmt: skip
    for path, fields in requests:
        reply = httpx.post(vllm.url + path, json={**body, **fields}, timeout=60)
        assert reply.status_code == 200, reply.text
    prompts = [ids for _, ids in _prompts_logged(vllm, tag)]
    assert prompts == [exact, exact, exact]


def _assert_one_message(events: list[Any], direct: list[Any]) -> None:
    """One Messages stream: one message_start, one text block opened and closed, one
    message_delta (stop reason ``max_tokens``) with usage of one answer, one
    message_stop."""
    types = [e.type for e in events]
    assert types.count("message_start") == 1
    assert types.count("content_block_start") == 1
    assert types.count("content_block_stop") == 1
    assert types.count("message_delta") == 1
    assert types[-1] == "message_stop"
    assert types.count("message_stop") == 1
    delta = next(e for e in events if e.type == "message_delta")
    direct_delta = next(e for e in direct if e.type == "message_delta")
    assert delta.delta.stop_reason == "max_tokens"
    assert delta.usage.output_tokens == MAX_TOKENS
    assert delta.usage.input_tokens == direct_delta.usage.input_tokens
    # The prompt's whole count, however vLLM split it between the cache and the rest
    # (the continuation's prompt also holds the released text, cached or not).
    assert _prompt_side(delta.usage) == _prompt_side(direct_delta.usage)


def _prompt_side(usage: Any) -> int:
    """Anthropic's prompt tokens: uncached, read from the cache and written to it."""
    cached = (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    return int(usage.input_tokens) + cached


def test_an_echoed_prompt_does_not_release_a_stream_that_turns_at_once(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """Completions with ``echo``: vLLM's first event is the prompt (with the first
    token). Such a stream has no continuation plan (the echo would cover the continued
    prefix), so it is held as ``adaptive`` holds it, and the echoed prompt counts for
    nothing: an answer that turns to '!' after one healthy token is still held when
    it turns, and retried whole. Before, the echo alone looked clearly healthy, the
    stream went out at its first event and its '!' run was relayed as it came."""
    gateway = gateway_for(vllm.url)  # the defaults: release auto
    tag = f"echo-{uuid.uuid4().hex[:8]}"
    xargs = {"vg_poison_after": 1, "vg_log_prompt": tag}
    chunks = list(
        openai_client(gateway.url).completions.create(
            model=vllm.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, echo=True, extra_headers={"x-request-id": tag},
            extra_body={"ignore_eos": True, "vllm_xargs": xargs},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(PROMPT)
    assert "!!!" not in text
    # The poisoned attempt, then one salted retry of the whole request.
    assert [salted for salted, _ in _prompts_logged(vllm, tag)] == [False, True]
