"""``vllm-guard probe``: is this vLLM corrupting answers, how much, and does it track
the prefix-cache hit rate?

Runs a workload against a target (a vLLM server directly, or the gateway) and
reports degenerate answers by kind (the gateway's own detectors), the prefix-cache
hit rate (from usage and from the target's metrics), latency p50/p99, time to
first token, attempts (through the gateway) and requests per second.

Workloads: a JSONL file of OpenAI request bodies, or the built-in GUI-agent
workload shaped like the field report: episodes of several steps whose prompts
share a long, growing prefix, optionally with a sliding history of 1-3 small
generated screenshots, temperature 0.
"""

from __future__ import annotations

import asyncio
import base64
import random
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.apis import CHAT
from gateway.config import DetectorSettings
from gateway.detect import Detector, StreamInspector
from gateway.tools.backend_support import logprobs_support, support_row
from gateway.tools.plot import CORRUPTION_COLOR, HIT_RATE_COLOR, _png, rate_chart
from gateway.upstream.scrape import PrefixCacheCounters, parse_nan_requests, parse_prefix_cache
from gateway.wire.sse import DONE, SSEParser

_WORDS_TEXT = (
    "click tap type scroll open close button window menu file edit view help search "
    "settings profile account login submit cancel save delete next back home screen "
    "image page link field form list item table row column value name date time user"
)
WORDS = _WORDS_TEXT.split()

BATCH_INVARIANCE_NOTE = (
    "vLLM is not batch-invariant by default: the same greedy request can differ "
    "when it is batched differently, so some mismatch is noise. Measure that noise "
    "on a server you trust (or with the bug's trigger off) and compare."
)


@dataclass
class ProbeConfig:
    target: str
    model: str | None = None
    workload: str = "agent"  # "agent" or a path to a JSONL file of request bodies
    episodes: int = 8
    steps: int = 6
    concurrency: int = 8
    stream: bool = False
    max_tokens: int = 24
    images: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    verify_determinism: bool = False
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0
    #: vLLM's own base URL, whose /metrics the NaN count is read from: a gateway's
    #: copy of it (the target's, when the target is a gateway) is only as recent as
    #: its last scrape of vLLM, every 15 s by default.
    vllm_metrics: str | None = None


@dataclass
class Outcome:
    finished_at: float
    latency_s: float
    ttft_s: float | None
    status: int
    kind: str | None
    attempts: int | None
    prompt_tokens: int | None
    cached_tokens: int | None
    mismatch: bool | None = None
    text: str = ""


@dataclass
class ProbeReport:
    target: str
    requests: int
    duration_s: float
    outcomes: list[Outcome]
    backend_hit_rate: float | None
    #: How much vLLM's own count of requests with NaN logits rose during the probe
    #: (None: the server does not count them, VLLM_COMPUTE_NANS_IN_LOGITS off).
    #: Through a gateway, as of its last scrape of vLLM (every 15 s by default).
    nan_requests: float | None = None
    #: Per API, whether the target answers the gateway's logprobs ask with a logprob
    #: per token (``gateway.tools.backend_support``): may ``ask_logprobs`` be on.
    logprobs_support: dict[str, bool | None] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


# -- workload ---------------------------------------------------------------------------


def screenshot(rng: random.Random, width: int = 32, height: int = 24) -> str:
    rows = [bytearray(rng.randbytes(3 * width)) for _ in range(height)]
    return "data:image/png;base64," + base64.b64encode(_png(width, height, rows)).decode()


class AgentEpisode:
    def __init__(self, index: int, rng: random.Random, images: bool) -> None:
        self.index = index
        self.rng = rng
        self.images = images
        self.system = f"GUI agent {index}: " + " ".join(rng.choice(WORDS) for _ in range(320))
        self.history: list[dict[str, Any]] = []
        self.screens: list[str] = []

    def next_request(self, model: str | None, max_tokens: int, stream: bool) -> dict[str, Any]:
        step = sum(1 for m in self.history if m["role"] == "user")
        text = f"step {step}: " + " ".join(self.rng.choice(WORDS) for _ in range(40))
        content: Any = text
        if self.images:  # a sliding history of the last 1-3 screenshots
            self.screens = [*self.screens, screenshot(self.rng)][-3:]
            content = [{"type": "text", "text": text}] + [
                {"type": "image_url", "image_url": {"url": url}} for url in self.screens
            ]
        self.history.append({"role": "user", "content": content})
        body: dict[str, Any] = {
            "messages": [{"role": "system", "content": self.system}, *self.history],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if model:
            body["model"] = model
        return body

    def record(self, text: str) -> None:
        self.history.append({"role": "assistant", "content": text})


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    bodies = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            body = orjson.loads(line)
            if not isinstance(body, dict):
                raise ValueError(f"{path}:{number}: each line must be a JSON object")
            bodies.append(body)
    return bodies


# -- one request -------------------------------------------------------------------------


def auth_headers(config: ProbeConfig) -> dict[str, str]:
    """The target's key (``--api-key``), for every request the probe sends."""
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


class Client:
    def __init__(self, config: ProbeConfig, session: aiohttp.ClientSession) -> None:
        self.config = config
        self.session = session
        self.detector = Detector(DetectorSettings())
        self.started = time.perf_counter()

    async def send(self, body: dict[str, Any]) -> Outcome:
        body = {**body, **self.config.extra_body}
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        headers = auth_headers(self.config)
        stream = bool(body.get("stream"))
        if stream:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        begin = time.perf_counter()
        ttft = None
        async with self.session.post(self.config.target + path, json=body, headers=headers) as r:
            attempts_header = r.headers.get("x-vllm-guard-attempts")
            if r.status != 200 or not stream:
                payload = orjson.loads(await r.read()) if r.status == 200 else {}
                usage = payload.get("usage") or {}
                verdict = CHAT.inspect_body(self.detector, payload) if r.status == 200 else None
                text = _first_text(payload)
            else:
                inspector = StreamInspector(self.detector)
                parser, usage = SSEParser(), {}
                async for chunk in r.content.iter_any():
                    for event in parser.feed(chunk):
                        if event.data is None or event.data == DONE:
                            continue
                        data = orjson.loads(event.data)
                        usage = data.get("usage") or usage
                        inspector.feed(data)
                        if ttft is None and inspector.visible_chars:
                            ttft = time.perf_counter() - begin
                verdict = inspector.final_verdict()
                text = "".join(
                    "".join(state.content_parts) for _, state in sorted(inspector.choices.items())
                )
        details = usage.get("prompt_tokens_details") or {}
        return Outcome(
            finished_at=time.perf_counter() - self.started,
            latency_s=time.perf_counter() - begin,
            ttft_s=ttft,
            status=r.status,
            kind=verdict.kind.value if verdict is not None and verdict.kind else None,
            attempts=int(attempts_header) if attempts_header else None,
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=details.get("cached_tokens"),
            text=text,
        )

    async def same_answer_with_fresh_salt(self, body: dict[str, Any], text: str) -> bool:
        """Send the request again with a fresh salt (a cache miss): same answer?"""
        again = {**body, "stream": False, "cache_salt": f"probe-{secrets.token_hex(8)}"}
        again.pop("stream_options", None)
        outcome = await self.send(again)
        return outcome.text == text


def _first_text(payload: dict[str, Any]) -> str:
    choices = payload.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message")
    if isinstance(message, dict):
        return str(message.get("content") or "")
    return str(choice.get("text") or "")


# -- the run -------------------------------------------------------------------------------


@dataclass(slots=True)
class TargetCounters:
    """What the target's /metrics says at one moment: vLLM's prefix-cache counters,
    the gateway's backend hit-ratio gauge, and vLLM's count of requests with NaN
    logits (vLLM's own counter, or the gateway's copies of it summed over backends;
    None where nobody counts)."""

    prefix_cache: PrefixCacheCounters | None = None
    gateway_hit_ratio: float | None = None
    nan_requests: float | None = None


def _gauge_values(text: bytes, prefix: bytes) -> list[float]:
    """The values of the exposition's samples whose line starts with ``prefix``."""
    return [float(line.rsplit(b" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)]


async def _target_counters(session: aiohttp.ClientSession, target: str) -> TargetCounters:
    try:
        async with session.get(target + "/metrics") as response:
            text = await response.read()
    except aiohttp.ClientError:
        return TargetCounters()
    ratios = _gauge_values(text, b"vllm_guard_backend_prefix_cache_hit_ratio{")
    nan_requests = parse_nan_requests(text)
    if nan_requests is None:  # a gateway: its copy of each backend's count
        copies = _gauge_values(text, b"vllm_guard_backend_nan_requests{")
        nan_requests = sum(copies) if copies else None
    return TargetCounters(
        parse_prefix_cache(text), sum(ratios) / len(ratios) if ratios else None, nan_requests
    )


async def run_probe(
    config: ProbeConfig, progress: Callable[[int, int], None] | None = None
) -> ProbeReport:
    rng = random.Random(config.seed)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    connector = aiohttp.TCPConnector(limit=max(config.concurrency * 2, 4))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        client = Client(config, session)
        before = await _target_counters(session, config.target)
        counted_at = config.vllm_metrics
        nan_before = (
            (await _target_counters(session, counted_at)).nan_requests
            if counted_at
            else before.nan_requests
        )
        outcomes: list[Outcome] = []
        total = (
            config.episodes * config.steps
            if config.workload == "agent"
            else len(load_jsonl(Path(config.workload)))
        )

        async def record(body: dict[str, Any]) -> Outcome:
            outcome = await client.send(body)
            if config.verify_determinism and body.get("temperature") == 0 and outcome.kind is None:
                outcome.mismatch = not await client.same_answer_with_fresh_salt(body, outcome.text)
            outcomes.append(outcome)
            if progress is not None:
                progress(len(outcomes), total)
            return outcome

        semaphore = asyncio.Semaphore(config.concurrency)
        if config.workload == "agent":

            async def episode(index: int) -> None:
                ep = AgentEpisode(index, random.Random(rng.random()), config.images)
                async with semaphore:
                    for _ in range(config.steps):
                        body = ep.next_request(config.model, config.max_tokens, config.stream)
                        ep.record((await record(body)).text)

            await asyncio.gather(*(episode(i) for i in range(config.episodes)))
        else:

            async def one(body: dict[str, Any]) -> None:
                async with semaphore:
                    await record(body)

            await asyncio.gather(*(one(b) for b in load_jsonl(Path(config.workload))))
        duration = time.perf_counter() - client.started
        if nan_before is not None:
            await asyncio.sleep(1.0)  # vLLM counts a request's NaNs as its stats arrive
        after = await _target_counters(session, config.target)
        support = await logprobs_support(session, config.target, config.model, auth_headers(config))
        nan_after = (
            (await _target_counters(session, counted_at)).nan_requests
            if counted_at
            else after.nan_requests
        )
    backend_hit_rate = after.gateway_hit_ratio
    cache_before, cache_after = before.prefix_cache, after.prefix_cache
    if cache_before and cache_after and cache_after.queries > cache_before.queries:
        backend_hit_rate = (cache_after.hits - cache_before.hits) / (
            cache_after.queries - cache_before.queries
        )
    nan_requests = (
        nan_after - nan_before if nan_before is not None and nan_after is not None else None
    )
    report = ProbeReport(
        config.target, len(outcomes), duration, outcomes, backend_hit_rate, nan_requests, support
    )
    report.summary = summarise(report)
    return report


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(report: ProbeReport) -> dict[str, Any]:
    outcomes = report.outcomes
    ok = [o for o in outcomes if o.status == 200]
    kinds = Counter(o.kind for o in ok if o.kind)
    prompt = sum(o.prompt_tokens or 0 for o in ok if o.cached_tokens is not None)
    cached = sum(o.cached_tokens or 0 for o in ok)
    attempts = [o.attempts for o in ok if o.attempts is not None]
    checked = [o for o in ok if o.mismatch is not None]
    latencies = [o.latency_s for o in ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "degenerate": sum(kinds.values()),
        "degenerate_rate": sum(kinds.values()) / len(ok) if ok else 0.0,
        "degenerate_by_kind": dict(kinds),
        "degenerate_with_cache_hit": sum(1 for o in ok if o.kind and (o.cached_tokens or 0) > 0),
        "hit_rate_usage": cached / prompt if prompt else None,
        "hit_rate_backend_metrics": report.backend_hit_rate,
        "vllm_counts_nans": report.nan_requests is not None,
        "vllm_nan_requests": report.nan_requests,
        "latency_p50_s": _pct(latencies, 0.5),
        "latency_p99_s": _pct(latencies, 0.99),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "attempts_mean": sum(attempts) / len(attempts) if attempts else None,
        "retried": sum(1 for a in attempts if a > 1),
        "requests_per_second": len(outcomes) / report.duration_s if report.duration_s else 0.0,
        "logprobs_support": report.logprobs_support,
        "determinism_checked": len(checked),
        "determinism_mismatch_rate": (
            sum(1 for o in checked if o.mismatch) / len(checked) if checked else None
        ),
    }


def format_table(report: ProbeReport) -> str:
    s = report.summary

    def fmt(value: Any, kind: str = "") -> str:
        if value is None:
            return "n/a"
        if kind == "%":
            return f"{value:.1%}"
        if kind == "ms":
            return f"{value * 1000:.0f} ms"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    kinds = ", ".join(f"{k}={v}" for k, v in sorted(s["degenerate_by_kind"].items())) or "none"
    rows = [
        ("target", report.target),
        ("requests (errors)", f"{s['requests']} ({s['errors']})"),
        ("degenerate answers", f"{s['degenerate']} ({fmt(s['degenerate_rate'], '%')}): {kinds}"),
        ("  of them with a cache hit", str(s["degenerate_with_cache_hit"])),
        ("prefix-cache hit rate (usage)", fmt(s["hit_rate_usage"], "%")),
        ("prefix-cache hit rate (metrics)", fmt(s["hit_rate_backend_metrics"], "%")),
        ("vLLM's own NaN-logit requests",
         f"{s['vllm_nan_requests']:.0f} (its counter, retries included)"
         if s["vllm_counts_nans"] else "not counted (VLLM_COMPUTE_NANS_IN_LOGITS=1 on vLLM)"),
        ("latency p50 / p99", f"{fmt(s['latency_p50_s'], 'ms')} / {fmt(s['latency_p99_s'], 'ms')}"),
        ("time to first token p50 / p99",
         f"{fmt(s['ttft_p50_s'], 'ms')} / {fmt(s['ttft_p99_s'], 'ms')}"),
        ("attempts per request (retried)", f"{fmt(s['attempts_mean'])} ({s['retried']})"),
        ("requests per second", fmt(s["requests_per_second"])),
        ("per-token logprobs asked", support_row(s["logprobs_support"])),
    ]  # fmt: skip
    if s["determinism_checked"]:
        rows.append(
            ("greedy answers changed by a fresh salt",
             f"{fmt(s['determinism_mismatch_rate'], '%')} of {s['determinism_checked']}")
        )  # fmt: skip
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    if s["determinism_checked"]:
        lines += ["", BATCH_INVARIANCE_NOTE]
    return "\n".join(lines)


def report_json(report: ProbeReport) -> bytes:
    data = {
        "target": report.target,
        "duration_s": report.duration_s,
        "summary": report.summary,
        "outcomes": [{k: v for k, v in asdict(o).items() if k != "text"} for o in report.outcomes],
    }
    return orjson.dumps(data, option=orjson.OPT_INDENT_2)


def plot(report: ProbeReport, path: Path, buckets: int = 12) -> None:
    """Corruption rate and hit rate over the run, on one time axis."""
    ok = sorted((o for o in report.outcomes if o.status == 200), key=lambda o: o.finished_at)
    size = max(1, len(ok) // buckets)
    corruption, hits = [], []
    for start in range(0, len(ok), size):
        window = ok[start : start + size]
        moment = window[-1].finished_at
        corruption.append((moment, sum(1 for o in window if o.kind) / len(window)))
        prompt = sum(o.prompt_tokens or 0 for o in window)
        if prompt:
            hits.append((moment, sum(o.cached_tokens or 0 for o in window) / prompt))
    path.write_bytes(rate_chart([(corruption, CORRUPTION_COLOR), (hits, HIT_RATE_COLOR)]))


def progress_bar(done: int, total: int) -> None:
    width = 30
    filled = round(width * done / total) if total else width
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()
