"""tools/sgl_vtoken_tools/cli/recall.py without a server: `--render` of several runs (trial ranges) gives one
summary per setting over all their trials; bad ranges are refused naming the flags; `--split`
plays that split's sessions and `--recall-defaults` leaves the recall rule to the server."""

import json

import pytest


@pytest.fixture(scope="module")
def eval_recall(command):
    return command("recall")


def _trial(setting, i, hit, live, recall_ms=None):
    turn = {
        "live_tokens": live,
        **({"recall_ms": recall_ms, "host_bytes": 1000 + i} if recall_ms else {}),
    }
    return {
        "kind": "trial",
        "setting": setting,
        "trial": f"recall-{i}",
        "hit": hit,
        "prompt_tokens": 600 + i,
        "turns": [turn],
    }


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_render_summarises_the_union_of_runs(eval_recall, tmp_path, capsys):
    first = _write(
        tmp_path / "a.jsonl",
        [
            {"kind": "config", "first": 0},
            _trial("full", 0, True, None),
            _trial("r128", 0, True, 256, 80.0),
            _trial("full", 1, True, None),
            _trial("r128", 1, False, 256, 90.0),
            {"kind": "summary", "setting": "full", "hits": 2, "trials": 2},
        ],
    )
    second = _write(
        tmp_path / "b.jsonl", [_trial("full", 2, True, None), _trial("r128", 2, True, 250, 120.0)]
    )
    eval_recall.main(["--render", first, second, "--plot", str(tmp_path / "p.png")])
    out = {s["setting"]: s for s in map(json.loads, capsys.readouterr().out.splitlines())}
    assert (out["full"]["hits"], out["full"]["trials"]) == (3, 3)
    assert (out["r128"]["hits"], out["r128"]["trials"], out["r128"]["accuracy"]) == (2, 3, 0.6667)
    assert (
        out["r128"]["recall_ms_median"] == 90.0 and out["r128"]["max_live_tokens_last_turn"] == 256
    )
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("argv", [["--first", "-1"], ["--trials", "0"]])
def test_bad_trial_ranges_are_refused(eval_recall, capsys, argv):
    with pytest.raises(SystemExit) as e:
        eval_recall.main([*argv, "--render", "unused.jsonl"])
    assert e.value.code == 2 and "--first must be >= 0 and --trials >= 1" in capsys.readouterr().err


def test_render_refuses_overlapping_trial_ranges(eval_recall, tmp_path, capsys):
    """A trial counted twice would inflate the table: the same (setting, trial) in two files is an error."""
    first = _write(
        tmp_path / "a.jsonl", [_trial("full", 0, True, None), _trial("full", 1, True, None)]
    )
    second = _write(tmp_path / "b.jsonl", [_trial("full", 1, False, None)])
    with pytest.raises(SystemExit) as e:
        eval_recall.main(["--render", first, second])
    assert (
        e.value.code == 2
        and "'full' has recall-1 twice (overlapping trial ranges)" in capsys.readouterr().err
    )


def test_split_plays_the_split_sessions_and_defaults_send_no_rule(
    eval_recall, tiny_tok, fake_essays
):
    args = eval_recall.build_parser().parse_args(
        [
            "--split",
            "heldout",
            "--trials",
            "3",
            "--first",
            "1",
            "--fillers",
            "2",
            "--filler-tokens",
            "40",
            "--recall-defaults",
        ]
    )
    trials = eval_recall.build_trials(args, tiny_tok, fake_essays)
    assert [t.id for t in trials] == [
        "session-heldout-0-1",
        "session-heldout-0-2",
        "session-heldout-0-3",
    ]
    assert all(t.task == "session" and len(t.messages) == 3 for t in trials)  # fillers + 2 turns
    assert eval_recall.server_config(args) == {"host_tokens": 1 << 20}
    args = eval_recall.build_parser().parse_args(["--score-layers", "15-16"])
    assert eval_recall.server_config(args) == {
        "host_tokens": 1 << 20,
        "recall_rounds": 4,
        "score_layers": [15, 16],
    }
    assert eval_recall.build_trials(args, tiny_tok, fake_essays)[0].task == "recall"
