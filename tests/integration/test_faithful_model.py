"""The faithful model of the bug inside real vLLM (tests/support/poison_scheduler.py):
only the state at the last reused block is loaded; corruption has sources and, with
propagation, spreads to every block computed from a corrupt state. Both switches
are exercised directly against vLLM, then the gateway is held to its promise under
the model: no corrupt answer delivered."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import pytest
from conftest import GatewayFactory, RunningVLLM, openai_client
from support.workload import StepResult, is_corrupt, long_prompt, run_workload

pytestmark = pytest.mark.vllm


def ask(vllm: RunningVLLM, messages: list[dict[str, str]], **xargs: Any) -> str:
    answer = openai_client(vllm.url).chat.completions.create(
        model=vllm.model, messages=messages, max_tokens=12, temperature=0,
        extra_body={"vllm_xargs": xargs} if xargs else {},
    )  # fmt: skip
    return answer.choices[0].message.content or ""


def conversation() -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]:
    """Three prompts, each extending the previous by more than a cache block."""
    system = {"role": "system", "content": f"{uuid.uuid4()} {long_prompt(seed=11, words=260)}"}
    first = [system, {"role": "user", "content": "step 0: open the settings page"}]
    step1 = "step 1: " + long_prompt(seed=12, words=220)
    step2 = "step 2: " + long_prompt(seed=13, words=220)
    second = [
        *first,
        {"role": "assistant", "content": "click(10, 20)"},
        {"role": "user", "content": step1},
    ]
    third = [
        *second,
        {"role": "assistant", "content": "click(30, 40)"},
        {"role": "user", "content": step2},
    ]
    return first, second, third


@pytest.mark.parametrize("propagate", [True, False], ids=["propagation", "sources-only"])
def test_corruption_follows_the_last_reused_state(vllm: RunningVLLM, propagate: bool) -> None:
    first, second, third = conversation()
    ask(vllm, first)  # cached, clean
    # Turn 2 reuses turn 1's blocks; every reused block is a source: poisoned.
    assert is_corrupt(ask(vllm, second, vg_source_rate=1.0, vg_propagate=propagate))
    # Turn 3 reuses turn 2's blocks; no block is a source any more. Only propagation
    # (turn 2 computed its later blocks from a corrupt state) poisons it.
    poisoned = is_corrupt(ask(vllm, third, vg_source_rate=0.0, vg_propagate=propagate))
    assert poisoned is propagate
    # Another namespace is never affected.
    salted = openai_client(vllm.url).chat.completions.create(
        model=vllm.model, messages=third, max_tokens=12, temperature=0,
        extra_body={"cache_salt": f"s-{uuid.uuid4().hex}",
                    "vllm_xargs": {"vg_source_rate": 0.0, "vg_propagate": propagate}},
    )  # fmt: skip
    assert not is_corrupt(salted.choices[0].message.content)


def test_no_corrupt_answer_is_delivered_under_the_faithful_model(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """The field workload (episodes sharing a growing prefix), half of the reused
    states sources, propagation on. Direct: corruption. Through the gateway (default
    settings): none. Steps of an episode often reuse the same last block, so the half
    rate alone leaves about 13 independent draws (1 in 8,000 runs direct with nothing
    corrupt): two more episodes whose every reused state is a source make corruption
    on each side certain."""
    gateway = gateway_for(vllm.url)
    xargs = {"vllm_xargs": {"vg_source_rate": 0.5, "vg_propagate": True}}
    every_state_a_source = {"vllm_xargs": {"vg_source_rate": 1.0, "vg_propagate": True}}
    shape = {"steps": 4, "max_tokens": 12}
    seed = int(time.time() * 1000) % 1_000_000

    def workload(url: str, seed: int) -> list[StepResult]:
        client = openai_client(url)
        return run_workload(
            client, vllm.model, seed=seed, episodes_count=6, concurrency=6,
            extra_body=xargs, **shape,
        ) + run_workload(
            client, vllm.model, seed=seed + 500_000, episodes_count=2, concurrency=2,
            extra_body=every_state_a_source, **shape,
        )  # fmt: skip

    direct = workload(vllm.url, seed)
    guarded = workload(gateway.url, seed + 1)
    assert sum(is_corrupt(r.text) for r in direct) > 0
    assert [r.text for r in guarded if is_corrupt(r.text)] == []
    assert any(r.verdict == "recovered" for r in guarded)
    assert all(r.verdict in ("clean", "recovered") for r in guarded)


def test_mid_generation_corruption_starts_after_the_healthy_tokens(vllm: RunningVLLM) -> None:
    """The test double for corruption that starts in the middle of a generation
    (``vg_poison_after``): the first N tokens are the model's own, then token 0 ('!');
    a salted request is immune (so a salted continuation of the healthy text is
    clean). Compared by token ids: a token's text may be part of a UTF-8 character."""
    prompt = f"{uuid.uuid4()} open the settings page"

    def token_ids(**extra: object) -> list[int]:
        body = {"model": vllm.model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip
        choice = httpx.post(vllm.url + "/v1/completions", json=body, timeout=60).json()
        ids: list[int] = choice["choices"][0]["token_ids"]
        return ids

    healthy = token_ids()
    corrupted = token_ids(vllm_xargs={"vg_poison_after": 5})
    salted = token_ids(vllm_xargs={"vg_poison_after": 5}, cache_salt=uuid.uuid4().hex)
    assert len(healthy) == 12
    assert salted == healthy
    assert corrupted == healthy[:5] + [0] * 7
    assert healthy[5:] != [0] * 7
