"""Metrics scraped by a real Prometheus while a poisoned workload runs against real vLLM,
and exact totals across ``--workers 2``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import ARTIFACTS, GatewayFactory, RunningVLLM, openai_client
from support.prometheus import PrometheusServer
from support.servers import free_port, wait_http
from support.workload import run_workload

pytestmark = pytest.mark.vllm

POISON = {"vllm_xargs": {"vg_poison_rate": 0.15}}
# Every cache hit poisoned: an episode's second step reuses its first step's blocks
# (the test server's 1M-token KV cache evicts nothing), so it is corrupt for sure.
ALWAYS_POISONED = {"vllm_xargs": {"vg_poison_rate": 1.0}}


def test_promql_matches_what_the_test_sent_and_saw(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(
        vllm.url,
        guard={"budget": {"ratio": 1.0, "min_per_second": 5.0}},
        upstream={"metrics_scrape_interval_s": 1.0},
    )
    with PrometheusServer({"gateway": f"127.0.0.1:{gateway.port}"}) as prom:
        seed = int(time.time()) % 100_000
        client = openai_client(gateway.url)
        results = run_workload(
            client, vllm.model, episodes_count=6, steps=4, concurrency=6, seed=seed,
            extra_body=POISON, max_tokens=16,
        )  # fmt: skip
        results += run_workload(
            client, vllm.model, episodes_count=4, steps=3, concurrency=4, seed=seed + 7,
            extra_body=POISON, max_tokens=16, stream=True,
        )  # fmt: skip
        # At 0.15 a run can hit no poisoned block at all (its ten episodes reuse about
        # 35 distinct blocks: all clean with odds of 0.85^35, about 1 in 300; it
        # happened in CI). Two episodes poisoned at every hit make the recovered
        # count at least 2 by construction, not by luck.
        results += run_workload(
            client, vllm.model, episodes_count=2, steps=2, concurrency=2, seed=seed + 13,
            extra_body=ALWAYS_POISONED, max_tokens=16,
        )  # fmt: skip
        sent = len(results)
        recovered = sum(r.verdict == "recovered" for r in results)
        retries = sum(r.attempts - 1 for r in results)
        assert recovered >= 2, "the always-poisoned episodes' second steps were not recovered"
        time.sleep(1.5)  # let the backend scrape see the traffic
        prom.wait_for_scrape_after(time.time(), "gateway")

        assert prom.scalar("sum(vllm_guard_requests_total)") == sent
        assert prom.scalar('sum(vllm_guard_requests_total{verdict="recovered"})') == recovered
        assert prom.scalar('sum(vllm_guard_requests_total{verdict="clean"})') == sent - recovered
        assert prom.scalar("sum(vllm_guard_retries_total)") == retries
        assert prom.scalar("sum(vllm_guard_degenerate_responses_total)") == retries
        # The corruption rate, as the dashboard computes it.
        corruption = prom.scalar(
            "sum(vllm_guard_degenerate_responses_total) / sum(vllm_guard_requests_total)"
        )
        assert corruption == pytest.approx(retries / sent)
        # Token accounting of clean attempts equals the usage the clients received.
        assert prom.scalar('sum(vllm_guard_prompt_tokens_total{verdict="clean"})') == sum(
            r.prompt_tokens for r in results
        )
        assert prom.scalar('sum(vllm_guard_cached_prompt_tokens_total{verdict="clean"})') == sum(
            r.cached_tokens or 0 for r in results
        )
        # Hit rate by verdict: every corrupted attempt was a cache hit (that is the bug).
        degenerate_hit_rate = prom.scalar(
            'sum(vllm_guard_cached_prompt_tokens_total{verdict="degenerate"})'
            ' / sum(vllm_guard_prompt_tokens_total{verdict="degenerate"})'
        )
        assert degenerate_hit_rate is not None
        assert degenerate_hit_rate > 0.5
        assert prom.scalar('vllm_guard_backend_up{backend="vllm0"}') == 1
        ratio = prom.scalar('vllm_guard_backend_prefix_cache_hit_ratio{backend="vllm0"}')
        assert ratio is not None
        assert 0 <= ratio <= 1
        version = prom.query('vllm_guard_backend_info{backend="vllm0"}')
        assert version
        assert version[0]["metric"]["version"].startswith("0.")
        assert prom.scalar("vllm_guard_build_info") == 1
        assert prom.scalar('sum(vllm_guard_attempts_count{model="tiny"})') == sent
        assert prom.scalar("sum(vllm_guard_overhead_seconds_count)") == sent
        # Bounded labels: an unknown model name becomes "other".
        models = {s["metric"]["model"] for s in prom.query("vllm_guard_requests_total")}
        assert models == {"tiny"}


def test_unknown_model_label_is_other(vllm: RunningVLLM, gateway_for: GatewayFactory) -> None:
    gateway = gateway_for(vllm.url)
    httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "user-supplied-garbage-123", "messages": [{"role": "user", "content": "x"}]},
    )
    text = httpx.get(gateway.url + "/metrics").text
    assert "user-supplied-garbage-123" not in text
    assert 'model="other",stream="false",verdict="error"} 1.0' in text


def test_two_workers_add_up_exactly(vllm: RunningVLLM, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = (ARTIFACTS / "gateway-workers.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--backend", vllm.url,
         "--host", "127.0.0.1", "--port", str(port), "--workers", "2"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/readyz", 60, process)
        sent = 40

        def one(i: int) -> int:
            response = httpx.post(
                url + "/v1/completions",
                json={"model": vllm.model, "prompt": f"tap {i}", "max_tokens": 2},
                timeout=60,
            )
            return response.status_code

        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(one, range(sent))) == {200}
        for _ in range(20):  # both workers answer /metrics with the same merged totals
            text = httpx.get(url + "/metrics").text
            total = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm_guard_requests_total{")
            )
            assert total == sent
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_corruption_ratios_stay_within_0_and_1(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """Every attempt of every request degenerate (three each): the old "degenerate
    attempts / requests" read 300%. The recording rules' ratios, evaluated by a real
    Prometheus on the gateway's real metrics, read 100%."""
    gateway = gateway_for(
        vllm.url, guard={"max_attempts": 3, "budget": {"ratio": 10.0, "min_per_second": 10.0}}
    )
    rules = yaml.safe_load((Path(__file__).parents[2] / "deploy/prometheus/alerts.yml").read_text())
    records = {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    client = openai_client(gateway.url)

    def corrupt_request(i: int) -> None:
        raw = client.chat.completions.with_raw_response.create(
            model=vllm.model, max_tokens=12,
            messages=[{"role": "user", "content": f"every attempt is corrupt {i}"}],
            extra_body={"vllm_xargs": {"vg_poison_all": "bang"}},
        )  # fmt: skip
        assert raw.headers["x-vllm-guard-attempts"] == "3"

    corrupt_request(0)  # every series exists before the first scrape (no half-done request)
    with PrometheusServer({"gateway": f"127.0.0.1:{gateway.port}"}) as prom:
        prom.wait_for_scrape_after(time.time(), "gateway")
        for i in range(1, 6):
            corrupt_request(i)
        time.sleep(1.5)
        prom.wait_for_scrape_after(time.time(), "gateway")
        old = prom.scalar(
            "sum(increase(vllm_guard_degenerate_responses_total[5m])) "
            "/ sum(increase(vllm_guard_requests_total[5m]))"
        )
        assert old == pytest.approx(3.0, rel=0.01)
        attempt_ratio = prom.scalar(f"max({records['vllm_guard:degenerate_attempt_ratio:rate5m']})")
        affected = prom.scalar(f"max({records['vllm_guard:affected_request_ratio:rate5m']})")
        assert attempt_ratio == pytest.approx(1.0)
        assert affected == pytest.approx(1.0)
