"""Presentation of the API's numbers: exact byte sizes, readable counts and durations, byte axes.

Formatting only; nothing here derives a new quantity from the data.
"""

from __future__ import annotations

import math

from commlens.vocab import BYTE_UNITS, format_bytes


def exact_bytes(n: float | int | None) -> str:
    """'120,320 B (118 KiB)': the exact value first, the readable one after."""
    if n is None:
        return "-"
    exact = f"{int(n):,}" if float(n) == int(n) else f"{n:,.3f}".rstrip("0").rstrip(".")
    return f"{exact} B" if abs(n) < 1024 else f"{exact} B ({format_bytes(n)})"


def num(x: float | int | None, digits: int = 4) -> str:
    """Counts as integers with separators, fractions with up to `digits` significant digits."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if float(x) == int(x) and abs(x) < 1e15:
        return f"{int(x):,}"
    return f"{x:,.{digits}g}" if abs(x) >= 1 else f"{x:.{digits}g}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f} %"


def duration_us(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.3g} s"
    if x >= 1e3:
        return f"{x / 1e3:.3g} ms"
    return f"{x:.3g} µs"


def byte_axis(max_value: float, min_value: float = 0.0, log: bool = False) -> dict[str, list]:
    """tickvals/ticktext for an axis of bytes, labelled in binary units.

    Linear: about six ticks at a 1-2-5 multiple of the largest binary unit below the range.
    Log: one tick per power of 4 (…, 1 KiB, 4 KiB, 16 KiB, …) inside the range.
    """
    if max_value <= 0:
        return {"tickvals": [0], "ticktext": ["0 B"]}
    if log:
        lo = max(min_value, 1.0)
        k0 = math.floor(math.log2(lo) / 2) * 2
        k1 = math.ceil(math.log2(max_value) / 2) * 2
        vals = [2.0**k for k in range(k0, k1 + 1, 2)]
        return {"tickvals": vals, "ticktext": [format_bytes(v) for v in vals]}
    unit = 1024 ** min(int(math.log(max_value, 1024)) if max_value >= 1 else 0, len(BYTE_UNITS) - 1)
    span = max_value / unit
    raw = span / 5
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw) * unit
    vals = [i * step for i in range(int(max_value // step) + 2)]
    return {"tickvals": vals, "ticktext": [format_bytes(v) for v in vals]}


def _step_125(span: float) -> float:
    """The 1-2-5 multiple of a power of ten that cuts `span` into at most about five steps."""
    raw = span / 5
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def duration_axis(max_us: float) -> dict[str, list]:
    """tickvals/ticktext for an axis of microseconds: 1-2-5 steps labelled µs, ms or s."""
    if max_us <= 0:
        return {"tickvals": [0], "ticktext": ["0 µs"]}
    step = _step_125(max_us)
    vals = [i * step for i in range(int(max_us // step) + 2)]
    return {"tickvals": vals, "ticktext": [duration_us(v) for v in vals]}
