"""Tables from tests/perf/gpu/run.sh's output folder (markdown, for BENCHMARKS.md).

python3 tests/perf/gpu/report.py plugin|gateway OUT
python3 tests/perf/gpu/report.py profile COLLAPSED_STACKS   # py-spy's raw output
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


ROUTES = ("direct", "off", "off2", "auto", "adaptive")


def gateway(out: Path) -> None:
    print(
        "| c | route | TTFT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 ms | output tok/s "
        "| vs direct: TTFT p50, ITL p50, tok/s | gateway CPU per output token |"
    )
    print("|---|---|---|---|---|---|---|---|")
    tick = out / "clk_tck.txt"
    clk = float(tick.read_text()) if tick.exists() else 100.0
    concs = sorted({int(p.name.split("_")[1][1:]) for p in out.glob("serve_c*_direct.json")})
    for conc in concs:
        direct: dict[str, float] = {}
        for route in ROUTES:
            path = out / f"serve_c{conc}_{route}.json"
            if not path.exists():
                continue
            r = json.loads(path.read_text())
            if route == "direct":
                direct = r
            ratios = "-"
            if direct and route != "direct":
                ratios = (
                    f"{r['median_ttft_ms'] / direct['median_ttft_ms']:.2f}x, "
                    f"{r['median_itl_ms'] / direct['median_itl_ms']:.2f}x, "
                    f"{r['output_throughput'] / direct['output_throughput']:.2f}x"
                )
            ticks = out / f"cpu_ticks_c{conc}_{route}.txt"
            cpu = "-"
            if ticks.exists() and r.get("total_output_tokens"):
                cpu = f"{float(ticks.read_text()) / clk / r['total_output_tokens'] * 1e6:.0f} µs"
            print(
                f"| {conc} | {route} | {r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} "
                f"| {r['median_itl_ms']:.2f} / {r['p99_itl_ms']:.2f} | {r['median_e2el_ms']:.0f} "
                f"| {r['output_throughput']:.0f} | {ratios} | {cpu} |"
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
    {"plugin": plugin, "gateway": gateway, "profile": profile}[sys.argv[1]](Path(sys.argv[2]))
