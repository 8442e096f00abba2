"""Conversation memory shared through a real ``redis-server``, against the real tiny
vLLM with its poisoning scheduler.

``vg_poison_unsalted_only`` poisons every cache hit of the default (unsalted)
namespace and none of a salted one: the field's picture of one poisoned chain,
made deterministic. A turn sent unsalted after its conversation was recovered
comes back corrupt and needs a retry; a turn that starts on the conversation's
known-clean salt does not.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    ARTIFACTS,
    GatewayFactory,
    RunningRedis,
    RunningVLLM,
    openai_client,
    scraped_metric,
    wait_for,
)
from support.servers import free_port, wait_http
from support.workload import is_corrupt, long_prompt

pytestmark = pytest.mark.vllm

POISON_UNSALTED = {
    "vllm_xargs": {
        "vg_poison_rate": 1.0, "vg_poison_kinds": "bang", "vg_poison_unsalted_only": True,
    }
}  # fmt: skip
GUARD = {
    "budget": {"ratio": 1.0, "min_per_second": 5.0},
    "salt_reuse": {"key": "shared-ladder-key"},
}


def state(redis: RunningRedis, **more: Any) -> dict[str, Any]:
    # 1 s, not the default 5 ms: on two cores beside vLLM the test process's threads
    # (three gateways and the client) can hold a lookup up past 5 ms, and a lookup past
    # its deadline is (rightly) answered locally, which is not what the first test is
    # about. The deadline's fallback is the second test's, with a Redis that hangs.
    return {"redis_url": redis.url, "reconnect_s": 0.5, "lookup_timeout_ms": 1000, **more}


def turn(gateway_url: str, model: str, messages: list[dict[str, str]]) -> tuple[str, str, str]:
    raw = openai_client(gateway_url).chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body=POISON_UNSALTED
    )
    text = raw.parse().choices[0].message.content or ""
    return text, raw.headers["x-vllm-guard-attempts"], raw.headers["x-vllm-guard-verdict"]


def test_next_turn_on_another_gateway_starts_on_the_clean_salt(
    vllm: RunningVLLM, gateway_for: GatewayFactory, redis_server: RunningRedis
) -> None:
    """Gateway A recovers a conversation; its next turn lands on gateway B, which
    learns the clean salt from Redis and goes straight to it. Gateway C, with its own
    memory only, sends the same turn unsalted and needs a retry."""
    shared = {"guard": GUARD, "state": state(redis_server)}
    a, b = gateway_for(vllm.url, **shared), gateway_for(vllm.url, **shared)
    alone = gateway_for(vllm.url, guard=GUARD)
    # A conversation is fingerprinted on its first two messages (salt_reuse).
    messages = [
        {"role": "system", "content": f"{uuid.uuid4()} You operate a browser."},
        {"role": "user", "content": long_prompt(seed=4, words=320)},
    ]
    openai_client(vllm.url).chat.completions.create(
        model=vllm.model, messages=messages, max_tokens=1
    )  # warm the default namespace

    answer, attempts, verdict = turn(a.url, vllm.model, messages)
    assert (attempts, verdict) == ("2", "recovered")
    assert wait_for(lambda: redis_server.command("DBSIZE").strip() == b":1", timeout_s=5)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]

    answer, attempts, verdict = turn(b.url, vllm.model, messages)
    assert (attempts, verdict) == ("1", "clean")
    assert not is_corrupt(answer)
    assert scraped_metric(b.url, "vllm_guard_salt_reuse_total", attempt="first") == 1
    assert scraped_metric(b.url, "vllm_guard_state_shared") == 1

    _, attempts, verdict = turn(alone.url, vllm.model, messages)
    assert (attempts, verdict) == ("2", "recovered")


def test_redis_slow_or_gone_loses_no_request(
    vllm: RunningVLLM, gateway_for: GatewayFactory, redis_server: RunningRedis
) -> None:
    """A load run while Redis hangs (SIGSTOP: every lookup misses its 5 ms deadline),
    then dies: every request is answered 200 and clean from the gateway's own
    memory, the failures are counted, and sharing resumes once Redis is back."""
    gateway = gateway_for(vllm.url, guard=GUARD, state=state(redis_server))
    client = openai_client(gateway.url)

    def one(i: int) -> tuple[int, str]:
        raw = client.chat.completions.with_raw_response.create(
            model=vllm.model, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": f"turn {i % 6} of a conversation"}],
        )  # fmt: skip
        return raw.status_code, raw.headers["x-vllm-guard-verdict"]

    def load(count: int) -> list[tuple[int, str]]:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, range(count)))

    assert {status for status, _ in load(12)} == {200}
    assert scraped_metric(gateway.url, "vllm_guard_state_errors_total") == 0
    redis_server.pause()
    try:
        assert load(24) == [(200, "clean")] * 24
        assert scraped_metric(gateway.url, "vllm_guard_state_errors_total", op="get") >= 1
        assert scraped_metric(gateway.url, "vllm_guard_state_shared") == 0
    finally:
        redis_server.resume()
    assert wait_for(lambda: scraped_metric(gateway.url, "vllm_guard_state_shared") == 1, 10)
    redis_server.stop()
    assert load(24) == [(200, "clean")] * 24
    assert scraped_metric(gateway.url, "vllm_guard_state_shared") == 0
    redis_server.start()
    assert wait_for(lambda: scraped_metric(gateway.url, "vllm_guard_state_shared") == 1, 10)
    assert load(12) == [(200, "clean")] * 12


def test_workers_share_the_memory_through_redis(
    vllm: RunningVLLM, redis_server: RunningRedis, tmp_path: Path
) -> None:
    """``serve --workers 2`` with Redis: the kernel spreads connections over both
    workers, so the next turns of conversations recovered by one worker reach the
    other too. Every next turn starts on its conversation's clean salt: one attempt.
    With each worker's own memory, a next turn on the worker that did not recover the
    conversation goes unsalted, is poisoned and retried (seen failing so, with the
    state section removed: next turns took 2 attempts)."""
    config = tmp_path / "workers.json"
    config.write_text(
        json.dumps({
            "upstream": {"backends": [{"name": "vllm", "url": vllm.url}]},
            "guard": GUARD,
            "state": state(redis_server),
        })
    )  # fmt: skip
    port = free_port()
    log = (ARTIFACTS / "gateway-workers-redis.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config),
         "--host", "127.0.0.1", "--port", str(port), "--workers", "2"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    conversations = [
        [
            {"role": "system", "content": f"{uuid.uuid4()} You operate a browser."},
            {"role": "user", "content": long_prompt(seed=10 + i, words=320)},
        ]
        for i in range(8)
    ]
    try:
        wait_http(url + "/readyz", 60, process)
        for messages in conversations:  # warm each conversation's unsalted blocks
            openai_client(vllm.url).chat.completions.create(
                model=vllm.model, messages=messages, max_tokens=1
            )
        # Each turn is its own client, so its own connection for the kernel to place;
        # two at a time keep both workers busy.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = list(pool.map(lambda m: turn(url, vllm.model, m), conversations))
        assert {(attempts, verdict) for _, attempts, verdict in first} == {("2", "recovered")}
        # The rung is written after the answer leaves: wait for all eight writes.
        assert wait_for(lambda: redis_server.command("DBSIZE").strip() == b":8", timeout_s=5)
        for messages, (answer, _, _) in zip(conversations, first, strict=True):
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "next"},
            ]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            second = list(pool.map(lambda m: turn(url, vllm.model, m), conversations))
        assert [(attempts, verdict) for _, attempts, verdict in second] == [("1", "clean")] * 8
        assert not any(is_corrupt(answer) for answer, _, _ in second)
    finally:
        process.terminate()
        process.wait(timeout=30)
