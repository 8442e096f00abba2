"""Detectors: the corpus (precision), table tests, and properties (hypothesis)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.apis import CHAT, COMPLETIONS
from gateway.config import DetectorSettings
from gateway.detect import (
    CLEAN,
    ChoiceOutput,
    DegenerateKind,
    Detector,
    PunctTracker,
    StreamInspector,
)
from gateway.guard.release import hold_decision

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
    inspector = StreamInspector(DETECTOR)
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
        (ChoiceOutput(content="", finish_reason="length"), DegenerateKind.EMPTY),
        (ChoiceOutput(content=" \n", finish_reason="length"), DegenerateKind.EMPTY),
        # max_tokens=1 whose one token is whitespace (or part of a character):
        # legitimate; two or more tokens of nothing at the limit are not.
        (ChoiceOutput(content=" ", finish_reason="length", tokens=1), None),
        (ChoiceOutput(content="", finish_reason="length", tokens=1), None),
        (ChoiceOutput(content="\n\n", finish_reason="length", tokens=2), DegenerateKind.EMPTY),
        (ChoiceOutput(content="", finish_reason="stop", tokens=1), DegenerateKind.EMPTY),
        (ChoiceOutput(content=" ", tool_arguments=("{}",), finish_reason="tool_calls"), None),
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
    assert CHAT.inspect_body(DETECTOR, chat).kind == DegenerateKind.PUNCT_RUN
    completion = {
        "choices": [
            {"index": 0, "text": "fine", "finish_reason": "stop"},
            {"index": 1, "text": "", "finish_reason": "stop"},
        ]
    }
    verdict = COMPLETIONS.inspect_body(DETECTOR, completion)
    assert verdict.kind == DegenerateKind.EMPTY
    assert verdict.choice_index == 1
    assert not CHAT.inspect_body(DETECTOR, {"object": "list"}).degenerate


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


# -- the adaptive stream hold-back ---------------------------------------------------

MIN_RELEASE = 20  # the default min_release_chars
CEILING = 1024  # the default ceiling: token_loop_min_repeats x token_loop_max_unit_chars


def delta(content: str, finish: str | None = None, field: str = "content") -> dict[str, Any]:
    if field == "tool_arguments":
        call = {"index": 0, "type": "function", "function": {"name": "act", "arguments": content}}
        body: dict[str, Any] = {"tool_calls": [call]}
    else:
        body = {"content": content}
    return {"choices": [{"index": 0, "delta": body, "finish_reason": finish}]}


def stream_hold_back(
    text: str, cuts: list[int], finish: str, field: str = "content", *, first_token: bool = False
) -> tuple[DegenerateKind | None, int | None]:
    """Feed ``text`` in pieces as the guard does; return (verdict kind, visible characters
    held at release, or None when the stream ended before a decision)."""
    inspector = StreamInspector(DETECTOR)
    inspector.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    bounds = sorted({c for c in cuts if 0 < c < len(text)})
    for start, end in zip([0, *bounds], [*bounds, len(text)], strict=True):
        inspector.feed(delta(text[start:end], field=field))
        decision = hold_decision(inspector, MIN_RELEASE, 1, CEILING, first_token=first_token)
        if decision is not None:
            return decision.kind, inspector.visible_chars
    inspector.feed(delta("", finish))
    decision = hold_decision(inspector, MIN_RELEASE, 1, CEILING, first_token=first_token)
    if decision is not None:
        return decision.kind, inspector.visible_chars
    return inspector.final_verdict().kind, None


def finish_of(entry: dict[str, Any]) -> str:
    if entry.get("field") == "tool_arguments":
        return "tool_calls"
    return str(entry.get("finish_reason", "stop" if entry["text"] else "length"))


STREAMABLE = [e for e in DEGENERATE if e.get("field") != "tool_arguments"]
#: Degenerate from the first characters: the field's failure (a corrupt state yields
#: garbage from the first sampled token).
FROM_THE_START = [e for e in STREAMABLE if "onset" not in e]
#: Entries with an "onset" start healthy and turn degenerate at that character:
#: corruption after a healthy start is the after_release policy's job.
AFTER_A_HEALTHY_START = [e for e in STREAMABLE if "onset" in e]
cut_lists = st.lists(st.integers(min_value=1, max_value=2000), max_size=40)


@pytest.mark.parametrize(
    "entry", FROM_THE_START, ids=lambda e: f"{e['kind']}:{str(e['text'])[:30]!r}"
)
@settings(max_examples=40, deadline=None)
@given(cuts=cut_lists)
def test_degenerate_stream_is_judged_before_release_as_if_whole(
    entry: dict[str, Any], cuts: list[int]
) -> None:
    """However it is chunked, a stream degenerate from its start gets, before
    anything is released, the verdict the whole answer gets non-streamed."""
    kind, _ = stream_hold_back(entry["text"] or "", cuts, finish_of(entry))
    assert kind == DETECTOR.choice_kind(as_choice(entry)) == DegenerateKind(entry["kind"])


@pytest.mark.parametrize(
    "entry", AFTER_A_HEALTHY_START, ids=lambda e: f"{e['kind']}:{str(e['text'])[:30]!r}"
)
def test_corruption_after_a_healthy_start_is_seen_after_release(entry: dict[str, Any]) -> None:
    """Held while the start is too short to judge, released once it looks healthy; the
    inspector still flags what follows (counted, or cut with after_release: cut)."""
    text = entry["text"]
    onset = entry["onset"]
    inspector = StreamInspector(DETECTOR)
    inspector.feed(delta(text[:onset]))
    before = inspector.release_decision(MIN_RELEASE, 1)
    assert before is None or before == CLEAN  # nothing degenerate in the healthy start
    inspector.feed(delta(text[onset:], finish_of(entry)))
    assert inspector.partial_verdict().degenerate or inspector.final_verdict().degenerate


@pytest.mark.parametrize("entry", LEGITIMATE, ids=lambda e: f"{e['category']}:{e['text'][:30]!r}")
@settings(max_examples=15, deadline=None)
@given(cuts=cut_lists)
def test_healthy_stream_is_released_clean_and_never_held_past_the_ceiling(
    entry: dict[str, Any], cuts: list[int]
) -> None:
    text = entry["text"]
    kind, released_at = stream_hold_back(text, cuts, finish_of(entry), entry.get("field", ""))
    assert kind is None
    if released_at is not None:
        bounds = sorted({c for c in cuts if 0 < c < len(text)})
        piece = max(b - a for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True))
        assert released_at <= CEILING + piece


def test_healthy_prose_is_released_after_min_release_chars() -> None:
    """A typical answer, token by token, goes out as soon as 20 visible characters
    look healthy (the fixed window held 32)."""
    text = "The submit button is at the bottom right of the form."
    words = [len(" ".join(text.split(" ")[:i])) for i in range(1, 12)]
    kind, released_at = stream_hold_back(text, words, "stop")
    assert kind is None
    assert released_at is not None
    assert 20 <= released_at <= 26


@pytest.mark.parametrize(
    "held",
    ["Wow!!", "the the the the the the", "<unk><unk><unk><un", "Let me think. Let me think.",
     "我" * 24, "Answer: click here click here cl"],
)  # fmt: skip
def test_text_that_may_still_turn_degenerate_is_held(held: str) -> None:
    inspector = StreamInspector(DETECTOR)
    inspector.feed(delta(held))
    assert inspector.release_decision(4, 1) is None


def test_one_whitespace_token_at_the_length_limit_is_legitimate_streamed_or_not() -> None:
    """A request with max_tokens=1 whose token decodes to whitespace (it happens to
    about 1 request in 10 on the test model) was retried as "empty"."""
    body = {"choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": " "}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1}}  # fmt: skip
    assert not CHAT.inspect_body(DETECTOR, body).degenerate
    body["usage"] = {"prompt_tokens": 9, "completion_tokens": 5}
    assert CHAT.inspect_body(DETECTOR, body).kind == DegenerateKind.EMPTY
    for text, tokens, expected in ((" ", 1, None), ("\n\n\n", 3, DegenerateKind.EMPTY)):
        inspector = StreamInspector(DETECTOR)
        inspector.feed(delta(""))
        inspector.feed(delta(text, "length"))
        assert inspector.release_decision(MIN_RELEASE, 1) is None  # waits for the usage
        inspector.completion_tokens = tokens  # what the usage chunk says
        assert inspector.final_verdict().kind == expected


# -- the first-token release policy ----------------------------------------------------

#: The bug's own signatures, decidable at the first visible token: nothing visible
#: (empty), or a first character that starts a punctuation run or an artifact.
FIRST_TOKEN_SIGNATURES = [
    e
    for e in FROM_THE_START
    if not (e["text"] or "").strip()
    or e["text"].strip()[0] in DETECTOR.candidates | {"<", "[", "\ufffd"}
]


def test_first_token_signatures_cover_the_fields_failures() -> None:
    kinds = {e["kind"] for e in FIRST_TOKEN_SIGNATURES}
    assert {"punct_run", "empty", "special_tokens"} <= kinds


@pytest.mark.parametrize(
    "entry", FIRST_TOKEN_SIGNATURES, ids=lambda e: f"{e['kind']}:{str(e['text'])[:30]!r}"
)
@settings(max_examples=25, deadline=None)
@given(cuts=cut_lists)
def test_first_token_policy_still_judges_the_bugs_signatures_before_release(
    entry: dict[str, Any], cuts: list[int]
) -> None:
    kind, _ = stream_hold_back(entry["text"] or "", cuts, finish_of(entry), first_token=True)
    assert kind == DETECTOR.choice_kind(as_choice(entry)) == DegenerateKind(entry["kind"])


@pytest.mark.parametrize("entry", LEGITIMATE, ids=lambda e: f"{e['category']}:{e['text'][:30]!r}")
def test_first_token_policy_releases_healthy_text_no_later_than_adaptive(
    entry: dict[str, Any],
) -> None:
    text = entry["text"]
    cuts = list(range(1, len(text)))  # a character per event, as tiny models stream
    field = entry.get("field", "")
    kind, first = stream_hold_back(text, cuts, finish_of(entry), field, first_token=True)
    assert kind is None
    _, adaptive = stream_hold_back(text, cuts, finish_of(entry), field)
    if adaptive is not None:
        assert first is not None
        assert first <= adaptive


def test_first_token_policy_releases_at_the_first_word() -> None:
    kind, released_at = stream_hold_back(
        "Click the submit button.", [1, 5], "stop", first_token=True
    )
    assert (kind, released_at) == (None, 1)
    # The same answer under the adaptive policy waits for 20 visible characters.
    assert stream_hold_back("Click the submit button.", [1, 5], "stop")[1] == 21
