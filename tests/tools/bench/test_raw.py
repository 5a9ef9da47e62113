"""The matrix's raw lines: what RawLog writes, load reads back."""

import json

from sgl_vtoken_tools.bench import raw
from sgl_vtoken_tools.bench.cells import Cell


def run_text(rate=None):
    lines = [
        {"kind": "config", "rate": rate},
        {"kind": "request", "session": 0, "turn": 1, "output_hash": "h", "error": None},
        {"kind": "sample", "t": 0.1, "running": 1},
        {"kind": "turn", "turn": 1, "completed": 1},
        {"kind": "summary", "completed": 1},
    ]
    return "\n".join(json.dumps(x) for x in lines) + "\n"


def test_round_trip(tmp_path):
    path = tmp_path / "bench.jsonl"
    log = raw.RawLog(path)
    log.line({"kind": "matrix", "settings": {"pool": 4096}, "command": "make bench"})
    naive = Cell("naive", "random", 128, 16, 4096)
    log.run(naive, 0, "burst", run_text())
    log.run(naive, 1, "rate2", run_text(rate=2.0))
    log.line({"kind": "check", "page": 16, "policy": "random", "budget": 128, "identical": 1})
    log.line({"kind": "matrix_end", "elapsed_min": 1.5})
    log.close()
    meta, cells, checks = raw.load(path)
    assert meta == {"settings": {"pool": 4096}, "command": "make bench", "elapsed_min": 1.5}
    assert [c.name for c in cells] == ["ps16-naive-random-b128"] and cells[0].pool == 4096
    burst, ladder = cells[0].repeats[0]["burst"], cells[0].repeats[1]["rate2"]
    assert burst["summary"] == {"kind": "summary", "completed": 1} and "rate" not in burst
    assert ladder["rate"] == 2.0
    assert [len(burst[k]) for k in ("requests", "samples", "turns")] == [1, 1, 1]
    assert burst["requests"][0]["output_hash"] == "h" and "cell" not in burst["requests"][0]
    assert checks[0]["identical"] == 1
    tagged = [json.loads(x) for x in path.read_text().splitlines()]
    assert {
        (x.get("cell"), x.get("repeat"), x.get("run")) for x in tagged if x.get("kind") == "request"
    } == {("ps16-naive-random-b128", 0, "burst"), ("ps16-naive-random-b128", 1, "rate2")}
