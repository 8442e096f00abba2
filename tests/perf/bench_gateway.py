"""Benchmark: the gateway vs. going direct to a real vLLM, in one run, with ratios.

    make bench          # or: .venv/bin/python tests/perf/bench_gateway.py [--quick]

Starts the tiny CPU vLLM (or uses VLLM_GUARD_BENCH_VLLM_URL) and gateways as
separate processes (``vllm-guard serve``), then reports:

1. latency, direct vs. gateway, non-streaming and streaming, c=1 and c=32,
   interleaved and repeated: p50/p99, added p50/p99, TTFT with hold-back K=0 and
   the default K, and the gateway's CPU time per request (from /proc);
2. the poisoned agent workload: corrupt answers direct vs. through the gateway,
   retries per request, prompt tokens recomputed and vLLM's prefix-cache hit
   rate, with salt reuse on and off;
3. detector cost per response for 100- and 4,000-token outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import timeit
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from support.servers import (  # noqa: E402
    MODEL_NAME,
    VLLMServer,
    ensure_model,
    free_port,
    wait_http,
)
from support.workload import is_corrupt, run_workload  # noqa: E402

from gateway.config import DetectorSettings  # noqa: E402
from gateway.detect import Detector  # noqa: E402

POISON_RATE = 0.1
ARTIFACTS = Path(os.environ.get("VLLM_GUARD_BENCH_ARTIFACTS", "/tmp/vllm-guard-bench"))


# -- processes ----------------------------------------------------------------------------


class ServiceProcess:
    """A server under test: a started process, its URL, and its CPU time (with children)."""

    def __init__(
        self,
        name: str,
        command: list[str],
        port: int,
        ready_path: str,
        env: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.name, self.command, self.port, self.ready_path = name, command, port, ready_path
        self.env = {**os.environ, **(env or {})}
        #: Headers every request to it needs (an API key).
        self.headers = headers or {}
        self.process: subprocess.Popen[bytes] | None = None
        #: Working directory (another checkout's, to run its code: ``-m`` puts it first).
        self.cwd: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Any:
        log = (ARTIFACTS / f"{self.name}.log").open("wb")
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd
        )
        wait_http(self.url + self.ready_path, 120, self.process)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)

    def pids(self) -> list[int]:
        """The process and its children (workers, nginx's worker)."""
        assert self.process is not None
        return [self.process.pid, *_children(self.process.pid)]

    def peak_rss_mib(self) -> float:
        """The largest peak resident set (VmHWM) among ``pids()``."""
        peaks = [0.0]
        for pid in self.pids():
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]) / 1024)
        return max(peaks)

    def cpu_seconds(self) -> float:
        total = 0.0
        for pid in self.pids():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total


def _children(pid: int) -> list[int]:
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(c) for c in children]


class GatewayProcess(ServiceProcess):
    def __init__(self, backend: str, name: str, **config: Any) -> None:
        config.setdefault("upstream", {}).setdefault("backends", [{"name": "vllm", "url": backend}])
        config_path = Path(tempfile.mkdtemp()) / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path),
                   "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        super().__init__(f"gateway-{name}", command, port, "/readyz")

    def metric_sum(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


# -- latency ------------------------------------------------------------------------------


@dataclass
class Sample:
    total_s: float
    ttft_s: float


async def one_request(
    session: aiohttp.ClientSession, url: str, stream: bool, i: int, max_tokens: int
) -> Sample:
    body = {
        "model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
        "messages": [{"role": "user", "content": f"request {i}: click the submit button"}],
        "ignore_eos": True,
    }  # fmt: skip
    started = time.perf_counter()
    ttft = 0.0
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        if stream:
            async for chunk in response.content.iter_any():
                if not ttft and b'"content":"' in chunk and b'"content":""' not in chunk:
                    ttft = time.perf_counter() - started
        else:
            await response.read()
    total = time.perf_counter() - started
    return Sample(total, ttft or total)


async def run_latency(
    url: str, concurrency: int, requests: int, stream: bool, max_tokens: int
) -> list[Sample]:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        queue = list(range(requests))
        samples: list[Sample] = []

        async def worker() -> None:
            while queue:
                i = queue.pop()
                samples.append(await one_request(session, url, stream, i, max_tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_section(vllm_url: str, quick: bool) -> list[str]:
    rounds = 2 if quick else 3
    per_round = {1: 20 if quick else 40, 32: 64 if quick else 128}
    lines = ["## Latency: gateway vs direct (ms; added = gateway - direct)", ""]
    lines.append(
        "| scenario | c | direct p50 | direct p99 | gateway p50 | gateway p99 "
        "| added p50 | added p99 | gw CPU/req |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    with (
        GatewayProcess(vllm_url, "k0", guard={"stream": {"holdback_chars": 0}}) as k0,
        GatewayProcess(vllm_url, "kdefault") as kdef,
    ):
        scenarios = [
            ("non-stream", False, kdef, "total"),
            ("stream TTFT, K=0", True, k0, "ttft"),
            ("stream TTFT, adaptive hold-back (default)", True, kdef, "ttft"),
            ("stream total, adaptive", True, kdef, "total"),
        ]
        for concurrency in (1, 32):
            results: dict[str, dict[str, list[Sample]]] = {}
            cpu: dict[str, float] = {}
            counts: dict[str, int] = {}
            for name, stream, gw, _ in scenarios:
                if name.startswith("stream total"):
                    continue
                results[name] = {"direct": [], "gateway": []}
                cpu[name], counts[name] = 0.0, 0
                for _ in range(rounds):  # interleaved: direct, gateway, direct, ...
                    n = per_round[concurrency]
                    results[name]["direct"] += asyncio.run(
                        run_latency(vllm_url, concurrency, n, stream, 16)
                    )
                    before = gw.cpu_seconds()
                    results[name]["gateway"] += asyncio.run(
                        run_latency(gw.url, concurrency, n, stream, 16)
                    )
                    cpu[name] += gw.cpu_seconds() - before
                    counts[name] += n
            for name, _stream, _gw, field in scenarios:
                source = (
                    "stream TTFT, adaptive hold-back (default)"
                    if name.startswith("stream total")
                    else name
                )
                direct = [getattr(s, f"{field}_s") * 1000 for s in results[source]["direct"]]
                through = [getattr(s, f"{field}_s") * 1000 for s in results[source]["gateway"]]
                d50, d99, g50, g99 = (
                    pct(direct, 0.5),
                    pct(direct, 0.99),
                    pct(through, 0.5),
                    pct(through, 0.99),
                )
                lines.append(
                    f"| {name} | {concurrency} | {d50:.1f} | {d99:.1f} | {g50:.1f} | {g99:.1f} "
                    f"| {g50 - d50:+.1f} | {g99 - d99:+.1f} "
                    f"| {cpu[source] / counts[source] * 1000:.2f} |"
                )
    return lines


# -- poisoned workload ----------------------------------------------------------------------


def vllm_counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def workload_section(vllm_url: str, quick: bool) -> list[str]:
    import openai

    shape = {
        "episodes_count": 8 if quick else 16, "steps": 5 if quick else 6,
        "concurrency": 8, "max_tokens": 20,
    }  # fmt: skip
    poison = {"vllm_xargs": {"vg_poison_rate": POISON_RATE}}
    budget = {"budget": {"ratio": 1.0, "min_per_second": 5.0}}
    lines = [
        f"## Poisoned agent workload (each cached block poisoned with p={POISON_RATE}, "
        "c=8, temperature 0)",
        "",
    ]
    lines.append(
        "| target | requests | corrupt delivered | retries/request | prompt tokens recomputed "
        "| vLLM prefix-cache hit rate |"
    )
    lines.append("|---|---|---|---|---|---|")
    runs = [
        ("direct to vLLM", None),
        (
            "gateway, fresh salt every retry",
            {"guard": {**budget, "salt_reuse": {"enabled": False}}},
        ),
        ("gateway, salt reuse (default)", {"guard": budget}),
    ]
    for seed, (name, config) in enumerate(runs, start=int(time.time()) % 10_000 * 10):
        queries0 = vllm_counter(vllm_url, "vllm:prefix_cache_queries_total")
        hits0 = vllm_counter(vllm_url, "vllm:prefix_cache_hits_total")
        prompt0 = vllm_counter(vllm_url, "vllm:prompt_tokens_total")
        if config is None:
            client = openai.OpenAI(base_url=vllm_url + "/v1", api_key="x", max_retries=0)
            results = run_workload(client, MODEL_NAME, seed=seed, extra_body=poison, **shape)
        else:
            with GatewayProcess(vllm_url, f"workload-{seed}", **config) as gw:
                client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
                results = run_workload(client, MODEL_NAME, seed=seed, extra_body=poison, **shape)
        queries = vllm_counter(vllm_url, "vllm:prefix_cache_queries_total") - queries0
        hits = vllm_counter(vllm_url, "vllm:prefix_cache_hits_total") - hits0
        prompt = vllm_counter(vllm_url, "vllm:prompt_tokens_total") - prompt0
        recomputed = prompt - hits
        corrupt = sum(is_corrupt(r.text) for r in results)
        retries = sum(r.attempts - 1 for r in results) / len(results)
        lines.append(
            f"| {name} | {len(results)} | {corrupt} ({corrupt / len(results):.1%}) "
            f"| {retries:.3f} | {recomputed:.0f} | {hits / queries if queries else 0:.1%} |"
        )
    return lines


# -- detectors ----------------------------------------------------------------------------


def detector_section() -> list[str]:
    detector = Detector(DetectorSettings())
    words = ["the", "quick", "brown", "fox", "clicks", "the", "submit", "button", "(120, 450)"]
    lines = ["## Detector cost per response (whole body: parse + all detectors)", ""]
    lines.append("| output | µs per response |")
    lines.append("|---|---|")
    for tokens in (100, 4000):
        text = " ".join(words[i % len(words)] + str(i % 7) for i in range(tokens))
        body = orjson.dumps(
            {"choices": [{"index": 0, "message": {"content": text}, "finish_reason": "stop"}]}
        )

        def run(b: bytes = body) -> None:
            detector.inspect_body(orjson.loads(b))

        n = 2000 if tokens == 100 else 200
        best = min(timeit.repeat(run, number=n, repeat=5)) / n
        lines.append(f"| {tokens} tokens (~{len(text)} chars) | {best * 1e6:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer requests (CI smoke run)")
    parser.add_argument(
        "--only", choices=["latency", "workload", "detectors"], help="run one section"
    )
    args = parser.parse_args()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    external = os.environ.get("VLLM_GUARD_BENCH_VLLM_URL")
    server = None
    if external:
        vllm_url = external.rstrip("/")
    else:
        server = VLLMServer(ensure_model(ARTIFACTS / "tiny-model"), ARTIFACTS / "vllm.log")
        server.start()
        server.wait_ready()
        vllm_url = server.url
    try:
        out = [
            f"# vllm-guard benchmark ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)",
            "",
        ]
        chosen = {
            "latency": lambda: latency_section(vllm_url, args.quick),
            "workload": lambda: workload_section(vllm_url, args.quick),
            "detectors": detector_section,
        }
        for name, section_fn in chosen.items():
            if args.only not in (None, name):
                continue
            section = [*section_fn(), ""]
            out += section
            print("\n".join(section), flush=True)
        (ARTIFACTS / "report.md").write_text("\n".join(out) + "\n")
        print(f"\nreport written to {ARTIFACTS / 'report.md'}")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
