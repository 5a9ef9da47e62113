"""The joint benchmark without a server: its conversations are what a chat client sends for the
split's trials, a run's figures come from its records alone, and the cell table shows the spread
over repeats and the ratio to stock of the same repeat."""

import json

import pytest

from sgl_vtoken_tools.bench import joint
from sgl_vtoken_tools.cli.common import REPO


@pytest.fixture(scope="module")
def bench(command):
    return command("joint")


def test_conversations_are_the_split_trials_as_chat_messages(tiny_tok, fake_essays):
    from sgl_vtoken_tools.quality import splits

    spec = joint.JointSpec(
        split="tuning", sessions=3, turns=3, passage_tokens=40, docqa=3, docqa_lengths=(120,)
    )
    convs = joint.conversations(tiny_tok, spec, fake_essays)
    sessions = splits.session_trials(tiny_tok, "tuning", 3, 3, 40, 0, fake_essays)
    docs = splits.docqa_trials(tiny_tok, "tuning", [120], 0, fake_essays)
    assert [c.id for c in convs] == [t.id for t in sessions] + [
        docs[i].id for i in (0, 2, 5)
    ]  # 8 spread over 3
    for c, t in zip(convs, sessions + [docs[0], docs[2], docs[5]]):
        ids = tiny_tok.apply_chat_template(
            [{"role": "user", "content": c.messages[0]}], add_generation_prompt=True
        )
        assert list(ids if isinstance(ids, list) else ids["input_ids"]) == list(
            t.prompt
        )  # the server sees the trial
        assert c.messages[1:] == t.messages and c.answer == t.answer
    assert [len(c.messages) for c in convs] == [3, 3, 3, 1, 1, 1]
    with pytest.raises(ValueError, match="has 8 document questions"):
        joint.conversations(
            tiny_tok,
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


def test_history_fields_read_the_report_and_its_absence():
    assert joint.history_fields(None) == {"history_source": None, "history_restored_tokens": 0}
    host = {"history_source": "host", "history_tokens": 900, "history_restored_tokens": 300}
    assert joint.history_fields(host) == {"history_source": "host", "history_restored_tokens": 300}
    # a server that names no source: a continued history is a device one, else none
    assert joint.history_fields({"history_tokens": 500})["history_source"] == "device"
    assert joint.history_fields({"live_tokens": 256, "history_tokens": 0}) == {
        "history_source": "none",
        "history_restored_tokens": 0,
    }
    named = joint.history_fields({"history_source": "none", "history_tokens": 0})
    assert named["history_source"] == "none"


def test_held_tokens_count_the_device_kv_not_the_logical_prompt():
    rec = {"live_tokens": None, "prompt_tokens": 1900, "completion_tokens": 12}
    # a last turn that ended before its first eviction, continuing a 1,800-token history whose
    # stored view holds 260: the view, the 100 new prompt tokens and the reply
    continued = {**rec, "history_tokens": 1800, "history_view_tokens": 260}
    assert joint.held_tokens(continued) == 260 + 100 + 12
    assert joint.held_tokens(rec) == 1900 + 12  # no stored history (or no plugin): all of it
    assert joint.held_tokens({**continued, "live_tokens": 270}) == 270  # after an eviction


def _turn(conv, turn, source, prompt, cached, restored=0, error=None):
    return {
        **_req(conv, turn, 8, 0.1, error, prompt, cached),
        "history_source": source,
        "history_restored_tokens": restored,
    }


def test_summary_counts_turns_by_history_source_and_host_bytes_per_turn():
    reqs = [
        _turn("a", 1, "none", 300, 0),
        _turn("a", 2, "device", 500, 420),
        _turn("a", 3, "host", 700, 600, restored=256),
        _turn("a", 4, "none", 900, 24),  # continued nothing, cache short of turn 3's 700: again
        _turn("b", 1, "none", 250, 0),
        _turn("b", 2, "host", 450, 400, restored=200),
        _turn("b", 3, "host", 650, 0, restored=100, error="HTTP 500"),  # failed: not counted
        _turn("c", 1, "none", 60, 0),
        _turn("c", 2, "none", 300, 60),  # the radix cache held turn 1's whole prompt
        _turn("c", 3, "none", 540, 299),  # one short of turn 2's prompt: prefilled again
        _turn("d", 1, "none", 1200, 0),  # a document question: one turn, prefilled once
    ]
    before = joint.host_counters({"host_bytes_to_host": 1000, "host_histories_stored": 2})
    after = joint.host_counters(
        {
            "host_bytes_to_host": 1000 + 46080 * 300,
            "host_bytes_to_device": 46080 * 456,
            "host_histories_stored": 5,
            "host_histories_restored": 2,
            "host_histories_dropped": 1,
            "host_histories_held": 1,
        }
    )
    moved = joint.host_moved(before, after)
    assert moved == {
        "host_histories_stored": 3,
        "host_histories_restored": 2,
        "host_histories_dropped": 1,
        "host_bytes_to_host": 46080 * 300,
        "host_bytes_to_device": 46080 * 456,
        "host_histories_held": 1,
    }
    s = joint.summarize(reqs, [], 2.0, None, None, moved)
    turns = ("turns_from_device", "turns_from_host", "turns_from_prefix", "turns_prefilled_again")
    assert [s[k] for k in turns] == [1, 2, 1, 2]  # the 6 answered later turns
    assert s["prefill_tokens"] == 300 + 80 + 100 + 876 + 250 + 50 + 60 + 240 + 241 + 1200
    assert s["history_restored_tokens"] == 456
    assert s["host_bytes_per_turn"] == round(46080 * 756 / 10, 1)  # 10 answered turns
    assert (s["host_histories_stored"], s["host_histories_dropped"]) == (3, 1)
    # no plugin state: no host figures; no report on any request (stock): no turn counts
    plain = [{**r, "history_source": None} for r in reqs]
    s = joint.summarize(plain, [], 2.0)
    assert s["turns_from_device"] is s["turns_from_host"] is None
    # stock's later turns: the radix cache held the previous prompt, or not (a4, c3)
    assert (s["turns_from_prefix"], s["turns_prefilled_again"]) == (4, 2)
    assert s["host_bytes_per_turn"] is None and s["host_histories_stored"] is None
    assert joint.host_moved(None, after) is None and joint.host_counters(None) is None
    # a plugin whose state names no host counters moved nothing
    idle = joint.host_moved(joint.host_counters({}), joint.host_counters({}))
    assert joint.summarize(reqs, [], 2.0, None, None, idle)["host_bytes_per_turn"] == 0.0


def test_cells_quote_computed_tokens_against_stock_and_history_turns(bench):
    def line(cell, rep, computed, device, host, prefix, again, moved):
        return {
            **_summary(cell, rep, 10.0, 1.0),
            "prefill_tokens": computed,
            "turns_from_device": device,
            "turns_from_host": host,
            "turns_from_prefix": prefix,
            "turns_prefilled_again": again,
            "host_bytes_per_turn": moved,
        }

    lines = [
        line("stock", 0, 40000, None, None, 30, 6, None),
        line("stock", 1, 50000, None, None, 24, 12, None),
        line("h2o b256 + host", 0, 10000, 20, 10, 0, 6, 2_500_000.0),
        line("h2o b256 + host", 1, 20000, 22, 8, 0, 6, 1_500_000.0),
    ]
    stock, host = bench.spread_lines(lines)
    assert (host["computed_ratio"]["min"], host["computed_ratio"]["max"]) == (0.25, 0.4)
    assert stock["computed_ratio"]["median"] == 1.0 and stock["turns_from_host"] is None
    assert host["turns_from_device"]["median"] == 21 and host["turns_prefilled_again"]["sd"] == 0
    md = bench.table([stock, host])
    head = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    rows = {r.split("|")[1].strip(): r for r in md.splitlines()[2:]}
    cols = dict(zip(head, [c.strip() for c in rows["h2o b256 + host"].strip("|").split("|")]))
    assert cols["prompt tokens computed"] == "15000 (10000-20000)"
    assert cols["computed x stock"] == "0.33 (0.25-0.40)"  # 10000/40000 and 20000/50000
    assert (
        cols["turns from device history"],
        cols["turns from host history"],
        cols["turns from radix prefix"],
        cols["turns prefilled again"],
    ) == ("21 (20-22)", "9 (8-10)", "0", "6")
    assert cols["host MB / turn"] == "2.00 (1.50-2.50)"
    assert cols["retractions"] == "0" and cols["peak running"] == "4"
    stock_cols = dict(zip(head, [c.strip() for c in rows["stock"].strip("|").split("|")]))
    assert stock_cols["turns from host history"] == "-" and stock_cols["host MB / turn"] == "-"
    assert stock_cols["turns prefilled again"] == "9 (6-12)"
    assert stock_cols["computed x stock"] == "1.00"


def test_the_host_cells_run_alone_with_the_recommended_flags(bench, monkeypatch, capsys):
    host = json.loads(bench.cell_flags("h2o b256 + host")[1][-1])
    assert bench.cell_flags("h2o b256 + host")[1] == [
        "--kv-evict",
        "h2o",
        "--kv-budget",
        "256",
        "--kv-evict-interval",
        "16",
        "--kv-evict-config",
        json.dumps({"host_tokens": 1048576, "offload": True}),
    ] and host == {"host_tokens": 1 << 20, "offload": True}
    recall = bench.cell_flags("h2o b256 + host + recall 192")[1]
    assert recall[:-1] == bench.CELLS["h2o b256 + host"][:-1]
    assert json.loads(recall[-1]) == {**host, "recall": 192}
    # the README's chat command: the recall cell with 16 sinks and a window of 32
    chat = bench.cell_flags("h2o b256 s16 w32 + host + recall 192")[1]
    assert chat == [*recall[:-2], "--kv-sink", "16", "--kv-window", "32", *recall[-2:]]
    # ... and with the pressure trigger, flag for flag (as a set of flag-value pairs) the README's
    # chat command (the code block under "**Chats:")
    import shlex

    readme_text = (REPO / "README.md").read_text()
    block = readme_text.split("**Chats:", 1)[1].split("```", 2)[1]
    readme = shlex.split(block.replace("\n", " "))
    pressure = bench.cell_flags("pressure")[1]
    assert pressure[:-3] == chat[:-1] and pressure[-2:] == ["--kv-evict-trigger", "pressure"]
    assert json.loads(pressure[-3]) == {**json.loads(chat[-1]), "prefill_chunk": 64}
    assert dict(zip(readme[::2], readme[1::2])) == dict(zip(pressure[::2], pressure[1::2]))
    # the documented command of the host run names exactly stock and the README's chat cell
    doc = bench.__doc__.split("recall 192) against stock:")[1]
    words = shlex.split(doc.replace("\\\n", " ").split("python -m sgl_vtoken_tools joint")[1])
    args = bench.build_parser().parse_args(words)
    assert args.cells == ["stock", "h2o b256 s16 w32 + host + recall 192"]
    seen = {}

    def fake_run(args):
        seen["cells"] = args.cells
        return bench.spread_lines([_summary(c, 0, 10.0, 1.0) for c in args.cells])

    monkeypatch.setattr(bench, "run", fake_run)
    assert bench.main([*words[: words.index("--out")], "--repeats", "1"]) == 0
    assert seen["cells"] == args.cells
    out = capsys.readouterr().out
    assert "| h2o b256 s16 w32 + host + recall 192 | 10.0 | 1.00 |" in out


def test_agent_replies_must_cover_every_turn_before_the_last():
    """bench_agent --replies: a run's replies of one cell feed the others' histories; a turn they
    lack is refused before any request, not silently answered with the server's own reply."""
    from sgl_vtoken_tools.bench.agent_chat import load_replies, play
    from sgl_vtoken_tools.bench.joint import Send
    from sgl_vtoken_tools.quality.agent_sessions import AgentSession

    lines = [
        {"kind": "request", "cell": "full", "repeat": 0, "conversation": "s", "turn": t, "reply": r}
        for t, r in ((1, "a"), (2, "b"))
    ] + [{"kind": "request", "cell": "evict", "repeat": 0, "conversation": "s", "turn": 1}]
    assert load_replies(lines, "full") == {("s", 1): "a", ("s", 2): "b"}
    with pytest.raises(ValueError, match="no request line of cell 'evict', repeat 0"):
        load_replies(lines, "evict")
    sess = AgentSession("s", (("user", "x"),) * 4, "12345")  # turns 1-3 are fed back
    with pytest.raises(ValueError, match=r"replies lack 1 turns .* \('s', 3\)"):
        play("http://127.0.0.1:9", "m", [sess], Send(), replies=load_replies(lines, "full"))
