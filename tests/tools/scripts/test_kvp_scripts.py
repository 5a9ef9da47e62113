"""The KVP pipeline scripts end to end at toy sizes: traces -> scorer, seeded, identity recorded."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_collect_then_train_is_reproducible(tiny_model, tmp_path, capsys):
    collect, train = load("collect_traces"), load("train_kvp")
    traces = tmp_path / "traces.pt"
    collect.main(
        [
            "--model",
            str(tiny_model),
            "--out",
            str(traces),
            "--num-seqs",
            "3",
            "--seq-len",
            "64",
            "--horizon",
            "16",
            "--min-cut",
            "16",
            "--cut-every",
            "16",
            "--threads",
            "1",
        ]
    )
    rec = json_lines(capsys.readouterr().out)[-1]
    assert rec["cuts"] == [16, 32, 48] and traces.exists()
    digests = []
    for name in ("a", "b"):
        train.main(
            [
                "--traces",
                str(traces),
                "--out",
                str(tmp_path / f"{name}.st"),
                "--steps",
                "4",
                "--batch",
                "2",
                "--threads",
                "1",
                "--log-every",
                "2",
            ]
        )
        done = json_lines(capsys.readouterr().out)[-1]
        digests.append(done["sha256"])
    assert digests[0] == digests[1]
    assert done["identity"] == {
        "model_type": "llama",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 32,
    }
    assert set(done["heuristics_reward"]) == {"traces", "recency", "knorm"}


def test_collect_refuses_traces_over_the_size_bound(tiny_model, tmp_path, capsys):
    with pytest.raises(SystemExit):
        load("collect_traces").main(
            [
                "--model",
                str(tiny_model),
                "--out",
                str(tmp_path / "t.pt"),
                "--max-mb",
                "0.001",
                "--threads",
                "1",
            ]
        )
    assert "--max-mb" in capsys.readouterr().err


def test_pydoc_corpus_holds_out_whole_topics():
    """`--text pydoc` (the real model's traces): Python's documentation topics, every N-th topic
    held out whole, so held-out windows never overlap a training topic."""
    from pydoc_data.topics import topics

    from sgl_vtoken_tools.corpus import corpus

    train, held = corpus("pydoc", 4)
    names = sorted(topics)
    assert held == [topics[n] for n in names[::4]]
    assert len(train) + len(held) == len(topics) and not set(train) & set(held)
    assert corpus(None, 4) == corpus("stdlib", 4)


def test_eval_kvp_replays_every_policy(tiny_model, tmp_path, capsys):
    """eval_kvp at toy size: one summary per (policy, budget) plus full attention; the oracle
    (it knows the future) keeps at least the mass StreamingLLM keeps, a budget past the
    sequence keeps all of it."""
    from transformers import AutoConfig

    from sgl_vtoken.kvp import KVPScorer, ModelIdentity, save_checkpoint

    idt = ModelIdentity.from_hf_config(AutoConfig.from_pretrained(tiny_model).to_dict())
    ckpt = save_checkpoint(KVPScorer(idt, hidden=8, seed=0), tmp_path / "kvp.safetensors")
    load("eval_kvp").main(
        [
            "--model",
            str(tiny_model),
            "--checkpoint",
            str(ckpt),
            "--num-seqs",
            "1",
            "--seq-len",
            "64",
            "--prompt",
            "8",
            "--horizon",
            "16",
            "--budgets",
            "16",
            "64",
            "--ppl-budgets",
            "16",
            "--policies",
            "kvp",
            "streamingllm",
            "h2o",
            "oracle",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "eval.jsonl"),
        ]
    )
    summary = {
        (r["policy"], r["budget"]): r
        for r in json_lines(capsys.readouterr().out)
        if r.get("event") == "summary"
    }
    assert set(summary) == {
        (p, b) for p in ("kvp", "streamingllm", "h2o", "oracle") for b in (16, 64)
    } | {("full", None)}
    assert (
        summary[("oracle", 16)]["retained_mass"] >= summary[("streamingllm", 16)]["retained_mass"]
    )
    assert all(
        summary[(p, 64)]["retained_mass"] == 1.0 for p in ("kvp", "streamingllm", "h2o", "oracle")
    )
    assert summary[("kvp", 16)]["ppl"] > 0 and summary[("full", None)]["ppl"] > 0
