"""Summary statistics of step times (seconds in, seconds out)."""

from __future__ import annotations

import statistics


def summarize(times: list[float]) -> dict:
    """{"n", "median", "q1", "q3", "iqr", "min", "max", "mean"}, in seconds; empty -> {"n": 0}."""
    if not times:
        return {"n": 0}
    xs = sorted(times)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"n": len(xs), "median": statistics.median(xs), "q1": q1, "q3": q3, "iqr": q3 - q1,
            "min": xs[0], "max": xs[-1], "mean": statistics.fmean(xs)}
