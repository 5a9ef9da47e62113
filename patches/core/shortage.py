"""Shortages of free KV pages the plugin meets under memory pressure (`Shortages`, on the process
object), and what it does instead of failing. Nothing raises into SGLang's scheduler loop: each
shortage is counted by the caller, tallied here by where it was met (`PATHS`) and logged once per
kind (`MESSAGES`). Kinds, fallbacks and counters: docs/design/step.md, "Page shortages".
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MESSAGES = {
    "eviction_deferred": "a decode eviction found no free KV page for the copies of the cached "
    "prompt tokens it keeps; the row is evicted at a later step",
    "prefill_aborted": "an eviction during prefill found no free KV page for the copies of the "
    "cached prompt tokens it keeps; the request ends with an error",
    "admission_deferred": "an admission found no free KV page for the copy of a stored view's "
    "last page, a retracted row or a history restored from host memory; the request waits",
    "admission_aborted": "an admission found no free KV page for the copy of a stored view's last "
    "page, a retracted row or a history restored from host memory with nothing else in the pool; "
    "the request ends with an error",
    "recall_skipped": "a turn's recall found no free KV page (or its prefill was not cut where "
    "recall needed); the turn goes on without the recalled tokens",
}
# What the plugin allocates pages for: copies of kept cached tokens (eviction), a stored view's
# last page (admission), a retracted row written back (admission), a host history restored
# (admission), recalled tokens (prefill).
KINDS = ("copies", "tail", "resume", "restore", "recall")
# Where a shortage is met: a kind of `MESSAGES`, refined by what lacked a page where one kind has
# several (`Shortages.note(kind, rid, detail)`).
PATHS = (
    "eviction_deferred",
    "prefill_aborted",
    "admission_deferred:tail",
    "admission_deferred:resume",
    "admission_deferred:restore",
    "admission_aborted:tail",
    "admission_aborted:resume",
    "admission_aborted:restore",
    "recall_skipped:page",
    "recall_skipped:cut",
)


@dataclass
class Shortages:
    """Shortages met in one scheduler process.

    Attributes:
        met: path (`PATHS`) -> shortages met.
        warned: kinds already logged.
    """

    met: Counter[str] = field(default_factory=Counter)
    warned: set[str] = field(default_factory=set)

    def note(self, kind: str, rid: str, detail: str | None = None) -> None:
        """A shortage of `kind` (`MESSAGES`) met by request `rid` at `kind:detail` (`PATHS`):
        tallied, and logged at warning level the first time per kind (the caller moves the
        counters of `/get_server_info` and the request's report). Never raises: it runs inside
        SGLang's scheduler loop; an unknown path is tallied as it is and logged as an error."""
        path = f"{kind}:{detail}" if detail else kind
        if path not in PATHS:
            logger.error("kv_evict shortage at an unknown path %r (known: %s)", path, PATHS)
        self.met[path] += 1
        if kind in self.warned:
            return
        self.warned.add(kind)
        logger.warning(
            "kv_evict shortage (%s, request %s): %s. Further ones are counted in "
            "/get_server_info without a log line.",
            kind,
            rid,
            MESSAGES.get(kind, kind),
        )

    def as_dict(self) -> dict[str, int]:
        """Shortages met so far, by path."""
        return dict(sorted(self.met.items()))
