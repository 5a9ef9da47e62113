"""A benchmark run's JSON lines: kept in order for the run's own report, and written to its
`--out` file line by line as they come, so a run that stops half-way keeps what it measured.

    log = RunLog(args.out, append=True)
    log.emit({"kind": "config", ...})
    ...
    log.close(); return log.records
"""

from __future__ import annotations

import json
from pathlib import Path


class RunLog:
    """The records of one run (`records`), each also written as a line of `path` (None: kept
    only); `append`: add to the file instead of starting it anew; `echo`: print each line too."""

    def __init__(self, path: str | Path | None, append: bool = False, echo: bool = False):
        self.records: list[dict] = []
        self._f = open(path, "a" if append else "w") if path else None
        self._echo = echo

    def emit(self, record: dict) -> None:
        self.records.append(record)
        if self._echo:
            print(json.dumps(record), flush=True)
        if self._f is not None:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
