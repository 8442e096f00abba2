"""The relay at GPU event rates, on CPUs: a stub that steps like a GPU engine (issue 42 item 0).

    make bench-event-rate   # or: .venv/bin/python tests/perf/bench_event_rate.py
                            #       [--concurrency 64,128] [--step-ms 12] [--rounds 3]
                            #       [--peers tree=/path/to/another/checkout]

On the lent H200, one gateway process at c=64 took 13% of vLLM's throughput and added
29% to the gap between tokens (ITL), at about 3,700 SSE events a second. This asks
whether the same loss appears without a GPU, so that it can be found and cut here.

The stub models what matters of vLLM's output path at that speed: one engine step
every ``--step-ms`` (12 ms: the H200's ITL p50 at c=64) produces one token for every
running stream at once, and the API server writes each stream's event in the same
loop pass, so events leave in bursts of c, not spread evenly. Where it differs: no
tokenizer, no scheduler; a stream's first token comes at the next step (vLLM's TTFT
includes a prefill step); every event is one token (MTP and ``--stream-interval`` put
several in one, fewer events for the same tokens: the easier case).

The loader keeps ``c`` streams open (a new one when one ends, as ``vllm bench serve
--max-concurrency`` does), each of ``--tokens`` text events, and records per stream
the first text event, the gaps between text events at the client, and the text
events per second over the run. Each proxy runs alone on core 1 (``taskset``); the
stub and the loader share core 0, the same for every route, so the ratio against
direct is the proxy's cost. Interleaved and repeated; prints medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT))

from bench_gateway import ARTIFACTS, GatewayProcess, ServiceProcess  # noqa: E402
from bench_proxy import aiohttp_peer  # noqa: E402

from gateway.tools.localvllm import free_port, wait_http  # noqa: E402

#: One engine step every STEP seconds gives every open stream its next event.
STUB = r"""
import asyncio, sys, orjson
from aiohttp import web
STEP = float(sys.argv[2])
HEAD = {"id": "chatcmpl-aa6e125256a909c4", "object": "chat.completion.chunk",
        "created": 1796319639, "model": "stub"}
def chunk(delta, finish=None):
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
              "token_ids": None}
    return b"data: " + orjson.dumps({**HEAD, "choices": [choice]}) + b"\n\n"
WORDS = [chunk({"content": f" word{i}"}) for i in range(4096)]
ROLE = chunk({"role": "assistant", "content": ""})
def tail(n):
    return (chunk({"content": "."}, finish="length") + b"data: " + orjson.dumps(
        {**HEAD, "choices": [], "usage": {"prompt_tokens": 5, "total_tokens": 5 + n,
         "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}})
        + b"\n\n" + b"data: [DONE]\n\n")
step = None
async def clock(app):
    async def tick():
        global step
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            step = loop.create_future()
            next_at += STEP
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            step.set_result(None)
    app["clock"] = asyncio.create_task(tick())
async def chat(request):
    body = orjson.loads(await request.read())
    tokens = body.get("max_tokens", 64)
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await step  # prefill: the first token comes with the next step
    await response.write(ROLE + WORDS[0])
    for i in range(1, tokens - 1):
        await step
        await response.write(WORDS[i % len(WORDS)])
    await step
    await response.write(tail(tokens))
    return response
async def health(request):
    return web.Response(text="")
app = web.Application()
app.on_startup.append(clock)
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None,
            backlog=4096)
"""

#: c streams open at a time, `total` in all; one JSON line of samples.
LOADER = r"""
import asyncio, json, sys, time, aiohttp
url, concurrency, total, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompt = ("open the settings page " * (int(sys.argv[5]) // 23 + 1))[:int(sys.argv[5])]
body = json.dumps({"model": "stub", "stream": True, "max_tokens": tokens,
                   "messages": [{"role": "user", "content": prompt}]},
                  separators=(",", ":"))
firsts, gaps, events = [], [], [0]
async def one(session):
    started = time.perf_counter()
    first = last = None
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"content-type": "application/json"}) as response:
        assert response.status == 200, response.status
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            n = chunk.count(b' word')
            if not n:
                continue
            events[0] += n
            if first is None:
                first = now - started
            else:
                gaps.append(now - last)
            last = now
    firsts.append(first)
left = [total]
async def client(session):
    while left[0] > 0:
        left[0] -= 1
        await one(session)
async def main():
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        began = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.perf_counter() - began
    print(json.dumps({"wall": wall, "events": events[0], "first": firsts, "gaps": gaps}))
asyncio.run(main())
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_once(
    url: str, proxy: ServiceProcess | None, concurrency: int, tokens: int, prompt_bytes: int
) -> dict[str, float]:
    cpu_before = proxy.cpu_seconds() if proxy else 0.0
    streams = concurrency * 4
    with tempfile.TemporaryFile() as samples:
        loader = [sys.executable, "-c", LOADER, url, str(concurrency), str(streams), str(tokens),
                  str(prompt_bytes)]  # fmt: skip
        subprocess.run(["taskset", "-c", CPUS["load"], *loader], stdout=samples, check=True)
        samples.seek(0)
        result = json.loads(samples.read())
    cpu = (proxy.cpu_seconds() - cpu_before) if proxy else 0.0
    return {
        "events_per_s": result["events"] / result["wall"],
        "ttft_p50": pct(result["first"], 0.5) * 1000,
        "itl_p50": pct(result["gaps"], 0.5) * 1000,
        "itl_p99": pct(result["gaps"], 0.99) * 1000,
        "cpu_per_event_us": cpu / result["events"] * 1e6,
        "cpu_share": cpu / result["wall"],
        "cpu_per_request_us": cpu / streams * 1e6,
    }


#: Cores for the proxy under test and for the stub and the loader (--proxy-cpus, --load-cpus).
CPUS = {"proxy": "1", "load": "0"}


def pinned(proxy: ServiceProcess) -> ServiceProcess:
    """The proxy alone on its cores: its cost shows as lost rate, not as the loader's."""
    proxy.command = ["taskset", "-c", CPUS["proxy"], *proxy.command]
    return proxy


def profiled(proxy: ServiceProcess | None, out: str) -> subprocess.Popen[bytes] | None:
    """py-spy's collapsed stacks of ``proxy`` for the next few seconds (``--profile``:
    ``tests/perf/gpu/report.py profile`` splits them into reading, parsing,
    inspection, writing and the event loop)."""
    if not out or proxy is None or proxy.process is None:
        return None
    command = ["py-spy", "record", "--nonblocking", "-r", "250", "-d", "4", "-f", "raw",
               "-o", out, "-p", str(proxy.process.pid)]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", default="64,128")
    parser.add_argument("--step-ms", type=float, default=12.0)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    # vllm bench serve's prefix_repetition prompts (512 + 32 tokens) are ~2 KB of text.
    parser.add_argument("--prompt-bytes", type=int, default=22, help="the user message's size")
    parser.add_argument("--peers", default="", help="aiohttp, workers2, tree=<checkout>")
    parser.add_argument("--proxy-cpus", default="1", help="taskset list for each proxy")
    parser.add_argument("--load-cpus", default="0", help="taskset list for the stub and loader")
    parser.add_argument("--profile", default="", help="py-spy output of the guard-off proxy")
    args = parser.parse_args()
    CPUS.update(proxy=args.proxy_cpus, load=args.load_cpus)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)  # the proxies' logs
    port = free_port()
    step_s = str(args.step_ms / 1000)
    stub_command = [sys.executable, "-c", STUB, str(port), step_s]
    stub = subprocess.Popen(["taskset", "-c", CPUS["load"], *stub_command])
    stub_url = f"http://127.0.0.1:{port}"
    wait_http(stub_url + "/health", 30, stub)
    proxies: dict[str, ServiceProcess] = {
        "guard off": pinned(GatewayProcess(stub_url, "rate-off", guard={"mode": "off"})),
        "default": pinned(GatewayProcess(stub_url, "rate-default")),
    }
    for peer in filter(None, args.peers.split(",")):
        if peer == "aiohttp":
            proxies["aiohttp"] = pinned(aiohttp_peer(stub_url))
        elif peer == "workers2":
            proxies["guard off, 2 workers"] = pinned(
                GatewayProcess(stub_url, "rate-w2", guard={"mode": "off"}, server={"workers": 2})
            )
        elif peer.startswith("tree="):
            other = pinned(GatewayProcess(stub_url, "rate-tree-off", guard={"mode": "off"}))
            other.cwd = peer.removeprefix("tree=")
            proxies["tree, guard off"] = other
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    started: list[ServiceProcess] = []
    try:
        for proxy in proxies.values():
            started.append(proxy.__enter__())
        for round_number in range(args.rounds):  # interleaved
            for c in levels:
                routes: dict[str, tuple[str, ServiceProcess | None]] = {"direct": (stub_url, None)}
                routes.update({name: (p.url, p) for name, p in proxies.items()})
                for name, (url, proxy) in routes.items():
                    last = round_number == args.rounds - 1 and c == levels[-1]
                    spy = profiled(proxy, args.profile) if last and name == "guard off" else None
                    sample = run_once(url, proxy, c, args.tokens, args.prompt_bytes)
                    if spy is not None:
                        spy.wait(timeout=60)
                    results.setdefault((c, name), []).append(sample)
                    print(c, name, {k: round(v, 2) for k, v in sample.items()}, flush=True)
    finally:
        for proxy in started:
            proxy.__exit__(None, None, None)
        stub.terminate()
        stub.wait(timeout=10)
    print_table(results, levels, args)


def print_table(
    results: dict[tuple[int, str], list[dict[str, float]]], levels: list[int], args: Any
) -> None:
    keys = ["events_per_s", "ttft_p50", "itl_p50", "itl_p99", "cpu_per_event_us", "cpu_share"]
    print(
        f"\n## A GPU-paced stub (a step every {args.step_ms:g} ms, {args.tokens} tokens a "
        f"stream), proxy alone on cores {args.proxy_cpus}; median of {args.rounds} rounds\n\n"
        "| c | route | text events/s (x direct) | TTFT p50 ms (x) | ITL p50 ms (x) "
        "| ITL p99 ms (x) | proxy CPU per event | proxy core busy |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for c in levels:
        base = {k: statistics.median(r[k] for r in results[(c, "direct")]) for k in keys}
        for (level, name), runs in results.items():
            if level != c:
                continue
            m = {k: statistics.median(r[k] for r in runs) for k in keys}

            def ratio(key: str, m: dict[str, float] = m, base: dict[str, float] = base) -> str:
                return f"{m[key]:.1f} ({m[key] / base[key]:.2f}x)" if base[key] else f"{m[key]:.1f}"

            cpu = "-" if name == "direct" else f"{m['cpu_per_event_us']:.0f} µs"
            busy = "-" if name == "direct" else f"{m['cpu_share']:.0%}"
            print(
                f"| {c} | {name} | {ratio('events_per_s')} | {ratio('ttft_p50')} "
                f"| {ratio('itl_p50')} | {ratio('itl_p99')} | {cpu} | {busy} |"
            )


if __name__ == "__main__":
    main()
