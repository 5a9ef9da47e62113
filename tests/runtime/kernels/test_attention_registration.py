"""`vtoken_flashinfer` backend: registration, paged views, and the page-level FlashInfer plans.

CPU tests drive the index updaters with recording stand-ins for FlashInfer's wrappers (FlashInfer
itself needs a GPU); the gpu-marked test runs FlashInfer's paged decode on `page_indices` output.
"""

import functools
import importlib.util
import math
from types import SimpleNamespace

import pytest
import torch
from kvtest_helpers import page_dense_rows

from sgl_vtoken.patches import attention as A  # imports SGLang only inside its functions
from sgl_vtoken.patches import paged_kv as P

needs_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None, reason="needs SGLang installed"
)


@pytest.fixture
def clean_registry():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    backends, choices = dict(ATTENTION_BACKENDS), list(ATTENTION_BACKEND_CHOICES)
    yield ATTENTION_BACKENDS, ATTENTION_BACKEND_CHOICES
    ATTENTION_BACKENDS.clear()
    ATTENTION_BACKENDS.update(backends)
    ATTENTION_BACKEND_CHOICES[:] = choices


@needs_sglang
def test_registration_adds_the_backend_once(clean_registry):
    backends, choices = clean_registry
    A.register_attention_backend()
    A.register_attention_backend()
    assert backends["vtoken_flashinfer"] is A.create_vtoken_flashinfer_backend
    assert choices.count("vtoken_flashinfer") == 1
    assert "flashinfer" in backends  # the stock backend stays


def test_importing_the_module_does_not_import_sglang():
    """The GPU check machine has torch, triton and maybe flashinfer, but no SGLang."""
    import subprocess
    import sys

    code = "import sys, sgl_vtoken.patches.attention; print('sglang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_factory_rejects_mla_models():
    with pytest.raises(ValueError, match="supports MHA models only"):
        A.create_vtoken_flashinfer_backend(SimpleNamespace(use_mla_backend=True))


def test_as_pages_views_slot_rows_as_pages():
    k = torch.arange(12 * 2 * 3).view(12, 2, 3)
    v = -k
    pk, pv = P.as_pages((k, v), 4)
    assert pk.shape == (3, 4, 2, 3) and pk.data_ptr() == k.data_ptr()
    for slot in range(12):  # page p, offset j holds slot p * 4 + j
        assert torch.equal(pk[slot // 4, slot % 4], k[slot]) and torch.equal(
            pv[slot // 4, slot % 4], v[slot]
        )
    assert P.as_pages((k, v), 1) == (k, v)
    with pytest.raises(ValueError, match="12 rows, not a multiple of page_size 5"):
        P.as_pages((k, v), 5)


class _RecordingWrapper:
    """Stands in for a FlashInfer paged wrapper: records plans and the kv caches it is run on."""

    def __init__(self, graph_indices=None):
        self.is_cuda_graph_enabled = graph_indices is not None
        self._paged_kv_indices_buf = graph_indices
        self.plans, self.runs = [], []
        self.begin_forward = self._plan

    def _plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, q, paged_kv_cache, *args, return_lse=False, **kwargs):
        self.runs.append(([t.shape for t in paged_kv_cache], return_lse))

    def forward(self, q, paged_kv_cache, **kwargs):  # FlashInfer's deprecated alias
        return self.run(q, paged_kv_cache)


def test_read_kv_as_pages_wraps_run_and_run_return_lse():
    w = P.read_kv_as_pages(_RecordingWrapper(), 4)
    assert P.read_kv_as_pages(w, 4) is w  # idempotent
    kv = (torch.zeros(8, 2, 16), torch.zeros(8, 2, 16))
    w.forward(None, kv)
    w.run_return_lse(None, kv)
    assert w.runs == [([(2, 4, 2, 16)] * 2, False), ([(2, 4, 2, 16)] * 2, True)]


def test_lse_to_hands_flashinfers_lse_over_and_restores_run():
    """The decode of a scored layer runs with `return_lse=True` (through the paged view too); the
    LSE goes to the sink, the output back to SGLang, and `run` is the paged one again after."""

    class Lse(_RecordingWrapper):
        def run(self, q, paged_kv_cache, *args, return_lse=False, **kwargs):
            super().run(q, paged_kv_cache, return_lse=return_lse)
            return ("out", "lse") if return_lse else "out"

    w = P.read_kv_as_pages(Lse(), 4)
    paged, got = w.run, []
    kv = (torch.zeros(8, 2, 16), torch.zeros(8, 2, 16))
    with P.lse_to(w, got.append):
        assert w.forward(None, kv) == "out"
    assert got == ["lse"] and w.run is paged and w.forward(None, kv) == "out"
    plain = Lse()
    with P.lse_to(plain, got.append):
        plain.forward(None, kv)
    assert "run" not in vars(plain) and got == ["lse", "lse"]
    assert [r[1] for r in w.runs + plain.runs] == [True, False, True]


def _backend(page_size, table, max_bs=8):
    return SimpleNamespace(
        page_size=page_size,
        req_to_token_pool=SimpleNamespace(req_to_token=table),
        kv_last_page_len=torch.ones(max_bs, dtype=torch.int32),
    )


def _updater(cls, backend):
    u = object.__new__(cls)  # the real __init__ needs a ModelRunner
    u.attn_backend = backend
    u.kv_last_page_len = backend.kv_last_page_len
    u.num_qo_heads, u.num_kv_heads, u.head_dim = 8, 2, 64
    u.data_type = u.q_data_type = torch.bfloat16
    return u


def _rows(page_size, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = page_dense_rows(page_size, lens, num_pages=64, g=g)
    table = torch.zeros(6, 128, dtype=torch.int32)
    rpi = torch.tensor([4, 1, 3][: len(lens)])
    for r, row in zip(rpi.tolist(), rows):
        table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return table, rpi


@needs_sglang
@pytest.mark.parametrize("graph", [False, True])
def test_decode_plan_uses_page_ids_and_the_real_page_size(graph):
    from sgl_vtoken.patches.flashinfer_backend import PagedDecodeUpdater as decode_cls

    page, lens = 4, [9, 4, 1]  # 3 pages (last holds 1), 1 full page, 1 page holding 1
    table, rpi = _rows(page, lens)
    backend = _backend(page, table)
    updater = _updater(decode_cls, backend)
    wrapper = _RecordingWrapper(torch.full((14,), -1, dtype=torch.int32) if graph else None)
    kv_indptr_buf = torch.zeros(9, dtype=torch.int32)
    seq_lens = torch.tensor(lens)
    updater.call_begin_forward(
        wrapper, seq_lens, sum(lens), kv_indptr_buf, None, None, seq_lens,
        plan=None, req_pool_indices=rpi,
    )  # fmt: skip
    ((args, kwargs),) = wrapper.plans
    indptr, indices, last, hq, hkv, dim, page_size = args
    assert page_size == 4 and (hq, hkv, dim) == (8, 2, 64)
    assert indptr.tolist() == [0, 3, 4, 5] and indptr.data_ptr() == kv_indptr_buf.data_ptr()
    assert last.tolist() == [1, 4, 1] and last.data_ptr() == backend.kv_last_page_len.data_ptr()
    expected_ids = [
        table[r, p * page].item() // page
        for r, n in zip(rpi.tolist(), lens)
        for p in range(math.ceil(n / page))
    ]
    assert indices[:5].tolist() == expected_ids
    if graph:  # written into the capture-stable buffer the graph reads
        assert indices.data_ptr() == wrapper._paged_kv_indices_buf.data_ptr()
    assert "global_override_indptr_cpu" not in kwargs


@needs_sglang
def test_decode_fast_plan_gets_the_host_page_indptr():
    from flashinfer.decode import fast_decode_plan

    class RecordingPartial(functools.partial):  # looks like SGLang's partial(fast_decode_plan, w)
        calls = []

        def __call__(self, *args, **kwargs):
            self.calls.append(kwargs)

    from sgl_vtoken.patches.flashinfer_backend import PagedDecodeUpdater as decode_cls

    table, rpi = _rows(4, [9, 4, 1])
    updater = _updater(decode_cls, _backend(4, table))
    wrapper = _RecordingWrapper(torch.zeros(14, dtype=torch.int32))
    wrapper.begin_forward = RecordingPartial(fast_decode_plan, wrapper)
    seq_lens = torch.tensor([9, 4, 1])
    updater.call_begin_forward(
        wrapper, seq_lens, 14, torch.zeros(9, dtype=torch.int32), None, None, seq_lens,
        plan=None, req_pool_indices=rpi,
    )  # fmt: skip
    assert RecordingPartial.calls[0]["global_override_indptr_cpu"].tolist() == [0, 3, 4, 5]


@needs_sglang
@pytest.mark.parametrize("use_ragged", [True, False])
def test_extend_plan_pages_the_prefix_or_the_whole_row(use_ragged):
    from sgl_vtoken.patches.flashinfer_backend import PagedPrefillUpdater as prefill_cls

    page = 4
    seq = [10, 7]
    prefix = [8, 0]
    table, rpi = _rows(page, seq, seed=1)
    backend = _backend(page, table)
    updater = _updater(prefill_cls, backend)
    ragged, paged = _RecordingWrapper(), _RecordingWrapper()
    kv_lens = torch.tensor(prefix if use_ragged else seq)
    qo_buf = torch.zeros(9, dtype=torch.int32)
    updater.call_begin_forward(
        ragged, paged, rpi[:2], kv_lens, int(kv_lens.sum()), torch.tensor(seq), torch.tensor(prefix),
        None, torch.zeros(9, dtype=torch.int32), qo_buf, use_ragged, None, plan=None,
    )  # fmt: skip
    ((args, kwargs),) = paged.plans
    qo_indptr, kv_indptr, indices, last, *_, page_size = args
    assert page_size == 4 and qo_indptr.tolist() == [0, 2, 9]  # new tokens: 10-8, 7-0
    if use_ragged:
        assert len(ragged.plans) == 1
        assert kv_indptr.tolist() == [0, 2, 2] and last.tolist() == [
            4,
            0,
        ]  # prefix 8 = 2 full pages
    else:
        assert ragged.plans == []
        assert kv_indptr.tolist() == [0, 3, 5] and last.tolist() == [2, 3]
    n = int(kv_indptr[-1])
    rows = [table[r] for r in rpi[:2].tolist()]
    firsts = [
        row[p * page].item() // page
        for row, k in zip(rows, kv_lens.tolist())
        for p in range(math.ceil(k / page))
    ]
    assert indices[:n].tolist() == firsts


@needs_sglang
@pytest.mark.parametrize(
    "kw,what",
    [
        (dict(spec_info=object()), "speculative decoding"),
        (dict(kv_start_idx=torch.zeros(1)), "sliding-window attention"),
    ],
)
def test_unsupported_features_are_named(kw, what):
    from sgl_vtoken.patches.flashinfer_backend import PagedDecodeUpdater as decode_cls

    table, rpi = _rows(4, [4])
    updater = _updater(decode_cls, _backend(4, table))
    args = dict(spec_info=None, kv_start_idx=None)
    args.update(kw)
    with pytest.raises(NotImplementedError, match=f"vtoken_flashinfer does not support {what}"):
        updater.call_begin_forward(
            _RecordingWrapper(), torch.tensor([4]), 4, torch.zeros(2, dtype=torch.int32), args["kv_start_idx"],
            args["spec_info"], None, plan=None, req_pool_indices=rpi[:1],
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_flashinfer_paged_decode_equals_token_level_decode(device, page_size):
    """FlashInfer planned with page ids from `page_indices` at the real page size reads exactly
    the same keys as SGLang's token-level plan at page size 1."""
    flashinfer = pytest.importorskip("flashinfer")
    from sgl_vtoken.kernels import page_indices

    g = torch.Generator().manual_seed(page_size)
    lens = [1, page_size, page_size + 1, 700, 333]
    num_pages = 256
    rows = page_dense_rows(page_size, lens, num_pages=num_pages, g=g)
    table = torch.zeros(len(lens), 1024, dtype=torch.int32)
    for r, row in enumerate(rows):
        table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    table, rpi, seq = (
        table.to(device),
        torch.arange(len(lens), device=device),
        torch.tensor(lens, device=device),
    )
    hq, hkv, dim = 32, 8, 128
    k = torch.randn(num_pages * page_size, hkv, dim, generator=g).to(torch.bfloat16).to(device)
    v = torch.randn(num_pages * page_size, hkv, dim, generator=g).to(torch.bfloat16).to(device)
    q = torch.randn(len(lens), hq, dim, generator=g).to(torch.bfloat16).to(device)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    outs = []
    for ps in (1, page_size):
        indptr, indices, last = page_indices(table, rpi, seq, ps)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(
            indptr,
            indices,
            last,
            hq,
            hkv,
            dim,
            ps,
            data_type=torch.bfloat16,
            q_data_type=torch.bfloat16,
        )
        outs.append(w.run(q, P.as_pages((k, v), ps)))
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
