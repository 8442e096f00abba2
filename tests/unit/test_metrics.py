"""The metric classes whose ``labels()`` remember their children."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    taken again, reports afresh."""
    registry = CollectorRegistry()
    metrics = Metrics(registry, models=["m"], backends=["vllm-0", "vllm-1"])
    for name in ("vllm-0", "vllm-1"):
        metrics.backend_up.labels(name).set(0)
        metrics.backend_hit_ratio.labels(name).set(0.5)
    metrics.forget_backend("vllm-1")
    text = generate_latest(registry).decode()
    assert 'backend="vllm-0"' in text
    assert 'backend="vllm-1"' not in text
    metrics.backend_up.labels("vllm-1").set(1)
    assert 'vllm_guard_backend_up{backend="vllm-1"} 1.0' in generate_latest(registry).decode()


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
