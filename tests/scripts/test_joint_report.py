"""The joint benchmark without a server: its conversations are what a chat client sends for the
split's trials, a run's figures come from its records alone, and the cell table shows the spread
over repeats and the ratio to stock of the same repeat."""

import json

import pytest

from sgl_vtoken_tools.bench import joint


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("bench_joint")


def test_conversations_are_the_split_trials_as_chat_messages(tok, fake_essays):
    from sgl_vtoken_tools.quality import splits

    spec = joint.JointSpec(
        split="tuning", sessions=3, turns=3, passage_tokens=40, docqa=3, docqa_lengths=(120,)
    )
    convs = joint.conversations(tok, spec, fake_essays)
    sessions = splits.session_trials(tok, "tuning", 3, 3, 40, 0, fake_essays)
    docs = splits.docqa_trials(tok, "tuning", [120], 0, fake_essays)
    assert [c.id for c in convs] == [t.id for t in sessions] + [
        docs[i].id for i in (0, 2, 5)
    ]  # 8 spread over 3
    for c, t in zip(convs, sessions + [docs[0], docs[2], docs[5]]):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": c.messages[0]}], add_generation_prompt=True
        )
        assert list(ids if isinstance(ids, list) else ids["input_ids"]) == list(
            t.prompt
        )  # the server sees the trial
        assert c.messages[1:] == t.messages and c.answer == t.answer
    assert [len(c.messages) for c in convs] == [3, 3, 3, 1, 1, 1]
    with pytest.raises(ValueError, match="has 8 document questions"):
        joint.conversations(
            tok,
            joint.JointSpec(split="tuning", sessions=0, docqa=9, docqa_lengths=(120,)),
            fake_essays,
        )


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"split": "dev"}, "split must be one of"),
        ({"sessions": 0, "docqa": 0}, "at least one"),
        ({"turns": 1}, "turns >= 2"),
    ],
)
def test_spec_refuses_bad_sizes(kw, match):
    with pytest.raises(ValueError, match=match):
        joint.JointSpec(**kw)


def _req(conv, turn, tokens, ttft, error=None, prompt=100, cached=40):
    return {
        "conversation": conv,
        "turn": turn,
        "completion_tokens": tokens,
        "ttft": ttft,
        "error": error,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
    }


def _ans(conv, task, number, hit, kv, failed=False):
    return {
        "conversation": conv,
        "task": task,
        "number": number,
        "hit": hit,
        "kv_tokens": kv,
        "failed": failed,
    }


def test_summary_counts_tokens_answers_and_agreement():
    reqs = [
        _req("a", 1, 10, 0.1),
        _req("a", 2, 6, 0.3, cached=None),
        _req("b", 1, 4, 0.2),
        _req("c", 1, 0, None, "HTTP 503"),
    ]
    answers = [
        _ans("a", "session", "123", True, 300),
        _ans("b", "docqa", "9", False, 200),
        _ans("c", "docqa", None, False, 0, failed=True),
    ]
    full = [
        _ans("a", "session", "123", True, 900),
        _ans("b", "docqa", "8", True, 800),
        _ans("c", "docqa", "7", True, 10),
    ]
    log = "KV cache pool is full. Retract requests. #retracted_reqs: 2\nDecode batch, #running-req: 3, x\n"
    s = joint.summarize(reqs, answers, 4.0, log, full)
    assert (s["requests"], s["failed"], s["output_tokens"], s["output_tokens_per_s"]) == (
        4,
        1,
        20,
        5.0,
    )
    assert s["mean_ttft_ms"] == 200.0
    assert (s["accuracy"], s["accuracy_session"], s["accuracy_docqa"]) == (0.3333, 1.0, 0.0)
    assert s["agreement"] == 0.3333 and s["kv_tokens_mean"] == 250.0 and s["kv_tokens_max"] == 300
    assert (s["retractions"], s["peak_running"]) == (2, 3)
    assert s["prefill_tokens"] == 60 + 100 + 60  # prompt minus cached, the failed request left out
    assert joint.summarize(reqs, answers, 4.0)["agreement"] is None


def _summary(cell, rep, tps, acc):
    return {
        "kind": "summary",
        "cell": cell,
        "repeat": rep,
        "output_tokens_per_s": tps,
        "mean_ttft_ms": 10.0,
        "accuracy": acc,
        "accuracy_session": acc,
        "accuracy_docqa": acc,
        "agreement": None,
        "kv_tokens_mean": 100.0,
        "retractions": 0,
        "peak_running": 4,
        "wall_s": 1.0,
        "failed": 0,
        **({"prefill_tokens": 1000 * tps} if cell != "stock" else {}),
    }  # a pilot's lines lack it


def test_cells_quote_the_ratio_to_stock_of_the_same_repeat(bench, tmp_path, capsys):
    lines = [
        _summary("stock", 0, 10.0, 1.0),
        _summary("stock", 1, 20.0, 1.0),
        _summary("h2o", 0, 25.0, 0.5),
        _summary("h2o", 1, 40.0, 0.75),
    ]
    stock, h2o = bench.spread_lines(lines)
    assert h2o["throughput_ratio"]["min"] == 2.0 and h2o["throughput_ratio"]["max"] == 2.5
    assert stock["throughput_ratio"]["median"] == 1.0 and h2o["accuracy"]["median"] == 0.625
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert bench.main(["--report", str(path), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert (
        "| h2o | 32.5 (25.0-40.0) | 2.25 (2.00-2.50) | 32500 (25000-40000) |" in out
        and "| 62 (50-75) |" in out
    )
    assert "| stock | 15.0 (10.0-20.0) | 1.00 | - |" in out
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_cells_are_refused_before_any_server(bench):
    with pytest.raises(SystemExit, match="unknown cell 'h3o'"):
        bench.main(["--cells", "stock", "h3o"])
    assert bench.cell_flags("x=--kv-evict tova --kv-budget 64") == (
        "x",
        ["--kv-evict", "tova", "--kv-budget", "64"],
    )
