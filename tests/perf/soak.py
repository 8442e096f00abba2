"""Soak: 10,000 requests at concurrency 32 through the gateway, streaming and not,
against a real (tiny) vLLM with its prefix cache poisoned.

    .venv/bin/python tests/perf/soak.py [--requests 10000] [--concurrency 32] [--mixed]

Checks and prints: every request answered exactly once, degenerate answers
delivered vs. what the metrics count as delivered after the guard gave up,
gateway-made 5xx, and the gateway's RSS after warm-up and at the end.
Uses VLLM_GUARD_BENCH_VLLM_URL when set, else starts the tiny vLLM itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "perf"))

from bench_gateway import ARTIFACTS, GatewayProcess  # noqa: E402
from support.servers import MODEL_NAME, VLLMServer, ensure_model  # noqa: E402
from support.workload import WORDS, is_corrupt  # noqa: E402

from gateway.config import DetectorSettings  # noqa: E402
from gateway.detect import Detector  # noqa: E402

GATEWAY_ERROR_TYPES = {
    "upstream_error", "degenerate_response", "service_unavailable", "timeout", "internal_error",
}  # fmt: skip


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


#: --mixed (issue 39): tokens before a mid-stream '!' run or a loop of the last
#: LOOP_UNIT tokens (the scheduler's vg_poison_after / vg_loop_after), answers of
#: MIXED_MAX_TOKENS (room for the detector's 16 copies), and every other stream
#: packed LOOP_UNIT + 1 tokens an event (vLLM's stream_interval: the burst).
MIXED_HEALTHY, LOOP_UNIT, MIXED_MAX_TOKENS = 8, 3, 80
LOOP_DETECTOR = Detector(DetectorSettings())


def delivered_corrupt(text: str) -> bool:
    """Empty, a run of '!' (what the scheduler's poison produces), or a loop."""
    return is_corrupt(text) or LOOP_DETECTOR.token_loop(text)


def mixed_poison(i: int, stream: bool) -> tuple[dict[str, object], dict[str, object]]:
    """Request i's poison (vllm_xargs) and extra fields in the --mixed soak: a quarter
    turn to '!' after a healthy start, a quarter fall into a loop, half are poisoned
    at the 5% cache-hit rate; half the streams arrive several tokens an event."""
    pair = i // 2  # request i is streamed when odd: each kind gets both
    kind = pair % 4
    if kind == 0:
        poison: dict[str, object] = {"vg_poison_after": MIXED_HEALTHY}
    elif kind == 2:
        poison = {"vg_loop_after": MIXED_HEALTHY, "vg_loop_unit": LOOP_UNIT}
    else:
        poison = {"vg_poison_rate": 0.05}
    burst = {"stream_interval": LOOP_UNIT + 1} if stream and pair % 8 >= 4 else {}
    return poison, burst


async def soak(
    url: str,
    requests: int,
    concurrency: int,
    pid: int,
    poison_after: int = 0,
    mixed: bool = False,
) -> dict[str, object]:
    rng = random.Random(7)
    systems = [" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(120)]
    answered: Counter[int] = Counter()
    statuses: Counter[int] = Counter()
    gateway_5xx = 0
    corrupt_delivered = 0
    verdicts: Counter[str] = Counter()
    queue = list(range(requests))
    rss: dict[str, float] = {}

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal gateway_5xx, corrupt_delivered
        stream = i % 2 == 1
        # --poison-after N: half the requests turn to "!" after N healthy tokens
        # (the mid-generation model), on 32-token answers: streams the gateway has
        # released by then must be continued, whole answers retried.
        poison: dict[str, object] = {"vg_poison_rate": 0.05}
        extra: dict[str, object] = {}
        if poison_after and i % 4 < 2:  # half of them streamed
            poison = {"vg_poison_after": poison_after}
        if mixed:
            poison, extra = mixed_poison(i, stream)
        max_tokens = MIXED_MAX_TOKENS if mixed else 32 if poison_after else 8
        body = {
            "model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "ignore_eos": bool(poison_after or mixed),
            "messages": [{"role": "system", "content": systems[i % len(systems)]},
                         {"role": "user", "content": f"step {i // len(systems)}"}],
            "vllm_xargs": poison, **extra,
        }  # fmt: skip
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            raw = await response.read()
            statuses[response.status] += 1
            answered[i] += 1
            verdicts[response.headers.get("x-vllm-guard-verdict", "none")] += 1
            if response.status >= 500:
                error = orjson.loads(raw).get("error", {}) if raw.startswith(b"{") else {}
                gateway_5xx += error.get("type") in GATEWAY_ERROR_TYPES
                return
            if stream:
                text = "".join(
                    (c.get("delta") or {}).get("content") or ""
                    for line in raw.split(b"\n\n")
                    if line.startswith(b"data: {")
                    for c in orjson.loads(line[6:]).get("choices", [])
                )
            else:
                text = orjson.loads(raw)["choices"][0]["message"]["content"] or ""
            corrupt_delivered += delivered_corrupt(text)

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop()
            if requests - len(queue) == 1000 and "warm" not in rss:
                rss["warm"] = rss_mib(pid)
            await one(session, i)

    started = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    rss["end"] = rss_mib(pid)
    return {
        "duration_s": time.perf_counter() - started,
        "answered_once": sum(1 for n in answered.values() if n == 1),
        "answered_twice_or_more": sum(1 for n in answered.values() if n > 1),
        "statuses": dict(statuses),
        "verdicts": dict(verdicts),
        "gateway_5xx": gateway_5xx,
        "corrupt_delivered": corrupt_delivered,
        "rss_mib": rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--poison-after", type=int, default=0, help="mid-stream poison (tokens)")
    parser.add_argument(
        "--mixed", action="store_true",
        help="'!' runs and loops after a healthy start, paced and packed streams (issue 39)",
    )  # fmt: skip
    args = parser.parse_args()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    server = None
    vllm_url = os.environ.get("VLLM_GUARD_BENCH_VLLM_URL", "").rstrip("/")
    if not vllm_url:
        server = VLLMServer(ensure_model(ARTIFACTS / "tiny-model"), ARTIFACTS / "vllm.log")
        server.start()
        server.wait_ready()
        vllm_url = server.url
    try:
        with GatewayProcess(vllm_url, "soak") as gateway:
            assert gateway.process is not None
            result = asyncio.run(
                soak(
                    gateway.url,
                    args.requests,
                    args.concurrency,
                    gateway.process.pid,
                    args.poison_after,
                    args.mixed,
                )
            )
            delivered_metric = gateway.metric_sum("vllm_guard_degenerate_delivered_total")
            exhausted = gateway.metric_sum("vllm_guard_retries_refused_total")
            recovered = gateway.metric_sum("vllm_guard_requests_total", verdict="recovered")
            continued = gateway.metric_sum("vllm_guard_continuations_total", outcome="clean")
            cut = gateway.metric_sum("vllm_guard_stream_cut_total")
        print(f"requests:            {args.requests} at concurrency {args.concurrency}")
        print(f"duration:            {result['duration_s']:.1f} s")
        print(f"answered once:       {result['answered_once']}")
        print(f"answered 2+ times:   {result['answered_twice_or_more']}")
        print(f"statuses:            {result['statuses']}")
        print(f"verdicts:            {result['verdicts']}")
        print(f"recovered (metrics): {recovered:.0f}; continued after release {continued:.0f}, "
              f"streams cut {cut:.0f}")  # fmt: skip
        print(f"corrupt delivered:   {result['corrupt_delivered']} "
              f"(metrics: {delivered_metric:.0f} delivered after the guard gave up; "
              f"budget exhausted {exhausted:.0f} times)")  # fmt: skip
        print(f"gateway-made 5xx:    {result['gateway_5xx']}")
        print(f"gateway RSS (MiB):   {result['rss_mib']}")
        ok = (
            result["answered_once"] == args.requests
            and result["gateway_5xx"] == 0
            and result["corrupt_delivered"] <= delivered_metric
        )
        print("SOAK PASSED" if ok else "SOAK FAILED")
        sys.exit(0 if ok else 1)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
