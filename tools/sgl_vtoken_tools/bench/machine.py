"""The machine a benchmark runs on: its load average (other jobs share the cores), waiting for
it to drop, and which plugin code the servers it starts will import."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def loadavg() -> float | None:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def loadavg_text() -> str:
    """The 1, 5 and 15-minute load averages as "a b c"."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def wait_for_quiet(max_load: float | None, timeout: float, say=None) -> None:
    """Wait (at most `timeout` s) until the 1-minute load average is below `max_load` (None or
    0: do not wait). `say(msg)` reports the wait every two minutes (default: stderr)."""
    if not max_load:
        return
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    start = time.monotonic()
    waited_log = -1
    while (la := loadavg()) is not None and la >= max_load and time.monotonic() - start < timeout:
        if (elapsed := int(time.monotonic() - start)) // 120 != waited_log:
            waited_log = elapsed // 120
            say(f"load average {la} >= {max_load}: waiting (up to {timeout:.0f} s)")
        time.sleep(10)


def provenance(repo: Path) -> dict:
    """Which code servers started now run: the plugin is imported from wherever `sgl_vtoken`
    resolves (an editable install serves the working tree as it is at server start). `repo` is
    the checkout the calling script belongs to."""
    import importlib.metadata

    import sgl_vtoken

    src = Path(sgl_vtoken.__file__).resolve().parent

    def git(*a: str) -> str:
        out = subprocess.run(
            ["git", "-C", str(repo), *a], capture_output=True, text=True, timeout=30
        )
        return out.stdout.strip()

    info = {
        "part": "meta",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "sglang": importlib.metadata.version("sglang"),
        "repo_commit": git("rev-parse", "--short", "HEAD"),
        "sgl_vtoken_source": str(src),
    }
    if src.parent == Path(repo).resolve():
        dirty = git("status", "--porcelain", "--", "sgl_vtoken", "patches", "kernels")
        info["plugin_code"] = "working tree, " + ("with uncommitted changes" if dirty else "clean")
    else:
        marker = src.parent / "COMMIT"  # written by whoever made the snapshot, if anyone
        info["plugin_code"] = "outside the repository" + (
            f", snapshot of {marker.read_text().strip()}" if marker.exists() else ""
        )
    return info
