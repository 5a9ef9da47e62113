"""Percentiles of one run and the spread over repeats."""

import pytest

from sgl_vtoken_tools.bench.quantiles import percentiles, spread


def test_percentiles_interpolate_linearly_and_skip_none():
    p = percentiles([0.4, None, 0.1, 0.3, 0.2, 0.5], scale=1000)
    assert p["p50"] == 300.0  # median of 100..500 ms
    assert p["p95"] == pytest.approx(480.0)  # 400 + 0.8 x 100
    assert p["mean"] == 300.0
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None, "mean": None}
    assert percentiles([7.0])["p99"] == 7.0


def test_spread_over_repeats():
    s = spread([3, None, 1, 2])
    assert (s["n"], s["min"], s["median"], s["max"], s["mean"]) == (3, 1.0, 2.0, 3.0, 2.0)
    assert s["sd"] == pytest.approx(1.0)
    assert spread([5])["sd"] == 0.0
    assert spread([None, None]) is None
