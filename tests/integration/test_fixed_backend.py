"""The fixed-vLLM plugin on vLLM's real cache managers and in a real server, and the
gateway routing between a poisoned stock backend and a fixed one."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import ARTIFACTS, GatewayFactory, RunningVLLM, openai_client, scraped_metric
from prometheus_client import CollectorRegistry
from support.servers import VLLMServer, vllm_python
from support.workload import is_corrupt, long_prompt

from gateway.config import Settings
from gateway.observe.metrics import Metrics
from gateway.upstream.pool import BackendPool
from gateway.upstream.scrape import BackendScraper

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fixed_vllm(tiny_model_dir: Path) -> Iterator[VLLMServer]:
    # vLLM's default for the Responses store (off), as most deployments run it: the
    # tests' poisoned server has it on (previous_response_id, background).
    server = VLLMServer(
        tiny_model_dir, ARTIFACTS / "vllm-fixed.log", fixed=True,
        extra_env={"VLLM_ENABLE_RESPONSES_API_STORE": "0"},
    )  # fmt: skip
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _fix_series(url: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in httpx.get(url + "/metrics").text.splitlines()
        if line.startswith("vllm_guard_fix_")
    }


def test_plugin_is_active_in_a_real_server_and_says_so(fixed_vllm: VLLMServer) -> None:
    log = fixed_vllm.log_text()
    assert "vllm-guard-fix: ACTIVE on vLLM 0.32.0" in log
    assert "coordinator code of vLLM 0.32" in log
    answer = openai_client(fixed_vllm.url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "open the menu"}], max_tokens=8
    )
    assert answer.choices[0].message.content
    series = _fix_series(fixed_vllm.url)
    info = 'vllm_guard_fix_info{coordinator="0.32",status="active",vllm_version="0.32.0"}'
    assert series[info] == 1.0
    # The tiny model has no Mamba layer and no speculative decoding: the fix has
    # nothing to lower, and the counters say exactly that.
    lookups = {k: v for k, v in series.items() if "mamba_lookups_total" in k}
    assert len(lookups) == 4
    assert set(lookups.values()) == {0.0}
    assert series["vllm_guard_fix_tokens_withheld_total"] == 0.0


def test_a_stock_server_says_the_fix_is_not_active(vllm: RunningVLLM) -> None:
    info = [k for k in _fix_series(vllm.url) if k.startswith("vllm_guard_fix_info")]
    disabled = 'coordinator="none",status="disabled",vllm_version="0.32.0"'
    assert info == ["vllm_guard_fix_info{" + disabled + "}"]


def _register(env: dict[str, str], before: str = "") -> subprocess.CompletedProcess[str]:
    code = before + "import vllm_guard_fix\nvllm_guard_fix.register()\nprint('served')\n"
    return subprocess.run(
        [str(vllm_python()), "-c", code], capture_output=True, text=True, timeout=300,
        cwd="/tmp",
        env={"PYTHONPATH": str(ROOT / "deploy/vllm-fixed"), "PATH": "/usr/bin:/bin", **env},
    )  # fmt: skip


def test_disabled_plugin_leaves_vllm_stock_and_says_so() -> None:
    result = _register({"VLLM_GUARD_FIX_DISABLE": "1"})
    assert result.returncode == 0
    assert "served" in result.stdout
    assert "NOT ACTIVE on vLLM 0.32.0: disabled by VLLM_GUARD_FIX_DISABLE" in result.stderr


# vLLM code the plugin was not proven on: the finder edited the way an upstream fix
# would edit it (its source no longer matches any known release), from a module file
# so that its source can be read like vLLM's.
EDITED_MODULE = (
    "from vllm.v1.core.single_type_kv_cache_manager import MambaManager\n"
    "stock = MambaManager.find_longest_cache_hit.__func__\n"
    "def find_longest_cache_hit(cls, *args, drop_eagle_block=False, **kwargs):\n"
    "    return stock(cls, *args, drop_eagle_block=drop_eagle_block, **kwargs)\n"
    "MambaManager.find_longest_cache_hit = classmethod(find_longest_cache_hit)\n"
)
EDITED_FINDER = (
    "import pathlib, sys, tempfile\n"
    "directory = tempfile.mkdtemp()\n"
    f"pathlib.Path(directory, 'edited_vllm.py').write_text({EDITED_MODULE!r})\n"
    "sys.path.insert(0, directory)\n"
    "import edited_vllm\n"
)


def test_unknown_vllm_code_is_refused_and_the_fixed_server_does_not_start() -> None:
    refused = _register({"VLLM_GUARD_FIX_REQUIRE": "1"}, before=EDITED_FINDER)
    assert refused.returncode != 0
    assert "served" not in refused.stdout
    assert "REFUSED on vLLM 0.32.0: MambaManager.find_longest_cache_hit is not" in (refused.stderr)
    assert "RuntimeError: vllm-guard-fix is required" in refused.stderr
    # The operator may still serve it, as stock, by leaving the requirement off.
    allowed = _register({}, before=EDITED_FINDER)
    assert allowed.returncode == 0
    assert "served" in allowed.stdout
    assert "REFUSED" in allowed.stderr
    # A required but disabled fix does not start either.
    both = _register({"VLLM_GUARD_FIX_REQUIRE": "1", "VLLM_GUARD_FIX_DISABLE": "1"})
    assert both.returncode != 0
    assert "served" not in both.stdout


def _requests_by_backend(url: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm_guard_requests_total{"):
            backend = line.split('backend="', 1)[1].split('"', 1)[0]
            totals[backend] = totals.get(backend, 0) + float(line.rsplit(" ", 1)[1])
    return totals


def _two_backends(stock: str, fixed: str) -> list[dict[str, object]]:
    return [
        {"name": "stock", "url": stock, "role": "primary"},
        {"name": "fixed", "url": fixed, "role": "fixed"},
    ]


def test_retries_go_to_the_fixed_backend(
    vllm: RunningVLLM, fixed_vllm: VLLMServer, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(
        [], backends=_two_backends(vllm.url, fixed_vllm.url),
        guard={"retry_target": "fixed", "budget": {"ratio": 1.0, "min_per_second": 5.0}},
    )  # fmt: skip
    client = openai_client(gateway.url)
    fixed_before = httpx.get(fixed_vllm.url + "/metrics").text.count("\n")
    recovered = 0
    for i in range(4):
        messages = [{"role": "user", "content": f"{time.time()} {i} {long_prompt(i, 320)}"}]
        openai_client(vllm.url).chat.completions.create(
            model="tiny", messages=messages, max_tokens=1
        )  # warm the stock cache
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=16,
            extra_body={"vllm_xargs": {"vg_poison_rate": 1.0}},
        )  # fmt: skip
        assert not is_corrupt(raw.parse().choices[0].message.content)
        recovered += raw.headers["x-vllm-guard-verdict"] == "recovered"
    assert recovered == 4
    by_backend = _requests_by_backend(gateway.url)
    assert by_backend == {"fixed": 4.0}  # every answer came from the fixed backend
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'vllm_guard_degenerate_responses_total{backend="stock",endpoint="chat",kind=' in metrics
    assert fixed_before > 0
    # The gateway reads each backend's own word on the fix, not its configured role.
    fix = "vllm_guard_backend_fix_info"
    for backend, role, status, value in (
        ("fixed", "fixed", "active", 1),
        ("stock", "primary", "disabled", 1),
        ("fixed", "fixed", "disabled", 0),
    ):
        labels = {"backend": backend, "role": role, "status": status}
        assert scraped_metric(gateway.url, fix, **labels) == value
        assert f'{fix}{{backend="{backend}",backend_address="' in metrics


def test_a_fixed_role_on_a_stock_vllm_is_called_out(
    vllm: RunningVLLM, gateway_for: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="gateway.upstream.scrape"):
        gateway = gateway_for([], backends=_two_backends(vllm.url, vllm.url))
    fix = "vllm_guard_backend_fix_info"
    assert scraped_metric(gateway.url, fix, backend="fixed", role="fixed", status="disabled") == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "gateway.upstream.scrape"]
    assert any(
        "backend fixed has role fixed but its vLLM reports vllm-guard-fix disabled" in w
        for w in warnings
    ), warnings
    assert not any("backend stock" in w for w in warnings)  # a primary may be stock


def test_each_backend_is_asked_once_whether_it_keeps_responses_answers(
    vllm: RunningVLLM, fixed_vllm: VLLMServer
) -> None:
    """issue 41 item 4: a Responses stream without ``store: false`` is continued
    after release only on a vLLM that keeps nothing. The gateway asks each pod (a
    one-token answer stored, then looked up): the server started with
    ``VLLM_ENABLE_RESPONSES_API_STORE=1`` keeps it, vLLM's default keeps none. The
    operator's ``keeps_responses`` is taken as said, and nothing is asked."""

    async def ask() -> list[bool | None]:
        backends = [{"name": "stock", "url": vllm.url}, {"name": "fixed", "url": fixed_vllm.url},
                    {"name": "said", "url": fixed_vllm.url, "keeps_responses": True}]  # fmt: skip
        settings = Settings.model_validate({"upstream": {"backends": backends}})
        pool = BackendPool(settings.upstream)
        metrics = Metrics(CollectorRegistry(), models=["tiny"], backends=pool.names)
        scraper = BackendScraper(pool, metrics, settings.upstream)
        try:
            await scraper.scrape_once()  # asks in the background
            await scraper.store_probes.settled()
            return [b.keeps_responses for b in pool.backends]
        finally:
            await scraper.stop()
            await pool.stop()

    before = _responses_created(fixed_vllm.url)
    assert asyncio.run(ask()) == [True, False, True]
    assert _responses_created(fixed_vllm.url) == before + 1  # "said" was not asked


def _responses_created(url: str) -> float:
    """The Responses requests a vLLM served (its own counter of HTTP requests)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(url + "/metrics").text.splitlines()
        if line.startswith("http_requests_total{")
        and 'handler="/v1/responses"' in line
        and 'method="POST"' in line
    )


def test_canary_weight_splits_first_attempts(
    vllm: RunningVLLM, fixed_vllm: VLLMServer, gateway_for: GatewayFactory
) -> None:
    gateway = gateway_for(
        [], backends=_two_backends(vllm.url, fixed_vllm.url), guard={"canary_weight": 0.3}
    )
    sent = 200

    def one(i: int) -> int:
        return httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "tiny", "prompt": f"tap {i}", "max_tokens": 1}, timeout=60,
        ).status_code  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(one, range(sent))) == {200}
    by_backend = _requests_by_backend(gateway.url)
    assert sum(by_backend.values()) == sent
    # Binomial(200, 0.3): mean 60, sd 6.5; the tolerance is 4.6 sd, so an unseeded
    # run fails falsely with odds below 1 in 200,000 (without the canary: 0 fixed).
    assert abs(by_backend.get("fixed", 0) - 60) <= 30, by_backend


def test_killing_a_backend_mid_run_loses_no_request(
    vllm: RunningVLLM, fixed_vllm: VLLMServer, gateway_for: GatewayFactory
) -> None:
    """Runs last in this module: it kills the fixed server."""
    gateway = gateway_for(
        [], backends=[
            {"name": "a", "url": vllm.url, "weight": 1.0},
            {"name": "b", "url": fixed_vllm.url, "weight": 1.0},
        ],
        upstream={"health_interval_s": 0.5},
        guard={"budget": {"ratio": 1.0, "min_per_second": 20.0}},
    )  # fmt: skip
    completed = 0
    completed_lock = threading.Lock()
    served_by_b_before_the_kill = 0.0

    def one(i: int) -> int:
        nonlocal completed, served_by_b_before_the_kill
        status = httpx.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": f"step {i}"}],
                  "max_tokens": 24},
            timeout=60,
        ).status_code  # fmt: skip
        with completed_lock:
            completed += 1
            # Kill b once a quarter of the run is answered (a fixed delay was
            # too short on a slow machine: nothing had finished on b yet).
            if completed == 30:
                served_by_b_before_the_kill = _requests_by_backend(gateway.url).get("b", 0)
                fixed_vllm.kill()
        return status

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, range(120)))
    assert statuses == [200] * 120
    assert served_by_b_before_the_kill > 0  # b was in rotation until it died
    by_backend = _requests_by_backend(gateway.url)
    assert sum(by_backend.values()) == 120
    ready = httpx.get(gateway.url + "/readyz").json()
    assert ready["backends"] == {"a": True, "b": False}


# The lookups run in vLLM's engine-core process, /metrics is served by the API-server
# process: a parent that registers first (as vLLM's API server does) and a child it
# spawns afterwards (as vLLM spawns the engine core), each with vLLM's real modules.
CROSS_PROCESS = """
import multiprocessing, sys
import vllm_guard_fix
from vllm_guard_fix import evidence

def engine_core():
    vllm_guard_fix.register()
    evidence.LOOKUPS.record("block", 64)
    evidence.LOOKUPS.record("block", 0)
    evidence.LOOKUPS.record("hash_unit", 0)
    evidence._flush(evidence._state_dir())

if __name__ == "__main__":
    vllm_guard_fix.register()
    child = multiprocessing.get_context("spawn").Process(target=engine_core)
    child.start(); child.join()
    from prometheus_client import generate_latest
    print(generate_latest().decode())
"""


def test_lookups_counted_in_the_engine_core_reach_the_api_servers_metrics(
    tmp_path: Path,
) -> None:
    script = tmp_path / "two_processes.py"
    script.write_text(CROSS_PROCESS)
    result = subprocess.run(
        [str(vllm_python()), str(script)], capture_output=True, text=True, timeout=300,
        cwd="/tmp", env={"PYTHONPATH": str(ROOT / "deploy/vllm-fixed"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = set(result.stdout.splitlines())
    assert 'vllm_guard_fix_mamba_lookups_total{outcome="lowered",path="block"} 1.0' in lines
    assert 'vllm_guard_fix_mamba_lookups_total{outcome="unchanged",path="block"} 1.0' in lines
    assert 'vllm_guard_fix_mamba_lookups_total{outcome="unchanged",path="hash_unit"} 1.0' in lines
    assert "vllm_guard_fix_tokens_withheld_total 64.0" in lines


def test_with_several_api_servers_the_series_come_from_multiprocess_files(
    tmp_path: Path,
) -> None:
    """``--api-server-count > 1``: vLLM sets PROMETHEUS_MULTIPROC_DIR before spawning
    its processes and serves /metrics from vLLM's own multiprocess registry."""
    script = tmp_path / "multiprocess.py"
    script.write_text(
        CROSS_PROCESS.replace(
            "    from prometheus_client import generate_latest\n"
            "    print(generate_latest().decode())\n",
            "    from prometheus_client import generate_latest\n"
            "    from vllm.v1.metrics.prometheus import get_prometheus_registry\n"
            "    print(generate_latest(get_prometheus_registry()).decode())\n",
        )
    )
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    result = subprocess.run(
        [str(vllm_python()), str(script)], capture_output=True, text=True, timeout=300,
        cwd="/tmp",
        env={"PYTHONPATH": str(ROOT / "deploy/vllm-fixed"), "PATH": "/usr/bin:/bin",
             "PROMETHEUS_MULTIPROC_DIR": str(multiproc)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = set(result.stdout.splitlines())
    info = 'vllm_guard_fix_info{coordinator="0.32",status="active",vllm_version="0.32.0"} 1.0'
    assert info in lines
    assert 'vllm_guard_fix_mamba_lookups_total{outcome="lowered",path="block"} 1.0' in lines
    assert 'vllm_guard_fix_mamba_lookups_total{outcome="unchanged",path="hash_unit"} 1.0' in lines
    assert "vllm_guard_fix_tokens_withheld_total 64.0" in lines


def test_a_real_server_with_two_api_servers_reports_the_fix(tiny_model_dir: Path) -> None:
    server = VLLMServer(
        tiny_model_dir, ARTIFACTS / "vllm-fixed-2api.log", fixed=True,
        extra_args=["--api-server-count", "2"],
    )  # fmt: skip
    server.start()
    try:
        server.wait_ready()
        series = _fix_series(server.url)
    finally:
        server.stop()
    info = 'vllm_guard_fix_info{coordinator="0.32",status="active",vllm_version="0.32.0"}'
    assert series[info] == 1.0
    assert series['vllm_guard_fix_mamba_lookups_total{outcome="lowered",path="block"}'] == 0.0
