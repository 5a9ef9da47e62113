"""The Naive-Evict / vToken fairness checks on hand-made cells."""

from sgl_vtoken_tools.bench.cells import Cell
from sgl_vtoken_tools.bench.checks import compare_cells, fair, repeat_consistency


def run(hashes: dict, evicted: int, cached: int = 0, errors=()):
    reqs = [
        {
            "session": s,
            "turn": t,
            "rid": f"burst-s{s}-t{t}",
            "output_hash": h,
            "error": "HTTP 500" if (s, t) in errors else None,
        }
        for (s, t), h in hashes.items()
    ]
    return {
        "requests": reqs,
        "summary": {"cached_tokens": cached, "vtoken": {"delta": {"evicted_tokens": evicted}}},
    }


def cell(mode, *runs):
    c = Cell(mode, "random", 128, 16, 4096)
    for r, x in enumerate(runs):
        c.repeat(r)["burst"] = x
    return c


H = {(0, 1): "a", (0, 2): "b", (1, 1): "c", (1, 2): "d"}


def test_identical_runs_are_fair():
    ch = compare_cells(
        cell("naive", run(H, 100, 0), run(H, 100, 0)),
        cell("vtoken", run(H, 100, 300), run(H, 100, 300)),
    )
    assert (ch["requests"], ch["identical"], ch["same_rids"], ch["unpaired"]) == (8, 8, 8, 0)
    assert (ch["runs"], ch["evicted_equal"], ch["cached"]) == (2, 2, [0, 600])
    assert ch["first_difference"] is None and fair(ch)


def test_a_differing_output_is_found_in_turn_order():
    other = {**H, (1, 1): "x", (0, 2): "y"}
    ch = compare_cells(cell("naive", run(H, 100)), cell("vtoken", run(other, 101)))
    assert ch["identical"] == 2 and ch["evicted_equal"] == 0
    # Turn 1 of session 1 comes before turn 2 of session 0: the earliest difference in a run.
    assert ch["first_difference"] == {
        "repeat": 0,
        "run": "burst",
        "session": 1,
        "turn": 1,
        "rid": "burst-s1-t1",
    }
    assert not fair(ch)


def test_failed_or_missing_requests_are_unpaired_and_unfair():
    ch = compare_cells(
        cell("naive", run(H, 100, errors={(1, 2)})), cell("vtoken", run({(0, 1): "a"}, 100))
    )
    assert ch["requests"] == 1 and ch["unpaired"] == 3 and not fair(ch)


def test_runs_on_one_side_only_are_not_compared():
    naive = cell("naive", run(H, 100))
    vtoken = cell("vtoken", run(H, 100))
    vtoken.repeat(0)["rate2"] = run(H, 50)  # the naive ladder stopped before rate 2
    ch = compare_cells(naive, vtoken)
    assert ch["one_sided_runs"] == 1 and ch["runs"] == 1 and ch["unpaired"] == 0 and fair(ch)


def test_repeat_consistency_counts_requests_answered_alike_every_time():
    other = {**H, (1, 2): "z"}
    assert repeat_consistency(cell("vtoken", run(H, 1), run(H, 1), run(other, 1))) == [3, 4]
    assert repeat_consistency(cell("vtoken", run(H, 1))) == [0, 0]  # one repeat: nothing to compare
