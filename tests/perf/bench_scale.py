"""Salt reuse and routing at scale, under the faithful model of the bug (issue 18).

    .venv/bin/python tests/perf/bench_scale.py [--vllm URL] [--episodes 12 --steps 6]
                                               [--replicas] [--rate 0.3]

The GUI-agent workload (episodes sharing a growing prefix, temperature 0, c=8)
against the tiny CPU vLLM running the faithful poisoning model
(``vg_source_rate``: the share of reused states that are sources;
``vg_propagate``: states computed from a corrupt one are corrupt). For each way of
running the gateway it reports corrupt answers delivered, upstream requests per
client request, and the prefill vLLM computed (prompt tokens minus prefix-cache
hits, from vLLM's own counters) as a multiple of what a bug-free vLLM computes on
the same workload direct. ``--replicas`` adds a second vLLM and compares the
prefix-cache hit rate with conversation affinity against random routing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "perf"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench_gateway import GatewayProcess, vllm_counter  # noqa: E402
from support.servers import (  # noqa: E402
    MODEL_NAME,
    RunningRedis,
    VLLMServer,
    ensure_model,
    free_port,
)
from support.workload import is_corrupt, run_workload  # noqa: E402

KEY = "bench-shared-salt-key"


def snapshot(urls: list[str]) -> dict[str, float]:
    names = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
             "vllm:prefix_cache_queries_total", "vllm:request_success_total")  # fmt: skip
    return {n: sum(vllm_counter(u, n) for u in urls) for n in names}


class Alternating:
    """An OpenAI client whose calls alternate between two gateways (two replicas
    behind a Service, a conversation's turns landing on either)."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0) for u in urls]
        self.calls = 0
        self.chat = self
        self.completions = self
        self.with_raw_response = self

    def create(self, **kwargs: Any) -> Any:
        client = self.clients[self.calls % len(self.clients)]
        self.calls += 1
        return client.chat.completions.with_raw_response.create(**kwargs)


def run(
    name: str, target: Any, vllm_urls: list[str], shape: dict[str, Any], seed: int,
    xargs: dict[str, Any], baseline: float | None,
) -> tuple[str, float]:  # fmt: skip
    client = (
        target
        if not isinstance(target, str)
        else openai.OpenAI(base_url=target + "/v1", api_key="x", max_retries=0)
    )
    before = snapshot(vllm_urls)
    results = run_workload(client, MODEL_NAME, seed=seed, extra_body=xargs, **shape)
    time.sleep(1.0)
    after = snapshot(vllm_urls)
    delta = {k: after[k] - before[k] for k in after}
    computed = delta["vllm:prompt_tokens_total"] - delta["vllm:prefix_cache_hits_total"]
    hit_rate = delta["vllm:prefix_cache_hits_total"] / max(
        1.0, delta["vllm:prefix_cache_queries_total"]
    )
    corrupt = sum(is_corrupt(r.text) for r in results)
    ratio = f"{computed / baseline:.2f}x" if baseline else "1.00x (baseline)"
    line = (
        f"| {name} | {len(results)} | {corrupt} | "
        f"{delta['vllm:request_success_total'] / len(results):.2f} | {computed:.0f} | {ratio} "
        f"| {hit_rate:.1%} |"
    )
    print(line, flush=True)
    return line, computed


def redis_keys(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.dbsize())
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", default="")
    parser.add_argument("--episodes", type=int, default=12)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rate", type=float, default=0.3)
    parser.add_argument("--replicas", action="store_true")
    parser.add_argument(
        "--sharing", action="store_true",
        help="only one process against two workers sharing through Redis (issue 41)",
    )  # fmt: skip
    args = parser.parse_args()
    shape = {"episodes_count": args.episodes, "steps": args.steps, "concurrency": 8,
             "max_tokens": 20}  # fmt: skip
    poisoned = {"vllm_xargs": {"vg_source_rate": args.rate, "vg_propagate": True}}
    base_seed = int(time.time()) % 100_000 * 10
    lines = [
        f"## Faithful model, GUI workload ({args.episodes} episodes x {args.steps} steps, "
        f"{args.rate:.0%} of reused states sources, propagation on, c=8)",
        "",
        "| run | client requests | corrupt delivered | upstream / client requests "
        "| prefill computed (tokens) | vs. bug-free | prefix-cache hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    with ExitStack() as stack:
        urls = [args.vllm] if args.vllm else []
        if not urls:
            model = ensure_model(Path("/tmp/vllm-guard-bench/tiny-model"))
            server = VLLMServer(model, Path("/tmp/vllm-guard-bench/vllm-scale.log"))
            server.start()
            stack.callback(server.stop)
            server.wait_ready()
            urls = [server.url]
        vllm = urls[0]
        redis = RunningRedis(free_port(), Path("/tmp/vllm-guard-bench/redis.log"))
        redis.start()
        stack.callback(redis.stop)
        # 50 ms, not the default 5: here two gateways (or workers), the load and Redis
        # share one core beside vLLM's, and a lookup that waits behind other requests'
        # work misses 5 ms (then this process answers from its own memory, as it
        # should). On hosts with cores to spare, 5 ms is ample for a loopback GET.
        shared = {"redis_url": redis.url, "lookup_timeout_ms": 50}
        # The same episodes (seed) for every run of the first group; each run gets
        # fresh system prompts (the seed is in them), so no run reuses another's cache.
        seeds = iter(range(base_seed, base_seed + 100))
        line, baseline = run("bug-free vLLM, direct (baseline)", vllm, [vllm], shape,
                             next(seeds), {}, None)  # fmt: skip
        lines.append(line)
        lines.append(run("poisoned vLLM, direct", vllm, [vllm], shape, next(seeds),
                         poisoned, baseline)[0])  # fmt: skip
        configs = {
            "gateway, fresh salt every retry (naive)": {
                "guard": {"salt_reuse": {"enabled": False}}},
            "gateway, 1 worker (default)": {"guard": {"salt_reuse": {"key": KEY}}},
            "gateway, --workers 2, shared key": {
                "guard": {"salt_reuse": {"key": KEY}}, "server": {"workers": 2}},
            "gateway, --workers 2, no key (the parent draws one)": {"server": {"workers": 2}},
            "gateway, --workers 2, shared key, Redis": {
                "guard": {"salt_reuse": {"key": KEY}}, "server": {"workers": 2},
                "state": shared},
        }  # fmt: skip
        if args.sharing:  # the product's own lookup deadline (5 ms) beside the 50 ms above
            configs = {
                "gateway, 1 worker (default)": configs["gateway, 1 worker (default)"],
                "gateway, --workers 2, shared key, Redis": configs[
                    "gateway, --workers 2, shared key, Redis"],
                "gateway, --workers 2, shared key, Redis, default 5 ms deadline": {
                    "guard": {"salt_reuse": {"key": KEY}}, "server": {"workers": 2},
                    "state": {"redis_url": redis.url}},
            }  # fmt: skip
        for name, config in configs.items():
            keys_before = redis_keys(redis.url)
            with GatewayProcess(vllm, f"scale-{len(lines)}", **config) as gateway:
                line = run(name, gateway.url, [vllm], shape, next(seeds), poisoned, baseline)[0]
                if "state" in config:  # what reached Redis, and what stayed in a process
                    unshared = gateway.metric_sum("vllm_guard_state_unshared_writes_total")
                    written = redis_keys(redis.url) - keys_before
                    line += f" Redis: {written} keys written, {unshared:.0f} writes unshared |"
                lines.append(line)
        if args.sharing:
            print("\n" + "\n".join(lines))
            return
        with (
            GatewayProcess(vllm, "alt-a", guard={"salt_reuse": {"key": KEY}}) as a,
            GatewayProcess(vllm, "alt-b", guard={"salt_reuse": {"key": KEY}}) as b,
        ):
            lines.append(run("two gateways alternating turns, shared key", Alternating(
                [a.url, b.url]), [vllm], shape, next(seeds), poisoned, baseline)[0])  # fmt: skip
        redis_config = {"guard": {"salt_reuse": {"key": KEY}}, "state": shared}
        with (
            GatewayProcess(vllm, "alt-redis-a", **redis_config) as a,
            GatewayProcess(vllm, "alt-redis-b", **redis_config) as b,
        ):
            lines.append(run("two gateways alternating turns, shared key, Redis", Alternating(
                [a.url, b.url]), [vllm], shape, next(seeds), poisoned, baseline)[0])  # fmt: skip
        if args.replicas:
            model = ensure_model(Path("/tmp/vllm-guard-bench/tiny-model"))
            second = VLLMServer(model, Path("/tmp/vllm-guard-bench/vllm-scale-2.log"))
            second.start()
            stack.callback(second.stop)
            second.wait_ready()
            both = [vllm, second.url]
            lines += ["", "Two vLLM replicas behind one gateway (no poisoning: the cache alone):",
                      "", lines[2], lines[3]]  # fmt: skip
            lines.append(run("one replica", vllm, [vllm], shape, next(seeds), {}, baseline)[0])
            for affinity in (True, False):
                config = {"upstream": {"conversation_affinity": affinity}}
                backends = [{"name": "r0", "url": vllm}, {"name": "r1", "url": second.url}]
                config["upstream"]["backends"] = backends
                with GatewayProcess(vllm, f"replicas-{affinity}", **config) as gateway:
                    label = "affinity (default)" if affinity else "random routing"
                    lines.append(run(f"two replicas, {label}", gateway.url, both, shape,
                                     next(seeds), {}, baseline)[0])  # fmt: skip
    report = "\n".join(lines)
    out = Path(os.environ.get("VLLM_GUARD_BENCH_ARTIFACTS", "/tmp/vllm-guard-bench"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale-report.md").write_text(report + "\n")
    print("\n" + report)


if __name__ == "__main__":
    main()
