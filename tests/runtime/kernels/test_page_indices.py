"""page_indices: FlashInfer paged-KV CSR from req_to_token, Triton against the torch reference."""

import pytest
import torch
from kvtest_helpers import page_dense_rows

from sgl_vtoken.kernels import page_indices, page_indices_ref


def _table(page_size, lens, max_reqs, max_ctx, g, dtype=torch.int32):
    """A req_to_token table holding page-dense rows at random row indices (other cells -1)."""
    rows = page_dense_rows(page_size, lens, num_pages=sum(lens) + 4, g=g)
    table = torch.full((max_reqs, max_ctx), -1, dtype=dtype)
    rpi = torch.randperm(max_reqs, generator=g)[: len(lens)]
    for r, row in zip(rpi.tolist(), rows):
        table[r, : len(row)] = torch.tensor(row, dtype=dtype)
    return table, rpi, torch.tensor(lens)


def _to(device, *ts, dtype=None):
    return [t.to(device) if dtype is None else t.to(device=device, dtype=dtype) for t in ts]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("bs", [1, 5, 37])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_matches_reference(device, page_size, bs, idx_dtype):
    """Includes an empty row, a single page, one page plus one token, and random lengths."""
    g = torch.Generator().manual_seed(page_size * 100 + bs)
    lens = torch.randint(0, 90, (bs,), generator=g).tolist()
    for i, n in enumerate([page_size, 0, page_size + 1][:bs]):
        lens[i] = n
    table, rpi, sl = _table(page_size, lens, bs + 3, 96, g)
    expected = page_indices_ref(table, rpi, sl, page_size)
    (table_d,) = _to(device, table)
    rpi_d, sl_d = _to(device, rpi, sl, dtype=idx_dtype)
    got = page_indices(table_d, rpi_d, sl_d, page_size, impl="triton", check=True)
    for name, a, b in zip(("kv_indptr", "kv_indices", "kv_last_page_len"), got, expected):
        assert a.dtype == torch.int32, name
        assert torch.equal(a.cpu(), b), name


def test_hand_made_example(device):
    """page_size 4; rows: 6 tokens on pages 3,7; 4 tokens on page 2; 0 tokens; 1 token on page 9."""
    table = torch.full((4, 8), -1, dtype=torch.int32)
    table[2, :6] = torch.tensor([12, 13, 14, 15, 28, 29])  # pages 3 (slots 12-15), 7 (28, 29)
    table[0, :4] = torch.tensor([8, 9, 10, 11])  # page 2, full
    table[3, :1] = torch.tensor([36])  # page 9
    rpi = torch.tensor([2, 0, 1, 3])
    sl = torch.tensor([6, 4, 0, 1])
    for impl in ("triton", "torch"):
        indptr, ids, last = page_indices(*_to(device, table, rpi, sl), 4, impl=impl)
        assert indptr.tolist() == [0, 2, 3, 3, 4]  # ceil(6/4)=2, ceil(4/4)=1, 0, ceil(1/4)=1
        assert ids.tolist() == [3, 7, 2, 9]
        assert last.tolist() == [2, 4, 0, 1]  # 6 = (2-1)*4 + 2; 4 = 0*4 + 4; empty; 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_ids_address_every_token_slot(device, page_size):
    """What the attention kernel relies on: token i of request b lives at
    kv_indices[kv_indptr[b] + i // P] * P + i % P, the slot req_to_token holds."""
    g = torch.Generator().manual_seed(3)
    lens = [1, page_size, page_size + 1, 70, 33]
    table, rpi, sl = _table(page_size, lens, 8, 80, g, dtype=torch.int64)
    indptr, ids, last = (
        t.cpu() for t in page_indices(*_to(device, table, rpi, sl), page_size, impl="triton")
    )
    for b, (r, n) in enumerate(zip(rpi.tolist(), lens)):
        i = torch.arange(n)
        slots = ids[indptr[b] + i // page_size].long() * page_size + i % page_size
        assert torch.equal(slots, table[r, :n])
        assert (indptr[b + 1] - indptr[b] - 1) * page_size + last[b] == n


def test_flashinfer_get_seq_lens_recovers_lengths(device):
    fi_page = pytest.importorskip("flashinfer.page")
    g = torch.Generator().manual_seed(7)
    page_size, lens = 16, [1, 16, 17, 250, 0, 33]
    table, rpi, sl = _table(page_size, lens, 8, 256, g)
    indptr, _, last = page_indices(*_to(device, table, rpi, sl), page_size, impl="triton")
    assert fi_page.get_seq_lens(indptr, last, page_size).cpu().tolist() == lens


def test_preallocated_output_buffer(device):
    g = torch.Generator().manual_seed(9)
    table, rpi, sl = _to(device, *_table(4, [5, 9, 2], 4, 16, g))
    expected = page_indices_ref(table.cpu(), rpi.cpu(), sl.cpu(), 4)[1]
    out = torch.full((20,), -7, dtype=torch.int32, device=device)
    _, whole, _ = page_indices(table, rpi, sl, 4, kv_indices_out=out, impl="triton")
    assert whole.data_ptr() == out.data_ptr() and whole.numel() == 20
    assert torch.equal(out[:6].cpu(), expected) and bool((out[6:] == -7).all())
    _, sliced, _ = page_indices(table, rpi, sl, 4, kv_indices_out=out, num_pages=6, impl="triton")
    assert sliced.numel() == 6 and torch.equal(sliced.cpu(), expected)


def test_too_small_output_buffer_is_refused_without_a_sync():
    table = torch.arange(32, dtype=torch.int32).view(4, 8)
    with pytest.raises(
        ValueError, match="kv_indices_out holds 1 entries but the batch has 2 pages"
    ):
        page_indices(
            table,
            torch.tensor([0, 1]),
            torch.tensor([4, 3]),
            4,
            kv_indices_out=torch.zeros(1, dtype=torch.int32),
        )


def test_empty_batch(device):
    table = torch.zeros(2, 8, dtype=torch.int32, device=device)
    e = torch.empty(0, dtype=torch.int64, device=device)
    for impl in ("triton", "torch"):
        indptr, ids, last = page_indices(table, e, e, 4, impl=impl)
        assert indptr.tolist() == [0] and ids.numel() == 0 and last.numel() == 0


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(page_size=0), "page_size must be an int >= 1"),
        (dict(req_to_token=torch.zeros(4, 8)), "req_to_token has dtype torch.float32"),
        (dict(req_to_token=torch.zeros(8, dtype=torch.int32)), "req_to_token must be 2-D"),
        (dict(seq_lens=torch.tensor([1])), "seq_lens has 1 entries, expected 2"),
        (
            dict(req_pool_indices=torch.tensor([0, 4])),
            r"req_pool_indices holds rows in \[0, 4\], outside \[0, 4\)",
        ),
        (
            dict(seq_lens=torch.tensor([4, 9])),
            r"seq_lens holds lengths in \[4, 9\], outside \[0, 8\]",
        ),
        (
            dict(kv_indices_out=torch.zeros(1, dtype=torch.int32)),
            "kv_indices_out holds 1 entries but the batch has 2 pages",
        ),
        (
            dict(kv_indices_out=torch.zeros(4, dtype=torch.int64)),
            "kv_indices_out has dtype torch.int64",
        ),
        (dict(impl="gpu"), "impl must be one of"),
    ],
)
def test_invalid_arguments(change, match):
    args = dict(
        req_to_token=torch.arange(32, dtype=torch.int32).view(4, 8),
        req_pool_indices=torch.tensor([0, 1]),
        seq_lens=torch.tensor([4, 3]),
        page_size=4,
        check=True,
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        page_indices(**args)


def test_check_rejects_rows_that_are_not_page_dense():
    table = torch.arange(32, dtype=torch.int32).view(4, 8)
    table[1, 2] = 20  # page of row 1 no longer consecutive
    with pytest.raises(ValueError, match="row 1 .batch entry 1. is not page-dense at position 2"):
        page_indices(table, torch.tensor([0, 1]), torch.tensor([4, 4]), 4, check=True)
    table2 = torch.arange(2, 34, dtype=torch.int32).view(4, 8)  # pages start off a page boundary
    with pytest.raises(ValueError, match="not page-dense at position 0"):
        page_indices(table2, torch.tensor([0]), torch.tensor([4]), 4, check=True)


@pytest.mark.gpu
def test_gpu_large_batch_matches_reference(device):
    g = torch.Generator().manual_seed(11)
    page_size, bs = 16, 512
    lens = torch.randint(0, 4000, (bs,), generator=g).tolist()
    table, rpi, sl = _table(page_size, lens, bs + 16, 4096, g)
    expected = page_indices_ref(table, rpi, sl, page_size)
    got = page_indices(*_to(device, table, rpi, sl), page_size)
    for a, b in zip(got, expected):
        assert torch.equal(a.cpu(), b)
