"""repack_kv_ validates a buffer set once (cached by identity) and launches with whole heads."""

import gc
import weakref

import pytest
import torch
from kvtest_helpers import assert_same_bytes, disjoint_moves, random_layers

from sgl_vtoken.kernels import buffer_set as B
from sgl_vtoken.kernels import repack_kv_, repack_kv_ref_
from sgl_vtoken.kernels.repack import default_launch


@pytest.fixture
def counts(monkeypatch):
    """Counts full validations and disjointness checks (the expensive per-set work)."""
    seen = {"validate": 0, "disjoint": 0}
    validate, disjoint = B.validate, B.check_disjoint_buffers

    def counting_validate(*a, **kw):
        seen["validate"] += 1
        return validate(*a, **kw)

    def counting_disjoint(*a, **kw):
        seen["disjoint"] += 1
        return disjoint(*a, **kw)

    monkeypatch.setattr(B, "validate", counting_validate)
    monkeypatch.setattr(B, "check_disjoint_buffers", counting_disjoint)
    B.clear_buffer_cache()
    yield seen
    B.clear_buffer_cache()


def _pool(g, device, layers=3, slots=32):
    return (random_layers(layers, slots, 2, 16, torch.bfloat16, g, device),
            random_layers(layers, slots, 2, 16, torch.bfloat16, g, device))  # fmt: skip


def _check_against_reference(keys, values, src, dst):
    k_exp, v_exp = [t.clone() for t in keys], [t.clone() for t in values]
    repack_kv_ref_(k_exp, v_exp, src, dst)  # the oracle directly: no validation counted
    repack_kv_(keys, values, src, dst, impl="triton")
    assert_same_bytes(keys, k_exp, "k")
    assert_same_bytes(values, v_exp, "v")


def test_a_buffer_set_is_validated_once(device, counts):
    g = torch.Generator().manual_seed(0)
    keys, values = _pool(g, device)
    for _ in range(3):
        src, dst = disjoint_moves(32, 5, torch.int64, g, device)
        _check_against_reference(keys, values, src, dst)
    assert counts == {"validate": 1, "disjoint": 1}
    repack_kv_(keys, values, src, dst, impl="triton", check=True)  # check=True re-validates
    assert counts["validate"] == 2


def test_a_replaced_layer_is_noticed(device, counts):
    g = torch.Generator().manual_seed(1)
    keys, values = _pool(g, device)
    src, dst = disjoint_moves(32, 4, torch.int64, g, device)
    repack_kv_(keys, values, src, dst, impl="triton")
    keys[1] = torch.zeros(32, 2, 8, dtype=torch.bfloat16, device=device)  # same list, new tensor
    with pytest.raises(ValueError, match=r"k_buffers\[1\] has shape"):
        repack_kv_(keys, values, src, dst, impl="triton")
    keys[1] = torch.zeros(32, 2, 16, dtype=torch.bfloat16, device=device)
    _check_against_reference(keys, values, src, dst)  # new address table: the new layer moves too


def test_a_swapped_storage_is_noticed(device, counts):
    """`set_` keeps the tensor object but moves its data: the address table must follow."""
    g = torch.Generator().manual_seed(2)
    keys, values = _pool(g, device)
    src, dst = disjoint_moves(32, 4, torch.int64, g, device)
    repack_kv_(keys, values, src, dst, impl="triton")
    fresh = random_layers(1, 32, 2, 16, torch.bfloat16, g, device)[0]
    keys[0].set_(fresh)
    before = counts["validate"]
    _check_against_reference(keys, values, src, dst)
    assert counts["validate"] == before + 1


def test_the_same_pair_of_containers_may_come_back_with_other_tensors(device, counts):
    """Entries are keyed by container identity; a reused id with other tensors is a miss."""
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        keys, values = _pool(g, device, layers=2)
        src, dst = disjoint_moves(32, 6, torch.int32, g, device)
        _check_against_reference(keys, values, src, dst)
        del keys, values
        gc.collect()


def test_the_cache_keeps_no_buffer_alive(device, counts):
    g = torch.Generator().manual_seed(4)
    keys, values = _pool(g, device)
    src, dst = disjoint_moves(32, 3, torch.int64, g, device)
    repack_kv_(keys, values, src, dst, impl="triton")
    ref = weakref.ref(keys[0])
    del keys, values
    gc.collect()
    assert ref() is None


def test_a_stacked_tensor_is_cached_by_identity(device, counts):
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 24, 2, 8, generator=g).to(device)
    v = torch.randn(2, 24, 2, 8, generator=g).to(device)
    src, dst = disjoint_moves(24, 5, torch.int64, g, device)
    for _ in range(2):
        k_exp, v_exp = k.clone(), v.clone()
        repack_kv_ref_(list(k_exp), list(v_exp), src, dst)
        repack_kv_(k, v, src, dst, impl="triton")
        assert torch.equal(k, k_exp) and torch.equal(v, v_exp)
    assert counts == {"validate": 1, "disjoint": 1}


@pytest.mark.parametrize(
    "shape,expected",
    [
        # Llama-3.1-8B on an H200: whole bf16 heads, 128 moves a chunk, 4 warps (the sweep's best)
        (dict(head_dim=128, elem=2, heads=8, num_layers=32, num_sms=132), (128, 4, 128)),
        (dict(head_dim=128, elem=1, heads=8, num_layers=32, num_sms=132), (256, 4, 128)),  # fp8
        (
            dict(head_dim=256, elem=4, heads=8, num_layers=32, num_sms=132),
            (64, 4, 128),
        ),  # 1 KiB rows: halves
        (
            dict(head_dim=64, elem=2, heads=3, num_layers=30, num_sms=132),
            (256, 4, 64),
        ),  # 128 B rows: whole
        (
            dict(head_dim=128, elem=2, heads=1, num_layers=4, num_sms=132),
            (256, 4, 64),
        ),  # tiny grid: split
        (
            dict(head_dim=80, elem=2, heads=8, num_layers=32, num_sms=132),
            (128, 4, 128),
        ),  # padded head
    ],
)
def test_default_launch_parameters(shape, expected):
    assert default_launch(**shape, rope=False) == expected


def test_default_launch_with_rope_keeps_whole_heads():
    assert default_launch(128, 2, 1, 4, rope=True, num_sms=132) == (32, 4, 128)
    assert default_launch(96, 4, 8, 2, rope=False, num_sms=None) == (16, 4, 128)  # interpreter


@pytest.mark.gpu
def test_gpu_cached_call_never_syncs_and_replays_in_a_cuda_graph(device):
    """After a first call (validation, address tables, compilation), repack_kv_ only enqueues
    work: no host sync, and a captured call replays correctly on new move lists."""
    g = torch.Generator().manual_seed(6)
    keys, values = _pool(g, device, layers=4, slots=4096)
    src = torch.zeros(256, dtype=torch.int64, device=device)
    dst = torch.zeros(256, dtype=torch.int64, device=device)
    repack_kv_(keys, values, src[:0], dst[:0])  # warm up: validate, build tables
    s0, d0 = disjoint_moves(4096, 256, torch.int64, g, device)
    src.copy_(s0), dst.copy_(d0)
    repack_kv_(keys, values, src, dst)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        repack_kv_(keys, values, src, dst)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        repack_kv_(keys, values, src, dst)
    s1, d1 = disjoint_moves(4096, 256, torch.int64, g, device)
    src.copy_(s1), dst.copy_(d1)
    k_exp, v_exp = [t.clone() for t in keys], [t.clone() for t in values]
    repack_kv_ref_(k_exp, v_exp, src, dst)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bytes(keys, k_exp, "k")
    assert_same_bytes(values, v_exp, "v")
