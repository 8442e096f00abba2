"""Tables from tests/perf/gpu/run.sh's output folder (markdown, for BENCHMARKS.md).

python3 tests/perf/gpu/report.py plugin|gateway OUT
python3 tests/perf/gpu/report.py gateway OUT1 OUT2 ...   # the runs' rounds pooled
python3 tests/perf/gpu/report.py profile COLLAPSED_STACKS   # py-spy's raw output
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def plugin(out: Path) -> None:
    print(
        "| arm | plugin | hit vs miss differ | miss vs miss (noise) | `!!!!` hit / miss "
        "| prefix-cache hit rate | MTP acceptance | lookups lowered / unchanged "
        "| tokens withheld |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for arm in ("stock", "fixed"):
        path = out / f"difftest_{arm}.json"
        if not path.exists():
            print(f"| {arm} | (no result) |")
            continue
        summary = json.loads(path.read_text())["summary"]
        text = (out / f"metrics_{arm}.txt").read_text()
        log = (out / f"vllm_{arm}.log").read_text(errors="replace")
        status = re.search(r"vllm-guard-fix: (NOT ACTIVE|ACTIVE|REFUSED)", log)
        hits = metric(text, "vllm:prefix_cache_hits_total")
        queries = metric(text, "vllm:prefix_cache_queries_total")
        accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
        drafted = metric(text, "vllm:spec_decode_num_draft_tokens_total")
        lowered = metric(text, "vllm_guard_fix_mamba_lookups_total", outcome="lowered")
        unchanged = metric(text, "vllm_guard_fix_mamba_lookups_total", outcome="unchanged")
        withheld = metric(text, "vllm_guard_fix_tokens_withheld_total")
        print(
            f"| {arm} | {status.group(1) if status else '-'} | {summary['hit1_vs_miss']} "
            f"| {summary['miss_vs_miss(noise)']} | {summary['bang(!!!!)_hit']} / "
            f"{summary['bang(!!!!)_miss']} | {hits / max(queries, 1):.1%} "
            f"| {accepted / max(drafted, 1):.1%} | {lowered:.0f} / {unchanged:.0f} "
            f"| {withheld:.0f} |"
        )


#: A route measured against a direct route that asks vLLM for the same work (where the
#: run has it): the logprobs gateway against vLLM answering with logprobs, the gateway's
#: own share; direct_logprobs itself against direct, vLLM's share.
BASELINES = {"logprobs": "direct_logprobs"}


def gateway(*outs: Path) -> None:
    """Medians over bench_routes.py's rounds (routes.json), each route against direct
    (or its BASELINES route). Several folders (runs on one machine): their rounds
    pooled, each paired with its own run's direct."""
    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    clk = 100.0
    for n, out in enumerate(outs):
        report = json.loads((out / "routes.json").read_text())
        clk = float(report["clk_tck"])
        for row in report["runs"]:
            if "failed" in row:  # said, not averaged
                print(f"c={row['conc']} {row['route']}: failed ({row['failed']})")
                continue
            row = {**row, "round": (n, row["round"])}  # a round is paired within its run
            runs.setdefault((row["conc"], row["route"]), []).append(row)

    def median(conc: int, route: str, key: str, like: str = "") -> float:
        """Over the route's rounds; with ``like``, only in the runs that route was in."""
        kept = {r["round"][0] for r in runs[(conc, like or route)]}
        return statistics.median(r[key] for r in runs[(conc, route)] if r["round"][0] in kept)

    print(
        "| c | route (rounds) | TTFT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 ms | output tok/s "
        "| vs direct: TTFT p50, ITL p50, tok/s | the same, paired by round "
        "| gateway CPU per output token |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for conc, route in runs:
        first = runs[(conc, route)][0]  # its figures: numbers (not the slowest list, tcp)
        m = {key: median(conc, route, key) for key in first if type(first[key]) in (int, float)}
        ratios = paired = cpu = "-"
        base = BASELINES.get(route, "direct")
        if (conc, base) not in runs:
            base = "direct"
        if route != "direct" and (conc, base) in runs:
            keys = ("median_ttft_ms", "median_itl_ms", "output_throughput")
            ratios = ", ".join(f"{m[k] / median(conc, base, k, like=route):.2f}x" for k in keys)
            # Each run against the same round's direct run, then the median. Neither
            # way is clean: the rounds drift (direct's own figures too; BENCHMARKS.md,
            # "The H200 with a model that writes words"), and so do the runs of one round
            # (the order rotates); where the two ratios differ, the figure is inside the
            # noise.
            direct = {r["round"]: r for r in runs[(conc, base)]}
            paired = ", ".join(
                "{:.2f}x".format(
                    statistics.median(
                        r[k] / direct[r["round"]][k]
                        for r in runs[(conc, route)]
                        if r["round"] in direct
                    )
                )
                for k in keys
            )
            tokens = sum(r["total_output_tokens"] for r in runs[(conc, route)])
            ticks = sum(r["cpu_ticks"] for r in runs[(conc, route)])
            cpu = f"{ticks / clk / tokens * 1e6:.0f} µs" if ticks else "-"  # a direct route
            ratios += "" if base == "direct" else f" (vs {base})"
        print(
            f"| {conc} | {route} ({len(runs[(conc, route)])}) "
            f"| {m['median_ttft_ms']:.1f} / {m['p99_ttft_ms']:.1f} "
            f"| {m['median_itl_ms']:.2f} / {m['p99_itl_ms']:.2f} | {m['median_e2el_ms']:.0f} "
            f"| {m['output_throughput']:.0f} | {ratios} | {paired} | {cpu} |"
        )


#: Where a sampled stack's time goes, by the deepest frame that names a part of the relay.
PARTS = (
    ("writing (to the client)", ("write_body", "uvicorn_edge.py", "transport.write", "send")),
    ("reading (from vLLM)", ("aiohttp/streams.py", "aiohttp/client_proto.py", "base_protocol.py")),
    ("parsing (SSE, JSON)", ("gateway/wire/", "httptools", "orjson")),
    ("inspection (detectors, hold, tail)", ("gateway/detect/", "gateway/guard/stream.py",
                                             "gateway/guard/tail.py", "holdback.py")),
    ("request setup (routing, headers, connect)", ("gateway/upstream/", "aiohttp/client.py",
                                                    "aiohttp/connector.py", "gateway/server/app.py",
                                                    "gateway/server/guarded.py")),
    ("metrics and accounting", ("prometheus_client", "gateway/observe/", "accounting.py")),
    ("the event loop (uvloop, asyncio, idle)", ("asyncio/", "uvloop", "uvicorn/")),
    ("the relay's own Python", ("gateway/",)),
)  # fmt: skip


def profile(path: Path) -> None:
    totals: dict[str, int] = {}
    samples = 0
    for line in path.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        samples += int(count)
        part = "other"
        for frame in reversed(frames):
            found = next((name for name, keys in PARTS if any(k in frame for k in keys)), None)
            if found:
                part = found
                break
        totals[part] = totals.get(part, 0) + int(count)
    print(f"| part | share of {samples} samples |\n|---|---|")
    for part, count in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {part} | {count / samples:.0%} |")


if __name__ == "__main__":
    {"plugin": plugin, "gateway": gateway, "profile": profile}[sys.argv[1]](
        *(Path(arg) for arg in sys.argv[2:])
    )
