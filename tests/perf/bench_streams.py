"""A thousand open streams through one gateway process, against a bare aiohttp proxy.

    .venv/bin/python tests/perf/bench_streams.py [--streams 1000] [--rounds 2]

Agents keep long streams open. The fast stub (bench_proxy's) answers every request
with a token-paced stream: 20 text events 100 ms apart, then the finish, usage and
``[DONE]``. A loader in its own process opens all streams at once and records, per
stream, the first byte, the delays between tokens and the whole stream's time.
Per proxy (one process each; the gateway with its default settings, the bare
aiohttp pass-through proxy of bench_proxy), interleaved and repeated: streams/s,
first byte and stream time p50 / p99, p99 of the delay between tokens, CPU per
token (from /proc), RSS per open stream (peak VmRSS above the idle process's, first
round) and the connections the kernel dropped from full accept queues.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT))

from bench_gateway import GatewayProcess, ServiceProcess  # noqa: E402
from bench_proxy import STUB, aiohttp_peer  # noqa: E402

from gateway.tools.localvllm import free_port, wait_http  # noqa: E402

EVENTS_PER_STREAM = 20
GAP_S = 0.1

#: The loader: N streams at once from one process; prints one JSON line of samples.
LOADER = r"""
import asyncio, json, sys, time, aiohttp
url, streams = sys.argv[1], int(sys.argv[2])
body = json.dumps({"model": "stub", "stream": True, "user": "slow",
                   "messages": [{"role": "user", "content": "open the settings page"}]},
                  separators=(",", ":"))
async def one(session, out):
    started = time.perf_counter()
    first, last, gaps = None, None, []
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"content-type": "application/json"}) as response:
        assert response.status == 200, response.status
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            if b'"content":"word' in chunk:
                if first is None:
                    first = now - started
                elif last is not None:
                    gaps.append(now - last)
                last = now
    out.append((first or 0.0, time.perf_counter() - started, gaps))
async def main():
    out = []
    connector = aiohttp.TCPConnector(limit=streams)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        began = time.perf_counter()
        await asyncio.gather(*(one(session, out) for _ in range(streams)))
        wall = time.perf_counter() - began
    print(json.dumps({"wall": wall, "first": [o[0] for o in out], "total": [o[1] for o in out],
                      "gaps": [g for o in out for g in o[2]]}))
asyncio.run(main())
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_kib(proxy: ServiceProcess) -> int:
    """Resident set of the proxy's largest process now (VmRSS)."""
    best = 0
    for pid in proxy.pids():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                best = max(best, int(line.split()[1]))
    return best


def listen_overflows() -> int:
    """TcpExtListenOverflows: connections dropped because an accept queue was full."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=True):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=True))
            return int(table["ListenOverflows"])
    return 0


def run_once(proxy: ServiceProcess, streams: int) -> dict[str, float]:
    idle = rss_kib(proxy)
    cpu_before = proxy.cpu_seconds()
    overflows_before = listen_overflows()
    # The samples go to a file: a pipe left unread while the streams run would fill
    # and stop the loader.
    with tempfile.TemporaryFile() as samples:
        loader = subprocess.Popen(
            [sys.executable, "-c", LOADER, proxy.url, str(streams)], stdout=samples
        )
        peak = idle
        while loader.poll() is None:  # the resident set while the streams are open
            peak = max(peak, rss_kib(proxy))
            time.sleep(0.2)
        assert loader.returncode == 0
        samples.seek(0)
        result = json.loads(samples.read())
    cpu = proxy.cpu_seconds() - cpu_before
    dropped = listen_overflows() - overflows_before
    return {
        "streams_per_s": streams / result["wall"],
        "first_p50": pct(result["first"], 0.5) * 1000,
        "first_p99": pct(result["first"], 0.99) * 1000,
        "total_p50": pct(result["total"], 0.5),
        "total_p99": pct(result["total"], 0.99),
        "gap_p99": pct(result["gaps"], 0.99) * 1000,
        "cpu_per_token_us": cpu / (streams * EVENTS_PER_STREAM) * 1e6,
        "rss_per_stream_kib": (peak - idle) / streams,
        # Connections the kernel dropped from a full accept queue (any listener on
        # the host): each costs its client a 1 s SYN retransmit, which is first byte.
        "accept_drops": dropped,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(port)])
    stub_url = f"http://127.0.0.1:{port}"
    wait_http(stub_url + "/health", 30, stub)
    results: dict[str, list[dict[str, float]]] = {}
    first_token = {"guard": {"stream": {"release": "first_token"}}}
    try:
        with (
            GatewayProcess(stub_url, "streams-bench") as gateway,
            GatewayProcess(stub_url, "streams-bench-first", **first_token) as early,
            aiohttp_peer(stub_url) as peer,
        ):
            # The adaptive hold-back releases a stream after 20 visible characters: 4 of
            # these tokens, 300 ms of first byte by design; first_token releases at once.
            proxies = {
                "vllm-guard (adaptive)": gateway,
                "vllm-guard (first_token)": early,
                "aiohttp": peer,
            }
            results = {name: [] for name in proxies}
            for _ in range(args.rounds):  # interleaved
                for name, proxy in proxies.items():
                    results[name].append(run_once(proxy, args.streams))
                    print(name, results[name][-1], flush=True)
    finally:
        stub.terminate()
        stub.wait(timeout=10)
    keys = ["streams_per_s", "first_p50", "first_p99", "total_p50", "total_p99", "gap_p99",
            "cpu_per_token_us", "rss_per_stream_kib", "accept_drops"]  # fmt: skip
    lines = [
        f"## {args.streams} concurrent streams ({EVENTS_PER_STREAM} events "
        f"{GAP_S * 1000:.0f} ms apart), median of {args.rounds} rounds",
        "",
        "| proxy | streams/s | first byte p50 / p99 ms | stream p50 / p99 s "
        "| token gap p99 ms | CPU per token | RSS per open stream | accept drops |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        m = {k: statistics.median(r[k] for r in runs) for k in keys}
        # A process keeps the memory of its first thousand streams: later rounds'
        # growth says nothing. RSS per stream is the first round's, on a fresh process.
        m["rss_per_stream_kib"] = runs[0]["rss_per_stream_kib"]
        lines.append(
            f"| {name} | {m['streams_per_s']:.0f} | {m['first_p50']:.0f} / {m['first_p99']:.0f} "
            f"| {m['total_p50']:.2f} / {m['total_p99']:.2f} | {m['gap_p99']:.0f} "
            f"| {m['cpu_per_token_us']:.0f} µs | {m['rss_per_stream_kib']:.0f} KiB "
            f"| {m['accept_drops']:.0f} |"
        )
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
