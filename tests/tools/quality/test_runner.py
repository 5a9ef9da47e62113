"""The runner's multi-turn replies are those of the full-recompute oracle running the same
conversation turn by turn (each prompt = previous prompt + reply + next message), and its
passkey and LM records carry what the summaries and the server check read."""

from sgl_vtoken_tools.hf_reference import masked_turn
from sgl_vtoken_tools.quality import tasks
from sgl_vtoken_tools.quality.runner import Runner, make_cells
from sgl_vtoken_tools.quality.settings import Setting, Sweep
from sgl_vtoken_tools.runtime_choice import RUNTIME_RECALL, runtime_policy


def test_recall_turns_equal_masked_turn(hf_eager, tiny_fast, tiny_tok, wheel_dir):
    sweep = Sweep(sink=4, interval=1, page_size=1)
    cells = make_cells([Setting.parse("h2o:window=8")], [48], sweep)
    (trial,) = tasks.recall_trials(tiny_tok, 1, fillers=1, filler_tokens=40, wheel_dir=wheel_dir)
    recs = []
    Runner(tiny_fast, tiny_tok, cells, recs.append).recall([trial], max_new_tokens=12)
    assert [r["setting"] for r in recs] == ["full", "h2o:window=8"]
    eos = tiny_tok.convert_tokens_to_ids("<|im_end|>")
    for cell, rec in zip(cells, recs):
        prompt, history = list(trial.prompt), None
        for turn, got in enumerate(rec["turn_ids"]):
            if turn:
                prev = rec["turn_ids"][turn - 1]
                prompt += prev + tasks.next_turn_ids(tiny_tok, trial.messages[turn - 1], prev)
            stop = got.index(eos) + 1 if eos in got else 12
            expected, _, history = masked_turn(
                hf_eager,
                prompt,
                stop,
                cell.cfg,
                rid=cell.rid(trial.id, turn),
                history=history,
                policy=runtime_policy,
                recall=RUNTIME_RECALL,
            )
            assert got == expected, (cell.setting.name, turn)
    assert len(recs[0]["turn_ids"]) == 3 and recs[0]["fact_kept"] == 1.0


def test_passkey_and_lm_records(tiny_fast, tiny_tok, wheel_dir):
    cells = make_cells([Setting.parse("streamingllm")], [48], Sweep(sink=4, interval=16))
    recs = []
    runner = Runner(tiny_fast, tiny_tok, cells, recs.append)
    runner.passkey(tasks.passkey_trials(tiny_tok, [150], [0.5], wheel_dir=wheel_dir), 6)
    runner.lm(tasks.lm_trials(tiny_tok, 1, 80, 40, wheel_dir=wheel_dir), greedy_tokens=8)
    full_pk, slm_pk, full_lm, slm_lm = recs
    assert full_pk["needle_kept"] == full_pk["needle_live"] == 1.0  # nothing evicted
    assert slm_pk["needle_kept"] == 0.0  # a mid-prompt needle is outside sinks + recent tokens
    assert len(slm_pk["output_ids"]) == 6 and isinstance(slm_pk["hit"], bool)
    assert full_lm["top1"] == full_lm["tokens"] == 40 and full_lm["greedy_prefix"] == 8
    assert slm_lm["nll"] > 0 and slm_lm["top1"] <= 40
