"""What a session sends: fixed request ids, the per-request eviction object, the reply length."""

from sgl_vtoken_tools.bench.agent import AgentConfig
from sgl_vtoken_tools.bench.agent_client import chat_payload, output_hash, request_id


def test_request_ids_are_fixed_per_session_and_turn():
    assert request_id("burst", 3, 2) == "burst-s3-t2"
    assert request_id(None, 3, 2) is None


def test_chat_payload_carries_rid_kv_evict_and_exact_length():
    cfg = AgentConfig(
        base_url="http://127.0.0.1:1/",
        model="m",
        reply_tokens=32,
        kv_evict={"policy": "random", "budget": 128},
    )
    assert cfg.base_url == "http://127.0.0.1:1"
    msgs = [{"role": "user", "content": "hi"}]
    p = chat_payload(cfg, msgs, "burst-s0-t1")
    assert p["rid"] == "burst-s0-t1" and p["messages"] is msgs
    assert p["custom_params"] == {"kv_evict": {"policy": "random", "budget": 128}}
    assert p["max_tokens"] == 32 and p["ignore_eos"] is True and p["temperature"] == 0.0
    bare = chat_payload(AgentConfig(base_url="u", ignore_eos=False), msgs, None)
    assert "rid" not in bare and "custom_params" not in bare and "ignore_eos" not in bare


def test_output_hash_tells_replies_apart():
    assert output_hash("abc") == output_hash("abc") != output_hash("abd")
    assert len(output_hash("")) == 16
