"""Summaries are recomputed from the trial records alone: accuracies count hits, perplexity
pools the tokens of every window, agreement divides by the tokens; tables and plot render."""

import math

import pytest

from sgl_vtoken_tools.quality import report
from sgl_vtoken_tools.quality.settings import Setting, Sweep


def trial(task, setting, budget, **kw):
    return {
        "kind": "trial",
        "task": task,
        "setting": setting,
        "policy": setting.split(":")[0],
        "budget": budget,
        "seconds": 1.0,
        **kw,
    }


RECORDS = [
    trial("passkey", "full", None, hit=True, needle_kept=1.0),
    trial("passkey", "full", None, hit=True, needle_kept=1.0),
    trial("passkey", "h2o:window=32", 128, hit=True, needle_kept=0.5),
    trial("passkey", "h2o:window=32", 128, hit=False, needle_kept=0.25),
    trial("lm", "full", None, nll=10.0, tokens=10, top1=10, greedy_agree=1.0),
    trial("lm", "h2o:window=32", 128, nll=20.0, tokens=10, top1=7, greedy_agree=0.5),
    trial("lm", "h2o:window=32", 128, nll=10.0, tokens=30, top1=21, greedy_agree=0.25),
    {"kind": "server", "task": "passkey", "equal": True},
]


def test_summaries_pool_trials():
    full, h2o = report.summarize(RECORDS)
    assert full["setting"] == "full" and full["passkey"] == 1.0 and full["ppl"] == round(math.e, 3)
    assert (h2o["passkey_hits"], h2o["passkey_trials"], h2o["needle_kept"]) == (1, 2, 0.375)
    assert h2o["ppl"] == round(math.exp(30 / 40), 3)  # tokens pooled, not windows averaged
    assert h2o["top1"] == round(28 / 40, 4) and h2o["greedy"] == 0.375 and h2o["lm_tokens"] == 40
    assert "recall" not in h2o


def test_markdown_pivots_budgets_and_quotes_the_full_cache(tmp_path):
    md = report.markdown(report.summarize(RECORDS))
    assert "full cache: 2/2" in md and "| `h2o:window=32` | 1/2 |" in md
    assert "| setting | budget 128 |" in md and "recall" not in md
    report.plot(report.summarize(RECORDS), tmp_path / "q.png", "t")
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"


def test_setting_specs_parse_and_validate():
    s = Setting.parse("h2o:window=32,score_layers=[1,2],pool=5")
    assert s.name == "h2o:window=32,score_layers=[1,2],pool=5"
    cfg = s.config(Sweep(sink=16, interval=16, page_size=1), 128)
    assert (cfg.window, cfg.scoring.score_layers, dict(cfg.params)) == (32, (1, 2), {"pool": 5})
    assert s.kv_evict(cfg) == {"policy": "h2o", "budget": 128, "sink": 16, "window": 32}
    assert s.server_options() == {"score_layers": (1, 2), "pool": 5}
    with pytest.raises(ValueError, match="unknown policy 'h3o'"):
        Setting.parse("h3o:window=4")
    try:
        Setting.parse("h2o:pool=4").config(Sweep(), 128)
    except ValueError as e:
        assert "h2o:pool=4" in str(e) and "pool" in str(e)
    else:
        raise AssertionError("an even pool must be refused")


def test_split_tasks_are_scored_apart_from_passkey():
    records = [
        trial("docqa", "full", None, hit=True),
        trial("docqa", "h2o", 128, hit=False),
        trial("docqa", "h2o", 128, hit=True),
        trial("session", "h2o", 128, hit=True),
        trial("passkey", "h2o", 128, hit=False),
    ]
    full, h2o = report.summarize(records)
    assert (full["docqa_hits"], full["docqa_trials"]) == (1, 1) and "session" not in full
    assert (h2o["docqa_hits"], h2o["docqa_trials"], h2o["session"], h2o["passkey"]) == (
        1,
        2,
        1.0,
        0.0,
    )
    md = report.markdown([full, h2o])
    assert (
        "**document question (split tasks), exact match** (higher is better; full cache: 1/1)" in md
    )
    assert "| `h2o` | 1/2 |" in md and "| `h2o` | 1/1 |" in md
