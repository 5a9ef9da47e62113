"""tools/sgl_vtoken_tools/cli/kvpress.py without kvpress: the budget -> compression ratio rule, the two prompt
modes, press options, the choice of a tuning run, the table and the StreamingLLM agreement oracle
on hand-made records."""

import json

import pytest


@pytest.fixture(scope="module")
def kv(command):
    return command("kvpress")


def test_ratio_keeps_exactly_the_budget(kv):
    # kvpress 0.5.5 keeps max(1, int(n * (1 - ratio))) (utils.compute_n_kept); StreamingLLM prunes
    # n - int(n * (1 - ratio)) tokens after its sinks
    for n in range(20, 4200, 13):
        for kept in {1, 16, 110, 128, 256, n - 1} - {k for k in (110, 128, 256) if k >= n}:
            r = kv.ratio_for(n, kept)
            assert 0 <= r < 1 and max(1, int(n * (1 - r))) == kept, (n, kept)
    with pytest.raises(ValueError, match="budget must lie in"):
        kv.ratio_for(100, 100)


def test_modes_split_the_prompt_at_the_question(kv):
    task = {"trial": "t", "prompt": list(range(300)), "question_at": 282}
    assert kv.split_prompt(task, "aware", 128) == (task["prompt"], [], 128)
    ctx, rest, keep = kv.split_prompt(task, "agnostic", 128)
    assert ctx + rest == task["prompt"] and len(rest) == 18 and keep + len(rest) == 128
    with pytest.raises(ValueError, match="smaller than the question"):
        kv.split_prompt(task, "agnostic", 18)
    with pytest.raises(ValueError, match="mode 'both'"):
        kv.split_prompt(task, "both", 128)


def _ours(setting, budget, trial, ids, hit):
    return {
        "kind": "trial",
        "task": "docqa",
        "setting": setting,
        "budget": budget,
        "trial": trial,
        "output_ids": ids,
        "hit": hit,
    }


def _press(press, mode, budget, trial, ids, hit):
    return {
        "kind": "press",
        "press": press,
        "mode": mode,
        "budget": budget,
        "trial": trial,
        "output_ids": ids,
        "hit": hit,
    }


RECORDS_OURS = [
    _ours("full", None, "a", [1, 2], True),
    _ours("full", None, "b", [3, 2], True),
    _ours("streamingllm", 128, "a", [5, 2], False),
    _ours("streamingllm", 128, "b", [6, 2], False),
    _ours("h2o", 128, "a", [1, 2], True),
    _ours("h2o", 128, "b", [7, 2], False),
]
RECORDS_PRESS = [
    _press("streamingllm", "aware", 128, "a", [5, 2], False),
    _press("streamingllm", "aware", 128, "b", [6, 9], False),
    _press("streamingllm", "agnostic", 128, "a", [5, 2], False),
    _press("snapkv", "aware", 128, "a", [1, 2], True),
    _press("snapkv", "aware", 128, "b", [3, 2], True),
]


def test_agreement_counts_equal_answers_per_budget():
    from sgl_vtoken_tools.bench.kvpress_table import agreement

    (a,) = agreement(RECORDS_OURS, RECORDS_PRESS)
    assert (a["budget"], a["equal"], a["trials"], a["differ"]) == (128, 1, 2, ["b"])


def test_report_tables_both_sides(kv, tmp_path, capsys):
    ours, press, md = tmp_path / "ours.jsonl", tmp_path / "press.jsonl", tmp_path / "t.md"
    ours.write_text("".join(json.dumps(r) + "\n" for r in RECORDS_OURS))
    press.write_text("".join(json.dumps(r) + "\n" for r in RECORDS_PRESS))
    assert kv.main(["--report", str(press), "--ours", str(ours), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert text == capsys.readouterr().out.rstrip("\n") + "\n"
    assert "full cache: 2/2" in text
    assert "| ours `h2o` | 1/2 |" in text and "| kvpress `snapkv` (aware) | 2/2 |" in text
    assert "| kvpress `streamingllm` (agnostic) | 0/1 |" in text
    assert "budget 128 1/2" in text


def test_press_options_override_the_defaults_and_bad_ones_are_named(kv):
    assert kv.parse_press("snapkv") == ("snapkv", "SnapKVPress", {}, ("aware", "agnostic"))
    name, cls, opts, _ = kv.parse_press("streamingllm:n_sink=4")
    assert (name, cls, opts) == ("streamingllm", "StreamingLLMPress", {"n_sink": 4})
    _, _, opts, modes = kv.parse_press("expected_attention:use_vnorm=false,epsilon=0.5")
    assert opts == {"use_vnorm": False, "epsilon": 0.5} and modes == ("agnostic",)
    with pytest.raises(ValueError, match="unknown press 'snap'.*snapkv"):
        kv.parse_press("snap:window_size=16")
    with pytest.raises(ValueError, match="options are key=value"):
        kv.parse_press("snapkv:window_size")
    with pytest.raises(ValueError, match="'wide' is not a number"):
        kv.parse_press("snapkv:window_size=wide")
    with pytest.raises(SystemExit):  # argparse names the bad spec before any model loads
        kv.main(["--model", "m", "--tasks", "t", "--presses", "snapkv:kernel"])


def test_a_tuning_run_chooses_the_spec_with_most_hits_and_ties_go_to_the_first(kv, tmp_path):
    from sgl_vtoken_tools.bench.kvpress_table import choose

    runs = [
        ("snapkv", [1, 0, 0]),
        ("snapkv:window_size=16", [1, 1, 0]),
        ("snapkv:kernel_size=1", [0, 1, 1]),  # as many hits, run later
        ("streamingllm", [1, 1]),
        ("streamingllm:n_sink=4", [1, 1]),  # a tie: the first stays
    ]
    records = [
        {"kind": "press", "press": spec, "mode": "aware", "budget": 128, "trial": str(i), "hit": h}
        for spec, hits in runs
        for i, h in enumerate(hits)
    ]
    got = {c["press"]: c for c in choose(records)}
    assert got["snapkv"]["spec"] == "snapkv:window_size=16" and got["snapkv"]["hits"] == 2
    assert got["snapkv"]["candidates"] == {
        "snapkv": 1,
        "snapkv:window_size=16": 2,
        "snapkv:kernel_size=1": 2,
    }
    assert got["streamingllm"]["spec"] == "streamingllm" and got["streamingllm"]["trials"] == 2
    chosen = tmp_path / "choice.jsonl"
    chosen.write_text("".join(json.dumps(c) + "\n" for c in got.values()))
    args = kv.build_parser().parse_args(
        ["--presses", "tova", "--modes", "aware", "--presses-from", str(chosen)]
    )
    assert kv.press_runs(args) == [
        ("tova", "aware"),
        ("snapkv:window_size=16", "aware"),
        ("streamingllm", "aware"),
    ]


def test_the_tuned_table_puts_defaults_and_choices_side_by_side_per_split(kv, tmp_path, capsys):
    def rec(spec, budget, hit, trial="a", mode="aware"):
        return {
            "kind": "press", "press": spec, "mode": mode, "budget": budget, "trial": trial,
            "hit": hit,
        }  # fmt: skip

    heldout = [rec("snapkv", 128, 0), rec("snapkv:window_size=16", 128, 1), rec("tova", 128, 1)]
    heldout += [rec("streamingllm", 128, 1), rec("streamingllm", 128, 0, trial="b")]
    heldout += [rec("streamingllm", 128, 1)]  # a trial run again (the tuned run's defaults)
    final = [rec("snapkv", 128, 1), rec("snapkv:window_size=16", 128, 0)]
    final += [rec("streamingllm", 128, 1), rec("streamingllm", 128, 1, trial="b")]
    choices = [
        {"kind": "choice", "press": "snapkv", "mode": "aware", "spec": "snapkv:window_size=16"},
        {"kind": "choice", "press": "streamingllm", "mode": "aware", "spec": "streamingllm"},
    ]
    paths = {}
    for name, recs in (("h", heldout), ("f", final), ("c", choices)):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in recs))
    argv = ["--tuned-table", f"held-out={paths['h']}", f"final={paths['f']}"]
    assert kv.main([*argv, "--choices", str(paths["c"])]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0] == "| press (mode) | options | held-out 128 | final 128 |"
    assert rows[2:] == [
        "| `snapkv` (aware) | defaults | 0/1 | 1/1 |",
        "| `snapkv` (aware) | tuned: `window_size=16` | 1/1 | 0/1 |",
        "| `tova` (aware) | defaults | 1/1 | - |",
        "| `streamingllm` (aware) | defaults (chosen) | 1/2 | 2/2 |",
    ]
    paths["h"].write_text(paths["h"].read_text() + json.dumps(rec("tova", 128, 0)) + "\n")
    with pytest.raises(ValueError, match="two runs of one trial disagree"):
        kv.main([*argv, "--choices", str(paths["c"])])


def test_run_needs_model_and_tasks(kv):
    with pytest.raises(SystemExit):
        kv.main(["--budgets", "128"])
