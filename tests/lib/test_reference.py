"""References: CSR metadata by hand, paged attention == token attention, masked == compacted."""

import torch

from sgl_vtoken.reference import (attention_probs_ref, attention_ref, kv_indices_ref,
                                  move_kv_ref_, paged_decode_attention_ref, row_attention_ref)


def test_kv_indices_hand_made():
    ps = 4
    req_to_token = torch.zeros(3, 16, dtype=torch.int32)
    req_to_token[1, :11] = torch.cat([torch.arange(8, 16), torch.arange(20, 23)]).int()  # pages 2,3,5
    req_to_token[2, :4] = torch.arange(36, 40).int()                                     # page 9
    indptr, indices, last = kv_indices_ref(req_to_token, torch.tensor([1, 2]), torch.tensor([11, 4]), ps)
    assert indptr.tolist() == [0, 3, 4]          # ceil(11/4) = 3, ceil(4/4) = 1
    assert indices.tolist() == [2, 3, 5, 9]
    assert last.tolist() == [3, 4]               # 11 = (3 - 1) * 4 + 3
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    # page size 1: token-level indices, last page length 1
    _, idx1, last1 = kv_indices_ref(req_to_token, torch.tensor([2]), torch.tensor([4]), 1)
    assert idx1.tolist() == [36, 37, 38, 39] and last1.tolist() == [1]


def test_paged_attention_equals_attention_over_gathered_tokens():
    g = torch.Generator().manual_seed(0)
    ps, hq, hkv, d, num_pages = 4, 4, 2, 8, 12
    k_pages = torch.randn(num_pages, ps, hkv, d, generator=g)
    v_pages = torch.randn(num_pages, ps, hkv, d, generator=g)
    req_to_token = torch.zeros(2, 32, dtype=torch.int64)
    req_to_token[0, :10] = torch.cat([torch.arange(12, 20), torch.arange(40, 42)])    # pages 3,4,10
    req_to_token[1, :5] = torch.cat([torch.arange(28, 32), torch.arange(4, 5)])       # pages 7,1
    lens = torch.tensor([10, 5])
    meta = kv_indices_ref(req_to_token, torch.tensor([0, 1]), lens, ps)
    q = torch.randn(2, hq, d, generator=g)
    out = paged_decode_attention_ref(q, k_pages, v_pages, *meta)
    k_flat, v_flat = k_pages.reshape(-1, hkv, d), v_pages.reshape(-1, hkv, d)
    for b in range(2):
        want = row_attention_ref(q[b], k_flat, v_flat, req_to_token[b, :int(lens[b])])
        torch.testing.assert_close(out[b], want, rtol=0, atol=1e-6)


def test_masked_attention_equals_attention_over_kept_tokens():
    g = torch.Generator().manual_seed(1)
    k, v, q = torch.randn(20, 2, 8, generator=g), torch.randn(20, 2, 8, generator=g), torch.randn(6, 8, generator=g)
    keep = torch.rand(20, generator=g) > 0.5
    torch.testing.assert_close(attention_ref(q, k, v, keep), attention_ref(q, k[keep], v[keep]),
                               rtol=0, atol=1e-6)


def test_attention_probs_sum_to_group_size_per_kv_head():
    g = torch.Generator().manual_seed(2)
    probs = attention_probs_ref(torch.randn(6, 4, generator=g), torch.randn(9, 3, 4, generator=g))
    assert probs.shape == (9, 3)
    torch.testing.assert_close(probs.sum(0), torch.full((3,), 2.0))   # 6 query heads / 3 KV heads


def test_move_gathers_before_scattering():
    kv = torch.arange(6.0).view(6, 1)
    move_kv_ref_(kv, torch.tensor([2, 3]), torch.tensor([1, 2]))        # dst 2 is an earlier src
    assert kv.flatten().tolist() == [0, 2, 3, 3, 4, 5]
