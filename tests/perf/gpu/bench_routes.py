"""vLLM's own `bench serve`, direct and through each gateway, in one process (run.sh gateway).

    python3 bench_routes.py --out DIR --concs 64 256 --rounds 3 \\
        direct=http://127.0.0.1:8000 off=http://127.0.0.1:9000@PID ...

Why one process: `vllm bench serve` imports vLLM for ~20 s on the lent machine's CPU
before its first request, so eight runs as commands cost minutes of device time; its
`main(args)` is called here once per run instead. Why rounds: one run at c=64 lasts
2-3 s, and a single run per route left the ratios within their own noise; each round
runs every route once, in a rotated order, and the report takes the median.

Per concurrency: a warm-up run direct (the prompts' prefixes cached, CUDA graphs of
every batch size taken), a short one through each gateway (its upstream connections
and first-request paths), then the measured rounds. Per gateway run: its CPU seconds
(process and workers, /proc) and, with --profile ROUTE, py-spy's collapsed stacks of
that gateway during its first measured run of each concurrency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
from pathlib import Path

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

#: What each run's row keeps of `bench serve`'s result.
KEPT = (
    "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms",
    "output_throughput", "total_output_tokens", "completed", "duration",
)  # fmt: skip


def cpu_ticks(pid: int) -> int:
    """User + system CPU ticks of a process and its children (uvicorn's workers)."""
    total = 0
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        children += [int(c) for c in task.read_text().split()]
    for p in (pid, *children):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


#: The kernel's TCP counters that tell a dropped or retried connection (/proc/net/netstat,
#: /proc/net/snmp), whose first retry comes after 1 s: one question about first tokens
#: about a second late. They count the whole machine (its network namespace) over the
#: whole run() call, `bench serve`'s start and the idle gateways' pools closing included.
TCP_COUNTERS = (
    "ListenOverflows", "ListenDrops", "TCPSynRetrans", "TCPTimeouts", "RetransSegs",
    "TCPReqQFullDrop", "TCPReqQFullDoCookies", "AttemptFails", "EstabResets", "OutRsts",
    "ActiveOpens", "PassiveOpens", "TW", "TWRecycled", "PAWSActive", "PAWSEstab",
    "TCPChallengeACK", "TCPSYNChallenge",
)  # fmt: skip


def tcp_counters() -> dict[str, int]:
    counters: dict[str, int] = {}
    for table in ("/proc/net/netstat", "/proc/net/snmp"):
        with contextlib.suppress(OSError):
            lines = Path(table).read_text().splitlines()
            for names, values in zip(lines[::2], lines[1::2], strict=True):
                for name, value in zip(names.split()[1:], values.split()[1:], strict=True):
                    if name in TCP_COUNTERS:
                        counters[name] = int(value)
    return counters


def serve_args(
    url: str, conc: int, prompts: int, tokenizer: str, extra: list[str]
) -> argparse.Namespace:
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(
        [
            "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", url, "--model", "tiny", "--tokenizer", tokenizer,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", "512", "--prefix-repetition-suffix-len", "32",
            "--prefix-repetition-num-prefixes", "4", "--prefix-repetition-output-len", "32",
            "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency", str(conc),
            "--temperature", "0", "--seed", "1",
            "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-detailed", *extra,  # detailed: each request's TTFT
        ]
    )  # fmt: skip


#: What a gateway with ``ask_logprobs`` adds to a chat request (openai_chunks.logprobs_ask):
#: sent direct by the routes in --ask-logprobs, vLLM's own share of that policy's cost.
LOGPROBS_ASK = '{"logprobs": true, "top_logprobs": 0}'


def run(url: str, conc: int, prompts: int, opts: argparse.Namespace, name: str = "") -> dict:
    extra = [*opts.extra, "--extra-body", LOGPROBS_ASK] if name in opts.ask_logprobs else opts.extra
    return main(serve_args(url, conc, prompts, opts.tokenizer, extra))


def main_cli() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "routes", nargs="+", help="name=url, or name=url@pid for a gateway (the first: direct)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--concs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts-per-client", type=int, default=8)
    parser.add_argument(
        "--prompts", type=int, default=0,
        help="prompts per run at every concurrency (instead of per client; at least the "
        "largest concurrency): runs of about equal length, c=64's as long as c=256's",
    )  # fmt: skip
    parser.add_argument("--tokenizer", default="/tmp/tiny")
    parser.add_argument("--profile", default="", help="route to record with py-spy")
    parser.add_argument("--extra", nargs="*", default=[], help="more `bench serve` flags")
    parser.add_argument(
        "--ask-logprobs", action="append", default=[], metavar="ROUTE",
        help="a route whose requests ask for the sampled tokens' logprobs, as a gateway "
        "with ask_logprobs does (a direct one: vLLM's share of that cost); repeatable",
    )  # fmt: skip
    opts = parser.parse_args()
    if opts.prompts and opts.prompts < max(opts.concs):
        parser.error(f"--prompts {opts.prompts}: fewer than a concurrency's clients")
    opts.out.mkdir(parents=True, exist_ok=True)
    routes = []
    for spec in opts.routes:
        name, rest = spec.split("=", 1)
        url, _, pid = rest.partition("@")
        routes.append((name, url, int(pid) if pid else None))
    unknown = set(opts.ask_logprobs) - {name for name, _, _ in routes}
    if unknown:
        parser.error(f"--ask-logprobs {' '.join(sorted(unknown))}: no such route")
    if opts.ask_logprobs and "--extra-body" in opts.extra:
        parser.error("--ask-logprobs sets --extra-body: put both in --extra instead")
    summary: list[dict] = []
    for conc in opts.concs:
        prompts = opts.prompts or conc * opts.prompts_per_client
        run(routes[0][1], conc, prompts, opts)  # warm-up direct: prefixes cached, graphs taken
        for _, url, pid in routes:
            if pid is not None:
                run(url, conc, max(conc, 8), opts)  # each gateway's connections and first requests
        for k in range(opts.rounds):
            order = routes[k % len(routes) :] + routes[: k % len(routes)]
            for name, url, pid in order:
                spy = None
                if pid is not None and name == opts.profile and k == 0:
                    spy = subprocess.Popen(
                        ["py-spy", "record", "--nonblocking", "-r", "250", "-d", "60",
                         "-f", "raw", "-o", str(opts.out / f"profile_{name}_c{conc}.txt"),
                         "-p", str(pid)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                before = cpu_ticks(pid) if pid else 0
                tcp_before = tcp_counters()
                try:
                    result = run(url, conc, prompts, opts, name)
                except Exception as exc:  # one route's failure leaves the others' rows
                    summary.append({"conc": conc, "route": name, "failed": repr(exc)})
                    print(json.dumps(summary[-1]), flush=True)
                    continue
                finally:
                    if spy is not None:
                        spy.send_signal(2)  # SIGINT: py-spy writes what it has
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            spy.wait(timeout=30)
                ticks = cpu_ticks(pid) - before if pid else 0
                if not result.get("completed"):  # every request failed: no figures
                    summary.append({"conc": conc, "route": name, "failed": "none completed"})
                    print(json.dumps(summary[-1]), flush=True)
                    continue
                keep = {key: result[key] for key in KEPT if key in result}
                ttfts = result.get("ttfts") or [0.0]  # seconds, one per request
                keep["max_ttft_ms"] = max(ttfts) * 1000
                # The slowest first tokens, each with when in the run its request started
                # (at the start: new connections; spread: the relay or vLLM).
                starts = result.get("start_times") or [0.0] * len(ttfts)
                began = min(starts)
                keep["slowest"] = sorted(
                    ((round(t, 3), round(start - began, 3))
                     for start, t in zip(starts, ttfts, strict=True)),
                    reverse=True,
                )[:10]  # fmt: skip
                tcp_after = tcp_counters()
                keep["tcp"] = {k: v - tcp_before.get(k, 0) for k, v in tcp_after.items()
                               if v != tcp_before.get(k, 0)}  # fmt: skip
                row = {"conc": conc, "route": name, "round": k, "cpu_ticks": ticks, **keep}
                summary.append(row)
                print(json.dumps(row), flush=True)
                report = {"clk_tck": os.sysconf("SC_CLK_TCK"), "runs": summary}
                (opts.out / "routes.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main_cli()
