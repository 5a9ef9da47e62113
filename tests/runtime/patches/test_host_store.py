"""The host store's bookkeeping (`patches/cache/host_tier.py`): reference-counted chunks, stores moving
from a request to its stored history, host histories (`host_history.py`) and which one a turn
continues, the capacity released least recently used first."""

import types
from array import array

import torch

from sgl_vtoken.patches.cache.host_history import find, restorable
from sgl_vtoken.patches.cache.host_tier import HostChunks, HostHistory, HostTier, offload
from sgl_vtoken.patches.core.records import Chunk
from sgl_vtoken.patches.core.report import Report


def chunk(positions, layers=2, heads=1, dim=4):
    m = len(positions)
    return Chunk(
        torch.tensor(positions),
        torch.zeros(m, layers, heads, dim),
        torch.zeros(m, layers, heads, dim),
    )


def node(t):
    return types.SimpleNamespace(last_access_time=t)


def state():
    return types.SimpleNamespace(host=HostChunks(), report=Report())


def test_a_chunk_is_counted_once_and_freed_with_its_last_owner():
    tier, c = HostTier(100), chunk([1, 2, 3])
    st, n1 = state(), node(0.0)
    tier.hold([c])
    st.host.chunks.append(c)
    tier.store(n1, st)  # the finished request's chunks go to its view
    assert (
        st.host.chunks == []
        and tier.store_of(n1) == [c]
        and tier.tokens == 3
        and tier.bytes == c.nbytes
    )
    tier.hold(tier.store_of(n1))  # a next turn takes the view's store
    tier.detach(n1)  # the old view goes: the turn still holds it
    assert tier.tokens == 3
    tier.drop([c])
    assert tier.tokens == 0 and tier.bytes == 0 and tier.peak_bytes == c.nbytes and tier.nodes == {}


def test_the_cap_releases_least_recently_used_histories_first_then_drops_what_does_not_fit():
    tier = HostTier(10)
    old, new = node(1.0), node(2.0)
    for n, pos in ((old, [0, 1, 2, 3]), (new, [4, 5, 6, 7])):
        st = state()
        st.host.chunks = [chunk(pos)]
        tier.hold(st.host.chunks)
        tier.store(n, st)
    assert tier.make_room(4) == 4 and tier.store_of(old) is None and tier.store_of(new) is not None
    assert tier.make_room(20) == 10 and tier.store_of(new) is None and tier.tokens == 0


def test_offload_copies_every_layers_kv_of_the_victims_and_counts_drops():
    layers = [torch.arange(10 * 3, dtype=torch.float32).view(10, 1, 3) + 100 * i for i in range(2)]
    tier = HostTier(3)
    a, b = state(), state()
    expected = torch.stack([layers[0][[4, 7]], layers[1][[4, 7]]], dim=1)
    offload(
        tier,
        [(a, torch.tensor([40, 70])), (b, torch.tensor([10, 20]))],
        torch.tensor([4, 7, 1, 2]),
        layers,
        [x + 0.5 for x in layers],
    )
    ca, cb = a.host.chunks[0], b.host.chunks[0]
    layers[0][4] = -1.0  # a host copy: later writes to the pool do not reach it
    torch.testing.assert_close(ca.k, expected)
    torch.testing.assert_close(ca.v, ca.k + 0.5)
    assert cb.positions.tolist() == [10] and tier.dropped == 1 and tier.offloaded == 3
    assert a.report.offloaded_tokens == 2 and b.report.offloaded_tokens == 1


def host_history(tier, ids, kept, used, ns="ns", store=()):
    """A host history of logical `ids` whose `kept` positions have K/V, kept in `tier`."""
    row = chunk(kept)
    tier.hold([row, *store])
    h = HostHistory(ns, torch.tensor(ids), row, list(store), used)
    tier.keep(h)
    return h


def test_host_histories_share_the_cap_and_go_least_recently_used_first_counted():
    tier = HostTier(12)
    view = node(2.0)
    st = state()
    st.host.chunks = [chunk([9, 10, 11])]
    tier.hold(st.host.chunks)
    tier.store(view, st)  # a device view's store: 3 tokens, used at 2.0
    old = host_history(tier, range(8), [0, 5, 6, 7], used=1.0, store=[chunk([1, 2])])
    new = host_history(tier, range(9), [0, 7, 8], used=3.0)
    assert tier.tokens == 12 and len(tier.histories) == 2
    # room only among what was used before 1.5: the old history goes (its row and its store)
    assert tier.make_room(6, before=1.5) == 6 and tier.histories_dropped == 1
    assert list(tier.histories.values()) == [new] and tier.tokens == 6
    # nothing used before 0.5: what does not fit is not made room for
    assert tier.make_room(7, before=0.5) == 6 and tier.tokens == 6
    tier.release(new)  # restored to the device: not a drop
    assert tier.histories_dropped == 1 and tier.tokens == 3 and old.depth == 8
    tier.reset()  # a flush: every store and host history goes
    assert tier.tokens == 0 and tier.bytes == 0 and not tier.histories and not tier.nodes


def test_a_turn_continues_the_host_history_it_extends_or_leaves_at_a_differing_id():
    tier = HostTier(100)
    a = host_history(tier, [1, 2, 3, 4, 5, 6], [0, 4, 5], used=1.0)
    host_history(tier, [1, 2, 3, 4, 5, 6, 7, 8], [0, 7], used=2.0, ns="other settings")
    prompt = array("q", [1, 2, 3, 4, 5, 6, 20, 21])
    assert find(tier, "ns", prompt, len(prompt) - 1, floor=0) == (a, 6)  # extended whole
    assert find(tier, "ns", prompt, 7, floor=6) is None  # the device has it as deep already
    edited = array("q", [1, 2, 3, 9, 5, 6, 20, 21])
    assert find(tier, "ns", edited, 7, floor=0) == (a, 3)  # cut at the differing id
    regenerate = array("q", [1, 2, 3, 4, 5])
    assert find(tier, "ns", regenerate, 4, floor=0) is None  # the prompt ends inside it


def test_a_view_continued_to_a_cut_shares_only_the_store_entries_before_the_cut():
    """A request that leaves a stored history at a differing id (two conversations sharing a
    system prompt) continues its view only up to the cut: the view's evicted tokens past the cut
    are the other conversation's and must not become the request's recall candidates. Chunks
    wholly before the cut are shared, one across it is copied in part, and the view keeps its
    whole store for its own conversation."""
    tier, n = HostTier(100), node(0.0)
    before, across = chunk([1, 2, 3]), chunk([5, 9, 12])
    across.k[:, 0, 0, 0] = torch.tensor([5.0, 9.0, 12.0])
    st = state()
    st.host.chunks = [before, across]
    tier.hold(st.host.chunks)
    tier.store(n, st)
    taken = tier.share_below(n, 8)
    assert taken[0] is before and [c.positions.tolist() for c in taken] == [[1, 2, 3], [5]]
    assert taken[1].k[:, 0, 0, 0].tolist() == [5.0]
    assert tier.store_of(n) == [before, across] and tier.tokens == 3 + 3 + 1
    assert tier.share_below(n, 1) == []
    tier.drop(taken)
    tier.detach(n)
    assert tier.tokens == 0 and tier.bytes == 0


def test_a_history_cut_where_it_kept_nothing_or_within_a_page_is_not_restored():
    """Two conversations that share only their opening: the other's host history is cut there.
    Restored, it would hold none of its kept entries (sinks 0: the opening was evicted) or less
    than a page; such a hit is no history to continue, not one that "does not fit yet" (which
    kept a turn waiting, then ended it with HTTP 503 on an idle pool)."""
    kept = torch.tensor([40, 41, 90, 91])  # the opening's entries were all evicted
    assert not restorable(kept, 30, page_size=1)
    assert restorable(kept, 41, page_size=1) and restorable(kept, 41, page_size=16)
    assert not restorable(torch.tensor([0, 1, 2]), 5, page_size=16)  # a cut within one page
    assert restorable(torch.tensor([0, 1, 2]), 5, page_size=1)
