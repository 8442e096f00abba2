"""The metric classes whose ``labels()`` remember their children."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import prometheus_client
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from gateway.observe.metrics import DURATION_BUCKETS, Counter, Histogram, LiveGauge, Metrics

BOUNDS = [float(b) for b in DURATION_BUCKETS]
ROOT = Path(__file__).resolve().parents[2]


def test_remembered_children_are_the_exported_ones() -> None:
    registry = CollectorRegistry()
    counter = Counter("c", "help", ["model", "verdict"], registry=registry)
    histogram = Histogram("h", "help", ["model"], buckets=(1.0,), registry=registry)
    assert counter.labels("m", "clean") is counter.labels("m", "clean")
    counter.labels("m", "clean").inc()
    counter.labels(model="m", verdict="clean").inc()  # by name: the same series
    counter.labels("m", "recovered").inc(3)
    histogram.labels("m").observe(0.5)
    histogram.labels("m").observe(2.0)
    gauge = LiveGauge("g", "help", ["endpoint"], registry=registry)
    assert gauge.labels("chat") is gauge.labels("chat")
    gauge.labels("chat").inc()
    gauge.labels("chat").inc()
    gauge.labels(endpoint="chat").dec()
    text = generate_latest(registry).decode()
    assert 'g{endpoint="chat"} 1.0' in text
    assert 'c_total{model="m",verdict="clean"} 2.0' in text
    assert 'c_total{model="m",verdict="recovered"} 3.0' in text
    assert 'h_bucket{le="1.0",model="m"} 1.0' in text
    assert 'h_count{model="m"} 2.0' in text


def test_fix_status_is_read_from_a_backends_metrics() -> None:
    from gateway.upstream.scrape import parse_fix_status

    line = b'vllm_guard_fix_info{coordinator="0.32",status="active",vllm_version="0.32.0"} 1.0\n'
    assert parse_fix_status(b"# HELP x\nvllm:num_requests_running 0.0\n" + line) == "active"
    assert parse_fix_status(line.replace(b"active", b"refused")) == "refused"
    assert parse_fix_status(b"vllm:num_requests_running 0.0\n") == "absent"
    # a status this gateway does not know is not taken for a working fix
    assert parse_fix_status(line.replace(b"active", b"maybe")) == "refused"
    assert parse_fix_status(line.replace(b"} 1.0", b"} 0.0")) == "absent"


def test_vllms_nan_count_is_read_from_its_metrics_summed_over_engines() -> None:
    """vLLM's counter as prometheus_client exposes it (the library vLLM registers it
    with, ``v1/metrics/loggers.py``: one child per engine): its ``_total`` samples
    summed, its ``_created`` ones ignored; None when the server does not count."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from gateway.upstream.scrape import parse_nan_requests

    registry = CollectorRegistry()
    nans = Counter(
        "vllm:corrupted_requests",
        "Corrupted requests, in terms of total number of requests with NaNs in logits.",
        ["model_name", "engine"],
        registry=registry,
    )
    nans.labels("tiny", "0").inc(3)
    nans.labels("tiny", "1").inc(4)
    assert parse_nan_requests(generate_latest(registry)) == 7.0
    assert parse_nan_requests(b"vllm:num_requests_running 0.0\n") is None


@settings(max_examples=300, derandomize=True)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(BOUNDS)))
def test_bisected_histogram_buckets_are_prometheus_clients(amounts: list[float]) -> None:
    """Same exposition as prometheus_client's own Histogram for any observations,
    bounds themselves, negatives, infinities and NaN included (seeded)."""
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = Histogram("h", "help", ["m"], buckets=DURATION_BUCKETS, registry=ours_registry)
    theirs = prometheus_client.Histogram(
        "h", "help", ["m"], buckets=DURATION_BUCKETS, registry=theirs_registry
    )
    for amount in amounts:
        ours.labels("x").observe(amount)
        theirs.labels("x").observe(amount)
    assert exposition(ours_registry) == exposition(theirs_registry)


def exposition(registry: CollectorRegistry) -> list[str]:
    """The samples, without the creation timestamps (when each histogram was made)."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_a_departed_backend_leaves_no_gauge_behind() -> None:
    """A discovered pod that left is not shown up, nor alerted on as down; its slot,
    taken again by another pod, reports afresh under the new pod's address."""
    registry = CollectorRegistry()
    metrics = Metrics(registry, models=["m"], backends=["vllm-0", "vllm-1"])
    pods = {"vllm-0": "10.0.0.1:8000", "vllm-1": "10.0.0.2:8000"}
    for name, address in pods.items():
        metrics.backend_up.labels(name, address).set(0)
        metrics.backend_hit_ratio.labels(name, address).set(0.5)
        metrics.backend_info.labels(name, address, "0.11.0").set(1)
        metrics.backend_fix_info.labels(name, address, "primary", "absent").set(1)
        metrics.count_degenerate("m", name, address, "punct_run", "chat")
        metrics.connection_wait.labels(name).observe(0.0)
    metrics.forget_backend("vllm-1", "10.0.0.2:8000")
    text = generate_latest(registry).decode()
    assert 'backend="vllm-0"' in text
    assert 'backend_address="10.0.0.2:8000"' not in text
    per_pod = [line for line in text.splitlines() if "vllm-1" in line]
    assert per_pod  # the per-request counters keep their counts
    assert all(line.startswith("vllm_guard_degenerate_responses") for line in per_pod)
    metrics.backend_up.labels("vllm-1", "10.0.0.3:8000").set(1)
    assert (
        'vllm_guard_backend_up{backend="vllm-1",backend_address="10.0.0.3:8000"} 1.0'
        in generate_latest(registry).decode()
    )


def test_a_slot_taken_again_in_the_same_resolution_drops_only_the_old_pods_series() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry, models=["m"], backends=[])
    metrics.backend_up.labels("vllm-0", "10.0.0.1:8000").set(1)
    metrics.backend_up.labels("vllm-0", "10.0.0.9:8000").set(1)  # the new pod, same slot
    metrics.connection_wait.labels("vllm-0").observe(0.0)
    metrics.forget_backend("vllm-0", "10.0.0.1:8000", slot_taken=True)
    text = generate_latest(registry).decode()
    assert "10.0.0.1:8000" not in text
    assert 'vllm_guard_backend_up{backend="vllm-0",backend_address="10.0.0.9:8000"} 1.0' in text
    assert 'vllm_guard_upstream_connection_wait_seconds_count{backend="vllm-0"} 1.0' in text


def test_backend_address_is_host_and_port_of_the_url_routing_hashes() -> None:
    from gateway.upstream.pool import backend_address

    assert backend_address("http://10.0.0.5:8000") == "10.0.0.5:8000"
    assert backend_address("http://[fd00::7]:8000/v1") == "[fd00::7]:8000"
    assert backend_address("http://vllm-stock:8000/") == "vllm-stock:8000"
    assert backend_address("http://vllm") == "vllm:80"
    assert backend_address("https://vllm.example") == "vllm.example:443"


def test_replicas_with_swapped_slots_label_each_pods_series_with_its_address(
    monkeypatch: Any,
) -> None:
    """Replica A saw pods .1 and .2, then .1 was replaced by .3; replica B started after
    that: the pods hold swapped slots in the two. Each replica's per-backend series of
    one pod (vLLM's NaN count from its /metrics, the degenerate attempts counted
    against it) carry the same ``backend_address``, the host and port of the URL that
    conversation affinity hashes (``Backend.identity``), whatever their slot; the
    departed pod's series are gone from A."""
    from yarl import URL

    from gateway.config import UpstreamSettings
    from gateway.upstream import discovery
    from gateway.upstream.pool import Backend, BackendPool
    from gateway.upstream.scrape import BackendScraper

    answers: dict[str, list[list[str]]] = {
        "a": [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"]],
        "b": [["10.0.0.2", "10.0.0.3"]],
    }
    replica = "a"
    nan_counts = {"10.0.0.1": 5, "10.0.0.2": 7, "10.0.0.3": 11}

    async def resolver(host: str, port: int) -> list[str]:
        return answers[replica].pop(0)

    async def healthy(self: Backend, timeout_s: float) -> bool:
        return True

    async def get(self: BackendScraper, backend: Backend, path: str) -> bytes | None:
        if path != "/metrics":
            return None
        count = nan_counts[URL(backend.url).host or ""]
        return f'vllm:corrupted_requests_total{{engine="0"}} {count}.0\n'.encode()

    monkeypatch.setattr(discovery, "resolve_addresses", resolver)
    monkeypatch.setattr(Backend, "probe_health", healthy)
    monkeypatch.setattr(BackendScraper, "_get", get)
    settings = UpstreamSettings.model_validate(
        {"backends": [{"name": "vllm", "url": "http://pods.test:8000", "discover": True}]}
    )

    async def run() -> list[tuple[BackendPool, Metrics]]:
        nonlocal replica
        replicas = []
        for replica in ("a", "b"):
            pool = BackendPool(settings)
            metrics = Metrics(CollectorRegistry(), models=[], backends=[])
            pool.on_departed.append(metrics.forget_backend)
            scraper = BackendScraper(pool, metrics, settings)
            for _ in answers[replica][:]:
                await pool.discover()
                await scraper.scrape_once()
            for backend in pool.backends:
                metrics.count_degenerate("m", backend.name, backend.address, "empty", "chat")
            await pool.session.close()
            await pool.fresh_session.close()
            replicas.append((pool, metrics))
        return replicas

    replicas = asyncio.run(run())
    slots: dict[str, set[str]] = {}
    for pool, metrics in replicas:
        text = generate_latest(metrics.registry).decode()
        assert "10.0.0.1" not in text  # the departed pod left nothing behind
        for backend in pool.backends:
            identity = URL(backend.identity)
            assert backend.address == f"{identity.host}:{identity.port}"
            labels = f'backend="{backend.name}",backend_address="{backend.address}"'
            count = nan_counts[identity.host or ""]
            assert f"vllm_guard_backend_nan_requests{{{labels}}} {count}.0" in text
            assert f"vllm_guard_backend_degenerate_attempts_total{{{labels}}} 1.0" in text
            assert f"vllm_guard_backend_up{{{labels}}} 1.0" in text
            slots.setdefault(backend.address, set()).add(backend.name)
    # the same pod, two slot names: only the address joins the two replicas
    assert slots == {"10.0.0.2:8000": {"vllm-0", "vllm-1"}, "10.0.0.3:8000": {"vllm-0", "vllm-1"}}


def test_state_shared_configured_says_whether_redis_is_configured() -> None:
    """vllm_guard_state_shared is 0 both without Redis and with Redis lost: the
    configured gauge tells them apart (1 only with state.redis_url)."""
    from gateway.config import Settings
    from gateway.guard.salting import Salting

    async def configured(state: dict[str, Any]) -> str:
        metrics = Metrics(CollectorRegistry(), models=[], backends=[])
        salting = Salting(Settings.model_validate({"state": state}), metrics, reuse=True)
        if salting.redis is not None:
            await salting.redis.client.aclose()
        return generate_latest(metrics.registry).decode()

    without = asyncio.run(configured({}))
    assert "vllm_guard_state_shared_configured 0.0" in without
    assert "vllm_guard_state_shared 0.0" in without
    with_redis = asyncio.run(configured({"redis_url": "redis://127.0.0.1:1/0"}))
    assert "vllm_guard_state_shared_configured 1.0" in with_redis
    assert "vllm_guard_state_shared 0.0" in with_redis  # not connected (yet)


def test_multiprocess_mode_exports_only_the_gateways_metrics(tmp_path: Path) -> None:
    """With ``--workers N`` every histogram any process creates writes a file into
    PROMETHEUS_MULTIPROC_DIR, and the merged /metrics shows whatever those files hold:
    a histogram made for a check at import (not registered anywhere) leaked into it.
    prometheus_client picks its value class at import, so this runs in a fresh
    interpreter set up as the CLI sets up a worker."""
    script = """
import json
from prometheus_client import CollectorRegistry, multiprocess
from gateway.observe.metrics import Metrics
metrics = Metrics(CollectorRegistry(), models=["m"], backends=["b"])
metrics.ttft.labels("m", "b").observe(0.1)
merged = CollectorRegistry()
multiprocess.MultiProcessCollector(merged)
defined = sorted(f.name for f in metrics.registry.collect())
exported = sorted(f.name for f in merged.collect())
print(json.dumps([defined, exported]))
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    defined, exported = json.loads(done.stdout)
    assert "vllm_guard_time_to_first_token_seconds" in exported  # the files were read
    assert sorted(set(exported) - set(defined)) == []


def test_a_pod_that_left_mid_scrape_or_mid_stream_leaves_no_series_behind() -> None:
    """A scrape round reading a terminating pod, or its last stream judged degenerate,
    after discovery removed its series: the series came back under the gone
    address and nothing removed them again (one more set per pod ever seen). Once a
    backend has departed nothing writes its per-pod series."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from gateway.config import Settings
    from gateway.upstream.pool import BackendPool
    from gateway.upstream.scrape import BackendScraper

    async def scenario() -> str:
        reading = asyncio.Event()

        async def slow_metrics(request: web.Request) -> web.Response:
            reading.set()
            await asyncio.sleep(0.3)  # a terminating pod still answers
            return web.Response(text='vllm:corrupted_requests_total{model_name="m"} 3\n')

        app = web.Application()
        app.router.add_get("/metrics", slow_metrics)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        settings = Settings.model_validate(
            {"upstream": {"backends": [{"name": "vllm-0", "url": url}]}}
        )
        pool = BackendPool(settings.upstream)
        metrics = Metrics(CollectorRegistry(), models=["m"], backends=pool.names)
        scraper = BackendScraper(pool, metrics, settings.upstream)
        pod = pool.backends[0]
        try:
            scraping = asyncio.ensure_future(scraper.scrape_once())
            await reading.wait()
            pod.departed = True  # discovery: the pod left (BackendPool.discover)
            metrics.forget_backend(pod.name, pod.address)
            metrics.count_degenerate("m", pod.name, pod.series_address, "punct_run", "chat")
            await scraping
            await scraper.scrape_once()  # a later round does not bring it back either
            return generate_latest(metrics.registry).decode()
        finally:
            await scraper.stop()
            await pool.stop()
            await server.close()

    text = asyncio.run(scenario())
    left = [line for line in text.splitlines() if "backend_address=" in line]
    assert left == [], left
