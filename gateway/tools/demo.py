"""``vllm-guard demo``: see the gateway work in one command, without a GPU.

Starts the tiny local vLLM (CPU build) with a poisoned prefix cache - the same
test-only scheduler the tests use, its poison made of real NaNs in the cached KV,
so the corrupt answers are runs of '!' that vLLM counts itself (the tests also
cover the empty answers, which NaNs cannot produce) - and the gateway in front of
it, runs the
GUI-agent workload direct and through the gateway, prints both side by side,
and cleans up its processes. It needs a source checkout's tests/support (the
test-only scheduler; ``localvllm.missing_support`` says exactly what is missing).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from gateway.tools.localvllm import (
    REPO,
    SUPPORT,
    VLLMServer,
    ensure_model,
    free_port,
    missing_support,
    wait_http,
)
from gateway.tools.probe import ProbeConfig, ProbeReport, run_probe

CACHE = Path(os.environ.get("VLLM_GUARD_CACHE", Path.home() / ".cache" / "vllm-guard"))


def say(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def run_demo(
    *, poison_rate: float, episodes: int, steps: int, concurrency: int, quiet: bool
) -> dict[str, Any]:
    if (missing := missing_support()) is not None:
        raise SystemExit(f"vllm-guard demo: {missing}")
    say("1/5  Finding or installing the vLLM CPU build (first time: ~4 minutes)...", quiet)
    subprocess.run(
        ["bash", str(SUPPORT / "install_vllm.sh")],
        check=True,
        stdout=subprocess.DEVNULL if quiet else sys.stderr,
    )
    say("2/5  Building a tiny Llama-shaped model (token 0 is '!', like Qwen)...", quiet)
    model = ensure_model(CACHE / "demo-model")
    logs = Path(tempfile.mkdtemp(prefix="vllm-guard-demo-"))
    say(
        f"3/5  Starting vLLM with prefix caching and a TEST-ONLY scheduler that poisons "
        f"cached blocks (p={poison_rate} per block, the field's failure: NaN in the cached "
        f"state, so '!!!!' answers on cache hits, which vLLM counts). Logs: {logs}",
        quiet,
    )
    vllm = VLLMServer(
        model, logs / "vllm.log", poison_rate=poison_rate, extra_env={"VG_POISON_KINDS": "nan"}
    )
    gateway: subprocess.Popen[bytes] | None = None
    try:
        vllm.start()
        vllm.wait_ready()
        say("4/5  Starting vllm-guard in front of it...", quiet)
        port = free_port()
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--backend", vllm.url,
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=(logs / "gateway.log").open("wb"), stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
        gateway_url = f"http://127.0.0.1:{port}"
        wait_http(gateway_url + "/readyz", 60, gateway)
        say(
            f"5/5  Running the GUI-agent workload ({episodes} episodes x {steps} steps, "
            f"c={concurrency}) direct to vLLM, then through the gateway...",
            quiet,
        )
        reports = [
            asyncio.run(
                run_probe(
                    ProbeConfig(
                        target=target, model="tiny", seed=seed, episodes=episodes, steps=steps,
                        concurrency=concurrency,
                        # vLLM's own count, both columns: the gateway's copy is as of
                        # its last scrape (it read 0 beside the answers it retried).
                        vllm_metrics=vllm.url,
                    )
                )
            )
            for seed, target in enumerate((vllm.url, gateway_url), start=1)
        ]  # fmt: skip
        direct, guarded = reports
        return {"direct": summary(direct), "gateway": summary(guarded)}
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=30)
        vllm.stop()


def summary(report: ProbeReport) -> dict[str, Any]:
    s = report.summary
    return {
        "requests": s["requests"],
        "corrupt": s["degenerate"],
        "corrupt_rate": s["degenerate_rate"],
        "retried": s["retried"],
        "hit_rate": s["hit_rate_usage"],
        "latency_p50_s": s["latency_p50_s"],
        "vllm_nan_requests": s["vllm_nan_requests"],
    }


def format_demo(result: dict[str, Any]) -> str:
    d, g = result["direct"], result["gateway"]

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    def count(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0f}"

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.0f} ms"

    rows = [
        ("", "direct to vLLM", "through vllm-guard"),
        ("requests", str(d["requests"]), str(g["requests"])),
        ("corrupt answers delivered", f"{d['corrupt']} ({pct(d['corrupt_rate'])})",
         f"{g['corrupt']} ({pct(g['corrupt_rate'])})"),
        ("answers retried with a fresh salt", "-", str(g["retried"])),
        ("NaN requests vLLM itself counted", count(d["vllm_nan_requests"]),
         count(g["vllm_nan_requests"])),
        ("prefix-cache hit rate", pct(d["hit_rate"]), pct(g["hit_rate"])),
        ("latency p50", ms(d["latency_p50_s"]), ms(g["latency_p50_s"])),
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}   {r[1]:>{widths[1]}}   {r[2]:>{widths[2]}}" for r in rows
    )


def demo_json(result: dict[str, Any]) -> bytes:
    return orjson.dumps(result, option=orjson.OPT_INDENT_2)
