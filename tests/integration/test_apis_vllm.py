"""OpenAI Responses and Anthropic Messages through the guard, against a real vLLM
whose prefix cache is poisoned (tests/support/poison_scheduler.py), with each
API's official SDK as the client.

With ``vg_poison_rate: 1.0`` every cache hit is poisoned, so a prompt sent once
before comes back corrupt direct, deterministically; a salted retry misses the
poisoned blocks. ``vg_poison_unsalted_only`` keeps salted namespaces clean.
"""

from __future__ import annotations

import uuid
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import (
    GatewayFactory,
    RunningRedis,
    RunningVLLM,
    openai_client,
    scraped_metric,
    wait_for,
)
from support.workload import is_corrupt, long_prompt

from gateway.server.auth import hash_key

pytestmark = pytest.mark.vllm

GENEROUS_BUDGET = {"guard": {"budget": {"ratio": 1.0, "min_per_second": 5.0}}}


def poison(kind: str, **more: Any) -> dict[str, Any]:
    return {"vllm_xargs": {"vg_poison_rate": 1.0, "vg_poison_kinds": kind, **more}}


#: Greedy decoding for the Messages API (the SDK no longer takes ``temperature``).
GREEDY = {"temperature": 0}


def fresh_prompt(words: int = 320) -> str:
    """A long prompt no other test has sent (the first send is a cache miss)."""
    return f"{uuid.uuid4()} {long_prompt(seed=5, words=words)}"


def anthropic_client(base_url: str, api_key: str = "test-key") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)


def salted() -> dict[str, str]:
    """A salt nobody has used: a cache miss, so the prompt's clean answer."""
    return {"cache_salt": f"ref-{uuid.uuid4().hex}"}


# -- OpenAI Responses -------------------------------------------------------------------


def responses_reference(vllm: RunningVLLM, prompt: str, max_tokens: int) -> str:
    answer = openai_client(vllm.url).responses.create(
        model=vllm.model, input=prompt, max_output_tokens=max_tokens, temperature=0,
        extra_body=salted(),
    )  # fmt: skip
    return answer.output_text


@pytest.mark.parametrize("kind", ["bang", "eos"])
def test_responses_poisoned_answer_is_recovered(
    vllm: RunningVLLM, gateway_for: GatewayFactory, kind: str
) -> None:
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    prompt = fresh_prompt()
    direct = openai_client(vllm.url)
    direct.responses.create(model=vllm.model, input=prompt, max_output_tokens=1)  # warm
    corrupt = direct.responses.create(
        model=vllm.model, input=prompt, max_output_tokens=24, temperature=0,
        extra_body=poison(kind),
    )  # fmt: skip
    assert is_corrupt(corrupt.output_text), "the poisoning did not trigger"

    raw = openai_client(gateway.url).responses.with_raw_response.create(
        model=vllm.model, input=prompt, max_output_tokens=24, temperature=0,
        extra_body=poison(kind),
    )  # fmt: skip
    answer = raw.parse()
    assert raw.headers["x-vllm-guard-verdict"] == "recovered"
    assert raw.headers["x-vllm-guard-attempts"] == "2"
    assert answer.output_text == responses_reference(vllm, prompt, 24)
    assert not is_corrupt(answer.output_text)
    assert (
        scraped_metric(
            gateway.url, "vllm_guard_requests_total", endpoint="responses", verdict="recovered"
        )
        == 1
    )
    assert (
        scraped_metric(gateway.url, "vllm_guard_degenerate_responses_total", endpoint="responses")
        == 1
    )


@pytest.mark.parametrize("kind", ["bang", "eos"])
def test_responses_poisoned_stream_is_one_coherent_recovered_response(
    vllm: RunningVLLM, gateway_for: GatewayFactory, kind: str
) -> None:
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    prompt = fresh_prompt()
    openai_client(vllm.url).responses.create(model=vllm.model, input=prompt, max_output_tokens=1)
    raw = openai_client(gateway.url).responses.with_raw_response.create(
        model=vllm.model, input=prompt, max_output_tokens=40, temperature=0, stream=True,
        extra_body=poison(kind),
    )  # fmt: skip
    assert raw.headers["x-vllm-guard-verdict"] == "recovered"
    events = list(raw.parse())
    # One response: one id from response.created to response.completed, the
    # sequence numbers 0, 1, 2, ... with nothing from the discarded attempt.
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    assert events[0].response.id == events[-1].response.id
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == responses_reference(vllm, prompt, 40)
    assert not is_corrupt(text)


def test_responses_stream_helper_gets_a_clean_final_response(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    prompt = fresh_prompt()
    openai_client(vllm.url).responses.create(model=vllm.model, input=prompt, max_output_tokens=1)
    with openai_client(gateway.url).responses.stream(
        model=vllm.model, input=prompt, max_output_tokens=30, temperature=0,
        extra_body=poison("bang"),
    ) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert not is_corrupt(final.output_text)
    assert final.output_text == responses_reference(vllm, prompt, 30)


def test_responses_next_turn_by_previous_response_id_starts_on_the_clean_rung(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """The history lives in vLLM (store on): the next turn carries only its new input.
    The guard keys it on the conversation of the answer it continues, so its first
    attempt uses the salt that recovered that conversation instead of the poisoned
    default namespace (unsalted, it would hit the poisoned blocks and need a retry)."""
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    prompt = fresh_prompt()
    openai_client(vllm.url).responses.create(model=vllm.model, input=prompt, max_output_tokens=1)
    client = openai_client(gateway.url)
    unsalted_only = poison("bang", vg_poison_unsalted_only=True)
    first = client.responses.with_raw_response.create(
        model=vllm.model, input=prompt, max_output_tokens=8, temperature=0, store=True,
        extra_body=unsalted_only,
    )  # fmt: skip
    assert first.headers["x-vllm-guard-verdict"] == "recovered"
    second = client.responses.with_raw_response.create(
        model=vllm.model, input="and then?", max_output_tokens=8, temperature=0,
        previous_response_id=first.parse().id, extra_body=unsalted_only,
    )  # fmt: skip
    assert second.headers["x-vllm-guard-attempts"] == "1"
    assert second.headers["x-vllm-guard-verdict"] == "clean"
    assert not is_corrupt(second.parse().output_text)


def test_responses_next_turn_on_another_replica_starts_on_the_clean_rung(
    vllm: RunningVLLM, gateway_for: GatewayFactory, redis_server: RunningRedis
) -> None:
    """Two replicas share Redis. Replica A recovers an answer; the agent's next turn
    (``previous_response_id``) lands on replica B, which learns the answer's
    conversation (and its pod) from Redis: its first attempt goes out on the clean
    rung. Before issue 32 B keyed the turn on the id itself, went unsalted into the
    poisoned blocks and needed a retry. Then GET of the stored answer through either
    replica is vLLM's own 200."""
    shared = {
        "guard": {**GENEROUS_BUDGET["guard"], "salt_reuse": {"key": "replica-key"}},
        "state": {"redis_url": redis_server.url, "lookup_timeout_ms": 1000},
    }
    a, b = gateway_for(vllm.url, **shared), gateway_for(vllm.url, **shared)
    prompt = fresh_prompt()
    openai_client(vllm.url).responses.create(model=vllm.model, input=prompt, max_output_tokens=1)
    unsalted_only = poison("bang", vg_poison_unsalted_only=True)
    first = openai_client(a.url).responses.with_raw_response.create(
        model=vllm.model, input=prompt, max_output_tokens=8, temperature=0, store=True,
        extra_body=unsalted_only,
    )  # fmt: skip
    assert first.headers["x-vllm-guard-verdict"] == "recovered"
    made = first.parse().id
    assert wait_for(
        lambda: redis_server.command("EXISTS", f"vllm-guard:answer:{made}") == b":1\r\n", 5
    )
    second = openai_client(b.url).responses.with_raw_response.create(
        model=vllm.model, input="and then?", max_output_tokens=8, temperature=0,
        previous_response_id=made, extra_body=unsalted_only,
    )  # fmt: skip
    assert second.headers["x-vllm-guard-attempts"] == "1"
    assert second.headers["x-vllm-guard-verdict"] == "clean"
    assert not is_corrupt(second.parse().output_text)
    for gateway in (a, b):
        assert openai_client(gateway.url).responses.retrieve(made).id == made


def test_responses_background_is_passed_through_unguarded_and_counted(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """A background response is generated after vLLM answers ("queued"): there is
    nothing to inspect. It is passed through once and counted as unguarded."""
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    raw = openai_client(gateway.url).responses.with_raw_response.create(
        model=vllm.model, input="hello", max_output_tokens=4, background=True, store=True,
    )  # fmt: skip
    assert raw.parse().status in ("queued", "in_progress", "completed")
    assert raw.headers["x-vllm-guard-verdict"] == "unguarded"
    assert raw.headers["x-vllm-guard-attempts"] == "1"
    assert (
        scraped_metric(
            gateway.url, "vllm_guard_requests_total", endpoint="responses", verdict="unguarded"
        )
        == 1
    )


def test_responses_exhausted_error_reaches_the_sdk_in_openai_shape(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(
        vllm.url, guard={"on_exhausted": "error", "max_attempts": 2, **GENEROUS_BUDGET["guard"]}
    )
    with pytest.raises(openai.APIStatusError) as caught:
        openai_client(gateway.url).responses.create(
            model=vllm.model, input="hello", max_output_tokens=8,
            extra_body={"vllm_xargs": {"vg_poison_all": "bang"}},
        )  # fmt: skip
    assert caught.value.status_code == 502
    assert caught.value.body["code"] == "degenerate_response"  # type: ignore[index]


# -- Anthropic Messages -----------------------------------------------------------------


def messages_reference(vllm: RunningVLLM, prompt: str, max_tokens: int) -> str:
    answer = anthropic_client(vllm.url).messages.create(
        model=vllm.model, max_tokens=max_tokens,
        messages=[{"role": "user", "content": prompt}], extra_body={**salted(), **GREEDY},
    )  # fmt: skip
    return "".join(b.text for b in answer.content if b.type == "text")


def warm_messages(vllm: RunningVLLM, prompt: str) -> None:
    anthropic_client(vllm.url).messages.create(
        model=vllm.model, max_tokens=1, messages=[{"role": "user", "content": prompt}]
    )


@pytest.mark.parametrize("kind", ["bang", "eos"])
def test_messages_poisoned_answer_is_recovered(
    vllm: RunningVLLM, gateway_for: GatewayFactory, kind: str
) -> None:
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    prompt = fresh_prompt()
    warm_messages(vllm, prompt)
    corrupt = anthropic_client(vllm.url).messages.create(
        model=vllm.model, max_tokens=24,
        messages=[{"role": "user", "content": prompt}], extra_body={**poison(kind), **GREEDY},
    )  # fmt: skip
    assert is_corrupt("".join(b.text for b in corrupt.content if b.type == "text"))

    raw = anthropic_client(gateway.url).messages.with_raw_response.create(
        model=vllm.model, max_tokens=24,
        messages=[{"role": "user", "content": prompt}], extra_body={**poison(kind), **GREEDY},
    )  # fmt: skip
    answer = raw.parse()
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert raw.headers["x-vllm-guard-verdict"] == "recovered"
    assert raw.headers["x-vllm-guard-attempts"] == "2"
    assert text == messages_reference(vllm, prompt, 24)
    assert not is_corrupt(text)
    assert answer.usage.cache_read_input_tokens is not None  # usage passes through


@pytest.mark.parametrize("kind", ["bang", "eos"])
def test_messages_poisoned_stream_is_recovered(
    vllm: RunningVLLM, gateway_for: GatewayFactory, kind: str
) -> None:
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    prompt = fresh_prompt()
    warm_messages(vllm, prompt)
    with anthropic_client(gateway.url).messages.stream(
        model=vllm.model, max_tokens=40,
        messages=[{"role": "user", "content": prompt}], extra_body={**poison(kind), **GREEDY},
    ) as stream:  # fmt: skip
        assert stream.response.headers["x-vllm-guard-verdict"] == "recovered"
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert not is_corrupt(text)
    assert text == messages_reference(vllm, prompt, 40)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert (
        scraped_metric(
            gateway.url, "vllm_guard_requests_total", endpoint="messages", verdict="recovered"
        )
        == 1
    )


def test_messages_gateway_errors_are_in_anthropic_shape(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """Gateway auth accepts Anthropic's x-api-key header; a wrong key, and an answer
    degenerate on every attempt (policy error), reach the SDK as Anthropic errors."""
    gateway = gateway_for(
        vllm.url,
        auth={"api_key_sha256": [hash_key("right-key")]},
        guard={"on_exhausted": "error", "max_attempts": 2, **GENEROUS_BUDGET["guard"]},
    )
    hello = [{"role": "user", "content": "hello"}]
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic_client(gateway.url, "wrong-key").messages.create(
            model=vllm.model, max_tokens=4, messages=hello
        )
    assert denied.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "missing or invalid API key"},
    }
    right = anthropic_client(gateway.url, "right-key")
    assert right.messages.create(model=vllm.model, max_tokens=4, messages=hello).content
    with pytest.raises(anthropic.APIStatusError) as exhausted:
        right.messages.create(
            model=vllm.model, max_tokens=8, messages=hello,
            extra_body={"vllm_xargs": {"vg_poison_all": "bang"}},
        )  # fmt: skip
    assert exhausted.value.status_code == 502
    assert exhausted.value.body["type"] == "error"  # type: ignore[index]
    assert exhausted.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    # Bad input of the gateway's own (not JSON) in the same shape, with a 400.
    bad = httpx.post(
        gateway.url + "/v1/messages", content=b"{not json", headers={"x-api-key": "right-key"}
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"


def test_messages_count_tokens_is_proxied(vllm: RunningVLLM, gateway_for: GatewayFactory) -> None:
    gateway = gateway_for(vllm.url)
    counted = anthropic_client(gateway.url).messages.count_tokens(
        model=vllm.model, messages=[{"role": "user", "content": "hello there"}]
    )
    assert counted.input_tokens > 0
