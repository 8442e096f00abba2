"""Recall per signature family after a healthy start, old default vs new (issue 39).

Every family the detectors know is appended to the healthy start of real legitimate
outputs (``tests/data/legitimate_outputs.jsonl``) and streamed through the guard's
own release and tail code (``hold_decision``, ``TailHold``), chunked two ways with a
fixed seed: *paced* (one token-sized piece a read, as vLLM paces a stream) and
*burst* (one to six pieces a read, as a loaded gateway reads them). ``adaptive`` is
the default before issue 33, ``auto`` today's; a row says what the client got:

* retried: caught while held (a whole retry), continued: dropped while held and
  continued, delivered: seen after it was sent (counted), missed: never seen.

The legitimate outputs themselves are streamed too: anything but "clean" there is a
false positive; the share of reads that ended with text held is the delay cost.

    python tests/perf/bench_families.py
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gateway.config import DetectorSettings  # noqa: E402
from gateway.detect import Detector, StreamInspector  # noqa: E402
from gateway.guard.release import hold_decision  # noqa: E402
from gateway.guard.tail import TailHold  # noqa: E402

FAMILIES = {
    "bang run": " " + "!" * 40,
    "bang run, attached": "!" * 40,
    "empty-ish: whitespace then bangs": "\n\n" + "!" * 24,
    "token loop": " the" * 40,
    "n-gram loop": " I'm sorry, I can't help with that." * 20,
    "greeting loop": " Hello!" * 40,
    "<unk>": " <unk>" * 20,
    "<pad>": " <pad>" * 20,
    "[PAD]": " [PAD]" * 20,
    "[UNK]": " [UNK]" * 20,
    "<0xHH>": " <0x0A>" * 20,
    "<|...|>": " <|endoftext|>" * 20,
    "U+FFFD": "\ufffd" * 20,
    "letter run": " " + "s" * 1000,  # to max_tokens: 90% of the answer is the run
}
MIN_RELEASE, CEILING = 20, 1024
POLICIES = ("adaptive", "auto")


def chunked(text: str, rng: random.Random, burst: bool) -> list[list[str]]:
    pieces, i = [], 0
    while i < len(text):
        step = rng.randint(1, 8)
        pieces.append(text[i : i + step])
        i += step
    reads, i = [], 0
    while i < len(pieces):
        size = rng.randint(1, 6) if burst else 1
        reads.append(pieces[i : i + size])
        i += size
    return reads


def chunk(text: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def streamed(
    detector: Detector,
    reads: list[list[str]],
    policy: str,
    held_reads: Counter[str],
    finish: str = "stop",
) -> str:
    """What the guard does with this stream: the relay's own steps, one read a batch
    ("retried", "continued", "delivered" or "clean")."""
    inspector = StreamInspector(detector)
    inspector.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    settings = detector.settings
    tail = TailHold(detector.candidates, inspector, max_unit=settings.token_loop_max_unit_chars)
    released = False
    for read in [*reads, None]:
        last = read is None
        for piece in read or []:
            inspector.feed(chunk(piece))
        if last:
            inspector.feed(chunk("", finish))
        tail.take([b"x"])
        held_reads["reads"] += 1
        held_reads["held"] += tail.holding
        if not released:
            decision = hold_decision(
                inspector, MIN_RELEASE, 1, CEILING,
                first_token=policy == "auto", content_only=True,
            )  # fmt: skip
            if decision is not None and decision.kind is not None:
                return "retried"
            if last:
                return "retried" if inspector.final_verdict().kind else "clean"
            released = decision is not None and tail.has_released_text
            continue
        kind = (inspector.final_verdict() if last else inspector.partial_verdict()).kind
        if kind is None and tail.holding:
            kind = tail.signature()
        if kind is not None:
            return "continued" if tail.holds(kind) else "delivered"
    return "clean"


def main() -> None:
    detector = Detector(DetectorSettings())
    data = ROOT / "tests" / "data" / "legitimate_outputs.jsonl"
    legit = [json.loads(line)["text"] for line in data.read_text().splitlines() if line.strip()]
    # The corpus's empty outputs are legitimate only with their finish reason (a
    # max_tokens=1 answer): this stream always ends "stop", so they are left out.
    legit = [text for text in legit if text]
    starts = [t[:80].rstrip() for t in legit if len(t) >= 40 and t[0].isalnum()][:40]
    rng = random.Random(39)
    outcomes = ("retried", "continued", "delivered", "missed")
    print(f"# Recall per family after a healthy start ({len(starts)} starts x 2 chunkings)\n")
    print("| family | reads | policy | " + " | ".join(outcomes) + " |")
    print("|---|---|---|" + "---|" * len(outcomes))
    for family, signature in FAMILIES.items():
        for burst in (False, True):
            for policy in POLICIES:
                seen: Counter[str] = Counter()
                for start in starts:
                    reads = chunked(start + signature, random.Random(rng.random()), burst)
                    seen[streamed(detector, reads, policy, Counter())] += 1
                seen["missed"] += seen.pop("clean", 0)
                cells = " | ".join(str(seen[o]) for o in outcomes)
                print(f"| {family} | {'burst' if burst else 'paced'} | {policy} | {cells} |")
    print(f"\n# Legitimate outputs ({len(legit)} x 2 chunkings)\n")
    for policy in POLICIES:
        seen, held = Counter(), Counter()
        for text in legit:
            for burst in (False, True):
                reads = chunked(text, random.Random(rng.random()), burst)
                seen[streamed(detector, reads, policy, held)] += 1
        wrong = sum(n for o, n in seen.items() if o != "clean")
        share = held["held"] / held["reads"]
        print(f"- {policy}: {wrong} not clean (false positives); {share:.1%} of reads end "
              "with text held (released with the next read)")  # fmt: skip


if __name__ == "__main__":
    main()
