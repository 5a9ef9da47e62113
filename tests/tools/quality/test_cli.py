"""`python -m sgl_vtoken_tools quality` at toy size on the tiny model: JSON lines with one trial
record per (task, trial, cell), a summary per cell and the run record; --report re-renders the tables."""

import json

from sgl_vtoken_tools.cli import quality


def test_smoke_run_writes_json_lines(tiny_model, wheel_dir, tmp_path, capsys):
    out, plot, md = tmp_path / "q.jsonl", tmp_path / "q.png", tmp_path / "q.md"
    rc = quality.main(
        [
            "--smoke",
            "--model",
            str(tiny_model),
            "--wheel-dir",
            str(wheel_dir),
            "--server-trials",
            "0",
            "--settings",
            "streamingllm",
            "h2o:window=16",
            "knorm",
            "--out",
            str(out),
            "--plot",
            str(plot),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [r["kind"] for r in recs]
    assert kinds[0] == "plan" and kinds[-1] == "run"
    trials = [r for r in recs if r["kind"] == "trial"]
    cells = {(r["setting"], r["budget"]) for r in trials}
    assert cells == {("full", None), ("streamingllm", 64), ("h2o:window=16", 64), ("knorm", 64)}
    assert sorted({r["task"] for r in trials}) == ["lm", "passkey", "recall"]
    assert len(trials) == 3 * 4  # one trial per task at smoke size, four cells
    full_lm = next(r for r in trials if r["task"] == "lm" and r["setting"] == "full")
    assert full_lm["top1"] == full_lm["tokens"] and full_lm["greedy_agree"] == 1.0
    summaries = [r for r in recs if r["kind"] == "summary"]
    assert [s["setting"] for s in summaries][0] == "full" and len(summaries) == 4
    assert plot.read_bytes()[:4] == b"\x89PNG" and "budget 64" in md.read_text()
    assert quality.main(["--report", str(out)]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_bad_setting_names_the_flag(tiny_model, wheel_dir):
    try:
        quality.main(
            ["--model", str(tiny_model), "--settings", "h2o:window=999", "--budgets", "128"]
        )
    except SystemExit as e:
        assert "h2o:window=999" in str(e) and "budget" in str(e)
    else:
        raise AssertionError("a window larger than the budget must be refused")


def test_split_tasks_run(tiny_model, wheel_dir, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    common = [
        "--model",
        str(tiny_model),
        "--wheel-dir",
        str(wheel_dir),
        "--split",
        "tuning",
        "--docqa-lengths",
        "120",
    ]
    rc = quality.main(
        [
            "--smoke",
            *common,
            "--tasks",
            "docqa",
            "session",
            "--session-trials",
            "2",
            "--session-turns",
            "2",
            "--server-trials",
            "0",
            "--settings",
            "streamingllm",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    trials = [r for r in map(json.loads, out.read_text().splitlines()) if r["kind"] == "trial"]
    count = {
        (t, s): sum(r["task"] == t and r["setting"] == s for r in trials)
        for t in ("docqa", "session")
        for s in ("full", "streamingllm")
    }
    assert count == {
        ("docqa", "full"): 8,
        ("docqa", "streamingllm"): 8,  # 4 depths x 2 phrasings
        ("session", "full"): 2,
        ("session", "streamingllm"): 2,
    }
    assert {r["split"] for r in trials} == {"tuning"}
    assert "document question" in capsys.readouterr().err
