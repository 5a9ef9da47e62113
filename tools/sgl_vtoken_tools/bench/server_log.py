"""What an SGLang server logs, read back: decode batch records ("Decode batch, #running-req: N"),
retraction records ("KV cache pool is full. Retract requests. #retracted_reqs: N") and failure
lines. The text is a server's log file (e.g. the one `ServerProcess` writes), whole or the part
written during a run."""

from __future__ import annotations

import re

# sglang/srt/managers/scheduler_components/metrics_reporter.py: "Decode batch[ [iter]], #running-req: N, ..."
DECODE_RE = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (\d+)")
RETRACT_LINE = "KV cache pool is full. Retract requests."
RETRACTED_RE = re.compile(r"#retracted_reqs: (\d+)")
ERROR_KEYS = ("Traceback", " ERROR ", "Error:", "Exception")


def peak_running_from_log(text: str) -> int | None:
    """Largest N over "Decode batch, #running-req: N" lines; None if there is no such line."""
    values = [int(m.group(1)) for m in DECODE_RE.finditer(text)]
    return max(values) if values else None


def mean_running_from_log(text: str) -> float | None:
    """Mean N over "Decode batch, #running-req: N" lines (rows per decode step); None without."""
    values = [int(m.group(1)) for m in DECODE_RE.finditer(text)]
    return round(sum(values) / len(values), 2) if values else None


def count_retractions(text: str) -> int:
    """Lines that contain "KV cache pool is full. Retract requests." (one per retraction event)."""
    return sum(RETRACT_LINE in line for line in text.splitlines())


def retracted_requests(text: str) -> int:
    """Sum of `#retracted_reqs: N` over the retraction lines (requests retracted, with repeats)."""
    total = 0
    for line in text.splitlines():
        if RETRACT_LINE in line:
            m = RETRACTED_RE.search(line)
            total += int(m.group(1)) if m else 0
    return total


def error_lines(text: str, limit: int = 10) -> list[str]:
    """Lines that look like failures (tracebacks, ERROR records, exceptions), at most `limit`."""
    hits = [line.strip() for line in text.splitlines() if any(k in line for k in ERROR_KEYS)]
    return hits[:limit]


def tracebacks(text: str) -> list[str]:
    """Every Python traceback in `text`: its "Traceback" line, the indented frames below it and the
    exception line that ends it."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" not in line:
            continue
        j = i + 1
        while j < len(lines) and lines[j].startswith(" "):
            j += 1
        out.append("\n".join(lines[i : j + 1]))
    return out


def parse_log(text: str) -> dict:
    """Peak and mean running requests (0 without decode lines), decode steps, retraction events
    and requests."""
    return {
        "peak_running_requests": peak_running_from_log(text) or 0,
        "mean_running_requests": mean_running_from_log(text) or 0,
        "decode_steps": len(DECODE_RE.findall(text)),
        "retraction_events": count_retractions(text),
        "retracted_requests": retracted_requests(text),
    }


def read_from(path, offset: int) -> str:
    """The text a log file gained after byte `offset` ("" when the file is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
