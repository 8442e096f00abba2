"""Detectors: the corpus (precision), table tests, and properties (hypothesis)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import DetectorSettings
from gateway.detect import ChoiceOutput, DegenerateKind, Detector, PunctTracker

DATA = Path(__file__).resolve().parents[1] / "data"
DETECTOR = Detector(DetectorSettings())


def load(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


LEGITIMATE = load("legitimate_outputs.jsonl")
DEGENERATE = load("degenerate_outputs.jsonl")


def as_choice(entry: dict[str, Any]) -> ChoiceOutput:
    text = entry["text"] or ""
    finish = entry.get("finish_reason", "stop" if text else "length")
    if entry.get("field") == "tool_arguments":
        return ChoiceOutput(tool_arguments=(text,), finish_reason="tool_calls")
    return ChoiceOutput(content=text, finish_reason=finish)


def test_corpus_sizes() -> None:
    assert len(LEGITIMATE) >= 150
    assert len(DEGENERATE) >= 50


@pytest.mark.parametrize("entry", LEGITIMATE, ids=lambda e: f"{e['category']}:{e['text'][:30]!r}")
def test_legitimate_output_is_never_flagged(entry: dict[str, Any]) -> None:
    assert DETECTOR.choice_kind(as_choice(entry)) is None
    # ...and not when it streams in, one character at a time.
    inspector = DETECTOR.stream_inspector()
    for char in entry["text"]:
        inspector.feed({"choices": [{"index": 0, "delta": {"content": char}}]})
        assert not inspector.partial_verdict().degenerate


@pytest.mark.parametrize("entry", DEGENERATE, ids=lambda e: f"{e['kind']}:{str(e['text'])[:30]!r}")
def test_degenerate_output_is_flagged_with_its_kind(entry: dict[str, Any]) -> None:
    assert DETECTOR.choice_kind(as_choice(entry)) == DegenerateKind(entry["kind"])


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (ChoiceOutput(content="", finish_reason="stop"), DegenerateKind.EMPTY),
        (ChoiceOutput(content="", finish_reason="length"), None),
        (ChoiceOutput(content="", reasoning="thinking...", finish_reason="length"), None),
        (ChoiceOutput(content="ok", finish_reason="repetition"), DegenerateKind.REPETITION),
        (ChoiceOutput(content="", tool_arguments=("{}",), finish_reason="tool_calls"), None),
        (ChoiceOutput(content="", tool_arguments=("{",), finish_reason="tool_calls"),
         DegenerateKind.MALFORMED_TOOL_CALL),
        (ChoiceOutput(reasoning="!" * 30, content="fine", finish_reason="stop"),
         DegenerateKind.PUNCT_RUN),
    ],
)  # fmt: skip
def test_choice_table(choice: ChoiceOutput, expected: DegenerateKind | None) -> None:
    assert DETECTOR.choice_kind(choice) == expected


def test_settings_switch_detectors_off_and_on() -> None:
    quiet = Detector(
        DetectorSettings(punct_run=False, empty=False, token_loop=False, repetition=False)
    )
    assert quiet.choice_kind(ChoiceOutput(content="!" * 50, finish_reason="stop")) is None
    assert quiet.choice_kind(ChoiceOutput(content="", finish_reason="stop")) is None
    strict = Detector(DetectorSettings(empty_with_reasoning_on_length=True))
    choice = ChoiceOutput(content="", reasoning="hmm", finish_reason="length")
    assert strict.choice_kind(choice) == DegenerateKind.EMPTY
    deny = Detector(DetectorSettings(deny_patterns=[r"(?i)as an ai language model"]))
    assert deny.text_kind("As an AI language model, I cannot") == DegenerateKind.DENY_PATTERN


def test_inspect_body_reads_chat_and_completions() -> None:
    chat = {"choices": [{"index": 0, "message": {"content": "!" * 20}, "finish_reason": "length"}]}
    assert DETECTOR.inspect_body(chat).kind == DegenerateKind.PUNCT_RUN
    completion = {
        "choices": [
            {"index": 0, "text": "fine", "finish_reason": "stop"},
            {"index": 1, "text": "", "finish_reason": "stop"},
        ]
    }
    verdict = DETECTOR.inspect_body(completion)
    assert verdict.kind == DegenerateKind.EMPTY
    assert verdict.choice_index == 1
    assert not DETECTOR.inspect_body({"object": "list"}).degenerate


# -- properties ---------------------------------------------------------------------

ordinary_text = st.text(
    alphabet=st.characters(categories=["L", "N", "Zs"]) | st.sampled_from(list(".,;:-'\"()!?\n")),
    max_size=400,
).filter(lambda t: "!" * 8 not in t.replace(" ", ""))


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=12))
def test_incremental_punct_run_agrees_with_whole_text(text: str, cuts: list[int]) -> None:
    tracker = PunctTracker(DETECTOR)
    start = 0
    for cut in sorted(set(cuts)):
        tracker.feed(text[start:cut])
        start = max(start, cut)
    tracker.feed(text[start:])
    assert tracker.degenerate(complete=True) == DETECTOR.punct_run(text)
    assert tracker.degenerate() == DETECTOR.punct_run(text, complete=False)


@settings(max_examples=300, deadline=None)
@given(prefix=st.text(max_size=200), run=st.integers(16, 200))
def test_any_text_ending_in_a_long_bang_run_is_flagged(prefix: str, run: int) -> None:
    assert DETECTOR.punct_run(prefix + "!" * run)


@settings(max_examples=300, deadline=None)
@given(text=ordinary_text)
def test_ordinary_prose_is_not_punct_run(text: str) -> None:
    assert not DETECTOR.punct_run(text)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(categories=["L", "N"]), min_size=1, max_size=300))
def test_one_word_without_loops_is_clean(text: str) -> None:
    # A single alphanumeric word is never punct_run or empty.
    kind = DETECTOR.choice_kind(ChoiceOutput(content=text, finish_reason="stop"))
    assert kind in (None, DegenerateKind.TOKEN_LOOP)
