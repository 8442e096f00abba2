"""A GUI-agent-like workload shaped like the field report, for tests and benchmarks.

Episodes of several steps; every step's prompt is the previous conversation plus
a new observation, so consecutive steps share a long, growing prefix and the
prefix cache hits more as the run goes. Temperature 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from gateway.tools.probe import WORDS  # one vocabulary for the probe and the tests


def long_prompt(seed: int, words: int = 300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Episode:
    index: int
    system: str
    messages: list[dict[str, Any]] = field(default_factory=list)

    def next_step(self, rng: random.Random) -> list[dict[str, Any]]:
        step = sum(1 for m in self.messages if m["role"] == "user")
        observation = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 60)))
        self.messages.append(
            {"role": "user", "content": f"episode {self.index} step {step}: {observation}"}
        )
        return [{"role": "system", "content": self.system}, *self.messages]

    def record_answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def episodes(count: int, seed: int = 0, system_words: int = 320) -> list[Episode]:
    rng = random.Random(seed)
    return [
        Episode(i, f"agent {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(system_words)))
        for i in range(count)
    ]


def is_corrupt(text: str | None) -> bool:
    """What the test knows the poisoning scheduler produces: empty, or a run of '!'."""
    return not text or text.count("!") >= 8


@dataclass
class StepResult:
    episode: int
    step: int
    text: str
    attempts: int
    verdict: str | None
    prompt_tokens: int
    cached_tokens: int | None
    latency_s: float


def _content_of_stream(chunks: list[Any]) -> tuple[str, Any]:
    text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    usage = next((c.usage for c in reversed(chunks) if c.usage is not None), None)
    return text, usage


def run_episode(
    client: Any,
    model: str,
    episode: Episode,
    steps: int,
    *,
    stream: bool = False,
    max_tokens: int = 24,
    extra_body: dict[str, Any] | None = None,
    seed: int = 0,
) -> list[StepResult]:
    import time

    rng = random.Random(seed * 1000 + episode.index)
    results = []
    for step in range(steps):
        messages = episode.next_step(rng)
        started = time.perf_counter()
        kwargs: dict[str, Any] = {
            "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "extra_body": extra_body or {},
        }  # fmt: skip
        if stream:
            kwargs |= {"stream": True, "stream_options": {"include_usage": True}}
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        parsed = raw.parse()
        if stream:
            text, usage = _content_of_stream(list(parsed))
        else:
            text, usage = parsed.choices[0].message.content or "", parsed.usage
        details = getattr(usage, "prompt_tokens_details", None)
        results.append(
            StepResult(
                episode=episode.index,
                step=step,
                text=text,
                attempts=int(raw.headers.get("x-vllm-guard-attempts", "1")),
                verdict=raw.headers.get("x-vllm-guard-verdict"),
                prompt_tokens=usage.prompt_tokens if usage else 0,
                cached_tokens=details.cached_tokens if details else None,
                latency_s=time.perf_counter() - started,
            )
        )
        episode.record_answer(text)
    return results


def run_workload(
    client: Any,
    model: str,
    *,
    episodes_count: int,
    steps: int,
    concurrency: int,
    seed: int,
    **kwargs: Any,
) -> list[StepResult]:
    from concurrent.futures import ThreadPoolExecutor

    eps = episodes(episodes_count, seed=seed)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [
            pool.submit(run_episode, client, model, ep, steps, seed=seed, **kwargs) for ep in eps
        ]
        return [r for f in futures for r in f.result()]
