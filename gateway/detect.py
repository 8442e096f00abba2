"""Pure detectors of degenerate output: text in, verdict out.

Two forms share one definition of each detector:

* ``Detector.inspect_body`` reads a whole (non-streaming) response body;
* ``Detector.stream_inspector()`` returns a ``StreamInspector`` fed chunk by chunk.

Precision over recall (DESIGN.md, invariant 7): every threshold errs towards
leaving legitimate text alone. ``tests/data/`` holds the false-positive corpus that
pins this.

``punct_run`` only considers ASCII punctuation that is not in the ignore set.
Emoji, CJK and letters are never "punctuation", and characters that form long
legitimate runs (``-=_.*#~`|+/\\<>``: rules, tables, ellipses, banners, arrows) are
ignored by default.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
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
_ARTIFACT_AT_END = re.compile(rf"{ARTIFACT}\s*(?:<[^\s<>]{{0,40}}|\[[A-Za-z]{{0,5}})?\Z")
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

    def inspect_body(self, body: Mapping[str, Any]) -> Verdict:
        """Inspect a chat.completion or text_completion body."""
        return self.inspect_choices(body_choices(body))

    def stream_inspector(self) -> StreamInspector:
        return StreamInspector(self)


def body_choices(body: Mapping[str, Any]) -> list[tuple[int, ChoiceOutput]]:
    """Each choice of a chat.completion or text_completion body, with its index."""
    choices = body.get("choices")
    if not isinstance(choices, list):
        return []
    usage = body.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    # Usage counts every choice's tokens: it is one choice's only when there is one.
    known = tokens if isinstance(tokens, int) and len(choices) == 1 else None
    return [
        (choice_index(c, i), choice_output(c, tokens=known))
        for i, c in enumerate(choices)
        if isinstance(c, dict)
    ]


def choice_output(choice: Mapping[str, Any], tokens: int | None = None) -> ChoiceOutput:
    """Read one choice of a chat or completions body (non-streaming)."""
    message = choice.get("message")
    finish = choice.get("finish_reason")
    finish_reason = finish if isinstance(finish, str) else None
    if isinstance(message, dict):
        return ChoiceOutput(
            content=as_text(message.get("content")),
            reasoning=as_text(message.get("reasoning_content"))
            or as_text(message.get("reasoning")),
            tool_arguments=_tool_arguments(message.get("tool_calls")),
            finish_reason=finish_reason,
            tokens=tokens,
        )
    return ChoiceOutput(
        content=as_text(choice.get("text")), finish_reason=finish_reason, tokens=tokens
    )


#: Characters a leaked tokenizer artifact (ARTIFACT) can start with.
_ARTIFACT_STARTS = frozenset("<[\ufffd")


def _first_visible(parts: list[str]) -> str:
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


@lru_cache(maxsize=1024)
def _loop_unit_counts(unit: str) -> bool:
    # A unit with no letter ("0, ", "|---") or a single distinct character ("zzz",
    # "AAAA" of base64) is left to punct_run or treated as legitimate data.
    letters = any(c.isalpha() for c in unit)
    return letters and len(set(unit.replace(" ", ""))) >= 2


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


def _tool_arguments(tool_calls: object) -> tuple[str, ...]:
    if not isinstance(tool_calls, list):
        return ()
    out = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            out.append(as_text(function.get("arguments")))
    return tuple(out)


# -- streams --------------------------------------------------------------------


@dataclass(slots=True)
class PunctTracker:
    """Incremental punct_run: the same rule as Detector.punct_run, fed piece by piece."""

    detector: Detector
    visible: int = 0
    run_char: str = ""
    run: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    long_run_chars: set[str] = field(default_factory=set)
    #: A run long enough to matter has been seen: ``degenerate`` is worth asking.
    suspect: bool = False

    def feed(self, text: str) -> None:
        if self.detector.find_candidate(text) is None:
            # No punctuation that could form a run: count the visible characters and
            # end the current run, without looking at each character. (str.split()
            # splits at exactly the characters str.isspace() accepts.)
            visible = len("".join(text.split()))
            if visible:
                self.visible += visible
                self.run_char, self.run = "", 0
            return
        candidates = self.detector.candidates
        settings = self.detector.settings
        min_run = settings.punct_min_run
        suspect_run = min(min_run, settings.punct_min_tail_run)
        for char in text:
            if char.isspace():
                continue
            self.visible += 1
            if char in candidates:
                self.counts[char] = self.counts.get(char, 0) + 1
                if char == self.run_char:
                    self.run += 1
                else:
                    self.run_char, self.run = char, 1
                if self.run >= suspect_run:
                    self.suspect = True
                    if self.run >= min_run:
                        self.long_run_chars.add(char)
            else:
                self.run_char, self.run = "", 0

    def degenerate(self, *, complete: bool = False) -> bool:
        s = self.detector.settings
        if not s.punct_run:
            return False
        if not self.suspect and not complete:
            return False  # no run has reached either threshold
        if self.run >= s.punct_min_tail_run:
            return True
        if complete and self.run >= s.punct_min_whole and self.run == self.visible:
            return True
        return any(self.counts[c] >= s.punct_min_share * self.visible for c in self.long_run_chars)


@dataclass(slots=True)
class _StreamChoice:
    content: PunctTracker
    reasoning: PunctTracker
    content_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    tool_arguments: dict[int, list[str]] = field(default_factory=dict)
    tool_visible: int = 0
    finish_reason: str | None = None

    @property
    def visible(self) -> int:
        return self.content.visible + self.reasoning.visible + self.tool_visible

    def texts(self) -> tuple[str, ...]:
        """The choice's held text per field (content, reasoning, tool arguments)."""
        tools = "".join("".join(parts) for _, parts in sorted(self.tool_arguments.items()))
        return ("".join(self.content_parts), "".join(self.reasoning_parts), tools)

    def output(self, tokens: int | None = None) -> ChoiceOutput:
        return ChoiceOutput(
            content="".join(self.content_parts),
            reasoning="".join(self.reasoning_parts),
            tool_arguments=tuple(
                "".join(parts) for _, parts in sorted(self.tool_arguments.items())
            ),
            finish_reason=self.finish_reason,
            tokens=tokens,
        )


class StreamInspector:
    """Follows a chat or completions SSE stream chunk by chunk."""

    def __init__(self, detector: Detector) -> None:
        self.detector = detector
        self.choices: dict[int, _StreamChoice] = {}
        #: Visible (non-whitespace) characters of content, reasoning and tool calls.
        self.visible_chars = 0
        #: From the stream's usage chunk (the gateway always asks for it), when it came.
        self.completion_tokens: int | None = None
        self.finished = False
        #: Some punctuation run has reached a threshold: ``partial_verdict`` may find one.
        self.suspect = False

    def _choice(self, index: int) -> _StreamChoice:
        state = self.choices.get(index)
        if state is None:
            state = _StreamChoice(PunctTracker(self.detector), PunctTracker(self.detector))
            self.choices[index] = state
        return state

    @property
    def has_first_choice(self) -> bool:
        """Choice 0 has been seen: its text events may take ``feed_first_choice``."""
        return 0 in self.choices

    def feed_first_choice(self, pieces: list[str]) -> None:
        """Text events of choice 0 (content, or a completion's text), in order, that
        carried nothing else: what ``feed`` does with each, done once for all."""
        self.feed_first_text("".join(pieces))

    def feed_first_text(self, text: str) -> None:
        """One text event of choice 0 that carried nothing else (``feed_first_choice``):
        ``_feed_text`` spelled out, as it runs once per streamed token."""
        if text:
            first = self.choices[0]
            tracker = first.content
            before = tracker.visible
            tracker.feed(text)
            first.content_parts.append(text)
            self.visible_chars += tracker.visible - before
            if tracker.suspect:
                self.suspect = True

    def feed(self, chunk: Mapping[str, Any]) -> None:
        choices = chunk.get("choices")
        if type(choices) is not list:
            return
        if len(choices) == 1 and self._feed_plain(choices[0]):
            return
        for position, raw in enumerate(choices):
            if not isinstance(raw, dict):
                continue
            state = self._choice(choice_index(raw, position))
            delta = raw.get("delta")
            if isinstance(delta, dict):
                self._feed_delta(state, delta)
            else:
                self._feed_text(state.content, state.content_parts, as_text(raw.get("text")))
            finish = raw.get("finish_reason")
            if isinstance(finish, str):
                state.finish_reason = finish

    def _feed_plain(self, raw: object) -> bool:
        """The common chunk (one choice, a delta with content only), fed with fewer
        lookups; False (nothing fed) for anything else."""
        if type(raw) is not dict:
            return False
        delta = raw.get("delta")
        if (
            type(delta) is not dict
            or delta.get("tool_calls") is not None
            or delta.get("reasoning_content") is not None
            or delta.get("reasoning") is not None
        ):
            return False
        index = raw.get("index", 0)
        state = self.choices.get(index) if type(index) is int else None
        if state is None:
            return False
        content = delta.get("content")
        if type(content) is str and content:
            tracker = state.content
            before = tracker.visible
            tracker.feed(content)
            state.content_parts.append(content)
            self.visible_chars += tracker.visible - before
            self.suspect = self.suspect or tracker.suspect
        finish = raw.get("finish_reason")
        if type(finish) is str:
            state.finish_reason = finish
        return True

    def _feed_delta(self, state: _StreamChoice, delta: Mapping[str, Any]) -> None:
        self._feed_text(state.content, state.content_parts, as_text(delta.get("content")))
        reasoning = as_text(delta.get("reasoning_content")) or as_text(delta.get("reasoning"))
        self._feed_text(state.reasoning, state.reasoning_parts, reasoning)
        tool_calls = delta.get("tool_calls")
        if isinstance(tool_calls, list):
            for position, call in enumerate(tool_calls):
                if not isinstance(call, dict):
                    continue
                index = choice_index(call, position)
                parts = state.tool_arguments.setdefault(index, [])
                function = call.get("function")
                if isinstance(function, dict):
                    args = as_text(function.get("arguments"))
                    if args:
                        parts.append(args)
                        state.tool_visible += len(args)
                        self.visible_chars += len(args)

    def open_choice(self, index: int) -> None:
        """An output has started (with no text yet): it is judged at the end even if
        no text ever comes, as an empty answer is."""
        self._choice(index)

    def feed_output(
        self,
        index: int,
        *,
        content: str = "",
        reasoning: str = "",
        tool_index: int = 0,
        tool_arguments: str | None = None,
        finish_reason: str | None = None,
    ) -> None:
        """One piece of an output, for APIs whose events name what they carry
        (Responses, Messages): text, reasoning, a tool call's arguments (a call with
        none yet counts as a call), or the output's finish reason."""
        state = self._choice(index)
        self._feed_text(state.content, state.content_parts, content)
        self._feed_text(state.reasoning, state.reasoning_parts, reasoning)
        if tool_arguments is not None:
            parts = state.tool_arguments.setdefault(tool_index, [])
            if tool_arguments:
                parts.append(tool_arguments)
                state.tool_visible += len(tool_arguments)
                self.visible_chars += len(tool_arguments)
        if finish_reason is not None:
            state.finish_reason = finish_reason

    def _feed_text(self, tracker: PunctTracker, parts: list[str], text: str) -> None:
        if text:
            before = tracker.visible
            tracker.feed(text)
            parts.append(text)
            self.visible_chars += tracker.visible - before
            self.suspect = self.suspect or tracker.suspect

    def partial_verdict(self) -> Verdict:
        """Verdict on what has arrived so far (the stream is still running)."""
        if not self.suspect:
            return CLEAN
        for index, state in self.choices.items():
            if state.content.degenerate() or state.reasoning.degenerate():
                return Verdict(DegenerateKind.PUNCT_RUN, index)
        return CLEAN

    def release_decision(self, min_release_chars: int, expected_choices: int) -> Verdict | None:
        """While a stream is held back: a degenerate verdict (reject it), CLEAN (release
        it: every choice is clearly healthy), or None (keep holding).

        A choice is clearly healthy once it shows ``min_release_chars`` visible
        characters and its text is no longer consistent with a degenerate pattern:
        it does not end in a run of one punctuation character or in a tokenizer
        artifact, and it does not repeat itself (a loop with a unit shorter than the
        text seen so far). Tool calls are held until they finish. Outputs that are
        degenerate from their first characters, the field's failure, therefore stay
        held until a detector decides.
        """
        partial = self.partial_verdict()
        if partial.degenerate:
            return partial
        if len(self.choices) < expected_choices:
            return None
        healthy = True
        for index, state in self.choices.items():
            if state.finish_reason is not None:  # this choice is complete: judge it whole
                if not state.tool_arguments and not "".join(state.content_parts).strip():
                    # Nothing to show: judged at the end of the stream, when the usage
                    # chunk says how many tokens it took (one whitespace token at the
                    # length limit is a legitimate max_tokens=1 answer).
                    healthy = False
                    continue
                kind = self.detector.choice_kind(self._output(state))
                if kind is not None:
                    return Verdict(kind, index)
                continue
            if state.visible < min_release_chars and not state.tool_visible:
                # Held whatever the detectors say (the punctuation trackers above
                # still reject at once): they run on more text, once, later.
                healthy = False
                continue
            texts = state.texts()
            for text in texts:
                kind = self.detector.text_kind(text, complete=False)
                if kind is not None:
                    return Verdict(kind, index)
            # A tool call is held until its choice finishes: its arguments are judged
            # whole (malformed JSON shows only at the end) and no client can act on
            # half a call anyway.
            if healthy and (
                state.visible < min_release_chars
                or state.tool_visible
                or any(map(self._suspicious, texts))
            ):
                healthy = False
        return CLEAN if healthy else None

    def hold_decision(
        self,
        min_release_chars: int,
        expected_choices: int,
        ceiling: int,
        *,
        full: bool = False,
        first_token: bool = False,
    ) -> Verdict | None:
        """``release_decision``, and at the ceiling (or when the held bytes are ``full``)
        a decision on what is held: the hold-back never outlasts its ceiling.
        ``first_token``: released as soon as ``first_token_release`` allows."""
        decision = self.release_decision(min_release_chars, expected_choices)
        if decision is None and first_token and self.first_token_release(expected_choices):
            decision = CLEAN
        if decision is None and (self.visible_chars >= ceiling or full):
            decision = self.holdback_verdict()
        return decision

    def first_token_release(self, expected_choices: int) -> bool:
        """Every choice has shown a first visible character that cannot start one of
        the bug's signatures: not punctuation that punct_run counts (a run of ``!``),
        not the start of a tokenizer artifact (``<``, ``[``, U+FFFD). An answer with
        nothing visible yet may still be empty; a tool call is held until it ends."""
        if len(self.choices) < expected_choices:
            return False
        for state in self.choices.values():
            if state.tool_arguments:
                return False
            first = _first_visible(state.content_parts) or _first_visible(state.reasoning_parts)
            if not first or first in self.detector.candidates or first in _ARTIFACT_STARTS:
                return False
        return True

    def _suspicious(self, text: str) -> bool:
        """The text so far could still become a degenerate pattern."""
        if not text:
            return False
        settings = self.detector.settings
        if trailing_run(text, self.detector.candidates) >= 2:
            return True
        if settings.special_tokens and _ARTIFACT_AT_END.search(text.rstrip()):
            return True
        return settings.token_loop and repeats_itself(
            text.lstrip(), settings.token_loop_max_unit_chars
        )

    def holdback_verdict(self) -> Verdict:
        """Verdict at the hold-back ceiling: cheap incremental checks plus the text
        detectors on what is held; nothing visible at all is an empty answer."""
        partial = self.partial_verdict()
        if partial.degenerate:
            return partial
        for index, state in self.choices.items():
            for text in state.texts():
                kind = self.detector.text_kind(text, complete=False)
                if kind is not None:
                    return Verdict(kind, index)
        if self.detector.settings.empty and self.visible_chars == 0:
            return Verdict(DegenerateKind.EMPTY, 0)
        return CLEAN

    def final_verdict(self) -> Verdict:
        """Verdict once the stream has ended (finish reasons known)."""
        return self.detector.inspect_choices(
            (index, self._output(state)) for index, state in sorted(self.choices.items())
        )

    def _output(self, state: _StreamChoice) -> ChoiceOutput:
        # Usage counts every choice's tokens: it is one choice's only when there is one.
        return state.output(self.completion_tokens if len(self.choices) == 1 else None)
