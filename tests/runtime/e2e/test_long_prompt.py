"""A prompt longer than the KV pool on a real model: SmolLM2-135M-Instruct (fp32, CPU) on a
512-token pool, `--kv-evict streamingllm` with eviction during prefill (`prefill_chunk`), takes a
prompt three times the pool and decodes, token for token, what the Hugging Face reference that
evicts the same chunks decodes, at page sizes 1 and 16. SGLang alone refuses any prompt over
`pool - 6` tokens; a request evicted during prefill never holds more than `budget +
prefill_chunk + page_size` (docs/reference.md, "Prompts longer than the pool").
"""

import pytest
import torch
from servers import eager_model, evict_flags, own_server
from test_eviction import generate, masked_greedy, wait_pool_free

from sgl_vtoken.config import EvictConfig, Prefill

pytestmark = [pytest.mark.server, pytest.mark.server_group("long")]

POOL, BUDGET, SINK, CHUNK, INTERVAL, NEW = 512, 128, 16, 64, 16, 16


@pytest.fixture(scope="module")
def prompt(smollm2_model):
    """Three times the pool: Python documentation prose, then a question about it."""
    import pydoc_data.topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_model)
    text = "\n\n".join(pydoc_data.topics.topics[t] for t in ("for", "while", "try", "with"))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    question = tok("\n\nQuestion: which statement is described last?", add_special_tokens=False)
    body = 3 * POOL - len(question["input_ids"])
    assert len(ids) >= body
    return ids[:body] + question["input_ids"]


@pytest.fixture(scope="module", params=[1, 16], ids=lambda ps: f"page{ps}")
def page_size(request):
    return request.param


@pytest.fixture(scope="module")
def server(page_size, server_factory, smollm2_model):
    flags = evict_flags(
        "streamingllm", BUDGET, sink=SINK, interval=INTERVAL, config={"prefill_chunk": CHUNK}
    )
    extra = (*flags, "--disable-overlap-schedule")
    yield from own_server(server_factory, page_size, extra, POOL, smollm2_model)


class PrefixReuse:
    """The model as `masked_greedy`'s chunked prefill calls it, computing each token once.

    The reference recomputes the whole prompt so far at every chunk (`ids[:end]` under the mask
    rows of every token before `end`); the rows of the tokens an earlier call computed are the
    same (each token attends to the row kept when it was prefilled), so their K/V are too. This
    wrapper checks that and runs the model only on the tokens past the previous call, over the
    K/V cached by then, with the logits of the last token only (all the reference reads): its
    definition, in ~1/12 of the forwards for a 1536-token prompt (recomputing the whole prefix took
    ~160 s of the test's setup on one CPU thread). Calls with cached K/V (decode steps) or asking
    for attentions go to the model unchanged."""

    def __init__(self, model):
        self.model, self.ids, self.mask, self.cache = model, [], None, None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, attention_mask, past_key_values=None, **kw):
        if past_key_values is not None or kw.get("output_attentions"):
            return self.model(
                input_ids, attention_mask=attention_mask, past_key_values=past_key_values, **kw
            )
        ids, done = input_ids[0].tolist(), len(self.ids)
        reuse = (
            0 < done < len(ids)
            and ids[:done] == self.ids
            and torch.equal(attention_mask[..., :done, :done], self.mask[..., :done, :done])
            and bool((attention_mask[..., :done, done:] == torch.finfo(torch.float32).min).all())
        )
        if not reuse:
            done, self.cache = 0, None
        res = self.model(
            input_ids[:, done:],
            attention_mask=attention_mask[..., done:, :],
            past_key_values=self.cache,
            position_ids=torch.arange(done, len(ids))[None],
            logits_to_keep=1,  # the reference reads the last token's only
            **kw,
        )
        self.ids, self.mask, self.cache = ids, attention_mask, res.past_key_values
        return res


@pytest.fixture(scope="module")
def reference(smollm2_model, prompt):
    """The masked reference's tokens, once for both page sizes: with 16 sinks and a budget and
    chunk of whole pages, page size 16 keeps the same positions as page size 1."""
    hf = eager_model(smollm2_model)
    cfg = EvictConfig(
        policy="streamingllm",
        budget=BUDGET,
        sink=SINK,
        interval=INTERVAL,
        prefill=Prefill(chunk=CHUNK),
    )
    return masked_greedy(PrefixReuse(hf), prompt, NEW, cfg, rid="long")[0]


def test_a_prompt_three_times_the_pool_equals_the_masked_reference(server, prompt, reference):
    out = generate(server, prompt, NEW, "long", timeout=600)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(prompt) == 3 * POOL
    assert meta["kv_evict"][0]["prefill_evicted_tokens"] > 2 * POOL
    assert out["output_ids"] == reference
    st = wait_pool_free(server)
    assert st["pool_available_tokens"] + st["pool_evictable_tokens"] == st["pool_total_tokens"]
    assert "Traceback" not in server.server.log_text()
