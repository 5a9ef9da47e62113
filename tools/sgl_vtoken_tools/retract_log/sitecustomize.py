"""Logs the KV picture of the running batch at every retraction of an SGLang server: put this
folder first on PYTHONPATH of the server (and of whatever starts it), e.g.

    PYTHONPATH=tools/sgl_vtoken_tools/retract_log RETRACT_LOG=/tmp/retract.jsonl \
        python -m sglang.launch_server ...

One JSON line per `ScheduleBatch.retract_decode` call: the pool's available, evictable and
locked (`protected`) tokens, and per running request its prompt and output lengths, row length
(`committed`), tree-owned row entries (`cpl`), the depth and `lock_ref` of the radix node it
locks, whether it continues a stored view (`hit`) and its position offset. A debugging aid for
benchmarks, never loaded by the plugin."""

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

LOG = os.environ.get("RETRACT_LOG", "retract.jsonl")
TARGET = "sglang.srt.managers.schedule_batch"


def _depth(tree, node):
    d = 0
    while node is not None and node is not tree.root_node:
        d += len(node.key)
        node = node.parent
    return d


def _picture(batch, tag):
    tree = batch.tree_cache
    alloc = batch.token_to_kv_pool_allocator
    rows = []
    for r in batch.reqs:
        st = getattr(r, "vtoken", None)
        kv = r.kv
        rows.append(
            {
                "rid": str(r.rid)[-12:],
                "inp": len(r.origin_input_ids),
                "out": len(r.output_ids),
                "max_new": r.sampling_params.max_new_tokens,
                "committed": kv.kv_committed_len,
                "cpl": kv.cache_protected_len,
                "prefix_len": r.prefix_len,
                "lock_depth": _depth(tree, r.last_node),
                "lock_ref": getattr(r.last_node, "lock_ref", None),
                "hit": None if st is None else (st.prefix.hit is not None),
                "offset": None if st is None else st.row.offset,
            }
        )
    rec = {
        "t": time.time(),
        "tag": tag,
        "pid": os.getpid(),
        "bs": len(batch.reqs),
        "available": alloc.available_size(),
        "evictable": tree.evictable_size(),
        "protected": tree.protected_size(),
        "size": alloc.size,
        "sum_committed": sum(x["committed"] for x in rows),
        "sum_cpl": sum(x["cpl"] for x in rows),
        "rows": rows,
    }
    with open(LOG, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _patch(mod):
    cls = mod.ScheduleBatch
    orig = cls.retract_decode

    def retract_decode(self, *a, **k):
        try:
            _picture(self, "retract")
        except Exception as e:  # noqa
            with open(LOG, "a") as f:
                f.write(json.dumps({"error": repr(e)}) + "\n")
        return orig(self, *a, **k)

    cls.retract_decode = retract_decode


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        orig_exec = loader.exec_module

        def exec_module(module):
            orig_exec(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


import importlib.util  # noqa

sys.meta_path.insert(0, _Finder())
