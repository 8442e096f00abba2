"""Ground truth beside the guess: vLLM's own count of requests with NaN logits
(``vllm:corrupted_requests``, the test server runs with
``VLLM_COMPUTE_NANS_IN_LOGITS=1``) against real NaNs.

The ``nan`` poison (``tests/support/poison_scheduler.py``) writes NaN into the
cached KV of the last prefix-cache block a poisoned request reuses; vLLM's own
forward pass, sampler and counter do the rest: the real mechanism from the
numerics up, with the corrupt state in an attention block instead of a recurrent
(Mamba) state.
"""

from __future__ import annotations

import time
import uuid

import httpx
from conftest import GatewayFactory, RunningVLLM, openai_client, scraped_metric, wait_for
from support.workload import is_corrupt, long_prompt

NAN_POISON = {"vllm_xargs": {"vg_poison_rate": 1.0, "vg_poison_kinds": "nan"}}
NAN_COUNT = "vllm:corrupted_requests_total"


def vllm_nan_count(vllm: RunningVLLM) -> float:
    return scraped_metric(vllm.url, NAN_COUNT)


def warmed_prompt(vllm: RunningVLLM) -> list[dict[str, str]]:
    """A conversation no other test has sent, sent once (its blocks now cached)."""
    messages = [{"role": "user", "content": f"{uuid.uuid4()} {long_prompt(seed=11, words=320)}"}]
    openai_client(vllm.url).chat.completions.create(
        model=vllm.model,
        messages=messages,
        max_tokens=1,  # type: ignore[arg-type]
    )
    return messages


def test_nan_poison_is_real_nans_that_vllm_counts(vllm: RunningVLLM) -> None:
    """Direct to vLLM: a poisoned cache hit comes back as a run of '!' (greedy and
    sampled: argmax over all-NaN logits is token 0), vLLM's counter rises by one per
    poisoned request, and the same prompt with a fresh salt is clean and uncounted."""
    client = openai_client(vllm.url)
    before = vllm_nan_count(vllm)
    answers = []
    for temperature in (0.0, 1.0):
        messages = warmed_prompt(vllm)
        answer = client.chat.completions.create(
            model=vllm.model, messages=messages, max_tokens=8,  # type: ignore[arg-type]
            temperature=temperature, extra_body=NAN_POISON,
        )  # fmt: skip
        answers.append(answer.choices[0].message.content or "")
        salted = client.chat.completions.create(
            model=vllm.model, messages=messages, max_tokens=8,  # type: ignore[arg-type]
            temperature=0, extra_body={**NAN_POISON, "cache_salt": uuid.uuid4().hex},
        )  # fmt: skip
        assert not is_corrupt(salted.choices[0].message.content or "")
    assert answers == ["!" * 8, "!" * 8]
    assert wait_for(lambda: vllm_nan_count(vllm) - before == 2, timeout_s=10)


def test_the_gateway_shows_vllms_nan_count_beside_its_verdicts(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """Through the gateway: every NaN-poisoned answer is recovered (0 corrupt), the
    gateway's per-backend series of vLLM's count equals vLLM's own counter, and its
    degenerate attempts rose exactly as much (nothing missed, nothing extra)."""
    gateway = gateway_for(
        vllm.url,
        upstream={"metrics_scrape_interval_s": 0.5},
        guard={"budget": {"ratio": 1.0, "min_per_second": 5.0}},
    )
    client = openai_client(gateway.url)
    before = vllm_nan_count(vllm)
    degenerate_before = scraped_metric(gateway.url, "vllm_guard_degenerate_responses_total")
    poisoned = 4
    for _ in range(poisoned):
        messages = warmed_prompt(vllm)
        raw = client.chat.completions.with_raw_response.create(
            model=vllm.model, messages=messages, max_tokens=8,  # type: ignore[arg-type]
            temperature=0, extra_body=NAN_POISON,
        )  # fmt: skip
        assert raw.headers["x-vllm-guard-verdict"] == "recovered"
        assert not is_corrupt(raw.parse().choices[0].message.content or "")
    assert wait_for(lambda: vllm_nan_count(vllm) - before == poisoned, timeout_s=10)
    time.sleep(0.1)
    assert wait_for(
        lambda: (
            scraped_metric(gateway.url, "vllm_guard_backend_nan_requests", backend="vllm0")
            == vllm_nan_count(vllm)
        ),
        timeout_s=10,
    )
    assert scraped_metric(gateway.url, "vllm_guard_backend_counts_nans", backend="vllm0") == 1
    degenerate = scraped_metric(gateway.url, "vllm_guard_degenerate_responses_total")
    assert degenerate - degenerate_before == poisoned
    assert httpx.get(gateway.url + "/readyz").status_code == 200


def test_a_real_prometheus_raises_the_recall_gap_only_for_what_the_detector_missed(
    vllm: RunningVLLM, gateway_for: GatewayFactory
) -> None:
    """deploy/prometheus/alerts.yml in a real Prometheus scraping two replicas of one
    gateway (job vllm-guard) in front of the real vLLM. NaN-poisoned requests through
    replica A, whose detectors are on, are all caught: VllmGuardDetectorMissesNaN stays
    silent. Then through replica B, with the detector for the bug's kind switched off
    (``punct_run``): the '!' answers are delivered, vLLM's count runs ahead of the
    degenerate attempts, and the alert goes pending (its ``for`` is 10 minutes)."""
    from pathlib import Path

    from support.prometheus import PrometheusServer

    from gateway.upstream.pool import backend_address

    alerts = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
    sections = {
        "upstream": {"metrics_scrape_interval_s": 0.5},
        "guard": {"budget": {"ratio": 1.0, "min_per_second": 5.0}},
    }
    a = gateway_for(vllm.url, **sections)
    b_guard = {**sections["guard"], "detectors": {"punct_run": False}}
    b = gateway_for(vllm.url, upstream=sections["upstream"], guard=b_guard)
    targets = {"vllm-guard": [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]}
    pending = 'ALERTS{alertname="VllmGuardDetectorMissesNaN"}'

    def send_poisoned(gateway_url: str, verdict: str) -> None:
        for _ in range(3):
            raw = openai_client(gateway_url).chat.completions.with_raw_response.create(
                model=vllm.model, messages=warmed_prompt(vllm),  # type: ignore[arg-type]
                max_tokens=8, temperature=0, extra_body=NAN_POISON,
            )  # fmt: skip
            assert raw.headers["x-vllm-guard-verdict"] == verdict

    def seen_by_prometheus(prom: PrometheusServer) -> None:
        count = vllm_nan_count(vllm)
        for gateway in (a, b):  # each replica's scrape of vLLM, then Prometheus's of it
            assert wait_for(
                lambda g=gateway: (
                    scraped_metric(g.url, "vllm_guard_backend_nan_requests", backend="vllm0")
                    == count
                ),
                timeout_s=10,
            )
        prom.wait_for_scrape_after(time.time(), "vllm-guard")
        time.sleep(2.5)  # two rule evaluations

    with PrometheusServer(targets, rule_files=[alerts]) as prom:
        prom.wait_for_scrape_after(time.time(), "vllm-guard")
        # increase() extrapolates a series toward the window's start by up to half a
        # scrape interval, except a counter that starts at 0 (the degenerate count),
        # which it stops at 0: on series a few seconds old that skew alone reached
        # 1.06 of 3 requests. 25 seconds of samples first bring it under 0.2. (In a
        # deployment the series are old; the 5% condition covers young ones.)
        time.sleep(25)
        send_poisoned(a.url, "recovered")
        seen_by_prometheus(prom)
        assert prom.query(pending) == []
        gap = "vllm_guard:nan_requests_not_judged_degenerate:increase30m"
        assert abs(prom.scalar(gap) or 0.0) < 1
        send_poisoned(b.url, "clean")  # delivered: the detector for '!' is off
        seen_by_prometheus(prom)
        (alert,) = prom.query(pending)
        assert alert["metric"]["alertstate"] == "pending"
        assert alert["metric"]["backend_address"] == backend_address(vllm.url)  # the pod
