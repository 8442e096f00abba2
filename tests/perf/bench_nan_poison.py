"""The guard's efficacy on two models of the corruption, in one run against one tiny
vLLM: ``bang`` (the test scheduler rewrites a poisoned request's sampled tokens to
id 0 after the fact) and ``nan`` (real NaNs: the last prefix-cache block a poisoned
request reuses has NaN in its cached KV, and vLLM's own forward pass, sampler and
counter do the rest; tests/support/poison_scheduler.py).

    .venv/bin/python tests/perf/bench_nan_poison.py [--episodes 8] [--steps 4]

The GUI-agent workload (gateway.tools.probe), each cache hit's blocks poisoned
with probability ``--rate`` per block, direct to vLLM and through the gateway,
each cell with its own prompts (seeded). Per cell: answers, corrupt answers
delivered, answers retried, vLLM's own NaN-request count (its counter's rise), and
the prompt tokens vLLM computed (prefill: its prefix-cache queries minus hits).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from gateway.tools.localvllm import VLLMServer, ensure_model, free_port, wait_http  # noqa: E402
from gateway.tools.probe import ProbeConfig, run_probe  # noqa: E402
from gateway.upstream.scrape import parse_nan_requests, parse_prefix_cache  # noqa: E402


def vllm_counters(url: str) -> tuple[float, float]:
    """(prompt tokens vLLM computed so far, requests with NaN logits so far)."""
    text = httpx.get(url + "/metrics", timeout=10).content
    cache = parse_prefix_cache(text)
    computed = (cache.queries - cache.hits) if cache is not None else 0.0
    return computed, parse_nan_requests(text) or 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rate", type=float, default=0.3)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="vllm-guard-bench-nan-"))
    model = ensure_model(Path.home() / ".cache" / "vllm-guard" / "bench-model")
    vllm = VLLMServer(model, logs / "vllm.log")
    vllm.start()
    gateway = None
    try:
        vllm.wait_ready()
        port = free_port()
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--backend", vllm.url,
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=(logs / "gateway.log").open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        gateway_url = f"http://127.0.0.1:{port}"
        wait_http(gateway_url + "/readyz", 60, gateway)
        rows = []
        seed = 7000
        for kind in ("bang", "nan"):
            for name, target in (("direct", vllm.url), ("gateway", gateway_url)):
                seed += 1
                computed_before, nans_before = vllm_counters(vllm.url)
                extra = {"vllm_xargs": {"vg_poison_rate": args.rate, "vg_poison_kinds": kind}}
                config = ProbeConfig(
                    target=target, model="tiny", seed=seed, episodes=args.episodes,
                    steps=args.steps, concurrency=4, extra_body=extra,
                )  # fmt: skip
                summary = asyncio.run(run_probe(config)).summary
                computed_after, nans_after = vllm_counters(vllm.url)
                rows.append((kind, name, summary["requests"], summary["degenerate"],
                             summary["retried"], nans_after - nans_before,
                             computed_after - computed_before))  # fmt: skip
        print(
            "| poison | path | answers | corrupt delivered | retried | vLLM NaN requests "
            "| prompt tokens vLLM computed |"
        )
        print("|---|---|---|---|---|---|---|")
        for kind, name, requests, corrupt, retried, nans, computed in rows:
            print(f"| {kind} | {name} | {requests} | {corrupt} | {retried} | {nans:.0f} "
                  f"| {computed:.0f} |")  # fmt: skip
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=30)
        vllm.stop()


if __name__ == "__main__":
    main()
