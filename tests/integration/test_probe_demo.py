"""``vllm-guard probe`` and ``vllm-guard demo`` against real vLLM."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
from conftest import GatewayFactory, RunningVLLM

from gateway.tools.plot import CORRUPTION_COLOR, HIT_RATE_COLOR

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def probe(*args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "probe", *args, "--json"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_probe_on_a_clean_server_finds_nothing_and_measures_noise(vllm: RunningVLLM) -> None:
    report = probe(vllm.url, "--model", vllm.model, "--episodes", "3", "--steps", "3",
                   "--seed", "101", "--verify-determinism")  # fmt: skip
    summary = report["summary"]
    assert summary["requests"] == 9
    assert summary["errors"] == 0
    assert summary["degenerate"] == 0
    assert summary["hit_rate_usage"] > 0  # the episodes share a growing prefix
    assert summary["determinism_checked"] == 9
    # The CPU build at temperature 0 is deterministic here: the noise floor is 0.
    assert summary["determinism_mismatch_rate"] == 0.0
    # issue 40: the probe says whether the backend can take ask_logprobs, per API.
    assert summary["logprobs_support"] == {"chat": True, "completions": True, "responses": True}


def test_probe_reports_exactly_the_injected_corruption(vllm: RunningVLLM, tmp_path: Path) -> None:
    """With every cache hit poisoned, the corrupt answers are exactly the cache hits."""
    png = tmp_path / "run.png"
    report = probe(vllm.url, "--model", vllm.model, "--episodes", "4", "--steps", "4",
                   "--seed", "202", "--extra-body", '{"vllm_xargs": {"vg_poison_rate": 1.0}}',
                   "--plot", str(png))  # fmt: skip
    outcomes = report["outcomes"]
    hits = sum(1 for o in outcomes if (o["cached_tokens"] or 0) > 0)
    summary = report["summary"]
    assert hits > 0
    assert summary["degenerate"] == hits
    assert summary["degenerate_with_cache_hit"] == hits
    assert set(summary["degenerate_by_kind"]) <= {"punct_run", "empty"}
    assert summary["hit_rate_backend_metrics"] is not None
    assert_png_with_series(png)


def test_probe_sets_vllms_own_nan_count_beside_its_verdicts(vllm: RunningVLLM) -> None:
    """With real NaNs (every cache hit's reused block NaN in vLLM's KV cache), vLLM's
    own counter rose by exactly the answers the probe found degenerate: the
    detector's verdicts and the server's ground truth agree. The seed is this test's
    alone: the poisoned blocks stay in vLLM's prefix cache."""
    report = probe(vllm.url, "--model", vllm.model, "--episodes", "3", "--steps", "3",
                   "--seed", "34034", "--extra-body",
                   '{"vllm_xargs": {"vg_poison_rate": 1.0, "vg_poison_kinds": "nan"}}')  # fmt: skip
    hits = sum(1 for o in report["outcomes"] if (o["cached_tokens"] or 0) > 0)
    summary = report["summary"]
    assert hits > 0
    assert summary["degenerate"] == hits
    assert summary["vllm_counts_nans"] is True
    assert summary["vllm_nan_requests"] == hits


def test_probe_through_the_gateway_reports_attempts(
    vllm: RunningVLLM, gateway_for: GatewayFactory, tmp_path: Path
) -> None:
    gateway = gateway_for(vllm.url, guard={"budget": {"ratio": 1.0, "min_per_second": 5.0}})
    workload = tmp_path / "requests.jsonl"
    long = " ".join(["click the submit button on the settings page"] * 40)
    lines = [
        {"model": vllm.model, "messages": [{"role": "user", "content": long}], "max_tokens": 8},
        {"model": vllm.model, "messages": [{"role": "user", "content": long}], "max_tokens": 8,
         "stream": True},
        {"model": vllm.model, "prompt": long, "max_tokens": 8, "temperature": 0},
    ]  # fmt: skip
    workload.write_text("\n".join(json.dumps(line) for line in lines))
    report = probe(gateway.url, "--workload", str(workload), "--concurrency", "1",
                   "--extra-body", '{"vllm_xargs": {"vg_poison_rate": 1.0}}')  # fmt: skip
    summary = report["summary"]
    assert summary["requests"] == 3
    assert summary["degenerate"] == 0  # the gateway delivered clean answers
    assert summary["attempts_mean"] is not None
    assert summary["retried"] >= 1  # the repeats hit the poisoned cache and were retried
    assert summary["ttft_p50_s"] is not None  # the streamed request


def assert_png_with_series(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, idat, width = 8, b"", 0
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        body = data[offset + 8 : offset + 8 + length]
        crc = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])[0]
        assert crc == zlib.crc32(kind + body)
        if kind == b"IHDR":
            width = struct.unpack(">I", body[:4])[0]
        if kind == b"IDAT":
            idat += body
        offset += 12 + length
    raw = zlib.decompress(idat)
    stride = 1 + 3 * width
    pixels = {bytes(raw[i + 1 + 3 * x : i + 4 + 3 * x])
              for i in range(0, len(raw), stride) for x in range(width)}  # fmt: skip
    assert bytes(CORRUPTION_COLOR) in pixels
    assert bytes(HIT_RATE_COLOR) in pixels


def test_demo_end_to_end() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "demo", "--json",
         "--episodes", "6", "--steps", "4"],
        capture_output=True, text=True, timeout=1200, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["direct"]["corrupt"] > 0
    assert summary["gateway"]["corrupt"] == 0
    assert summary["gateway"]["retried"] > 0
    assert summary["direct"]["requests"] == summary["gateway"]["requests"] == 24
    # The poison is real NaNs: direct, vLLM's own count is the corrupt answers'.
    assert summary["direct"]["vllm_nan_requests"] == summary["direct"]["corrupt"]
    # Through the gateway too, vLLM's own count (read from vLLM, not the gateway's
    # copy as of its last scrape, which read 0 beside the retried answers): every
    # retried answer had at least one NaN attempt that vLLM counted.
    assert summary["gateway"]["vllm_nan_requests"] >= summary["gateway"]["retried"] > 0
