"""The fixed-vLLM plugin on vLLM's real cache managers and in a real server, and the
gateway routing between a poisoned stock backend and a fixed one."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import ARTIFACTS, GatewayFactory, RunningVLLM, openai_client
from support.servers import VLLMServer, vllm_python
from support.workload import is_corrupt, long_prompt

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_plugin_on_vllms_real_prefix_cache_managers() -> None:
    result = subprocess.run(
        [str(vllm_python()), str(ROOT / "tests/support/check_vllm_fix.py")],
        capture_output=True, text=True, check=True, timeout=300,
        env={"PYTHONPATH": str(ROOT / "deploy/vllm-fixed"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    report = json.loads(result.stdout.strip().splitlines()[-1])
    block = report["block_size"]
    cached = report["cached_blocks"] * block
    before, after = report["before"], report["after"]
    # The defect: full attention drops the last matched block under spec decoding,
    # Mamba does not.
    assert before["full_spec_on"] == cached - block
    assert before["mamba_spec_on"] == cached
    assert report["applied"] is True
    # The fix: the Mamba hit stops one block earlier, like full attention...
    assert after["mamba_spec_on"] == cached - block == after["full_spec_on"]
    # ...and every other case is unchanged.
    assert after["mamba_spec_off"] == before["mamba_spec_off"] == cached
    assert after["full_spec_off"] == before["full_spec_off"] == cached
    assert report["second_apply"] is False  # idempotent
    # Where upstream already honours drop_eagle_block it does nothing...
    assert report["on_fixed_upstream"] == {
        "apply": False, "refused": False,
        "reason": "this vLLM's MambaManager already honours drop_eagle_block",
    }  # fmt: skip
    # ...and where the code it expects is not there it refuses instead of patching blind.
    assert report["on_renamed"]["refused"] is True


@pytest.fixture(scope="module")
def fixed_vllm(tiny_model_dir: Path) -> Iterator[VLLMServer]:
    server = VLLMServer(tiny_model_dir, ARTIFACTS / "vllm-fixed.log", fixed=True)
    server.start()
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_plugin_loads_in_a_real_server_and_serves(fixed_vllm: VLLMServer) -> None:
    log = fixed_vllm.log_text()
    assert "vllm-guard-fix: applied to vLLM 0.32.0" in log
    answer = openai_client(fixed_vllm.url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "open the menu"}], max_tokens=8
    )
    assert answer.choices[0].message.content


def test_plugin_can_be_disabled_by_environment() -> None:
    code = (
        "import vllm_guard_fix\n"
        "from vllm.v1.core.single_type_kv_cache_manager import MambaManager\n"
        "vllm_guard_fix.register()\n"
        "print(vllm_guard_fix.decide(MambaManager).apply)\n"
    )
    result = subprocess.run(
        [str(vllm_python()), "-c", code], capture_output=True, text=True, check=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT / "deploy/vllm-fixed"), "PATH": "/usr/bin:/bin",
             "VLLM_GUARD_FIX_DISABLE": "1"},
    )  # fmt: skip
    assert result.stdout.strip().splitlines()[-1] == "True"  # still unpatched
    assert "disabled by VLLM_GUARD_FIX_DISABLE" in result.stdout + result.stderr


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
    assert 'vllm_guard_degenerate_responses_total{backend="stock",kind=' in metrics
    assert fixed_before > 0


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
    # Binomial(200, 0.3): mean 60, sd 6.5; the tolerance is 3 sd.
    assert abs(by_backend.get("fixed", 0) - 60) <= 20, by_backend


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
