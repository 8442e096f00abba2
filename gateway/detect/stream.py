"""The detectors applied to a stream as it arrives.

``StreamInspector`` follows one answer's stream: each choice's content, reasoning
and tool-call arguments, fed piece by piece (OpenAI chunk deltas directly; other
APIs' events through ``open_choice`` / ``feed_output``), with the punctuation run
tracked incrementally (``PunctTracker``). It answers the guard's questions about
what is held: degenerate already (``partial_verdict``), clearly healthy
(``release_decision``, ``first_token_release``), the verdict at the hold-back's
ceiling (``holdback_verdict``) and once the stream ended (``final_verdict``). When
to ask is the guard's release policy (``gateway.guard.release``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.detect.logprobs import sampled_logprob_is_nan
from gateway.detect.text import (
    ARTIFACT_AT_END,
    ARTIFACT_STARTS,
    CLEAN,
    ChoiceOutput,
    DegenerateKind,
    Detector,
    Verdict,
    as_text,
    choice_index,
    first_visible,
    repeats_itself,
    trailing_run,
)


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
    #: Where in the content a token with a null logprob (NaN logits) began, if one came.
    nan_at: int | None = None

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
            nan_logits=self.nan_at is not None,
        )

    def saw_nan(self) -> None:
        """The event about to be fed carried a token with a null logprob."""
        if self.nan_at is None:
            self.nan_at = sum(map(len, self.content_parts))


class StreamInspector:
    """Follows a chat or completions SSE stream chunk by chunk."""

    def __init__(self, detector: Detector, *, watch_nan: bool = False) -> None:
        self.detector = detector
        #: Events' logprobs are read for a sampled token's null (NaN logits): the
        #: request asked for them (``gateway.detect.logprobs``).
        self.watch_nan = watch_nan and detector.settings.nan_logits
        #: The first choice with a NaN-logit token, once one came.
        self.nan_choice: int | None = None
        self.choices: dict[int, _StreamChoice] = {}
        #: Visible (non-whitespace) characters of content, reasoning and tool calls.
        self.visible_chars = 0
        #: From the stream's usage chunk (the gateway always asks for it), when it came.
        self.completion_tokens: int | None = None
        self.finished = False
        #: Some punctuation run has reached a threshold: ``partial_verdict`` may find one.
        self.suspect = False
        #: Events that carried text (any field): vLLM streams one per engine step,
        #: a token each without speculative decoding (a continuation's token count).
        self.text_events = 0

    def watch_logprobs(self) -> None:
        """From here on events' logprobs are read for a NaN logit (the attempt asked
        for them)."""
        self.watch_nan = self.detector.settings.nan_logits

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
        self.text_events += len(pieces) - 1  # feed_first_text counts one
        self.feed_first_text("".join(pieces))

    def feed_first_text(self, text: str) -> None:
        """One text event of choice 0 that carried nothing else (``feed_first_choice``)."""
        first = self.choices[0]
        self._feed_text(first.content, first.content_parts, text)

    def feed(self, chunk: Mapping[str, Any]) -> None:
        choices = chunk.get("choices")
        if type(choices) is not list:
            return
        if len(choices) == 1 and self._feed_plain(choices[0]):
            return
        for position, raw in enumerate(choices):
            if not isinstance(raw, dict):
                continue
            index = choice_index(raw, position)
            state = self._choice(index)
            if self.watch_nan:
                self._watch_logprobs(state, raw.get("logprobs"), index)
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
        if self.watch_nan:
            self._watch_logprobs(state, raw.get("logprobs"), index)
        content = delta.get("content")
        if type(content) is str and content:
            tracker = state.content
            before = tracker.visible
            tracker.feed(content)
            state.content_parts.append(content)
            self.visible_chars += tracker.visible - before
            self.suspect = self.suspect or tracker.suspect
            self.text_events += 1
        finish = raw.get("finish_reason")
        if type(finish) is str:
            state.finish_reason = finish
        return True

    def _watch_logprobs(self, state: _StreamChoice, logprobs: object, index: int) -> None:
        """``logprobs``: the tokens of the piece about to be fed, in any API's shape."""
        if logprobs is not None and sampled_logprob_is_nan(logprobs):
            self.mark_nan(state, index)

    def mark_nan(self, state: _StreamChoice, index: int) -> None:
        """A token with a null logprob arrives next in ``state``: degenerate at once."""
        state.saw_nan()
        if self.nan_choice is None:
            self.nan_choice = index
        self.suspect = True

    def nan_offset(self, index: int = 0) -> int | None:
        """Where in choice ``index``'s content its NaN-logit token began, if one came."""
        state = self.choices.get(index)
        return state.nan_at if state is not None else None

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
        logprobs: object = None,
    ) -> None:
        """One piece of an output, for APIs whose events name what they carry
        (Responses, Messages): text, reasoning, a tool call's arguments (a call with
        none yet counts as a call), or the output's finish reason; ``logprobs``, the
        piece's tokens' (read for a NaN where ``watch_nan``)."""
        state = self._choice(index)
        if self.watch_nan:
            self._watch_logprobs(state, logprobs, index)
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
            self.text_events += 1
            before = tracker.visible
            tracker.feed(text)
            parts.append(text)
            self.visible_chars += tracker.visible - before
            self.suspect = self.suspect or tracker.suspect

    def partial_verdict(self) -> Verdict:
        """Verdict on what has arrived so far (the stream is still running)."""
        if not self.suspect:
            return CLEAN
        if self.nan_choice is not None:
            return Verdict(DegenerateKind.NAN_LOGITS, self.nan_choice)
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

    def first_token_release(self, expected_choices: int, *, content_only: bool = False) -> bool:
        """Every choice has shown a first visible character that cannot start one of
        the bug's signatures: not punctuation that punct_run counts (a run of ``!``),
        not the start of a tokenizer artifact (``<``, ``[``, U+FFFD). An answer with
        nothing visible yet may still be empty; a tool call is held until it ends.
        ``content_only``: an answer that starts with reasoning is not released so (a
        continuation cannot resume reasoning)."""
        if len(self.choices) < expected_choices:
            return False
        for state in self.choices.values():
            if state.tool_arguments or (content_only and state.reasoning_parts):
                return False
            first = first_visible(state.content_parts) or first_visible(state.reasoning_parts)
            if not first or first in self.detector.candidates or first in ARTIFACT_STARTS:
                return False
        return True

    def _suspicious(self, text: str) -> bool:
        """The text so far could still become a degenerate pattern."""
        if not text:
            return False
        settings = self.detector.settings
        if trailing_run(text, self.detector.candidates) >= 2:
            return True
        if settings.special_tokens and ARTIFACT_AT_END.search(text.rstrip()):
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
