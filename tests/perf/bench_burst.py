"""A burst of new requests: when does each reach the backend, direct and through a proxy?

    make bench-burst   # or: taskset -c 0 .venv/bin/python tests/perf/bench_burst.py
                       #       [--requests 64] [--bursts 12] [--rounds 2]
                       #       [--peers tree=/path/to/another/checkout]

``vllm bench serve`` gives every stream the same length, so c streams end in one
engine step and the next c requests arrive together; a production workload does
the same whenever a batch of agents is started at once. A request that reaches vLLM
after the engine has begun a step waits for the next one, so the time to the first
token depends on how long the gateway takes to pass the whole burst on, not only on
its cost per request.

The stub (aiohttp) records when each request's body has arrived; the client opens
``--requests`` keep-alive connections, then sends that many requests at once, a
burst at a time, and reads each answer (two events). Per burst: when the first,
the median and the last request arrived, counted from the moment the client began
sending; medians over bursts. The proxy runs alone on core 1, the stub and the client
on core 0 (bench_event_rate's ``CPUS``; the client is this process: ``make bench-burst``
starts it under ``taskset -c 0``), the same for every route; routes interleave,
``--rounds`` times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT))

from bench_event_rate import CPUS, pinned  # noqa: E402
from bench_gateway import ARTIFACTS, GatewayProcess, ServiceProcess  # noqa: E402
from bench_proxy import aiohttp_peer  # noqa: E402

from gateway.tools.localvllm import free_port, wait_http  # noqa: E402

#: Answers at once (two events) and keeps each request's arrival for /arrivals.
STUB = r"""
import sys, time
from aiohttp import web
arrivals = []
HEAD = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"stub",'
        b'"choices":[{"index":0,')
async def chat(request):
    await request.read()
    arrivals.append(time.perf_counter())
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await response.write(HEAD + b'"delta":{"role":"assistant","content":" hi"},'
                         b'"finish_reason":null}]}\n\n')
    await response.write(HEAD + b'"delta":{"content":" there"},"finish_reason":"stop"}]}\n\n'
                         b"data: [DONE]\n\n")
    return response
async def taken(request):
    global arrivals
    answer, arrivals = arrivals, []
    return web.json_response(answer)
async def health(request):
    return web.Response(text="")
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/arrivals", taken)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None,
            backlog=4096)
"""


async def bursts(url: str, stub_url: str, requests: int, count: int) -> list[list[float]]:
    """Arrival offsets (ms, sorted) of each burst's requests at the stub."""
    prompt = ("open the settings page " * 100)[:2200]  # bench serve's prompts are ~2 KB
    body = json.dumps(
        {"model": "stub", "stream": True, "max_tokens": 8,
         "messages": [{"role": "user", "content": prompt}]}
    )  # fmt: skip
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=requests)
    offsets: list[list[float]] = []
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one() -> None:
            async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as r:
                assert r.status == 200, r.status
                await r.read()

        async def arrivals() -> list[float]:
            async with session.get(stub_url + "/arrivals") as r:
                return sorted(await r.json())

        await asyncio.gather(*(one() for _ in range(requests)))  # the connections, warm
        await arrivals()
        for _ in range(count):
            began = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(requests)))
            offsets.append([(t - began) * 1000 for t in await arrivals()])
            await asyncio.sleep(0.05)
    return offsets


def summary(runs: list[list[float]]) -> dict[str, float]:
    return {
        "first": statistics.median(r[0] for r in runs),
        "median": statistics.median(statistics.median(r) for r in runs),
        "last": statistics.median(r[-1] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64, help="requests in a burst")
    parser.add_argument("--bursts", type=int, default=12, help="bursts per route and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peers", default="", help="aiohttp, tree=<checkout>")
    args = parser.parse_args()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    stub = subprocess.Popen(["taskset", "-c", CPUS["load"], sys.executable, "-c", STUB, str(port)])
    stub_url = f"http://127.0.0.1:{port}"
    wait_http(stub_url + "/health", 30, stub)
    proxies: dict[str, ServiceProcess] = {
        "gateway, guard off": GatewayProcess(stub_url, "burst-off", guard={"mode": "off"}),
        "gateway, defaults": GatewayProcess(stub_url, "burst-default"),
    }
    for peer in filter(None, args.peers.split(",")):
        if peer == "aiohttp":
            proxies["bare aiohttp proxy"] = aiohttp_peer(stub_url)
        elif peer.startswith("tree="):
            for label, config in (("guard off", {"guard": {"mode": "off"}}), ("defaults", {})):
                other = GatewayProcess(stub_url, f"burst-tree-{label[:3]}", **config)
                other.cwd = peer.removeprefix("tree=")
                proxies[f"tree, {label}"] = other
    results: dict[str, list[list[float]]] = {"direct": []}
    started: list[ServiceProcess] = []
    try:
        for proxy in proxies.values():
            started.append(pinned(proxy).__enter__())
        routes = {"direct": stub_url, **{name: p.url for name, p in proxies.items()}}
        for round_number in range(args.rounds):
            names = list(routes)
            order = names[round_number % len(names) :] + names[: round_number % len(names)]
            for name in order:
                runs = asyncio.run(bursts(routes[name], stub_url, args.requests, args.bursts))
                results.setdefault(name, []).extend(runs)
                print(name, {k: round(v, 2) for k, v in summary(runs).items()}, flush=True)
    finally:
        for proxy in started:
            proxy.__exit__(None, None, None)
        stub.terminate()
        stub.wait(timeout=10)
    print_table(results, args)


def print_table(results: dict[str, list[list[float]]], args: Any) -> None:
    base = summary(results["direct"])
    print(
        f"\n## Bursts of {args.requests} new requests ({args.bursts * args.rounds} per route): "
        "when each reached the backend, ms after the client began sending (median over "
        "bursts)\n\n| route | first | median (x direct) | last (x direct) |\n|---|---|---|---|"
    )
    for name, runs in results.items():
        m = summary(runs)
        print(
            f"| {name} | {m['first']:.1f} | {m['median']:.1f} ({m['median'] / base['median']:.2f}x)"
            f" | {m['last']:.1f} ({m['last'] / base['last']:.2f}x) |"
        )


if __name__ == "__main__":
    main()
