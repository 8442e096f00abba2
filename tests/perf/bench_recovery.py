"""What a recovered answer costs the gateway: CPU per request, clean vs. recovered.

    .venv/bin/python tests/perf/bench_recovery.py [--rounds 3] [--requests 3000]

A stub backend answers a run of ``!`` to every request marked "poison" that has
no ``cache_salt``, and a clean answer otherwise, so each marked request is
recovered on its second attempt. Salt reuse is off (it would send later requests
with a remembered clean salt, and they would never degenerate) and the retry
budget is unlimited. Clean and recovered rounds are interleaved; the gateway's
CPU time comes from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT))

from bench_gateway import GatewayProcess  # noqa: E402
from bench_proxy import load, small_body  # noqa: E402

from gateway.tools.localvllm import free_port, wait_http  # noqa: E402

STUB = r"""
import sys, orjson
from aiohttp import web
def answer(text):
    return orjson.dumps({"id": "x", "object": "chat.completion", "model": "stub",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60,
                  "prompt_tokens_details": {"cached_tokens": 0}}})
CLEAN, DEGENERATE = answer("The button is at the top right."), answer("!" * 40)
async def chat(request):
    body = await request.read()
    poisoned = b'"poison"' in body and b"cache_salt" not in body
    return web.Response(body=DEGENERATE if poisoned else CLEAN, content_type="application/json")
async def health(request):
    return web.Response(text="")
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(port)])
    stub_url = f"http://127.0.0.1:{port}"
    wait_http(stub_url + "/health", 30, stub)
    clean = small_body(False)
    poisoned = orjson.dumps({**orjson.loads(clean), "user": "poison"})
    guard = {"budget": {"ratio": 1.0, "min_per_second": 1e6}, "salt_reuse": {"enabled": False}}
    try:
        with GatewayProcess(stub_url, "recovery-bench", guard=guard) as gateway:
            cpu = {"clean": 0.0, "recovered": 0.0}
            for _ in range(args.rounds):
                for name, body in (("clean", clean), ("recovered", poisoned)):
                    before = gateway.cpu_seconds()
                    asyncio.run(load(gateway.url, body, args.requests, 8))
                    cpu[name] += (gateway.cpu_seconds() - before) / args.requests / args.rounds
            recovered = gateway.metric_sum("vllm_guard_requests_total", verdict="recovered")
            assert recovered == args.rounds * args.requests, recovered
            extra = cpu["recovered"] - cpu["clean"]
            print("| answer | gateway CPU per request |\n|---|---|")
            print(f"| clean (1 attempt) | {cpu['clean'] * 1000:.3f} ms |")
            print(f"| recovered (2 attempts) | {cpu['recovered'] * 1000:.3f} ms |")
            print(f"\nthe second attempt costs {extra * 1000:.3f} ms "
                  f"({extra / cpu['clean']:.2f}x a whole clean request)")  # fmt: skip
    finally:
        stub.terminate()
        stub.wait(timeout=10)


if __name__ == "__main__":
    main()
