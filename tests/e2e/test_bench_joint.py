"""The joint benchmark's client against one evicting test server: every turn of every
conversation is answered, request ids are fixed, the full cache agrees with itself, and an
evicting conversation holds at most its budget (+ one interval) of device KV."""

import pytest
from conftest import BENCH_FLAGS

from sgl_vtoken_tools.bench import joint
from sgl_vtoken_tools.bench.probe import flush_cache

pytestmark = [pytest.mark.server, pytest.mark.server_group("bench16")]

BUDGET, INTERVAL = 64, 16  # the server's (BENCH_FLAGS)


@pytest.fixture(scope="module")
def client(server_factory):
    return server_factory(page_size=16, extra=BENCH_FLAGS)


def test_conversations_play_and_score(client, tiny_model, fake_essays):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    spec = joint.JointSpec(
        split="heldout",
        sessions=3,
        turns=3,
        passage_tokens=60,
        docqa=2,
        docqa_lengths=(200,),
        reply_tokens=8,
    )
    convs = joint.conversations(tok, spec, fake_essays)
    model = client.get("/v1/models")["data"][0]["id"]
    runs = {}
    for name, kv in (
        ("full", {"policy": "none"}),
        ("evict", None),
    ):  # None: the server's streamingllm b64
        flush_cache(client.base_url)
        runs[name] = joint.play(client.base_url, model, convs, kv, rid_prefix=name, reply_tokens=8)
    full_reqs, full_answers, _ = runs["full"]
    for name, (reqs, answers, wall) in runs.items():
        assert len(reqs) == 3 * 3 + 2 and all(r["error"] is None for r in reqs)
        assert {r["rid"] for r in reqs} == {
            f"{name}-{c.id}-t{t}" for c in convs for t in range(1, len(c.messages) + 1)
        }
        assert [a["conversation"] for a in answers] == [c.id for c in convs]
        s = joint.summarize(reqs, answers, wall, None, full_answers)
        assert (
            s["failed"] == 0 and s["output_tokens"] == sum(r["completion_tokens"] for r in reqs) > 0
        )
        assert s["conversations"] == 5 and s["accuracy"] is not None
        if name == "full":
            assert s["agreement"] == 1.0
            # the whole history: the last turn's prompt and reply
            last = {
                r["conversation"]: r
                for r in reqs
                if r["turn"]
                == max(x["turn"] for x in reqs if x["conversation"] == r["conversation"])
            }
            assert [a["kv_tokens"] for a in answers] == [
                last[c.id]["prompt_tokens"] + last[c.id]["completion_tokens"] for c in convs
            ]
        else:
            long = [
                r for r in reqs if r["prompt_tokens"] + r["completion_tokens"] >= BUDGET + INTERVAL
            ]
            assert len(long) >= 5 and all(0 < r["live_tokens"] < BUDGET + INTERVAL for r in long)
            assert 0 < s["kv_tokens_max"] < BUDGET + INTERVAL
