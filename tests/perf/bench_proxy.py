"""The gateway's own cost against a fast stub backend, beside nginx and LiteLLM.

    make bench-proxy        # installs nginx (Debian) and LiteLLM (own venv) if missing
    .venv/bin/python tests/perf/bench_proxy.py [--rounds 3] [--peers nginx,litellm,redis,tracing]
                                               [--peers tree=/path/to/another/checkout]

Every proxy is one process in front of the same aiohttp stub that answers
instantly, so only the proxy's own cost shows. Interleaved and repeated: small
non-streaming requests (~1.3 KB body) at c=1 and c=32, streams of 24 SSE events
(vLLM 0.32's own event bytes) written at once or paced (a token every 2 ms, as
vLLM streams them: each event its own network read), and ~3 MB bodies (three
base64 screenshots). Peer ``redis``: the gateway again with ``state.redis_url`` (a
local redis-server), for the cost of shared conversation memory. Peer ``tracing``: the
gateway with ``tracing.enabled``, every request sampled, exporting OTLP/HTTP to a
local sink that answers every export at once (its own process: the gateway's cost
includes building, batching and sending the spans, from its export thread). Prints
requests/s, p50/p99, the added latency against going direct, and each proxy's CPU
time per request / per event (from /proc), in one table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench_gateway import ARTIFACTS, GatewayProcess, ServiceProcess, pct  # noqa: E402
from support.servers import RunningRedis  # noqa: E402

from gateway.tools.localvllm import free_port, wait_http  # noqa: E402

STUB = r"""
import asyncio, sys, orjson
from aiohttp import web
BODY = orjson.dumps({"id": "x", "object": "chat.completion", "model": "stub",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "The button is at the top right."}}],
    "usage": {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60,
              "prompt_tokens_details": {"cached_tokens": 0}}})
# Events as vLLM 0.32 writes them (key order and null fields read off a real server).
HEAD = {"id": "chatcmpl-aa6e125256a909c4", "object": "chat.completion.chunk",
        "created": 1796319639, "model": "stub"}
def chunk(delta, finish=None, logprobs=None):
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
              "token_ids": None}
    return b"data: " + orjson.dumps({**HEAD, "choices": [choice]}) + b"\n\n"
def sampled(text):  # a request that asked for logprobs: the sampled token's, as vLLM
    return {"content": [{"token": text, "logprob": -0.25, "bytes": list(text.encode()),
                         "top_logprobs": []}]}
EVENTS = [chunk({"role": "assistant", "content": ""})] + [
    chunk({"content": f"word{i} "}) for i in range(20)] + [
    chunk({"content": "end."}, finish="stop"),
    b"data: " + orjson.dumps({**HEAD, "choices": [], "usage": {"prompt_tokens": 5,
        "total_tokens": 26, "completion_tokens": 21,
        "prompt_tokens_details": {"cached_tokens": 0}}}) + b"\n\n",
    b"data: [DONE]\n\n"]
EVENTS_WITH_LOGPROBS = [EVENTS[0]] + [
    chunk({"content": f"word{i} "}, logprobs=sampled(f"word{i} ")) for i in range(20)] + [
    chunk({"content": "end."}, finish="stop", logprobs=sampled("end.")), *EVENTS[-2:]]
async def chat(request):
    body = await request.read()
    if b'"stream":true' in body:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        paced = b'"user":"paced"' in body
        # "slow": an agent's long stream (bench_streams), a token every 100 ms.
        gap = 0.1 if b'"user":"slow"' in body else 0.002
        events = EVENTS_WITH_LOGPROBS if b'"logprobs":true' in body else EVENTS
        for i, event in enumerate(events):
            await response.write(event)
            if (paced or gap > 0.002) and i < len(EVENTS) - 3:  # usage, [DONE], end at once
                await asyncio.sleep(gap)
        return response
    return web.Response(body=BODY, content_type="application/json")
async def health(request):
    return web.Response(text="")
app = web.Application(client_max_size=64 * 1024 * 1024)
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/health", health)
# backlog: aiohttp's default (128) drops connections when a thousand streams open at
# once (bench_streams), and a dropped SYN costs the client a 1 s retransmit.
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None,
            backlog=4096)
"""


#: The floor for a Python proxy: aiohttp server + aiohttp client, bodies and events
#: relayed chunk by chunk, nothing inspected. The gateway's target is 1.2x its CPU.
AIOHTTP_PROXY = r"""
import sys, aiohttp
from aiohttp import web
UPSTREAM = sys.argv[2]
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
async def proxy(request):
    session = request.app["session"]
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    async with session.request(request.method, UPSTREAM + request.path_qs, data=body,
                               headers=headers) as upstream:
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
        response = web.StreamResponse(status=upstream.status, headers=out)
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response
async def start(app):
    app["session"] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=512), auto_decompress=False)
async def stop(app):
    await app["session"].close()
app = web.Application(client_max_size=64 * 1024 * 1024)
app.on_startup.append(start)
app.on_cleanup.append(stop)
app.router.add_route("*", "/{tail:.*}", proxy)
# backlog: aiohttp's default (128) drops connections when a thousand streams open at
# once (bench_streams), and a dropped SYN costs the client a 1 s retransmit.
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None,
            backlog=4096)
"""


#: The floor for a proxy on the gateway's own server stack: uvicorn (httptools,
#: uvloop) + a bare ASGI callable + aiohttp client, events relayed as they arrive,
#: no disconnect watcher, nothing inspected. The gap between this and AIOHTTP_PROXY
#: is the server stack's; the gap between the gateway and this is the gateway's.
ASGI_PROXY = r"""
import sys, aiohttp, uvicorn
UPSTREAM = sys.argv[2]
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"host"}
session = None
async def app(scope, receive, send):
    global session
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=512), auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k not in HOP]
    path = scope["path"] + ("?" + scope["query_string"].decode() if scope["query_string"] else "")
    async with session.request(scope["method"], UPSTREAM + path, data=body,
                               headers=headers) as upstream:
        out = [(k.encode(), v.encode()) for k, v in upstream.headers.items()
               if k.lower().encode() not in HOP]
        await send({"type": "http.response.start", "status": upstream.status, "headers": out})
        async for chunk in upstream.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            access_log=False, http="httptools", loop="uvloop")
"""


def asgi_peer(stub_url: str) -> ServiceProcess:
    port = free_port()
    command = [sys.executable, "-c", ASGI_PROXY, str(port), stub_url]
    return ServiceProcess("peer-asgi", command, port, "/health")


def aiohttp_peer(stub_url: str) -> ServiceProcess:
    port = free_port()
    command = [sys.executable, "-c", AIOHTTP_PROXY, str(port), stub_url]
    return ServiceProcess("peer-aiohttp", command, port, "/health")


LITELLM_VENV = Path(os.environ.get("LITELLM_VENV", Path.home() / ".cache/vllm-guard/litellm-venv"))
NGINX_CONF = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_max_body_size 64m;
  client_body_buffer_size 4m;
  upstream stub {{ server 127.0.0.1:{stub}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://stub;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""


def nginx_peer(stub_port: int) -> ServiceProcess:
    directory = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
    port = free_port()
    conf = directory / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=directory, stub=stub_port, port=port))
    command = ["nginx", "-c", str(conf), "-p", str(directory), "-g", "daemon off;"]
    return ServiceProcess("peer-nginx", command, port, "/health")


def litellm_peer(stub_url: str) -> ServiceProcess:
    directory = Path(tempfile.mkdtemp(prefix="bench-litellm-"))
    port = free_port()
    config = directory / "config.yaml"
    config.write_text(
        "model_list:\n  - model_name: stub\n    litellm_params:\n"
        f"      model: openai/stub\n      api_base: {stub_url}/v1\n      api_key: none\n"
    )
    command = [str(LITELLM_VENV / "bin" / "litellm"), "--config", str(config),
               "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]  # fmt: skip
    key = "sk-bench-" + "0" * 32
    return ServiceProcess(
        "peer-litellm", command, port, "/health/liveliness",
        env={"LITELLM_MASTER_KEY": key}, headers={"Authorization": f"Bearer {key}"},
    )  # fmt: skip


@dataclass
class Run:
    rps: float
    latencies: list[float]


def small_body(stream: bool, *, paced: bool = False) -> bytes:
    """~1.3 KB of chat request. ``paced``: the stub spaces its events 2 ms apart."""
    text = "click the submit button at the bottom of the settings page " * 20  # ~1.2 KB
    body = {"model": "stub", "messages": [{"role": "user", "content": text}], "stream": stream}
    if paced:
        body["user"] = "paced"
    return orjson.dumps(body)


def large_body() -> bytes:
    rng = random.Random(0)
    shots = [base64.b64encode(rng.randbytes(780_000)).decode() for _ in range(3)]  # ~3.1 MB
    content = [{"type": "text", "text": "what is on the screen?"}] + [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{s}"}} for s in shots
    ]
    return orjson.dumps({"model": "stub", "messages": [{"role": "user", "content": content}]})


async def load(
    url: str, body: bytes, requests: int, concurrency: int, auth: dict[str, str] | None = None
) -> Run:
    latencies: list[float] = []
    queue = list(range(requests))
    headers = {"content-type": "application/json", **(auth or {})}
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


#: An OTLP/HTTP sink for the ``tracing`` peer: every export accepted, nothing kept (an
#: empty ExportTraceServiceResponse is zero bytes of protobuf).
OTLP_SINK = r"""
import sys
from aiohttp import web
async def traces(request):
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")
app = web.Application(client_max_size=64 * 1024 * 1024)
app.router.add_post("/v1/traces", traces)
app.router.add_get("/health", lambda request: web.Response(text="ok"))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    peers_help = "comma list; '' for none"
    parser.add_argument("--peers", default="aiohttp,asgi,nginx,litellm", help=peers_help)
    parser.add_argument("--only", default="", help="scenario names containing this text")
    args = parser.parse_args()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(port)])
    stub_url = f"http://127.0.0.1:{port}"
    wait_http(stub_url + "/health", 30, stub)
    env_note = os.environ.get("MALLOC_TRIM_THRESHOLD_", "unset")
    large = large_body()
    scenarios = [
        ("small, c=1", small_body(False), 1, 1000, 1),
        ("small, c=32", small_body(False), 32, 3000, 1),
        ("stream 24 events, c=1", small_body(True), 1, 500, 24),
        ("stream 24 events, c=32", small_body(True), 32, 1500, 24),
        # As vLLM sends them: a token every 2 ms, each event its own network read.
        ("stream 24 events paced, c=1", small_body(True, paced=True), 1, 150, 24),
        ("stream 24 events paced, c=32", small_body(True, paced=True), 32, 900, 24),
        ("3 MB body, c=1", large, 1, 40, 1),
        ("3 MB body, c=32", large, 32, 320, 1),  # last: the peak RSS it leaves
    ]
    try:
        with ExitStack() as stack:
            gateway = stack.enter_context(GatewayProcess(stub_url, "proxy-bench"))
            proxies: list[tuple[str, ServiceProcess]] = [("vllm-guard", gateway)]
            peers = [p for p in args.peers.split(",") if p]
            if "redis" in peers:  # the gateway again, its conversation memory in Redis
                redis = RunningRedis(free_port(), ARTIFACTS / "redis.log")
                redis.start()
                stack.callback(redis.stop)
                shared = GatewayProcess(
                    stub_url, "proxy-bench-redis", state={"redis_url": redis.url}
                )
                proxies.append(("vllm-guard + Redis", stack.enter_context(shared)))
            for peer in peers:  # tree=<dir>: the gateway again, run from another checkout
                if peer.startswith("tree="):
                    tree = peer.removeprefix("tree=")
                    other = GatewayProcess(stub_url, "proxy-bench-tree")
                    # Its own tree first: -m puts the working directory ahead of the
                    # editable install's finder.
                    other.cwd = other.env["PYTHONPATH"] = tree
                    proxies.append((f"vllm-guard ({Path(tree).name})", stack.enter_context(other)))
            if "tracing" in peers:  # the gateway again, tracing every request (OTLP/HTTP)
                sink_port = free_port()
                sink = subprocess.Popen([sys.executable, "-c", OTLP_SINK, str(sink_port)])
                stack.callback(sink.wait, 10)
                stack.callback(sink.terminate)
                wait_http(f"http://127.0.0.1:{sink_port}/health", 30, sink)
                traced = GatewayProcess(stub_url, "proxy-bench-tracing", tracing={"enabled": True})
                traced.env.update({
                    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink_port}/v1/traces",
                    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                    "OTEL_TRACES_SAMPLER": "always_on",
                })  # fmt: skip
                proxies.append(("vllm-guard + tracing", stack.enter_context(traced)))
            if "ask" in peers:  # the gateway again, asking for every answer's logprobs
                backends = [{"name": "vllm", "url": stub_url, "ask_logprobs": True}]
                asking = GatewayProcess(
                    stub_url, "proxy-bench-ask", upstream={"backends": backends}
                )
                proxies.append(("vllm-guard + ask_logprobs", stack.enter_context(asking)))
            if "aiohttp" in peers:
                proxies.append(("aiohttp", stack.enter_context(aiohttp_peer(stub_url))))
            if "asgi" in peers:
                proxies.append(("asgi", stack.enter_context(asgi_peer(stub_url))))
            if "nginx" in peers:
                proxies.append(("nginx", stack.enter_context(nginx_peer(port))))
            if "litellm" in peers:
                proxies.append(("LiteLLM", stack.enter_context(litellm_peer(stub_url))))
            lines = [
                "| scenario | proxy | req/s (direct) | p50 / p99 ms (direct) | added p50 / p99 ms "
                "| p99/p50 | CPU per request | CPU per event | CPU per event over a request |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            # CPU of a small non-streaming request per (proxy, concurrency): a stream's
            # events cost what the stream costs beyond one such request.
            request_cpu: dict[tuple[str, int], float] = {}
            for name, body, concurrency, requests, events in scenarios:
                if args.only and args.only not in name and not name.startswith("small"):
                    continue
                direct: list[Run] = []
                through: dict[str, list[Run]] = {p: [] for p, _ in proxies}
                cpu = dict.fromkeys(through, 0.0)
                for _ in range(args.rounds):  # interleaved: direct, each proxy, direct, ...
                    direct.append(asyncio.run(load(stub_url, body, requests, concurrency)))
                    for proxy_name, proxy in proxies:
                        n = requests if proxy_name != "LiteLLM" else max(10, requests // 10)
                        before = proxy.cpu_seconds()
                        run = asyncio.run(load(proxy.url, body, n, concurrency, proxy.headers))
                        through[proxy_name].append(run)
                        cpu[proxy_name] += (proxy.cpu_seconds() - before) / n
                d = [x for r in direct for x in r.latencies]
                d50, d99 = pct(d, 0.5), pct(d, 0.99)
                d_rps = sum(r.rps for r in direct) / len(direct)
                for proxy_name, runs in through.items():
                    g = [x for r in runs for x in r.latencies]
                    g50, g99 = pct(g, 0.5), pct(g, 0.99)
                    per_request = cpu[proxy_name] / args.rounds
                    per_event = marginal = "-"
                    if events == 1 and name.startswith("small"):
                        request_cpu[proxy_name, concurrency] = per_request
                    if events > 1:
                        per_event = f"{per_request / events * 1e6:.0f} µs"
                        if (proxy_name, concurrency) in request_cpu:
                            extra = per_request - request_cpu[proxy_name, concurrency]
                            marginal = f"{extra / events * 1e6:.0f} µs"
                    lines.append(
                        f"| {name} | {proxy_name} "
                        f"| {sum(r.rps for r in runs) / len(runs):.0f} ({d_rps:.0f}) "
                        f"| {g50 * 1000:.2f} / {g99 * 1000:.2f} "
                        f"({d50 * 1000:.2f} / {d99 * 1000:.2f}) "
                        f"| {(g50 - d50) * 1000:+.2f} / {(g99 - d99) * 1000:+.2f} "
                        f"| {g99 / g50:.1f} | {per_request * 1000:.2f} ms | {per_event} "
                        f"| {marginal} |"
                    )
                    print(lines[-1], flush=True)
            peaks = [f"| {name} | {proxy.peak_rss_mib():.1f} MiB |" for name, proxy in proxies]
        report = "\n".join(
            [f"## Proxy cost vs. a fast stub (one process each; MALLOC_TRIM_THRESHOLD_={env_note})",
             "", *lines, "", "| proxy | peak RSS (VmHWM, largest process) |", "|---|---|", *peaks]
        )  # fmt: skip
        (ARTIFACTS / "proxy-report.md").write_text(report + "\n")
        print("\n" + report)
    finally:
        stub.terminate()
        stub.wait(timeout=10)


if __name__ == "__main__":
    main()
