"""Detection and salted retries against a real vLLM whose prefix cache is poisoned.

The poisoning scheduler (tests/support/poison_scheduler.py) corrupts requests whose
prefill hit a "poisoned" prefix-cache block, chosen from the block's hash. With
``vg_poison_rate: 1.0`` every cache hit is poisoned, which makes single-request
tests deterministic; the workload tests use a partial rate, like the field.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import httpx
import openai
import pytest
from conftest import GatewayFactory, RunningVLLM, openai_client, scraped_metric
from support.workload import is_corrupt, long_prompt, run_workload

pytestmark = pytest.mark.vllm

GENEROUS_BUDGET = {"guard": {"budget": {"ratio": 1.0, "min_per_second": 5.0}}}


def poison(rate: float, kinds: str = "bang,eos") -> dict[str, Any]:
    return {"vllm_xargs": {"vg_poison_rate": rate, "vg_poison_kinds": kinds}}


def fresh_messages(words: int = 320) -> list[dict[str, str]]:
    """A long prompt no other test has sent (so the first send is a cache miss)."""
    return [{"role": "user", "content": f"{uuid.uuid4()} {long_prompt(seed=3, words=words)}"}]


def warm(vllm: RunningVLLM, messages: list[dict[str, str]]) -> None:
    openai_client(vllm.url).chat.completions.create(
        model=vllm.model, messages=messages, max_tokens=1, temperature=0
    )


def clean_reference(vllm: RunningVLLM, messages: list[dict[str, str]], max_tokens: int) -> str:
    """The prompt's true greedy answer: a fresh salt misses every cached block."""
    answer = openai_client(vllm.url).chat.completions.create(
        model=vllm.model, messages=messages, max_tokens=max_tokens, temperature=0,
        extra_body={"cache_salt": f"ref-{uuid.uuid4().hex}"},
    )  # fmt: skip
    return answer.choices[0].message.content or ""


@pytest.mark.parametrize("kind", ["bang", "eos"])
def test_poisoned_cache_hit_is_recovered_with_a_salted_retry(
    vllm: RunningVLLM, gateway_for: GatewayFactory, kind: str
) -> None:
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    messages = fresh_messages()
    warm(vllm, messages)
    direct = openai_client(vllm.url).chat.completions.create(
        model=vllm.model, messages=messages, max_tokens=24, temperature=0,
        extra_body=poison(1.0, kind),
    )  # fmt: skip
    assert is_corrupt(direct.choices[0].message.content), "the poisoning did not trigger"

    raw = openai_client(gateway.url).chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, max_tokens=24, temperature=0,
        extra_body=poison(1.0, kind),
    )  # fmt: skip
    answer = raw.parse().choices[0].message.content
    assert raw.headers["x-vllm-guard-attempts"] == "2"
    assert raw.headers["x-vllm-guard-verdict"] == "recovered"
    assert answer == clean_reference(vllm, messages, 24)  # this prompt's answer, byte for byte
    assert not is_corrupt(answer)


@pytest.mark.parametrize("kind", ["bang", "eos"])
def test_poisoned_stream_is_replaced_before_the_first_byte(
    vllm: RunningVLLM, gateway_for: GatewayFactory, kind: str
) -> None:
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    messages = fresh_messages()
    warm(vllm, messages)
    stream = openai_client(gateway.url).chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, max_tokens=200, temperature=0, stream=True,
        extra_body={**poison(1.0, kind), "ignore_eos": kind == "bang"},
    )  # fmt: skip
    assert stream.headers["x-vllm-guard-attempts"] == "2"
    assert stream.headers["x-vllm-guard-verdict"] == "recovered"
    chunks = list(stream.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"  # one well-formed stream
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert chunks[-1].choices[0].finish_reason is not None
    assert not is_corrupt(text)
    assert text == clean_reference(vllm, messages, 200)


def test_discarded_stream_attempt_is_aborted_in_vllm(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """The degenerate attempt is closed after the hold-back window and vLLM aborts it
    (its log names the attempt), instead of generating all of its '!' tokens.

    vLLM's CPU build loses an abort now and then by itself (6-9 of 100 abandoned
    streams measured with no gateway), so vLLM's side gets five tries (all lost at 9%:
    6e-6); the gateway's side (a recovered answer, two attempts, the retry not
    aborted) is checked on each."""
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    lost = []
    for _ in range(5):
        messages = fresh_messages(words=120)
        warm(vllm, messages)
        request_id = f"abort-{uuid.uuid4().hex}"
        raw = openai_client(gateway.url).chat.completions.with_raw_response.create(
            model=vllm.model, messages=messages, max_tokens=1800, temperature=0, stream=True,
            extra_body={**poison(1.0, "bang"), "ignore_eos": True},
            extra_headers={"X-Request-Id": request_id},
        )  # fmt: skip
        chunks = list(raw.parse())
        assert raw.headers["x-vllm-guard-attempts"] == "2"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not is_corrupt(text)
        # The retry ran to the end under its own id.
        assert not re.search(rf"{request_id}-a2\S* aborted", vllm.log_text())
        if vllm.aborted(request_id):
            return
        lost.append(request_id)
    raise AssertionError(f"vLLM aborted none of the discarded attempts {lost}")


def test_exhausted_policy_deliver_and_error(vllm: RunningVLLM, gateway_for: GatewayFactory) -> None:
    messages = fresh_messages()
    warm(vllm, messages)
    body = {"model": vllm.model, "messages": messages, "max_tokens": 20, **poison(1.0, "bang")}
    deliver = gateway_for(vllm.url, guard={"max_attempts": 1, "on_exhausted": "deliver"})
    response = httpx.post(deliver.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.headers["x-vllm-guard-verdict"] == "degenerate"
    assert is_corrupt(response.json()["choices"][0]["message"]["content"])

    error = gateway_for(vllm.url, guard={"max_attempts": 1, "on_exhausted": "error"})
    with pytest.raises(openai.APIStatusError) as info:
        openai_client(error.url).chat.completions.create(
            model=vllm.model, messages=messages, max_tokens=20, extra_body=poison(1.0, "bang")
        )
    assert info.value.status_code == 502
    assert info.value.body["type"] == "degenerate_response"  # type: ignore[index]


def test_observe_mode_counts_but_never_retries(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(vllm.url, guard={"mode": "observe"})
    messages = fresh_messages()
    warm(vllm, messages)
    raw = openai_client(gateway.url).chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, max_tokens=20, extra_body=poison(1.0, "bang")
    )
    assert raw.headers["x-vllm-guard-attempts"] == "1"
    assert raw.headers["x-vllm-guard-verdict"] == "degenerate"
    metrics = httpx.get(gateway.url + "/metrics").text
    assert (
        'vllm_guard_degenerate_responses_total{backend="vllm0",endpoint="chat",'
        'kind="punct_run",model="tiny"} 1.0' in metrics
    )


def test_off_mode_relays_the_answer_as_it_is_and_counts_it_unguarded(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """``off`` is the relay alone: the poisoned answer reaches the client as vLLM wrote
    it, and the request is counted ``unguarded``, never ``clean`` (nothing judged it:
    a dashboard of clean answers under ``off`` would be a claim no one checked)."""
    gateway = gateway_for(vllm.url, guard={"mode": "off"})
    messages = fresh_messages()
    warm(vllm, messages)
    client = openai_client(gateway.url)
    raw = client.chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, max_tokens=20, extra_body=poison(1.0, "bang")
    )
    assert is_corrupt(raw.parse().choices[0].message.content or "")
    assert raw.headers["x-vllm-guard-attempts"] == "1"
    assert raw.headers["x-vllm-guard-verdict"] == "unguarded"
    streamed = client.chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, max_tokens=20, stream=True,
        extra_body=poison(1.0, "bang"),
    )  # fmt: skip
    assert streamed.headers["x-vllm-guard-verdict"] == "unguarded"
    text = "".join(
        chunk.choices[0].delta.content or "" for chunk in streamed.parse() if chunk.choices
    )
    assert is_corrupt(text)
    for stream in ("false", "true"):
        assert (
            scraped_metric(
                gateway.url, "vllm_guard_requests_total", stream=stream, verdict="unguarded"
            )
            == 1
        )
    assert "vllm_guard_degenerate_responses_total{" not in httpx.get(gateway.url + "/metrics").text


def test_retry_salt_is_derived_from_the_client_salt(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """Tenant isolation survives the retry: the retry salt is bound to the client's."""
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    messages = fresh_messages()
    client = openai_client(gateway.url)
    tenant = {"cache_salt": "tenant-a", **poison(1.0, "bang")}
    first = client.chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, max_tokens=16, temperature=0, extra_body=tenant
    )
    assert first.headers["x-vllm-guard-attempts"] == "1"  # a miss under tenant-a's salt
    second = client.chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, max_tokens=16, temperature=0, extra_body=tenant
    )
    assert second.headers["x-vllm-guard-verdict"] == "recovered"
    remembered = list(gateway.runtime.guard.salts._entries.values())
    assert len(remembered) == 1
    salt, rung, _ = remembered[0]
    # The ladder's first rung for this conversation *and this tenant's salt*.
    (conversation,) = gateway.runtime.guard.salts._entries.keys()
    assert salt == gateway.runtime.guard.ladder.rung(conversation, "tenant-a", rung)
    assert salt != gateway.runtime.guard.ladder.rung(conversation, "tenant-b", rung)
    assert salt != "tenant-a"
    # Another tenant's identical conversation does not get tenant-a's salt.
    other = client.chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, max_tokens=16,
        extra_body={"cache_salt": "tenant-b"},
    )  # fmt: skip
    other_usage = other.parse().usage
    assert other_usage is not None
    assert other_usage.prompt_tokens_details is not None
    assert other_usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_agent_workload_direct_corrupt_gateway_clean(
    vllm: RunningVLLM, gateway_for: GatewayFactory, stream: bool
) -> None:
    """The field workload: episodes sharing a growing prefix, temperature 0, c=8.

    Each cached block is poisoned with p=0.4. At 0.15 a CI simulation once had
    no recovered answer in the gateway's run (measured again: every one of 20
    runs had some corruption), so the rare run with nothing to recover is now
    far rarer still."""
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    seed = int(time.time() * 1000) % 1_000_000
    shape = {"episodes_count": 8, "steps": 4, "concurrency": 8, "max_tokens": 20}
    direct = run_workload(
        openai_client(vllm.url), vllm.model, seed=seed, stream=stream,
        extra_body=poison(0.4), **shape,
    )  # fmt: skip
    guarded = run_workload(
        openai_client(gateway.url), vllm.model, seed=seed + 1, stream=stream,
        extra_body=poison(0.4), **shape,
    )  # fmt: skip
    direct_corrupt = sum(is_corrupt(r.text) for r in direct)
    guarded_corrupt = sum(is_corrupt(r.text) for r in guarded)
    assert direct_corrupt > 0, "the poisoned workload produced no corruption direct"
    assert guarded_corrupt == 0
    assert any(r.verdict == "recovered" for r in guarded)
    assert all(r.verdict in ("clean", "recovered") for r in guarded)
    # Corruption needs a cache hit: every corrupt direct answer had cached tokens.
    assert all((r.cached_tokens or 0) > 0 for r in direct if is_corrupt(r.text))


def test_a_conversations_next_turn_starts_in_the_namespace_that_recovered_it(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """Unsalted hits are poisoned here. Turn 1 comes back corrupt and is recovered
    on a ladder rung, which the gateway remembers for the conversation; turn 2
    (the same two leading messages, the fingerprint's default) starts on that rung
    and is clean at its first attempt. The gateway computes the conversation's
    fingerprint only when something can use it: turn 1 found the salt memory
    empty and fingerprinted the conversation at its retry. Without the reuse,
    turn 2 is poisoned again and takes 2 attempts."""
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    assert len(gateway.runtime.guard.salts) == 0
    messages = fresh_messages()
    warm(vllm, messages)
    poisoned = {"vllm_xargs": {"vg_poison_rate": 1.0, "vg_poison_unsalted_only": True,
                               "vg_poison_kinds": "bang"}}  # fmt: skip
    client = openai_client(gateway.url)
    turns = []
    for turn in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=vllm.model, max_tokens=16, temperature=0, extra_body=poisoned,
            messages=[*messages, {"role": "assistant", "content": "Noted."},
                      {"role": "user", "content": f"turn {turn}"}],
        )  # fmt: skip
        turns.append((raw.headers["x-vllm-guard-attempts"], raw.headers["x-vllm-guard-verdict"]))
    assert turns == [("2", "recovered"), ("1", "clean")]
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'vllm_guard_salt_reuse_total{attempt="first",model="tiny"} 1.0' in metrics


def test_a_conversations_retry_lands_in_the_namespace_another_gateway_warmed(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """Two gateways (two replicas, or two workers) with the same salt key: the second
    one, which never saw the conversation, retries it on the same ladder rung as the
    first and hits the prefix cache that the first one's retry filled. With a
    per-process key it would recompute the whole prompt in a cold namespace."""
    key = {"guard": {**GENEROUS_BUDGET["guard"], "salt_reuse": {"key": "shared-test-key"}}}
    first, second = gateway_for(vllm.url, **key), gateway_for(vllm.url, **key)
    messages = fresh_messages()
    warm(vllm, messages)
    poisoned = {"vllm_xargs": {"vg_poison_rate": 1.0, "vg_poison_unsalted_only": True,
                               "vg_poison_kinds": "bang"}}  # fmt: skip
    body = {"model": vllm.model, "messages": messages, "max_tokens": 16, "temperature": 0,
            **poisoned}  # fmt: skip
    one = httpx.post(first.url + "/v1/chat/completions", json=body, timeout=60)
    assert one.headers["x-vllm-guard-verdict"] == "recovered"
    two = httpx.post(second.url + "/v1/chat/completions", json=body, timeout=60)
    assert two.headers["x-vllm-guard-verdict"] == "recovered"
    assert two.headers["x-vllm-guard-attempts"] == "2"
    cached = two.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, "the second gateway's retry recomputed the prompt"
    assert (
        two.json()["choices"][0]["message"]["content"]
        == one.json()["choices"][0]["message"]["content"]
    )

    other = gateway_for(vllm.url, **GENEROUS_BUDGET)  # no key: a ladder of its own
    three = httpx.post(other.url + "/v1/chat/completions", json=body, timeout=60)
    assert three.headers["x-vllm-guard-verdict"] == "recovered"
    assert three.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_max_tokens_1_answers_are_never_retried(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """A one-token answer that decodes to whitespace (7% of max_tokens=1 answers on
    this model: 29 of 400 measured) was retried as "empty". 60 requests, streamed and
    not: on the old rule all 60 pass clean with probability 0.93^60, about 1%; on
    the current one none was flagged in 400.

    ``ignore_eos``: with it off, a one-token answer is now and then the end-of-text
    token alone (vocabulary of 1,028, sampled at temperature 1): an empty answer that
    stopped, which the guard rightly retries; this test failed on it in one of four
    runs here. The whitespace tokens this test is about are unaffected."""
    gateway = gateway_for(vllm.url, **GENEROUS_BUDGET)
    client = openai_client(gateway.url)

    def one(i: int) -> str:
        messages = [{"role": "user", "content": f"{uuid.uuid4()} one token {i}"}]
        raw = client.chat.completions.with_raw_response.create(
            model=vllm.model, messages=messages, max_tokens=1, stream=i % 3 == 0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        raw.parse() if i % 3 else list(raw.parse())
        return f"{raw.headers['x-vllm-guard-attempts']}/{raw.headers['x-vllm-guard-verdict']}"

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(one, range(60)))
    assert outcomes == ["1/clean"] * 60


@pytest.mark.parametrize("kind", ["bang", "eos"])
def test_first_token_release_still_replaces_a_poisoned_stream(
    vllm: RunningVLLM, gateway_for: GatewayFactory, kind: str
) -> None:
    """``release: first_token`` releases at the first token that cannot start one of
    the bug's signatures: a run of '!' or an empty answer is still held, judged and
    retried before the client gets a byte."""
    gateway = gateway_for(
        vllm.url, guard={"stream": {"release": "first_token"}, **GENEROUS_BUDGET["guard"]}
    )
    messages = fresh_messages()
    warm(vllm, messages)
    stream = openai_client(gateway.url).chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, max_tokens=40, temperature=0, stream=True,
        extra_body=poison(1.0, kind),
    )  # fmt: skip
    assert stream.headers["x-vllm-guard-verdict"] == "recovered"
    text = "".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices)
    assert text == clean_reference(vllm, messages, 40)
