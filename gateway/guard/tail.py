"""The rolling hold-back after release: a released stream's unsettled end is kept back.

Once a stream is released (``gateway.guard.release``), its text goes to the client
as it arrives, except its end where that could still become one of the bug's
signatures (``gateway.detect.text.unsettled_start``): a run of one punctuation
character (the ``!`` of NaN logits), tokenizer artifacts, a run of one letter,
trailing whitespace; and the copies after the first of a unit that repeats at the
end (``repeat_start``: it could become a loop). Held text is released as soon as
what follows settles it ("Wow!" goes out with the next word, a repetition that
breaks goes out with the token that breaks it), so a healthy stream is delayed by a
token, only after such an end, and never loses text. When the held end turns
degenerate (``signature``), none of it has been sent: the guard drops it and
continues the answer from exactly the text the client has.

The tail owns a guarded stream from its first byte: while the stream is still held
back before release (``HoldBack.hold``) its batches go through ``take`` too, so
the first release never sends an unsettled end, whatever arrives in one read.

Only a stream the guard can continue is held this way: one output whose text is
plain content (a continuation cannot resume reasoning or half a tool call). Once
anything else shows, everything held is released and the rest passes through as
before (``continuable`` False).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.detect import DegenerateKind, StreamInspector
from gateway.detect.text import (
    ARTIFACT_ENDS,
    LETTER_RUN_HELD,
    REPEAT_MIN_OVERLAP,
    repeat_start,
    unsettled_start,
)

#: The signatures a held end holds whole, from their first character: a run of one
#: punctuation character or of one letter, tokenizer artifacts, a loop (its copies
#: after the first).
CONTINUED_KINDS = frozenset({
    DegenerateKind.PUNCT_RUN, DegenerateKind.SPECIAL_TOKENS,
    DegenerateKind.LETTER_RUN, DegenerateKind.TOKEN_LOOP, DegenerateKind.NAN_LOGITS,
})  # fmt: skip
#: The kinds ``signature`` reports: what a held end that grew can become.
SIGNATURES_OF_HELD_TEXT = frozenset({
    DegenerateKind.TOKEN_LOOP, DegenerateKind.LETTER_RUN, DegenerateKind.SPECIAL_TOKENS,
})  # fmt: skip
#: Held text is judged by the detectors each time it has grown by this many
#: characters (a loop or a letter run is recognised while it is all held).
JUDGE_EVERY_CHARS = 32

#: Most bytes kept back at once: a flood of whitespace settles nothing, yet is not
#: the bug's signature; past this the held part is released.
MAX_TAIL_BYTES = 64 * 1024


@dataclass(slots=True)
class _HeldBatch:
    data: list[bytes]
    #: The stream's text offset and text-event count at this batch's end.
    text_end: int
    events_end: int


@dataclass(slots=True)
class TailHold:
    """One stream's rolling hold-back, across its continuations."""

    candidates: frozenset[str]
    inspector: StreamInspector
    #: The longest loop unit the detector recognises (0: loops are not held).
    max_unit: int = 0
    #: The stream can still be continued: one output, plain content so far.
    continuable: bool = True
    #: The text the client has been sent (its pieces), and how many text events
    #: (tokens, without speculative decoding) carried it.
    released_parts: list[str] = field(default_factory=list)
    released_chars: int = 0
    released_events: int = 0
    #: The bytes the client was sent up to its first text (the stream's opening
    #: events: its id), and the latest (a Responses stream's sequence number).
    first_bytes: bytes = b""
    latest_bytes: bytes = b""
    _held: list[_HeldBatch] = field(default_factory=list)
    _held_text: str = ""
    _held_bytes: int = 0
    #: Content pieces of the inspector's output already taken, and the text events
    #: counted before the current inspector (a continuation's inspector starts anew).
    _parts_seen: int = 0
    _events_before: int = 0
    #: The end of the released text, to see a repetition that began before the
    #: held part; and whether the held part is held as a repetition.
    _recent: str = ""
    _repeating: bool = False
    #: The held text's length when the detectors last judged it.
    _judged_at: int = 0
    #: Released text kept to see a run or a repetition that began in it: two loop
    #: units and the overlap, or an artifact's length.
    _recent_limit: int = 0

    def __post_init__(self) -> None:
        self._recent_limit = max(2 * self.max_unit + REPEAT_MIN_OVERLAP, 64)

    @property
    def released_text(self) -> str:
        return "".join(self.released_parts)

    @property
    def holding(self) -> bool:
        """Some text is held back (a degenerate end may be dropped)."""
        return bool(self._held_text)

    @property
    def has_released_text(self) -> bool:
        return bool(self.released_parts)

    def holds(self, kind: DegenerateKind) -> bool:
        """The degenerate end of this kind is held, not sent: it can be dropped and
        the answer continued. A loop only when its copies are what is held."""
        if kind is DegenerateKind.NAN_LOGITS:  # its token is held from its first character
            nan = self.inspector.nan_offset(0)
            return self.continuable and nan is not None and nan >= self.released_chars
        if not (self.continuable and self.holding and kind in CONTINUED_KINDS):
            return False
        if kind is DegenerateKind.TOKEN_LOOP:
            return self._repeating
        if kind is DegenerateKind.LETTER_RUN:  # the run, not a whitespace end, is held
            return len(self._held_text.strip()) >= LETTER_RUN_HELD
        return True

    def signature(self) -> DegenerateKind | None:
        """The kind of signature the held end has become, judged each time the held
        text grew by ``JUDGE_EVERY_CHARS``; None while it has not (and never a
        verdict on text already sent: a run of punctuation is the inspector's own).

        A held end that ends as a letter run or an artifact can is judged on the
        whole answer (``complete=False``, as the hold-back's ceiling judges it). A
        held repetition is first judged on the end of the answer only
        (``token_loop`` looks at its last ``min_repeats`` units, so the verdict is
        the whole answer's), and once that is a loop, on the whole answer, which
        names the kind. A long stream held a read at a time (text that repeats
        phrase by phrase) so costs a look at its end, not a scan of all of it."""
        held = self._held_text
        if len(held) - self._judged_at < JUDGE_EVERY_CHARS or not self.continuable:
            return None
        self._judged_at = len(held)
        visible = held.rstrip()
        if not visible:
            return None
        detector = self.inspector.detector
        if not self._ends_in_run(visible):
            if not self._repeating:
                return None
            settings = detector.settings
            span = settings.token_loop_min_repeats * settings.token_loop_max_unit_chars + 1
            span += len(held) - len(visible)  # the trailing whitespace token_loop strips
            if not detector.token_loop((self._recent + held)[-span:]):
                return None
        choice = self.inspector.choices.get(0)
        if choice is None:
            return None
        kind = detector.text_kind("".join(choice.content_parts), complete=False)
        if kind not in SIGNATURES_OF_HELD_TEXT:
            return None
        return kind if self.holds(kind) else None

    @staticmethod
    def _ends_in_run(visible: str) -> bool:
        """The held end could be a run of artifacts or of one letter (what
        ``unsettled_start`` holds), judged on the whole answer."""
        last = visible[-1]
        if last in ARTIFACT_ENDS:
            return True
        end = visible[-2 * LETTER_RUN_HELD :].replace(" ", "")[-LETTER_RUN_HELD:]
        return last.isalpha() and end == last * LETTER_RUN_HELD

    def follow(self, inspector: StreamInspector, events_before: int) -> None:
        """A continuation's inspector, fed the released text already (``events_before``
        of its text events stand for it)."""
        self.inspector = inspector
        choice = inspector.choices.get(0)
        self._parts_seen = len(choice.content_parts) if choice is not None else 0
        self._events_before = self.released_events - events_before

    def take(self, forward: list[bytes]) -> list[bytes]:
        """One batch of the stream's events: what may be sent now."""
        if not self.continuable:
            return forward
        if not self._take_text():
            return self.release_all(forward)
        text_end = len(self._held_text)
        keep_from = self._keep_from()
        held = self._held
        if not held and keep_from == text_end:
            # Nothing held and this batch ends settled (nearly every token): sent as is.
            self._sent(forward, text_end, self._events_before + self.inspector.text_events)
            return forward
        held.append(_HeldBatch(forward, text_end, self._events_before + self.inspector.text_events))
        self._held_bytes += len(forward[0]) if len(forward) == 1 else sum(map(len, forward))
        if self._held_bytes > MAX_TAIL_BYTES:
            return self.release_all()
        releasing = 0
        for batch in held:
            if batch.text_end > keep_from:
                break
            releasing += 1
        if not releasing:
            return []
        return self._release(releasing)

    def release_all(self, more: list[bytes] | None = None) -> list[bytes]:
        """Everything held (and ``more``): the stream ended clean, or cannot be continued."""
        out = self._release(len(self._held)) if self._held else []
        if more:
            out.extend(more)
        return out

    def drop(self) -> None:
        """The held end turned degenerate: it is never sent."""
        self._held.clear()
        self._held_text = ""
        self._held_bytes = 0
        self._judged_at = 0
        self._repeating = False

    def _keep_from(self) -> int:
        """Where in the held text the part that must stay held starts."""
        text = self._held_text
        recent = self._recent
        # Judged with the end of what was sent before it: a run or a repetition may
        # have begun there (then all that is held stays held).
        window = recent + text if recent else text
        keep = unsettled_start(window, self.candidates) - len(recent)
        if keep < 0:
            keep = 0
        if self.inspector.nan_choice is not None:
            # A token with NaN logits (its logprob null) is held whatever its text.
            nan = self.inspector.nan_offset(0)
            if nan is not None:
                keep = min(keep, max(0, nan - self.released_chars))
        self._repeating = False
        if self.max_unit and len(window) >= 2 * REPEAT_MIN_OVERLAP:
            repeated = repeat_start(window, self.max_unit) - len(recent)
            # Held as a repetition only while its second copy is held (at most the
            # overlap of it sent): copies already sent cannot be taken back.
            if -REPEAT_MIN_OVERLAP <= repeated < len(text):
                self._repeating = True
                keep = min(keep, max(0, repeated))
        return keep

    def _take_text(self) -> bool:
        """Take the output's new text into the held text; False (and no longer
        ``continuable``) once the stream shows what a continuation cannot resume."""
        inspector = self.inspector
        choice = inspector.choices.get(0)
        if choice is None:
            return True
        if len(inspector.choices) > 1 or choice.reasoning_parts or choice.tool_arguments:
            self.continuable = False
            return False
        parts = choice.content_parts
        if len(parts) > self._parts_seen:
            self._held_text += "".join(parts[self._parts_seen :])
            self._parts_seen = len(parts)
        return True

    def _release(self, count: int) -> list[bytes]:
        held = self._held
        if count == 1 and len(held[0].data) == 1:  # one read of one event: the common case
            last = held.pop(0)
            out = last.data
        else:
            batches = held[:count]
            del held[:count]
            last = batches[-1]
            out = [data for batch in batches for data in batch.data]
        for batch in held:
            batch.text_end -= last.text_end
        self._held_bytes -= sum(map(len, out))
        self._sent(out, last.text_end, last.events_end)
        return out

    def _sent(self, out: list[bytes], text_end: int, events: int) -> None:
        """``out`` goes to the client: with it the held text up to ``text_end``, and
        the stream's text events up to ``events``."""
        if out and not self.released_parts:
            # The stream's opening: every event sent up to its first text (a
            # Responses stream names its response and its message in two of them).
            self.first_bytes += b"".join(out)
        if text_end:
            part = self._held_text[:text_end]
            self.released_parts.append(part)
            self.released_chars += len(part)
            recent = self._recent + part
            self._recent = (
                recent[-self._recent_limit :] if len(recent) > self._recent_limit else recent
            )
            self._held_text = self._held_text[text_end:]
            self._judged_at = self._judged_at - text_end if self._judged_at > text_end else 0
        self.released_events = events
        if out:
            self.latest_bytes = out[-1]
