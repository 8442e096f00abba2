"""Every guarded API against the poisoned tiny vLLM: corrupt answers delivered direct
vs through the gateway, and the first byte of a healthy stream.

    .venv/bin/python tests/perf/bench_apis.py [--quick] [--vllm URL]

1. Per API (chat, responses, messages) and mode (whole, streamed): fresh long
   prompts, each sent once to warm the prefix cache, then with
   ``vg_poison_rate`` 0.5 (about half the cache hits come back as a run of ``!``
   or empty) direct to vLLM and through the gateway. Corrupt = empty, or 8 or
   more ``!`` (what the poisoning produces).
2. Time to the first text byte of healthy streams (no poisoning, short prompts,
   40-token answers), direct and through gateways with each release policy,
   interleaved; median and p90 in ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench_gateway import GatewayProcess  # noqa: E402
from bench_holdback import against_vllm  # noqa: E402
from support.servers import MODEL_NAME  # noqa: E402
from support.workload import is_corrupt, long_prompt  # noqa: E402

GENEROUS_BUDGET = {"ratio": 1.0, "min_per_second": 10.0}


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}


def responses_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"input": prompt, "max_output_tokens": max_tokens}


#: path, request body, text of a whole answer, text of one stream event (or None).
API: dict[str, tuple[str, Callable[[str, int], dict[str, Any]], Callable[[Any], str],
                     Callable[[Any], str | None]]] = {
    "chat": (
        "/v1/chat/completions", chat_body,
        lambda b: b["choices"][0]["message"]["content"] or "",
        lambda e: (e.get("choices") or [{}])[0].get("delta", {}).get("content"),
    ),
    "responses": (
        "/v1/responses", responses_body,
        lambda b: "".join(p.get("text", "") for item in b["output"] if item["type"] == "message"
                          for p in item["content"]),
        lambda e: e.get("delta") if e.get("type") == "response.output_text.delta" else None,
    ),
    "messages": (
        "/v1/messages", chat_body,
        lambda b: "".join(c.get("text", "") for c in b["content"] if c["type"] == "text"),
        lambda e: (e.get("delta") or {}).get("text") if e.get("type") == "content_block_delta"
        else None,
    ),
}  # fmt: skip


def ask(
    client: httpx.Client,
    url: str,
    api: str,
    prompt: str,
    stream: bool,
    max_tokens: int,
    extra: dict[str, Any],
) -> tuple[str, float]:
    """The answer's text and the seconds to its first text byte (whole: to the body)."""
    path, body_of, whole_text, event_text = API[api]
    body = {"model": MODEL_NAME, "temperature": 0, "stream": stream,
            **body_of(prompt, max_tokens), **extra}  # fmt: skip
    started = time.perf_counter()
    if not stream:
        response = client.post(url + path, json=body)
        response.raise_for_status()
        return whole_text(response.json()), time.perf_counter() - started
    pieces: list[str] = []
    first = 0.0
    with client.stream("POST", url + path, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = event_text(orjson.loads(line[6:]))
            if piece:
                first = first or time.perf_counter() - started
                pieces.append(piece)
    return "".join(pieces), first


def corruption_section(url: str, gateway: str, prompts: int) -> list[str]:
    lines = [
        f"## Corrupt answers delivered, vg_poison_rate 0.5, {prompts} warmed prompts per row",
        "",
        "| API | mode | direct | through the gateway |",
        "|---|---|---|---|",
    ]
    poison = {"vllm_xargs": {"vg_poison_rate": 0.5}}
    with httpx.Client(timeout=120) as client:
        for api in API:
            for stream in (False, True):
                direct = through = 0
                for _ in range(prompts):
                    prompt = f"{uuid.uuid4()} {long_prompt(seed=9, words=320)}"
                    ask(client, url, api, prompt, False, 1, {})  # warm the cache
                    direct += is_corrupt(ask(client, url, api, prompt, stream, 16, poison)[0])
                    through += is_corrupt(ask(client, gateway, api, prompt, stream, 16, poison)[0])
                mode = "streamed" if stream else "whole"
                lines.append(f"| {api} | {mode} | {direct} of {prompts} | {through} of {prompts} |")
                print(lines[-1], flush=True)
    return lines


def first_byte_section(url: str, gateways: dict[str, str], requests: int) -> list[str]:
    routes = {"direct": url, **gateways}
    lines = [
        f"## First text byte of healthy streams (ms, p50 / p90), 40-token answers, "
        f"{requests} requests per cell, interleaved",
        "",
        "| API | " + " | ".join(routes) + " |",
        "|---|" + "---|" * len(routes),
    ]
    with httpx.Client(timeout=120) as client:
        for api in API:
            samples: dict[str, list[float]] = {route: [] for route in routes}
            for i in range(requests):
                for route, target in routes.items():
                    prompt = f"request {i}: open the settings page and click save"
                    samples[route].append(ask(client, target, api, prompt, True, 40, {})[1] * 1000)
            cells = [
                f"{statistics.median(v):.1f} / {statistics.quantiles(v, n=10)[-1]:.1f}"
                for v in samples.values()
            ]
            lines.append(f"| {api} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    return lines


def run(url: str, quick: bool) -> list[str]:
    policies = ("adaptive", "first_token")
    gateways = {
        policy: GatewayProcess(
            url, f"apis-{policy}", guard={"stream": {"release": policy}, "budget": GENEROUS_BUDGET}
        )
        for policy in policies
    }
    for gateway in gateways.values():
        gateway.__enter__()
    try:
        lines = corruption_section(url, gateways["adaptive"].url, 8 if quick else 24)
        urls = {f"gateway, {p}": g.url for p, g in gateways.items()}
        return [*lines, "", *first_byte_section(url, urls, 10 if quick else 30)]
    finally:
        for gateway in gateways.values():
            gateway.__exit__(None, None, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vllm", default="", help="use this vLLM instead of starting one")
    args = parser.parse_args()
    print("\n".join(against_vllm(args.vllm, "apis", lambda url: run(url, args.quick))))


if __name__ == "__main__":
    main()
