"""Pure detectors of degenerate output: text in, verdict out.

``Detector`` judges a text (``text_kind``) and an answer's outputs
(``choice_kind``: content, reasoning, tool-call arguments, finish reason, token
count); each API's adapter (``gateway.apis``) reads its own response shapes into
``ChoiceOutput``s, and ``gateway.detect.stream`` applies the same definitions
incrementally to a stream.

Precision over recall: every threshold errs towards leaving legitimate text alone.
``tests/data/`` holds the false-positive corpus that pins this.

``punct_run`` only considers ASCII punctuation that is not in the ignore set.
Emoji, CJK and letters are never "punctuation", and characters that form long
legitimate runs (``-=_.*#~`|+/\\<>``: rules, tables, ellipses, banners, arrows) are
ignored by default.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Any

import orjson

from gateway.config import DetectorSettings


class DegenerateKind(StrEnum):
    PUNCT_RUN = "punct_run"
    EMPTY = "empty"
    REPETITION = "repetition"
    TOKEN_LOOP = "token_loop"
    MALFORMED_TOOL_CALL = "malformed_tool_call"
    SPECIAL_TOKENS = "special_tokens"
    LETTER_RUN = "letter_run"
    DENY_PATTERN = "deny_pattern"
    #: A sampled token's logprob was NaN (its logits were): the bug's own mechanism,
    #: seen per token (``gateway.detect.logprobs``), not its look.
    NAN_LOGITS = "nan_logits"


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: DegenerateKind | None = None
    choice_index: int | None = None

    @property
    def degenerate(self) -> bool:
        return self.kind is not None


CLEAN = Verdict()

_WHITESPACE = re.compile(r"\s+")

#: One leaked tokenizer artifact: SentencePiece/BERT/GPT specials, byte-fallback
#: tokens, chat-template markers, and U+FFFD (bytes that did not decode).
ARTIFACT = (
    r"(?:<unk>|<pad>|<mask>|</?s>|<\|[A-Za-z0-9_]{1,40}\|>|\[(?:PAD|UNK|CLS|SEP|MASK)\]"
    r"|<0x[0-9A-Fa-f]{2}>|\ufffd)"
)
_ARTIFACT_RUN = re.compile(rf"{ARTIFACT}(?:\s*{ARTIFACT})*")
_ARTIFACT_ONE = re.compile(ARTIFACT)
#: An artifact at the end of a stream's held text, perhaps followed by the start
#: of another one that has not fully arrived ("<unk><un").
ARTIFACT_AT_END = re.compile(rf"{ARTIFACT}\s*(?:<[^\s<>]{{0,40}}|\[[A-Za-z]{{0,5}})?\Z")
#: Shortest overlap for the stream hold-back to call a text "repeating itself"...
_LOOP_MIN_OVERLAP = 3
#: ...after a lead of at most this many characters.
_LOOP_MAX_LEAD = 12


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """What one choice said, however it arrived."""

    content: str = ""
    reasoning: str = ""
    tool_arguments: tuple[str, ...] = ()
    finish_reason: str | None = None
    #: Tokens generated for this choice, when known (usage, or the stream's pieces).
    tokens: int | None = None
    #: A sampled token's logprob was null: its logits were NaN.
    nan_logits: bool = False


def _never_found(text: str) -> None:
    """``Detector.find_candidate`` when every punctuation character is ignored."""


class Detector:
    """Compiled detectors for one DetectorSettings; cheap to call, safe to share."""

    def __init__(self, settings: DetectorSettings) -> None:
        self.settings = settings
        self.candidates = frozenset(string.punctuation) - frozenset(settings.punct_ignore)
        escaped = "".join(re.escape(c) for c in sorted(self.candidates))
        self._run_pattern = (
            re.compile(rf"([{escaped}])(?:\s*\1){{{settings.punct_min_run - 1},}}")
            if escaped
            else None
        )
        self._deny = [re.compile(p) for p in settings.deny_patterns]
        self._letter_run = re.compile(rf"([A-Za-z])(?:\s*\1){{{settings.letter_min_run - 1},}}")
        #: The first punctuation character punct_run counts in a text, or None.
        self.find_candidate: Callable[[str], re.Match[str] | None] = (
            re.compile(f"[{escaped}]").search if escaped else _never_found
        )

    # -- text detectors ---------------------------------------------------------

    def punct_run(self, text: str, *, complete: bool = True) -> bool:
        """A run of one repeated punctuation character dominates or ends the text.

        ``complete``: the text is the whole output, so "nothing but a short run"
        counts too; a stream still running may yet continue after the run.
        """
        if not self.settings.punct_run or self._run_pattern is None:
            return False
        tail = trailing_run(text, self.candidates)
        if tail >= self.settings.punct_min_tail_run:
            return True
        if complete and tail >= self.settings.punct_min_whole and tail == _visible_length(text):
            return True
        visible = 0
        for match in self._run_pattern.finditer(text):
            if not visible:
                visible = _visible_length(text)
            char = match.group(1)
            if text.count(char) >= self.settings.punct_min_share * visible:
                return True
        return False

    def token_loop(self, text: str) -> bool:
        """The text ends with one short unit (that has a letter) repeated many times."""
        if not self.settings.token_loop:
            return False
        return ends_in_loop(
            text.rstrip(),
            self.settings.token_loop_min_repeats,
            self.settings.token_loop_max_unit_chars,
        )

    def letter_run(self, text: str, *, complete: bool = True) -> bool:
        """One ASCII letter repeated makes up nearly all of a long output ("ssss...")."""
        s = self.settings
        if not s.letter_run:
            return False
        min_run = s.letter_min_run if complete else 4 * s.letter_min_run
        visible = 0
        for match in self._letter_run.finditer(text):
            run = _visible_length(match.group())
            if run < min_run:
                continue
            if not visible:
                visible = _visible_length(text)
            if run >= s.letter_min_share * visible:
                return True
        return False

    def deny_pattern(self, text: str) -> bool:
        return any(p.search(text) for p in self._deny)

    def special_tokens(self, text: str, *, complete: bool = True) -> bool:
        """A run of leaked tokenizer artifacts dominates or ends the text (or is all of it)."""
        s = self.settings
        if not s.special_tokens:
            return False
        visible = 0
        for match in _ARTIFACT_RUN.finditer(text):
            run = len(_ARTIFACT_ONE.findall(match.group()))
            if run < 3:
                continue
            if not visible:
                visible = _visible_length(text)
            run_visible = _visible_length(match.group())
            rest = text[match.end() :]
            if complete and run >= 3 and run_visible == visible:
                return True  # nothing but artifacts
            if run < s.special_min_run:
                continue
            if run_visible >= s.special_min_share * visible:
                return True
            if not rest.strip() and run >= s.special_min_tail_run:
                return True
        return False

    def text_kind(self, text: str, *, complete: bool = True) -> DegenerateKind | None:
        if not text:
            return None
        if self.punct_run(text, complete=complete):
            return DegenerateKind.PUNCT_RUN
        if self.special_tokens(text, complete=complete):
            return DegenerateKind.SPECIAL_TOKENS
        if self.token_loop(text):
            return DegenerateKind.TOKEN_LOOP
        if self.letter_run(text, complete=complete):
            return DegenerateKind.LETTER_RUN
        if self._deny and self.deny_pattern(text):
            return DegenerateKind.DENY_PATTERN
        return None

    # -- choice and body --------------------------------------------------------

    def choice_kind(self, choice: ChoiceOutput) -> DegenerateKind | None:
        s = self.settings
        if s.nan_logits and choice.nan_logits:
            return DegenerateKind.NAN_LOGITS  # the mechanism itself: before any look
        if s.repetition and choice.finish_reason == "repetition":
            return DegenerateKind.REPETITION
        for text in (choice.content, choice.reasoning, *choice.tool_arguments):
            kind = self.text_kind(text)
            if kind is not None:
                return kind
        if s.malformed_tool_call and any(not _is_json(args) for args in choice.tool_arguments):
            return DegenerateKind.MALFORMED_TOOL_CALL
        if s.empty and not choice.tool_arguments and not choice.content.strip():
            # Reasoning that ran out of tokens before the answer is a model thinking
            # long, not corruption (unless configured otherwise).
            thinking_cut_short = choice.finish_reason == "length" and choice.reasoning.strip()
            # One token that is whitespace (or part of a character) at the length
            # limit is a legitimate max_tokens=1 answer, not an empty one.
            one_token_cut = choice.finish_reason == "length" and choice.tokens == 1
            if one_token_cut:
                return None
            if not thinking_cut_short or s.empty_with_reasoning_on_length:
                return DegenerateKind.EMPTY
        return None

    def inspect_choices(self, choices: Iterable[tuple[int, ChoiceOutput]]) -> Verdict:
        for index, choice in choices:
            kind = self.choice_kind(choice)
            if kind is not None:
                return Verdict(kind, index)
        return CLEAN


#: Characters a leaked tokenizer artifact (ARTIFACT) can start and end with.
ARTIFACT_STARTS = frozenset("<[\ufffd")
ARTIFACT_ENDS = frozenset(">]\ufffd")


#: Tokenizer artifacts ending a text, or the start of one still arriving ("<unk><un",
#: "<|endof"), whitespace between them allowed.
_ARTIFACTS_AT_END = re.compile(
    rf"\s*(?:{ARTIFACT}\s*)*(?:{ARTIFACT}|<[^\s<>]{{0,40}}|\[[A-Za-z]{{0,5}})\Z"
)
#: The unsettled tail is looked for in at most this many last characters: a run
#: longer than the detectors' thresholds is decided before it gets there.
_UNSETTLED_SCAN = 1024


def unsettled_start(text: str, candidates: frozenset[str]) -> int:
    """Where the end of ``text`` that could still become one of the bug's signatures
    starts (``len(text)``: nothing could): a trailing run of one punctuation
    character (whitespace between repeats), trailing tokenizer artifacts or the start
    of one, a trailing run of one letter, and trailing whitespace, which a chat
    template may strip from the text a continuation is asked to continue. A stream's
    rolling hold-back keeps this part back (``gateway.guard.tail``); the earliest
    start any of them gives wins, so an artifact ending in punctuation (``[PAD]``) is
    held whole, not from its ``]``."""
    end = len(text)
    while end and text[end - 1].isspace():
        end -= 1
    if not end:
        return 0
    start = end
    last = text[end - 1]
    floor = max(0, end - _UNSETTLED_SCAN)
    if last in candidates or (last.isascii() and last.isalpha()):
        # The run and the whitespace before it: the text a continuation continues
        # ends on a settled character, whatever a template strips.
        position = end - 1
        while position > floor and (text[position - 1] == last or text[position - 1].isspace()):
            position -= 1
        if last in candidates or (
            end - position >= LETTER_RUN_HELD and text.count(last, position, end) >= LETTER_RUN_HELD
        ):
            start = position
    if last in ARTIFACT_ENDS or "<" in text[-48:] or "[" in text[-8:]:
        match = _ARTIFACTS_AT_END.search(text, floor, end)
        if match is not None:
            start = min(start, match.start())
    return start


#: A run of one letter is held from this many repeats ("aaa", "s s s"): no English
#: word repeats a letter three times, and "www" or "zzz" is released with the next
#: token. The detector's ``letter_run`` decides whether a held run is degenerate.
LETTER_RUN_HELD = 3
#: A repeating end is held once this many characters of its next copy matched:
#: shorter overlaps ("the" twice in a sentence) are ordinary text, held too often.
REPEAT_MIN_OVERLAP = 4


def repeat_start(text: str, max_unit: int) -> int:
    """Where the copies after the first of a unit repeating at the end of ``text``
    start (``len(text)``: the end does not repeat): the unit is at most ``max_unit``
    characters, has a letter and two distinct characters (what ``token_loop`` can
    call a loop), and at least ``REPEAT_MIN_OVERLAP`` characters of its next copy
    are there. "the cat sat. the cat" -> the second "the cat". A stream's rolling
    hold-back keeps the copies back (``gateway.guard.tail``): if they become a loop,
    they are dropped and the answer continued from the end of the first copy; when
    the repetition breaks, they go out."""
    n = len(text)
    overlap = REPEAT_MIN_OVERLAP
    if n < 2 * overlap:
        return n
    ending = text[n - overlap :]
    lowest = max(0, n - overlap - max_unit)
    # A period p works only if the last characters recur p places before the end.
    at = text.rfind(ending, lowest, n - 1)
    best = n
    while at >= 0:
        period = n - overlap - at
        if _loop_unit_counts(text[n - period :]):
            best = min(best, _periodic_from(text, n - overlap - period, period) + period)
        at = text.rfind(ending, lowest, at + overlap - 1) if at > lowest else -1
    return best


def _periodic_from(text: str, begin: int, period: int) -> int:
    """Where the stretch of ``text`` with period ``period`` that reaches ``begin`` from
    the right starts: extended backwards in doubling steps, then halving ones (slices,
    not characters). Prose stops at once: the character before already differs."""
    step = 1
    while (
        begin >= step and text[begin - step : begin] == text[begin - step + period : begin + period]
    ):
        begin -= step
        step *= 2
    while step > 1:
        step //= 2
        if (
            begin >= step
            and text[begin - step : begin] == text[begin - step + period : begin + period]
        ):
            begin -= step
    return begin


def first_visible(parts: list[str]) -> str:
    """The first non-whitespace character of the pieces, or ""."""
    for part in parts:
        stripped = part.lstrip()
        if stripped:
            return stripped[0]
    return ""


def _visible_length(text: str) -> int:
    return len(text) - sum(len(ws) for ws in _WHITESPACE.findall(text))


def trailing_run(text: str, candidates: frozenset[str]) -> int:
    """Length of the run of one candidate character ending the text, whitespace skipped."""
    run_char = ""
    run = 0
    for char in reversed(text):
        if char.isspace():
            continue
        if run_char:
            if char != run_char:
                break
        elif char in candidates:
            run_char = char
        else:
            break
        run += 1
    return run


def ends_in_loop(text: str, min_repeats: int, max_unit: int) -> bool:
    n = len(text)
    last = text[-1:]
    # A unit length can only work if the last character recurs that many places
    # before it: only those are tried, shortest first (as ``repeats_itself`` does).
    longest = min(max_unit, n // min_repeats)
    before = n - 1
    while last and (before := text.rfind(last, n - 1 - longest, before)) >= 0:
        unit_len = n - 1 - before
        # Cheap test first: the last two units are equal (most texts fail here).
        if text[n - 2 * unit_len : n - unit_len] != text[n - unit_len :]:
            continue
        unit = text[-unit_len:]
        if text.endswith(unit * min_repeats) and _loop_unit_counts(unit):
            return True
    # One non-ASCII letter over and over ("我我我..."): twice the repeats, since a
    # short run can be legitimate ("哈哈哈" is laughter).
    repeats = 2 * min_repeats
    return (
        bool(last)
        and not last.isascii()
        and last.isalpha()
        and len(text) >= repeats
        and text.endswith(last * repeats)
    )


_LETTER = re.compile(r"[^\W\d_]")


@lru_cache(maxsize=1024)
def _loop_unit_counts(unit: str) -> bool:
    # A unit with no letter ("0, ", "|---") or a single distinct character ("zzz",
    # "AAAA" of base64) is left to punct_run or treated as legitimate data.
    return _LETTER.search(unit) is not None and len(set(unit.replace(" ", ""))) >= 2


def repeats_itself(text: str, max_unit: int) -> bool:
    """The text so far is one unit of up to ``max_unit`` characters over and over,
    with at least a few characters of the repeat already there ("the the t"),
    perhaps after a word or two ("Answer: click here click here cl")."""
    n = len(text)
    if n <= _LOOP_MIN_OVERLAP:
        return False
    # A period p can only work if the last character recurs p places before it: the
    # candidates come from a few rfind calls instead of a comparison per length.
    last = text[-1]
    lowest = max(0, n - 1 - max_unit)
    periods = []
    at = text.rfind(last, lowest, n - 1)
    while at >= 0:
        periods.append(n - 1 - at)
        at = text.rfind(last, lowest, at)
    if not periods:
        return False
    starts = [0]
    starts.extend(i + 1 for i, c in enumerate(text[:_LOOP_MAX_LEAD]) if c == " ")
    for start in starts:
        longest = n - start - _LOOP_MIN_OVERLAP
        for period in periods:
            if period <= longest and text[start + period :] == text[start : n - period]:
                return True
    return False


def _is_json(text: str) -> bool:
    if not text.strip():
        return True  # some servers send "" for a call without arguments
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


def as_text(value: object) -> str:
    """A JSON value that should be a string: itself, or "" when it is not one."""
    return value if isinstance(value, str) else ""


def choice_index(choice: Mapping[str, Any], default: int) -> int:
    index = choice.get("index")
    return index if isinstance(index, int) else default
