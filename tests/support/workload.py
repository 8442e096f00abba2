"""A GUI-agent-like workload shaped like the field report, for tests and benchmarks.

Episodes of several steps; every step's prompt is the previous conversation plus
a new observation, so consecutive steps share a long, growing prefix and the
prefix cache hits more as the run goes. Temperature 0.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORDS = (
    "click tap type scroll open close button window menu file edit view help search "
    "settings profile account login submit cancel save delete next back home screen "
    "image page link field form list item table row column value name date time user"
).split()


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
