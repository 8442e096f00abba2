"""The gateway's own cost, against a fast stub backend (so only the proxy shows).

    .venv/bin/python tests/perf/bench_proxy.py [--rounds 3]

One gateway process (one worker) in front of an aiohttp stub that answers
instantly. Interleaved and repeated: small non-streaming requests (~1.3 KB body)
at c=1 and c=32, streams of 24 SSE events, and ~3 MB bodies (three base64
screenshots). Prints requests/s, p50/p99 direct and through the gateway, the
added latency, and the gateway's CPU time per request / per event (from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT))

from bench_gateway import ARTIFACTS, GatewayProcess, pct  # noqa: E402

from gateway.localvllm import free_port, wait_http  # noqa: E402

STUB = r"""
import sys, orjson
from aiohttp import web
BODY = orjson.dumps({"id": "x", "object": "chat.completion", "model": "stub",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "The button is at the top right."}}],
    "usage": {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60,
              "prompt_tokens_details": {"cached_tokens": 0}}})
def chunk(text):
    return b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "model": "stub",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}) + b"\n\n"
EVENTS = [chunk("")] + [chunk(f"word{i} ") for i in range(21)] + [
    b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":21}}\n\n',
    b"data: [DONE]\n\n"]
async def chat(request):
    body = await request.read()
    if b'"stream":true' in body:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in EVENTS:
            await response.write(event)
        return response
    return web.Response(body=BODY, content_type="application/json")
async def health(request):
    return web.Response(text="")
app = web.Application(client_max_size=64 * 1024 * 1024)
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


@dataclass
class Run:
    rps: float
    latencies: list[float]


def small_body(stream: bool) -> bytes:
    text = "click the submit button at the bottom of the settings page " * 20  # ~1.2 KB
    return orjson.dumps(
        {"model": "stub", "messages": [{"role": "user", "content": text}], "stream": stream}
    )


def large_body() -> bytes:
    rng = random.Random(0)
    shots = [base64.b64encode(rng.randbytes(780_000)).decode() for _ in range(3)]  # ~3.1 MB
    content = [{"type": "text", "text": "what is on the screen?"}] + [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{s}"}} for s in shots
    ]
    return orjson.dumps({"model": "stub", "messages": [{"role": "user", "content": content}]})


async def load(url: str, body: bytes, requests: int, concurrency: int) -> Run:
    latencies: list[float] = []
    queue = list(range(requests))
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while queue:
                queue.pop()
                started = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", data=body,
                                        headers=headers) as response:  # fmt: skip
                    await response.read()
                    assert response.status == 200
                latencies.append(time.perf_counter() - started)

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Run(requests / (time.perf_counter() - began), latencies)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(port)])
    stub_url = f"http://127.0.0.1:{port}"
    wait_http(stub_url + "/health", 30, stub)
    env_note = os.environ.get("MALLOC_TRIM_THRESHOLD_", "unset")
    scenarios = [
        ("small, c=1", small_body(False), 1, 1000, 1),
        ("small, c=32", small_body(False), 32, 3000, 1),
        ("stream 24 events, c=1", small_body(True), 1, 500, 24),
        ("stream 24 events, c=32", small_body(True), 32, 1500, 24),
        ("3 MB body, c=1", large_body(), 1, 40, 1),
    ]
    try:
        with GatewayProcess(
            stub_url, "proxy-bench", guard={"stream": {"holdback_chars": 32}}
        ) as gw:
            lines = [
                "| scenario | direct req/s | gateway req/s | direct p50 / p99 ms "
                "| gateway p50 / p99 ms | added p50 ms | p99/p50 | gateway CPU per request "
                "| per event |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for name, body, concurrency, requests, events in scenarios:
                direct: list[Run] = []
                through: list[Run] = []
                cpu = 0.0
                for _ in range(args.rounds):  # interleaved
                    direct.append(asyncio.run(load(stub_url, body, requests, concurrency)))
                    before = gw.cpu_seconds()
                    through.append(asyncio.run(load(gw.url, body, requests, concurrency)))
                    cpu += gw.cpu_seconds() - before
                d = [x for r in direct for x in r.latencies]
                g = [x for r in through for x in r.latencies]
                per_request = cpu / (requests * args.rounds)
                d50, d99, g50, g99 = pct(d, 0.5), pct(d, 0.99), pct(g, 0.5), pct(g, 0.99)
                per_event = f"{per_request / events * 1e6:.0f} µs" if events > 1 else "-"
                lines.append(
                    f"| {name} | {sum(r.rps for r in direct) / len(direct):.0f} "
                    f"| {sum(r.rps for r in through) / len(through):.0f} "
                    f"| {d50 * 1000:.2f} / {d99 * 1000:.2f} | {g50 * 1000:.2f} / {g99 * 1000:.2f} "
                    f"| {(g50 - d50) * 1000:+.2f} | {g99 / g50:.1f} "
                    f"| {per_request * 1000:.2f} ms | {per_event} |"
                )
                print(lines[-1], flush=True)
        report = "\n".join(
            [f"## Gateway's own cost vs. a fast stub (1 worker, MALLOC_TRIM_THRESHOLD_={env_note})",
             "", *lines]
        )  # fmt: skip
        (ARTIFACTS / "proxy-report.md").write_text(report + "\n")
        print("\n" + report)
    finally:
        stub.terminate()
        stub.wait(timeout=10)


if __name__ == "__main__":
    main()
