"""Session fixtures: one real vLLM server per test session, gateways on real sockets.

The vLLM server is started once (about a minute on 2 cores) by the
``vllm_server`` fixture. Set ``VLLM_GUARD_TEST_VLLM_URL`` to reuse a server you
started yourself with ``python tests/support/servers.py`` (it must run the
poisoning scheduler, as that script does).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import settings as hypothesis_settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.pods import Dns, pods_on_one_port
from support.servers import (
    MODEL_NAME,
    GatewayServer,
    RunningRedis,
    VLLMServer,
    ensure_model,
    free_port,
    gateway_settings,
)
from support.stub_backend import StubBackend

from gateway.upstream import discovery

ARTIFACTS = Path(os.environ.get("VLLM_GUARD_TEST_ARTIFACTS", "/tmp/vllm-guard-test"))

# Property tests explore the same examples on every run (seeded from each test's
# name): a CI run cannot fail on an example the last local run never tried.
hypothesis_settings.register_profile("seeded", derandomize=True, print_blob=True)
hypothesis_settings.load_profile("seeded")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_model(ARTIFACTS / "tiny-model")


def scraped_metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` at ``url/metrics`` whose labels include ``labels``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric_name = head.split("{", 1)[0]
        if metric_name != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


class RunningVLLM:
    def __init__(self, url: str, server: VLLMServer | None) -> None:
        self.url = url
        self.server = server
        self.model = MODEL_NAME

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a vLLM metric's samples whose labels include ``labels``."""
        return scraped_metric(self.url, name, **labels)

    def log_text(self) -> str:
        """The server log (the session's own server, or VLLM_GUARD_TEST_VLLM_LOG)."""
        if self.server is not None:
            return self.server.log_text()
        return Path(os.environ["VLLM_GUARD_TEST_VLLM_LOG"]).read_text(errors="replace")

    def reset_prefix_cache(self) -> None:
        httpx.post(self.url + "/reset_prefix_cache", timeout=30).raise_for_status()

    def wait_received(self, request_id: str, timeout_s: float = 30) -> None:
        """Until vLLM's log shows it received ``request_id`` (now generating)."""
        received = re.compile(rf"Received request \S*{request_id}\b")
        assert wait_for(lambda: bool(received.search(self.log_text())), timeout_s), (
            f"vLLM never received {request_id}"
        )

    def generating(self) -> bool:
        """Whether vLLM is running a request (its gauge lags a new request by ~0.3 s)."""
        return wait_for(lambda: self.metric("vllm:num_requests_running") > 0, timeout_s=3)

    def aborted(self, request_id: str) -> bool:
        """Whether vLLM logs the abort of ``request_id`` by the time it has stopped
        running requests. A request that finished is never logged as aborted, so this
        cannot pass by timing."""
        pattern = re.compile(
            rf"chatcmpl-{request_id}\S* aborted|Aborted request\(s\) \S*{request_id}\b"
        )

        def settled() -> bool:
            return bool(pattern.search(self.log_text())) or (
                self.metric("vllm:num_requests_running") == 0
            )

        assert wait_for(settled, timeout_s=60)
        time.sleep(1.0)  # the abort's log line, if it is on its way
        assert wait_for(lambda: self.metric("vllm:num_requests_running") == 0, timeout_s=60)
        return bool(pattern.search(self.log_text()))


def wait_for(predicate: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="session")
def vllm(tiny_model_dir: Path) -> Iterator[RunningVLLM]:
    external = os.environ.get("VLLM_GUARD_TEST_VLLM_URL")
    if external:
        yield RunningVLLM(external.rstrip("/"), None)
        return
    server = VLLMServer(tiny_model_dir, ARTIFACTS / "vllm.log")
    server.start()
    try:
        server.wait_ready()
        yield RunningVLLM(server.url, server)
    finally:
        server.stop()


GatewayFactory = Callable[..., GatewayServer]


@pytest.fixture
def gateway_for() -> Iterator[GatewayFactory]:
    """Start gateways with given backends and settings sections; stopped after the test."""
    started: list[GatewayServer] = []

    def start(
        backend_urls: list[str] | str, http_protocol: Any = None, **sections: Any
    ) -> GatewayServer:
        settings = gateway_settings(backend_urls, **sections)
        server = (
            GatewayServer(settings, http_protocol) if http_protocol else GatewayServer(settings)
        ).__enter__()
        started.append(server)
        return server

    yield start
    for server in started:
        server.__exit__(None, None, None)


@pytest.fixture
def gateway(vllm: RunningVLLM, gateway_for: GatewayFactory) -> GatewayServer:
    return gateway_for(vllm.url)


def openai_client(base_url: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="test-key", max_retries=0, **kwargs)


@pytest.fixture
def redis_server() -> Iterator[RunningRedis]:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    server = RunningRedis(free_port(), ARTIFACTS / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pods() -> Iterator[tuple[int, dict[str, StubBackend]]]:
    """Scripted vLLM pods behind one name (``support.pods``): (port, address -> pod)."""
    with pods_on_one_port() as found:
        yield found


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> Dns:
    """The pods' name resolves to what the test sets in ``dns.answer``."""
    resolver = Dns()
    monkeypatch.setattr(discovery, "resolve_addresses", resolver.resolve)
    return resolver
