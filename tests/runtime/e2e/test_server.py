"""The plugin-loaded server on CPU: the OpenAI-compatible API, /generate, prefix-cache hits, and
greedy output equal to Hugging Face transformers on the same fp32 weights."""

import random

import pytest
import torch

pytestmark = [pytest.mark.server, pytest.mark.server_group("stock")]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([input_ids])
    out = []
    for _ in range(max_new_tokens):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prompt_len", [2, 10, 230])
def test_greedy_matches_transformers(server_factory, hf_model, page_size, prompt_len):
    """Greedy tokens from the server equal HF transformers' on the same fp32 weights."""
    client = server_factory(page_size=page_size)
    prompt = random_ids(prompt_len, seed=prompt_len)
    got = client.generate_ids(prompt, max_new_tokens=32)["output_ids"]
    assert got == hf_greedy(hf_model, prompt, 32)


def test_generate_reports_usage(server_factory):
    out = server_factory(page_size=1).generate_ids(random_ids(20, seed=1), max_new_tokens=8)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 20 and meta["completion_tokens"] == 8
    assert len(out["output_ids"]) == 8 and isinstance(out["text"], str)


@pytest.mark.parametrize("page_size,expected_cached", [(1, 300), (16, 288)])  # 288 = 18 * 16
def test_prefix_cache_hits(server_factory, page_size, expected_cached):
    """A second request sharing a 300-token prefix reuses its KV (page-aligned at page size 16)."""
    client = server_factory(page_size=page_size)
    prefix = random_ids(300, seed=100 + page_size)
    first = client.generate_ids(prefix + [5, 6, 7], max_new_tokens=4)
    second = client.generate_ids(prefix + [8, 9], max_new_tokens=4)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == expected_cached


def test_chat_completions_with_cache_report(server_factory):
    client = server_factory(page_size=1)
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 20},
        {"role": "user", "content": "Name three colours."},
    ]
    first = client.chat(messages, 12)
    second = client.chat(messages, 12)
    assert first.choices[0].message.role == "assistant"
    assert first.usage.completion_tokens <= 12 and first.usage.prompt_tokens > 100
    assert second.choices[0].message.content == first.choices[0].message.content
    # The repeat reuses the whole prompt except the last token, which is re-run for logits.
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1


def test_completions(server_factory, hf_model, tiny_model):
    """What a completions client relies on: greedy text is the model's greedy tokens decoded (the
    same every time), the usage counts the prompt's tokens and the reply's, a reply cut by
    `max_tokens` says "length", and a request that opts into eviction (or out of it) but never
    reaches its budget gets the text it gets without eviction."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    oai = server_factory(page_size=1).openai()
    prompt, n = "def main():", 10

    def complete(kv_evict=None):
        extra = {"custom_params": {"kv_evict": kv_evict}} if kv_evict is not None else None
        return oai.completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body=extra
        )

    out = complete()
    ids = tok(prompt).input_ids
    expected = hf_greedy(hf_model, ids, n)  # the tiny model writes no EOS in these 10 tokens
    assert tok.eos_token_id not in expected
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), n)
    assert out.usage.total_tokens == len(ids) + n
    assert choice.text == tok.decode(expected, skip_special_tokens=True) != ""
    assert complete().choices[0].text == choice.text  # greedy: the same text again
    # h2o scores attention in every forward, but a budget of 64 is never reached by 3 + 10 tokens
    under = complete({"policy": "h2o", "budget": 64, "window": 16})
    assert under.choices[0].text == choice.text and under.usage.completion_tokens == n
    figures = under.usage.model_extra["kv_evict"]
    assert figures["policy"] == "h2o" and figures["evicted_tokens"] == figures["evictions"] == 0
    opted_out = complete({"policy": "none"})
    assert opted_out.choices[0].text == choice.text and "kv_evict" not in (
        opted_out.usage.model_extra or {}
    )


def test_chat_streaming_equals_non_streaming(server_factory):
    client = server_factory(page_size=1)
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat(messages, 16)
    stream = client.chat(messages, 16, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 1
    assert "".join(pieces) == whole.choices[0].message.content
