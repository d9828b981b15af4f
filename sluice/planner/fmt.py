"""How numbers read in the plan's formulas: thousands separators, four significant
digits, and the units people write (GB, ms, %, $), so that a formula such as
"10,000 users × 0.08 = 800 sequences" can be checked by eye."""

from __future__ import annotations

import math


def num(x: float, sig: int = 4) -> str:
    """1,401,600 · 55.56 · 8.825 · 0.08 — whole numbers at and above 1,000, else `sig` digits."""
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    if abs(x) >= 1000:
        return f"{round(x):,}"
    digits = max(0, sig - 1 - math.floor(math.log10(abs(x))))
    text = f"{x:.{digits}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def count(x: float) -> str:
    """A whole count: 10,000 · 800."""
    return f"{round(x):,}"


def gb(x: float) -> str:
    return f"{num(x / 1e9)} GB"


def tb_s(x: float) -> str:
    return f"{num(x / 1e12)} TB/s"


def tflops(x: float) -> str:
    return f"{num(x / 1e12)} TFLOP/s"


def gflop(x: float) -> str:
    return f"{num(x / 1e9)} GFLOP"


def ms(x: float) -> str:
    return f"{num(x * 1e3, 3)} ms" if math.isfinite(x) else "unbounded"


def pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def usd(x: float) -> str:
    if abs(x) >= 1000:
        return f"${round(x):,}"
    return f"${x:,.2f}"


def kv_bytes(x: float) -> str:
    """Per-token KV sizes are exact powers of two: '20,480 B (20 KiB)'."""
    kib = x / 1024
    return f"{count(x)} B ({num(kib)} KiB)" if kib >= 1 else f"{num(x)} B"


def times(x: float) -> str:
    return f"{num(x, 3)}×"


UNIT_FORMATS = {
    "B": gb,
    "B/token": kv_bytes,
    "s": ms,
    "fraction": pct,
    "usd": usd,
    "FLOP": gflop,
    "FLOP/s": tflops,
    "B/s": tb_s,
    "x": times,
}


def value(x: float, unit: str) -> str:
    """A figure's value in its unit, e.g. value(0.00907, "s") == "9.07 ms"."""
    formatter = UNIT_FORMATS.get(unit)
    if formatter is not None:
        return formatter(x)
    return f"{num(x)} {unit}".rstrip()
