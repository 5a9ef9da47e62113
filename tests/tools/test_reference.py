"""Library oracles: paged attention == token attention, masked == compacted, plans applied.

The kernels' oracles (KV move, page indices, scores) are tested beside the kernels
(tests/runtime/kernels); here they serve as building blocks.
"""

import torch
from helpers.reference import attention_ref, paged_decode_attention_ref, row_attention_ref

from sgl_vtoken.kernels.reference import page_indices_ref, repack_kv_ref_


def test_paged_attention_equals_attention_over_gathered_tokens():
    g = torch.Generator().manual_seed(0)
    ps, hq, hkv, d, num_pages = 4, 4, 2, 8, 12
    k_pages = torch.randn(num_pages, ps, hkv, d, generator=g)
    v_pages = torch.randn(num_pages, ps, hkv, d, generator=g)
    req_to_token = torch.zeros(2, 32, dtype=torch.int64)
    req_to_token[0, :10] = torch.cat([torch.arange(12, 20), torch.arange(40, 42)])  # pages 3,4,10
    req_to_token[1, :5] = torch.cat([torch.arange(28, 32), torch.arange(4, 5)])  # pages 7,1
    lens = torch.tensor([10, 5])
    meta = page_indices_ref(req_to_token, torch.tensor([0, 1]), lens, ps)
    q = torch.randn(2, hq, d, generator=g)
    out = paged_decode_attention_ref(q, k_pages, v_pages, *meta)
    k_flat, v_flat = k_pages.reshape(-1, hkv, d), v_pages.reshape(-1, hkv, d)
    for b in range(2):
        want = row_attention_ref(q[b], k_flat, v_flat, req_to_token[b, : int(lens[b])])
        torch.testing.assert_close(out[b], want, rtol=0, atol=1e-6)


def test_masked_attention_equals_attention_over_kept_tokens():
    g = torch.Generator().manual_seed(1)
    k, v, q = (
        torch.randn(20, 2, 8, generator=g),
        torch.randn(20, 2, 8, generator=g),
        torch.randn(6, 8, generator=g),
    )
    keep = torch.rand(20, generator=g) > 0.5
    torch.testing.assert_close(
        attention_ref(q, k, v, keep), attention_ref(q, k[keep], v[keep]), rtol=0, atol=1e-6
    )


def test_move_gathers_before_scattering():
    kv = torch.arange(6.0).view(6, 1)
    repack_kv_ref_([kv], [], torch.tensor([2, 3]), torch.tensor([1, 2]))  # dst 2 is an earlier src
    assert kv.flatten().tolist() == [0, 2, 3, 3, 4, 5]
