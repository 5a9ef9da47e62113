"""Percentiles of one run's latencies, and the spread of a figure over repeated runs."""

from __future__ import annotations

import math
import statistics


def quantile(sorted_values: list[float], p: float) -> float:
    """The `p` quantile (0..1) of ascending values, linear interpolation between neighbours."""
    k = (len(sorted_values) - 1) * p
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def percentiles(values: list[float | None], scale: float = 1.0, digits: int = 1) -> dict:
    """p50/p95/p99 and mean of the values that are not None, times `scale`, rounded to `digits`;
    every entry None when there are none."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    return {
        **{f"p{int(p * 100)}": round(quantile(vals, p) * scale, digits) for p in (0.5, 0.95, 0.99)},
        "mean": round(sum(vals) / len(vals) * scale, digits),
    }


def spread(values: list[float | None]) -> dict | None:
    """n, min, median, max, mean and sample sd (0 for one value) of the values that are not None
    (one per repeat); None when there are none."""
    vals = sorted(float(v) for v in values if v is not None)
    if not vals:
        return None
    return {
        "n": len(vals),
        "min": vals[0],
        "median": statistics.median(vals),
        "max": vals[-1],
        "mean": statistics.fmean(vals),
        "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0,
    }


def spread_text(s: dict | None, digits: int = 1, pct: bool = False, scale: float = 1.0) -> str:
    """A `spread`'s median times `scale` (`pct`: as a whole percent), with (min-max) when they
    differ; "-" for None."""
    if s is None:
        return "-"
    f = (lambda v: f"{100 * v:.0f}") if pct else (lambda v: f"{v * scale:.{digits}f}")
    mid = f(s["median"])
    return mid if s["min"] == s["max"] else f"{mid} ({f(s['min'])}-{f(s['max'])})"


def median_text(vals: list, digits: int = 1, scale: float = 1.0) -> str:
    """The median of `vals` (None left out) times `scale`, with (min-max) when they differ; "-"
    without any."""
    s = spread([None if v is None else v * scale for v in vals])
    if s is None:
        return "-"
    mid = f"{s['median']:.{digits}f}"
    return mid if s["min"] == s["max"] else f"{mid} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
