"""The retry budget against real vLLM: recovery is never rationed, useless load is.

The poisoning scheduler (tests/support/poison_scheduler.py) corrupts requests whose
prefill hit the prefix cache (``vg_poison_rate``: the field's mechanism, a salted
retry comes back clean) or, with ``vg_poison_all``, every request (a backend
broken for everyone: retries come back degenerate too).

Every test here runs with the *default* budget settings unless it says otherwise.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from conftest import GatewayFactory, RunningVLLM, scraped_metric
from support.workload import is_corrupt, long_prompt

from gateway.server.auth import hash_key

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12  # a poisoned answer is 12 '!' or empty: both flagged


def fresh_prompt() -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{uuid.uuid4()} {long_prompt(seed=5, words=200)}"}]


def ask(url: str, messages: list[dict[str, str]], key: str | None = None, **extra: Any) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # Greedy: a sampled answer can open with EOS (about 6e-5 a request on the test
    # model) and come back empty, which the guard rightly retries; a "clean" count
    # would then be off by one. The greedy first token was never EOS in 300 prompts.
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            **extra}  # fmt: skip
    response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response


def text_of(response: httpx.Response) -> str:
    return str(response.json()["choices"][0]["message"]["content"] or "")


def test_a_burst_with_half_the_answers_poisoned_is_delivered_clean(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """60 requests at once, 30 of them cache hits on poisoned blocks (the field: one
    poisoned prefix chain corrupts every request that reuses it). Every retry comes
    back clean, so every corrupt answer is retried: 0 delivered corrupt.

    The old budget (20% of requests + 1/s over 10 s: 22 retries here) delivered 8 of
    them corrupt with attempts=1. Deterministic: a warmed prompt with
    vg_poison_rate 1.0 always hits a poisoned block; 0.0 never does."""
    # 60 client threads share this process (and its GIL) with the gateway: a loopback
    # connect can wait past the default 5 s connect timeout, which is not under test.
    gateway = gateway_for(vllm.url, upstream={"timeouts": {"connect_s": 60.0}})
    poisoned = [fresh_prompt() for _ in range(30)]
    with ThreadPoolExecutor(8) as pool:  # warm: the next send of each hits the cache
        list(pool.map(lambda m: ask(vllm.url, m, max_tokens=1), poisoned))
    jobs = [(m, 1.0) for m in poisoned] + [(fresh_prompt(), 0.0) for _ in range(30)]
    with ThreadPoolExecutor(60) as pool:
        responses = list(
            pool.map(
                lambda job: ask(gateway.url, job[0], vllm_xargs={"vg_poison_rate": job[1]}), jobs
            )
        )
    verdicts = [r.headers["x-vllm-guard-verdict"] for r in responses]
    assert not [v for v in verdicts if v == "degenerate"]
    assert not [r for r in responses if is_corrupt(text_of(r))]
    assert verdicts.count("recovered") == 30
    assert scraped_metric(gateway.url, "vllm_guard_retries_refused_total") == 0


def test_a_backend_broken_for_everyone_gets_bounded_extra_load(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """Every answer degenerate, every retry too. Once the window has seen retries
    fail, extra upstream requests stay within the allowance.

    Settings: min_failed 3 (failed retries before the window judges), allowance
    ratio 0.1 x requests + min_per_second 0.1 x window 10 s, at most 0.1 x 40 + 1 = 5
    for 40 requests. Bound on extra requests: 3 (learning) + 4 x 2 (retries already
    granted to the 4 requests in flight when the window turns) + 5 = 16, whatever
    the timing. Without a budget: 80 (max_attempts 3)."""
    budget = {"ratio": 0.1, "min_per_second": 0.1, "window_s": 10, "min_failed": 3}
    gateway = gateway_for(vllm.url, guard={"budget": budget})
    broken = {"vllm_xargs": {"vg_poison_all": "bang"}}
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: ask(gateway.url, fresh_prompt(), **broken), range(40)))
    extra = sum(int(r.headers["x-vllm-guard-attempts"]) - 1 for r in responses)
    assert 3 <= extra <= 16
    assert all(r.headers["x-vllm-guard-verdict"] == "degenerate" for r in responses)
    refused = scraped_metric(gateway.url, "vllm_guard_retries_refused_total")
    assert refused >= 40 - extra  # every request that was not retried says why


def test_a_noisy_client_does_not_get_another_clients_corrupt_answer_delivered(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """One client's 40 answers are hopeless (no retry helps); then another client's
    answer hits a poisoned cache block. Its retry is granted from its own share and
    comes back clean. With one shared budget (the old design, or client_share 1.0)
    the noisy client spent it all and the quiet client got '!!!!' delivered."""
    keys = {"noisy": hash_key("noisy-key"), "quiet": hash_key("quiet-key")}
    # Allowance 0.5 x 41 + 10 = 30 useless retries. The noisy client's learning phase
    # costs at most 3 + 4 (in flight), its share 0.25 x 30 = 7.5 more: about 15, so a
    # shared budget still has room for the quiet client whatever the timing, and
    # without the share the noisy client's 80 would-be retries exhaust it.
    gateway = gateway_for(
        vllm.url,
        auth={"api_key_sha256": list(keys.values())},
        guard={"budget": {"ratio": 0.5}},
    )
    broken = {"vllm_xargs": {"vg_poison_all": "bang"}}
    with ThreadPoolExecutor(4) as pool:
        noisy = list(
            pool.map(lambda _: ask(gateway.url, fresh_prompt(), "noisy-key", **broken), range(40))
        )
    noisy_extra = sum(int(r.headers["x-vllm-guard-attempts"]) - 1 for r in noisy)
    refused = scraped_metric(gateway.url, "vllm_guard_retries_refused_total", reason="client_share")
    assert refused > 0, f"the noisy client was never held to its share ({noisy_extra} retries)"

    messages = fresh_prompt()
    ask(vllm.url, messages, max_tokens=1)  # warm: the next send hits the cache
    quiet = ask(gateway.url, messages, "quiet-key", vllm_xargs={"vg_poison_rate": 1.0})
    assert quiet.headers["x-vllm-guard-verdict"] == "recovered"
    assert not is_corrupt(text_of(quiet))
