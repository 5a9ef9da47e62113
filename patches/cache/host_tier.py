"""The host tier: evicted tokens' K/V kept in host memory (`offload`), recalled when a new turn
needs them (`host_recall.py`); one `HostTier` per scheduler process, on the process object.

An eviction copies its victims' K/V, every layer, to the host before their slots are freed: one
immutable, reference-counted `Chunk` per row and step, asynchronous into pinned memory on CUDA
(read only after its event, `Chunk.wait`). A chunk's owners are a running request
(`st.host`, `HostChunks`) and a stored history's view (`HostTier.store_of`); it lives while one
of them can recall it. A stored history the radix cache evicts for room moves here whole, its
kept K/V too (`HostHistory`, `host_history.py`). Over the `host_tokens` cap the least recently
used histories (their stores, or whole host histories) go first. Design: docs/design/cache.md, "Host
tier and recall" and "Host histories".
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..core.process import process
from ..core.records import Chunk
from ..core.state import state_of

if TYPE_CHECKING:
    from collections.abc import Iterable

    from sgl_vtoken.step import Decision, KVPoolView

    from ..core.sglang_types import Req, TreeNode
    from ..core.state import ReqEvictState


@dataclass(eq=False)
class HostHistory:
    """A stored history in host memory (`host_history.py`): the logical ``ids [depth] int64`` its
    KV covers, its live entries (`row`: their positions and K/V), the chunks of its evicted
    tokens (`store`, recall candidates), the radix namespace it was stored under (`ns`) and when
    it was last used (`last_access`, `time.monotonic`)."""

    ns: str
    ids: torch.Tensor
    row: Chunk
    store: list[Chunk]
    last_access: float

    @property
    def depth(self) -> int:
        return int(self.ids.numel())


@dataclass
class HostChunks:
    """The host chunks a request holds (`st.host`)."""

    chunks: list[Chunk] = field(default_factory=list)  # its view's store, then its own evictions'
    taken: bool = False  # it took its view's store (`take_store`, once)

    def take(self) -> list[Chunk]:
        """Its chunks, which leave it (the caller owns them now)."""
        chunks, self.chunks = self.chunks, []
        return chunks


class HostTier:
    """Host-memory store of one scheduler process, capped at `cap` tokens."""

    def __init__(self, cap: int) -> None:
        self.cap, self.tokens, self.bytes, self.peak_bytes = cap, 0, 0, 0
        self.offloaded = self.dropped = self.recalled = self.recalls = self.skipped_recalls = 0
        self.recall_seconds = 0.0
        # id -> (radix node, the chunks its view's store holds)
        self.nodes: dict[int, tuple[TreeNode, list[Chunk]]] = {}
        self.histories: dict[int, HostHistory] = {}  # id -> a history moved here whole
        self.histories_stored = self.histories_restored = self.histories_dropped = 0
        self.bytes_to_host = self.bytes_to_device = 0
        self.streams: dict[
            torch.device, torch.cuda.Stream
        ] = {}  # device -> side stream of its copies to the device (CUDA)

    def hold(self, chunks: Iterable[Chunk]) -> None:
        for c in chunks:
            if c.refs == 0:
                self.tokens += c.positions.numel()
                self.bytes += c.nbytes
            c.refs += 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def drop(self, chunks: Iterable[Chunk]) -> None:
        for c in chunks:
            c.refs -= 1
            assert c.refs >= 0, "a host chunk was released twice"
            if c.refs == 0:
                self.tokens -= c.positions.numel()
                self.bytes -= c.nbytes

    def store(self, node: TreeNode, st: ReqEvictState) -> None:
        """A finished request's chunks become the store of the view at radix `node`."""
        self.detach(node)
        st.report.hold_host(sum(c.nbytes for c in st.host.chunks))
        if st.host.chunks:
            self.nodes[id(node)] = (node, st.host.chunks)
            st.host.chunks = []

    def store_of(self, node: TreeNode) -> list[Chunk] | None:
        """The chunks of the store of `node`'s view, or None."""
        entry = self.nodes.get(id(node))
        return None if entry is None else entry[1]

    def detach(self, node: TreeNode) -> None:
        """Release the store of `node`'s view (the view is gone or replaced)."""
        entry = self.nodes.pop(id(node), None)
        if entry is not None:
            self.drop(entry[1])

    def take_store(self, node: TreeNode) -> list[Chunk]:
        """The chunks of `node`'s view's store, which leaves the node (their owners' count
        unchanged: the caller owns them now); [] when it has none."""
        entry = self.nodes.pop(id(node), None)
        return [] if entry is None else entry[1]

    def share_below(self, node: TreeNode, below: int) -> list[Chunk]:
        """The chunks of `node`'s view's store cut to positions ``< below``, held for the
        caller; the node keeps its store. A request continuing the view to depth `below` takes
        these: where it left the stored history at a differing id (a cut), the entries past the
        cut are another conversation's tokens and must never become its recall candidates. A
        chunk wholly below is shared; one across `below` is copied in part."""
        out = []
        for c in self.store_of(node) or []:
            keep = c.positions < below
            if bool(keep.all()):
                out.append(c)
            elif bool(keep.any()):
                c.wait()
                out.append(Chunk(c.positions[keep], c.k[keep], c.v[keep]))
        self.hold(out)
        return out

    def give_store(self, node: TreeNode, chunks: list[Chunk]) -> None:
        """`chunks` (owned by the caller) become the store of `node`'s view."""
        self.detach(node)
        if chunks:
            self.nodes[id(node)] = (node, chunks)

    def keep(self, history: HostHistory) -> None:
        """`history` (its row and store held by the caller: `hold`) is kept here."""
        self.histories[id(history)] = history
        self.histories_stored += 1
        self.bytes_to_host += history.row.nbytes

    def release(self, history: HostHistory) -> None:
        """`history` leaves host memory (restored to the device, or dropped): its row and store
        are released."""
        if self.histories.pop(id(history), None) is not None:
            self.drop([history.row, *history.store])

    def reset(self) -> None:
        """The tree was flushed: every stored history's store goes, and every host history."""
        for node, _ in list(self.nodes.values()):
            self.detach(node)
        for history in list(self.histories.values()):
            self.release(history)

    def make_room(self, m: int, before: float = math.inf) -> int:
        """Room for up to `m` more tokens, releasing stored histories' stores and host histories,
        least recently used first (only those used before `before`), while it does not fit.
        Returns the tokens that fit (<= m)."""
        if self.tokens + m > self.cap:
            entries: list[tuple[float, TreeNode | None, HostHistory | None]] = [
                (node.last_access_time, node, None) for node, _ in self.nodes.values()
            ]
            entries += [(h.last_access, None, h) for h in self.histories.values()]
            for used, node, history in sorted(entries, key=lambda entry: entry[0]):
                if used >= before:
                    break
                if history is None:
                    assert node is not None, "an entry is a stored view's node or a host history"
                    self.detach(node)
                else:
                    self.release(history)
                    self.histories_dropped += 1
                if self.tokens + m <= self.cap:
                    break
        return max(0, min(m, self.cap - self.tokens))

    def count_recall(self, n: int, seconds: float) -> None:
        """A turn recalled `n` tokens (`host_recall.recall_prompt`) in `seconds`."""
        self.recalled += n
        self.recalls += 1
        self.recall_seconds += seconds

    def count_skip(self) -> None:
        """A turn's recall was skipped (`core/shortage.py`)."""
        self.skipped_recalls += 1

    def as_dict(self) -> dict:
        return {
            "host_tokens_cap": self.cap,
            "host_tokens_held": self.tokens,
            "host_bytes_held": self.bytes,
            "peak_host_bytes": self.peak_bytes,
            "offloaded_tokens": self.offloaded,
            "offload_dropped_tokens": self.dropped,
            "recalled_tokens": self.recalled,
            "recalls": self.recalls,
            "recall_seconds": round(self.recall_seconds, 6),
            "skipped_recalls": self.skipped_recalls,
            "host_histories_held": len(self.histories),
            "host_histories_stored": self.histories_stored,
            "host_histories_restored": self.histories_restored,
            "host_histories_dropped": self.histories_dropped,
            "host_bytes_to_host": self.bytes_to_host,
            "host_bytes_to_device": self.bytes_to_device,
        }


# --- offload (the eviction step, eviction.py) ------------------------------------------------
def offload_victims(
    tier: HostTier | None,
    d: Decision,
    states: list[ReqEvictState],
    view: KVPoolView,
    stream: AbstractContextManager[object] | None,
) -> None:
    """The eviction step's offload: the victims of decision `d`'s rows whose request offloads
    (`states`, one per row) go to the host tier before their slots are freed or overwritten.
    Their row entries are known on the host (`d.keep`), so one index copy to the device gathers
    their slots, and the copies run on `stream`, the one that then moves KV (no host
    synchronization). Nothing without a host tier or an offloading row."""
    offloading = [(b, st) for b, st in enumerate(states) if st.cfg.host.offload]
    if tier is None or not offloading:
        return
    w = d.keep.shape[1]
    victims = [(~d.keep[b, : d.rows[b].length]).nonzero().flatten() for b, _ in offloading]
    flat = torch.cat([b * w + v for (b, _), v in zip(offloading, victims)])
    with stream or nullcontext():
        slots = d.raw.flatten().index_select(0, flat.to(d.raw.device, non_blocking=True))
        offload(
            tier,
            [(st, d.rows[b].positions[v]) for (b, st), v in zip(offloading, victims)],
            slots,
            view.k_buffers,
            view.v_buffers,
        )


def offload(
    tier: HostTier,
    rows: list[tuple[ReqEvictState, torch.Tensor]],
    slots: torch.Tensor,
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
) -> None:
    """Copy the victims of `rows` (``(state, positions [m_b] host)`` each, in order) to the host
    before their slots are freed. `slots`: all their slots, row after row (``[sum m_b]``, pool
    device). One gather per layer, one copy to the host for K and one for V, asynchronous on CUDA
    (pinned memory; run it on the stream that then moves KV): no host synchronization."""
    if not slots.numel():
        return
    k, ready = to_host(torch.stack([buf[slots] for buf in k_buffers], dim=1))
    v, ready = to_host(torch.stack([buf[slots] for buf in v_buffers], dim=1))
    start = 0
    for st, positions in rows:
        m = positions.numel()
        keep = tier.make_room(m)
        tier.dropped += m - keep
        tier.offloaded += keep
        st.report.offload(keep)
        if keep:
            chunk = Chunk(
                positions[:keep].clone(),
                k[start : start + keep],
                v[start : start + keep],
                ready=ready,
            )
            tier.hold([chunk])
            st.host.chunks.append(chunk)
        start += m


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of `t` (pinned on CUDA), made asynchronously on the current stream, and the
    CUDA event after which it holds the values (None off CUDA: the copy is done)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=True)
    if not t.is_cuda:
        return host, None
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def to_device(
    host: torch.Tensor, device: torch.device | str
) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`host` on `device`: on CUDA copied asynchronously from pinned memory on a side stream, with
    the event the stream that reads it must wait for (`torch.cuda.current_stream().wait_event`);
    elsewhere `host` itself and None."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device), None
    side = _side_stream(device)
    with torch.cuda.stream(side):
        out = (host if host.is_pinned() else host.pin_memory()).to(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(side)
    out.record_stream(torch.cuda.current_stream(device))  # read there: not reused before
    return out, ready


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The host tier's side stream on `device` (made at its first use)."""
    tier = process().tier
    assert tier is not None, "only recall copies to the device, and it needs the host tier"
    streams = tier.streams
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def take_store(st: ReqEvictState) -> list[Chunk]:
    """Before a request's first prefill chunk (admission, then its first forward; once): it
    takes the store of the view it continues, cut to the positions its row covers
    (`HostTier.share_below`). Returns those chunks ([] when there is none, or nothing to
    take)."""
    tier = process().tier
    if st.host.taken or tier is None or not st.cfg.host.offload:
        return []
    st.host.taken = True
    if st.prefix.hit is None:
        return []
    # the row is the view as continued: it covers the first `below` logical tokens
    below = st.row.offset + st.row.kept_pos.numel()
    chunks = tier.share_below(st.prefix.hit.node, below)
    st.host.chunks = chunks + st.host.chunks
    return chunks


def release_finished(req: Req) -> None:
    """After a request's KV is released: a finished (or aborted) request's chunks that no stored
    view took are released; a retracted one keeps them."""
    st = state_of(req)
    tier = process().tier
    if st is None or tier is None or not req.finished():
        return
    if st.host.chunks:  # no stored view took them
        tier.drop(st.host.chunks)
        st.host.chunks = []
        st.report.hold_host(0)
    st.recall.reset()
