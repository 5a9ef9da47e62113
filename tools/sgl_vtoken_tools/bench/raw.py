"""The matrix's raw JSON lines in one file (docs/results/bench_agent.jsonl), and reading them back.

Lines: one `matrix` line (settings, start), every line of every agent run (`config`, `request`,
`sample`, `turn`, `summary`, as `agent.run_benchmark` writes them) tagged with its `cell`,
`mode`, `policy`, `budget`, `page`, `repeat` and `run`; then one `check` line per
Naive-Evict / vToken pair (`checks.compare_cells`), one `cell` line per cell (figure spreads) and
one `matrix_end` line (duration, load). `load` rebuilds the cells, so the report can be rendered
again from the file alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from sgl_vtoken_tools.bench.cells import Cell

RUN_KINDS = ("config", "request", "sample", "turn", "summary")


class RawLog:
    """Appends tagged lines to one JSON lines file as the matrix runs (a crash keeps what ran)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w")

    def line(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def run(self, cell: Cell, repeat: int, name: str, text: str) -> None:
        """The JSON lines of one agent run (`text`), each tagged with where it belongs."""
        tag = {
            "cell": cell.name,
            "mode": cell.mode,
            "policy": cell.policy,
            "budget": cell.budget,
            "page": cell.page,
            "repeat": repeat,
            "run": name,
        }
        for line in text.splitlines():
            if line.strip():
                self._f.write(json.dumps({**tag, **json.loads(line)}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def load(path: Path) -> tuple[dict, list[Cell], list[dict]]:
    """(meta, cells, checks) from a file `RawLog` wrote: meta merges the `matrix` and
    `matrix_end` lines; cells are in their first-seen order, runs as `run_benchmark` returns them."""
    meta: dict = {}
    cells: dict[str, Cell] = {}
    checks = []
    with open(path) as f:
        for raw in f:
            rec = json.loads(raw)
            kind = rec.get("kind")
            if kind in ("matrix", "matrix_end"):
                meta.update({k: v for k, v in rec.items() if k != "kind"})
            elif kind == "check":
                checks.append(rec)
            elif "cell" in rec and kind in RUN_KINDS:
                _add(cells, rec, meta["settings"]["pool"])
    return meta, list(cells.values()), checks


def _add(cells: dict, rec: dict, pool: int) -> None:
    name = rec["cell"]
    if name not in cells:
        cells[name] = Cell(rec["mode"], rec["policy"], rec["budget"], rec["page"], pool)
    rep = cells[name].repeat(rec["repeat"])
    run = rep.setdefault(rec["run"], {"summary": None, "turns": [], "requests": [], "samples": []})
    body = {
        k: v
        for k, v in rec.items()
        if k not in ("cell", "mode", "policy", "budget", "page", "repeat", "run")
    }
    kind = body["kind"]
    if kind == "config":
        if body.get("rate") is not None and rec["run"].startswith("rate"):
            run["rate"] = body["rate"]
    elif kind == "summary":
        run["summary"] = body
    else:
        run[{"request": "requests", "sample": "samples", "turn": "turns"}[kind]].append(body)
