"""What asking for the sampled tokens' logprobs costs vLLM (issue 40, ``ask_logprobs``).

    .venv/bin/python tests/perf/bench_logprobs.py [--vllm URL] [--rounds 3]
        [--requests 48] [--concurrency 8] [--max-tokens 64]

Streamed chat requests straight to vLLM (the tiny CPU model unless ``--vllm`` names
another server, such as the H200 recipe's), each on a fresh salt (a cache miss:
every request prefills), ``ignore_eos`` so every answer is ``--max-tokens`` long;
the same requests without and with ``logprobs: true, top_logprobs: 0`` (what the
gateway adds), the two kinds interleaved round by round. Prints output tokens per
second and TTFT (median, p90) per kind, and the ratios. The gateway's own cost (every
event's JSON read, the logprobs taken out again) is ``bench_proxy.py --peers ask``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench_holdback import against_vllm  # noqa: E402
from support.servers import MODEL_NAME  # noqa: E402
from support.workload import long_prompt  # noqa: E402

ASK = {"logprobs": True, "top_logprobs": 0}


async def one(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> tuple[float, int]:
    """(seconds to the first content, output tokens) of one streamed request."""
    started = time.perf_counter()
    first = 0.0
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line and not first:
                first = time.perf_counter() - started
            if '"usage":{' in line:
                tokens = int(line.split('"completion_tokens":', 1)[1].split(",")[0].split("}")[0])
    return first, tokens


async def run_kind(
    url: str, model: str, args: argparse.Namespace, ask: bool, seed: int
) -> dict[str, float]:
    limits = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def request(i: int) -> tuple[float, int]:
            body = {
                "model": model, "stream": True, "max_tokens": args.max_tokens,
                "ignore_eos": True, "temperature": 0, "cache_salt": uuid.uuid4().hex,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": long_prompt(seed=seed + i, words=60)}],
                **(ASK if ask else {}),
            }  # fmt: skip
            async with limits:
                return await one(client, url, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(request(i) for i in range(args.requests)))
        elapsed = time.perf_counter() - started
    ttfts = sorted(first for first, _ in results)
    return {
        "tok_s": sum(tokens for _, tokens in results) / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
    }


def section(url: str, args: argparse.Namespace) -> list[str]:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] or MODEL_NAME
    asyncio.run(run_kind(url, model, args, ask=False, seed=0))  # warm-up
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for ask in (False, True) if round_ % 2 == 0 else (True, False):
            rows[ask].append(asyncio.run(run_kind(url, model, args, ask, seed=1000 * round_)))
    out = [
        f"vLLM at {url}, model {model}: {args.requests} streamed chat requests a round, "
        f"c={args.concurrency}, {args.max_tokens} tokens each, {args.rounds} rounds (medians)",
        "",
        "| request | output tok/s | TTFT p50 / p90 ms |",
        "|---|---|---|",
    ]
    medians = {}
    for ask, label in (
        (False, "as the client sent it"),
        (True, "+ logprobs: true, top_logprobs: 0"),
    ):
        median = {k: statistics.median(r[k] for r in rows[ask]) for k in rows[ask][0]}
        medians[ask] = median
        out.append(f"| {label} | {median['tok_s']:.0f} | "
                   f"{median['ttft_p50_ms']:.0f} / {median['ttft_p90_ms']:.0f} |")  # fmt: skip
    out += [
        "",
        f"throughput with the ask: {medians[True]['tok_s'] / medians[False]['tok_s']:.3f}x; "
        f"TTFT p50: {medians[True]['ttft_p50_ms'] / medians[False]['ttft_p50_ms']:.3f}x",
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", default="", help="an OpenAI-compatible vLLM URL")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    print("\n".join(against_vllm(args.vllm, "logprobs", lambda url: section(url, args))))


if __name__ == "__main__":
    main()
