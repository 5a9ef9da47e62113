"""The long-document benchmark asks about documents longer than the evicting server's pool,
evicted during prefill, and counts whole keys only."""

from sgl_vtoken_tools.quality import long_doc, splits


def test_every_document_is_its_multiple_of_the_pool_and_the_server_evicts_in_prefill(
    tiny_tok, wheel_dir
):
    docs = long_doc.trials(tiny_tok, "heldout", 100, [2, 3], seed=1, wheel_dir=wheel_dir)
    per = len(splits.DEPTHS["heldout"]) * len(splits.PHRASINGS["heldout"])
    assert [t.meta["times"] for t in docs] == [2] * per + [3] * per
    assert all(len(t.prompt) > t.meta["times"] * 100 for t in docs)
    args = long_doc.build_parser().parse_args(["--split", "heldout", "--pool", "100"])
    (_, full, _), (_, flags, cells) = long_doc.servers(args, docs)
    assert flags[flags.index("--max-total-tokens") + 1] == "100"
    assert '"prefill_chunk": 64' in flags[flags.index("--kv-evict-config") + 1]
    assert "--disable-overlap-schedule" in flags
    assert flags[flags.index("--kv-evict") + 1] == "h2o" and "--kv-evict" not in full
    longest = max(len(t.prompt) for t in docs)
    assert int(full[full.index("--max-total-tokens") + 1]) > longest + args.max_new
    assert [kv.get("recall") for _, kv in cells] == [0, args.recall]


def test_the_summary_counts_whole_keys_per_cell_and_length():
    rec = [
        {"cell": "full", "times": 2, "hit": True},
        {"cell": "full", "times": 2, "hit": False},
        {"cell": "h2o", "times": 3, "hit": True},
    ]
    assert long_doc.summary(rec) == [
        {"kind": "summary", "cell": "full", "times": 2, "hits": 1, "trials": 2},
        {"kind": "summary", "cell": "h2o", "times": 3, "hits": 1, "trials": 1},
    ]
