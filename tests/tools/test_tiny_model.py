"""The embedded tiny model: deterministic, loadable, with a working chat template."""

import pytest

from sgl_vtoken_tools.tiny_model import (
    TinyModelSpec,
    build_tiny_model,
    ensure_tiny_model,
    folder_digest,
)


def test_same_seed_same_bytes(tiny_model, tmp_path):
    assert folder_digest(build_tiny_model(tmp_path / "again")) == folder_digest(tiny_model)


def test_other_seed_other_weights(tiny_model, tmp_path):
    other = build_tiny_model(tmp_path / "seed1", TinyModelSpec(seed=1))
    assert (other / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (
        tiny_model / "model.safetensors"
    ).read_bytes()


def test_ensure_reuses_a_matching_folder(tiny_model):
    before = (tiny_model / "model.safetensors").stat().st_mtime_ns
    ensure_tiny_model(tiny_model)
    assert (tiny_model / "model.safetensors").stat().st_mtime_ns == before


def test_architecture_and_chat_template(tiny_model):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model)
    assert (
        cfg.model_type,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    ) == ("llama", 2, 4, 2)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"


@pytest.mark.parametrize(
    "field,value", [("num_key_value_heads", 3), ("vocab_size", 100), ("hidden_size", 0)]
)
def test_bad_spec_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TinyModelSpec(**{field: value})
