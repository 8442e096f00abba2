"""Tables from tests/perf/gpu/run.sh's output folder (markdown, for BENCHMARKS.md).

python3 tests/perf/gpu/report.py plugin|gateway OUT
"""

from __future__ import annotations

import json
import re
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


def gateway(out: Path) -> None:
    print(
        "| c | route | TTFT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 ms | output tok/s "
        "| TTFT p50 vs direct |"
    )
    print("|---|---|---|---|---|---|---|")
    for conc in (8, 64):
        direct = None
        for route in ("direct", "off", "auto", "adaptive"):
            path = out / f"serve_c{conc}_{route}.json"
            if not path.exists():
                print(f"| {conc} | {route} | (no result) |")
                continue
            r = json.loads(path.read_text())
            if route == "direct":
                direct = r["median_ttft_ms"]
            ratio = f"{r['median_ttft_ms'] / direct:.2f}x" if direct else "-"
            print(
                f"| {conc} | {route} | {r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} "
                f"| {r['median_itl_ms']:.2f} / {r['p99_itl_ms']:.2f} | {r['median_e2el_ms']:.0f} "
                f"| {r['output_throughput']:.0f} | {ratio} |"
            )


if __name__ == "__main__":
    {"plugin": plugin, "gateway": gateway}[sys.argv[1]](Path(sys.argv[2]))
