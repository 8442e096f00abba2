"""The stream hold-back: what it catches before release, and what it costs in first byte.

    .venv/bin/python tests/perf/bench_holdback.py [--quick] [--vllm URL]

1. Recall on the corpus (tests/data/): each degenerate output streamed in pieces
   of 1-8 characters (seeded), judged before release by the adaptive hold-back
   and by the fixed 32-character window it replaced; beside the non-streamed
   verdict of the same output. False positives on the legitimate corpus, both ways.
2. First-byte delay on healthy answers against a real vLLM (the tiny CPU model,
   16-token answers, interleaved rounds): direct, hold-back off, the fixed
   32-character window (``holdback_chars: 32, min_release_chars: 32``), and the
   adaptive default. Median and p90 time to the first content byte.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench_gateway import GatewayProcess, pct, run_latency  # noqa: E402
from support.servers import VLLMServer, ensure_model  # noqa: E402

from gateway.config import DetectorSettings  # noqa: E402
from gateway.detect import (  # noqa: E402
    ChoiceOutput,
    DegenerateKind,
    Detector,
    StreamInspector,
)
from gateway.guard.release import hold_decision  # noqa: E402

DATA = ROOT / "tests" / "data"
ADAPTIVE_MIN_RELEASE, ADAPTIVE_CEILING = 20, 1024
FIXED_WINDOW = 32


def load(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        step = rng.randint(1, 8)
        out.append(text[i : i + step])
        i += step
    return out


def delta(entry: dict[str, Any], text: str, finish: str | None = None) -> dict[str, Any]:
    if entry.get("field") == "tool_arguments":
        call = {"index": 0, "function": {"name": "act", "arguments": text}}
        body: dict[str, Any] = {"tool_calls": [call]}
    else:
        body = {"content": text}
    return {"choices": [{"index": 0, "delta": body, "finish_reason": finish}]}


def finish_of(entry: dict[str, Any]) -> str:
    if entry.get("field") == "tool_arguments":
        return "tool_calls"
    return str(entry.get("finish_reason", "stop" if entry["text"] else "length"))


def stream_verdict(
    detector: Detector, entry: dict[str, Any], rng: random.Random, adaptive: bool
) -> DegenerateKind | None:
    """The verdict the guard has when it releases the stream (or at its end)."""
    inspector: StreamInspector = StreamInspector(detector)
    for piece in pieces(entry["text"] or "", rng):
        inspector.feed(delta(entry, piece))
        if adaptive:
            decision = hold_decision(inspector, ADAPTIVE_MIN_RELEASE, 1, ADAPTIVE_CEILING)
        elif inspector.visible_chars >= FIXED_WINDOW:
            decision = inspector.holdback_verdict()
        else:
            decision = None
        if decision is not None:
            return decision.kind
    inspector.feed(delta(entry, "", finish_of(entry)))
    return inspector.final_verdict().kind


def recall_section(rounds: int) -> list[str]:
    detector = Detector(DetectorSettings())
    degenerate, legitimate = load("degenerate_outputs.jsonl"), load("legitimate_outputs.jsonl")
    rng = random.Random(7)
    lines = [
        f"## Recall before release, corpus streamed in 1-8 character pieces ({rounds} "
        "chunkings per output)",
        "",
        "| outputs | kind | count | non-streamed | streamed, fixed 32 | streamed, adaptive |",
        "|---|---|---|---|---|---|",
    ]
    groups = {
        "degenerate from the start": [e for e in degenerate if "onset" not in e],
        "after a healthy start": [e for e in degenerate if "onset" in e],
    }
    for group, entries in groups.items():
        whole: Counter[str] = Counter()
        total: Counter[str] = Counter()
        caught = {True: Counter[str](), False: Counter[str]()}
        for entry in entries:
            kind = entry["kind"]
            total[kind] += rounds
            text = entry["text"] or ""
            if entry.get("field") == "tool_arguments":
                output = ChoiceOutput(tool_arguments=(text,), finish_reason="tool_calls")
            else:
                output = ChoiceOutput(content=text, finish_reason=finish_of(entry))
            whole[kind] += rounds * (detector.choice_kind(output) is not None)
            for adaptive in (True, False):
                for _ in range(rounds):
                    verdict = stream_verdict(detector, entry, rng, adaptive)
                    caught[adaptive][kind] += verdict is not None
        for kind in [*sorted(total), "all"]:
            n = total[kind] if kind != "all" else sum(total.values())

            def share(counts: Counter[str], kind: str = kind, n: int = n) -> str:
                value = counts[kind] if kind != "all" else sum(counts.values())
                return f"{value / n:.0%}"

            lines.append(
                f"| {group} | {kind} | {n // rounds} | {share(whole)} | {share(caught[False])} "
                f"| {share(caught[True])} |"
            )
    false_positives = {
        adaptive: sum(
            stream_verdict(detector, entry, rng, adaptive) is not None
            for entry in legitimate
            for _ in range(rounds)
        )
        for adaptive in (True, False)
    }
    lines += [
        "",
        f"False positives on {len(legitimate)} legitimate outputs x {rounds} chunkings: "
        f"fixed 32: {false_positives[False]}, adaptive: {false_positives[True]}.",
    ]
    return lines


def first_byte_section(vllm_url: str, quick: bool) -> list[str]:
    rounds = 2 if quick else 4
    per_round = {1: 20 if quick else 40, 8: 32 if quick else 64}
    configs = {
        "hold-back off": {"guard": {"stream": {"holdback_chars": 0}}},
        "fixed 32 characters (before)": {
            "guard": {"stream": {"holdback_chars": 32, "min_release_chars": 32}}
        },
        "adaptive (default)": {},
    }
    lines = [
        "## First content byte on healthy answers (ms), real vLLM, 16-token answers",
        "",
        "| c | direct p50 / p90 | " + " | ".join(f"{n} p50 / p90" for n in configs) + " |",
        "|---|---|" + "---|" * len(configs),
    ]
    gateways = [GatewayProcess(vllm_url, f"hb{i}", **c) for i, c in enumerate(configs.values())]
    for gw in gateways:
        gw.__enter__()
    try:
        for concurrency in (1, 8):
            direct: list[float] = []
            through: list[list[float]] = [[] for _ in gateways]
            for _ in range(rounds):  # interleaved
                n = per_round[concurrency]
                samples = asyncio.run(run_latency(vllm_url, concurrency, n, True, 16))
                direct += [s.ttft_s * 1000 for s in samples]
                for i, gw in enumerate(gateways):
                    samples = asyncio.run(run_latency(gw.url, concurrency, n, True, 16))
                    through[i] += [s.ttft_s * 1000 for s in samples]
            cells = [f"{pct(v, 0.5):.1f} / {pct(v, 0.9):.1f}" for v in through]
            lines.append(
                f"| {concurrency} | {pct(direct, 0.5):.1f} / {pct(direct, 0.9):.1f} | "
                + " | ".join(cells)
                + " |"
            )
    finally:
        for gw in gateways:
            gw.__exit__(None, None, None)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vllm", default="", help="use this vLLM instead of starting one")
    args = parser.parse_args()
    report = recall_section(3 if args.quick else 10)
    print("\n".join(report), flush=True)
    section = against_vllm(args.vllm, "holdback", lambda url: first_byte_section(url, args.quick))
    print("\n" + "\n".join(section))


def against_vllm(url: str, name: str, section: Callable[[str], list[str]]) -> list[str]:
    """``section(url)`` against the vLLM at ``url``, or a tiny one started for it."""
    server = None
    if not url:
        model = ensure_model(Path("/tmp/vllm-guard-bench/tiny-model"))
        server = VLLMServer(model, Path(f"/tmp/vllm-guard-bench/vllm-{name}.log"))
        server.start()
        server.wait_ready()
        url = server.url
    try:
        return section(url)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
