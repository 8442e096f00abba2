"""A dependency-free PNG line chart: two rate series (0..1) on one time axis.

Enough for ``vllm-guard probe --plot``: corruption rate and prefix-cache hit rate
over a run, so an operator sees the one track the other.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence

Color = tuple[int, int, int]

CORRUPTION_COLOR: Color = (214, 39, 40)
HIT_RATE_COLOR: Color = (31, 119, 180)
_AXIS: Color = (60, 60, 60)
_GRID: Color = (225, 225, 225)
_WHITE: Color = (255, 255, 255)


def _png(width: int, height: int, pixels: list[bytearray]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(_WHITE * width) for _ in range(height)]

    def dot(self, x: int, y: int, color: Color, size: int = 1) -> None:
        for dx in range(-size, size + 1):
            for dy in range(-size, size + 1):
                px, py = x + dx, y + dy
                if 0 <= px < self.width and 0 <= py < self.height:
                    self.rows[py][3 * px : 3 * px + 3] = bytes(color)

    def line(self, a: tuple[int, int], b: tuple[int, int], color: Color, size: int = 1) -> None:
        steps = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        for i in range(steps + 1):
            x = round(a[0] + (b[0] - a[0]) * i / steps)
            y = round(a[1] + (b[1] - a[1]) * i / steps)
            self.dot(x, y, color, size)


def rate_chart(
    series: Sequence[tuple[Sequence[tuple[float, float]], Color]],
    width: int = 800,
    height: int = 360,
) -> bytes:
    """``series``: (points as (seconds, rate 0..1), color). Returns PNG bytes."""
    canvas = _Canvas(width, height)
    left, right, top, bottom = 50, width - 20, 20, height - 40
    times = [t for points, _ in series for t, _ in points] or [0.0, 1.0]
    t0, t1 = min(times), max(times)
    span = (t1 - t0) or 1.0
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):  # horizontal grid at 0%, 25% ... 100%
        y = round(bottom - fraction * (bottom - top))
        canvas.line((left, y), (right, y), _GRID, size=0)
    canvas.line((left, top), (left, bottom), _AXIS)
    canvas.line((left, bottom), (right, bottom), _AXIS)

    def position(t: float, value: float) -> tuple[int, int]:
        x = round(left + (t - t0) / span * (right - left))
        y = round(bottom - max(0.0, min(1.0, value)) * (bottom - top))
        return x, y

    for points, color in series:
        ordered = sorted(points)
        for a, b in itertools.pairwise(ordered):
            canvas.line(position(*a), position(*b), color, size=1)
        for point in ordered:
            canvas.dot(*position(*point), color, size=2)
    # Legend swatches, top right: corruption first, then hit rate.
    for index, (_, color) in enumerate(series):
        x = right - 30 - index * 40
        canvas.line((x, top + 8), (x + 20, top + 8), color, size=2)
    return _png(width, height, canvas.rows)
