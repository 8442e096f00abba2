"""Detection of degenerate answers: ``text`` (pure detectors: text in, verdict out)
and ``stream`` (the same detectors applied as a stream arrives). The names every
other layer uses are re-exported here."""

from gateway.detect.stream import PunctTracker, StreamInspector
from gateway.detect.text import (
    CLEAN,
    ChoiceOutput,
    DegenerateKind,
    Detector,
    Verdict,
    as_text,
    choice_index,
)

__all__ = [
    "CLEAN",
    "ChoiceOutput",
    "DegenerateKind",
    "Detector",
    "PunctTracker",
    "StreamInspector",
    "Verdict",
    "as_text",
    "choice_index",
]
