"""The gates in front of third-party internals: uvicorn's (``gateway.server.uvicorn_edge``: open on
the tested release, closed with a reason on any other or when a name the edge relies
on is gone), aiohttp's read timer hook (``gateway.upstream.pool``) and prometheus_client's
histogram privates (``gateway.observe.metrics``), each with the public path as its fallback."""

from __future__ import annotations

import logging

import prometheus_client
import pytest
import uvicorn
from aiohttp.client_proto import ResponseHandler
from prometheus_client import CollectorRegistry
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.observe import metrics
from gateway.server import uvicorn_edge
from gateway.upstream import pool


def test_the_installed_uvicorn_carries_the_edge() -> None:
    assert uvicorn_edge.uvicorn_incompatibility() is None
    assert uvicorn_edge.edge_protocol() is uvicorn_edge.EdgeHttpToolsProtocol


@pytest.mark.parametrize("version", ["0.54.9", "0.56.0", "1.0.0", "0.55"])
def test_a_release_outside_the_tested_range_closes_the_gate(
    version: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(uvicorn, "__version__", version)
    if version == "0.55":
        assert uvicorn_edge.uvicorn_incompatibility() is None
        return
    assert uvicorn_edge.uvicorn_incompatibility() == (
        f"uvicorn {version} is outside the tested range >=0.55,<0.56"
    )
    with caplog.at_level(logging.WARNING, logger="gateway.server.uvicorn_edge"):
        assert uvicorn_edge.edge_protocol() == "httptools"
    assert len(caplog.records) == 1


def test_a_renamed_method_closes_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(HttpToolsProtocol, "on_response_complete")
    assert uvicorn_edge.uvicorn_incompatibility() == (
        f"uvicorn {uvicorn.__version__} lacks HttpToolsProtocol.on_response_complete"
    )


def test_aiohttp_read_timer_hook_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stall watch drops aiohttp's per-read timer only where aiohttp has the hook;
    the stream tests run both ways (``test_stub_faults``'s ``read_timer``)."""
    assert pool._read_timer_hook_present()
    monkeypatch.delattr(ResponseHandler, "read_timeout")
    assert not pool._read_timer_hook_present()


def test_histograms_without_prometheus_clients_privates_are_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert metrics._bisection_possible()
    monkeypatch.setattr(metrics, "BISECTION", False)
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = metrics.Histogram("h", "help", buckets=(0.1, 1.0), registry=ours_registry)
    theirs = prometheus_client.Histogram("h", "help", buckets=(0.1, 1.0), registry=theirs_registry)
    for amount in (0.05, 0.1, 0.5, 7.0):
        ours.observe(amount)
        theirs.observe(amount)
    samples = [
        [
            (s.name, s.labels, s.value)
            for m in r.collect()
            for s in m.samples
            if "created" not in s.name
        ]
        for r in (ours_registry, theirs_registry)
    ]
    assert samples[0] == samples[1]
    assert ("h_bucket", {"le": "1.0"}, 3.0) in samples[0]
