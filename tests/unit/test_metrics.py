"""The metric classes whose ``labels()`` remember their children."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from gateway.metrics import Counter, Histogram


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
    text = generate_latest(registry).decode()
    assert 'c_total{model="m",verdict="clean"} 2.0' in text
    assert 'c_total{model="m",verdict="recovered"} 3.0' in text
    assert 'h_bucket{le="1.0",model="m"} 1.0' in text
    assert 'h_count{model="m"} 2.0' in text
