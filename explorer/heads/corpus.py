"""Training text a head may be shipped from: source code whose licence lets us ship what is learned from it, never a
prompt the bench or the lessons measure with.

``stdlib_texts`` reads the Python standard library's own modules and ``pydoc_texts`` its reference topics
(``pydoc_data``: the language reference's prose with examples); both under the Python Software Foundation License, a
permissive licence (the shipped head's card names the Python version). ``leaks`` finds any text that holds a
prompt of the bench's sets (HumanEval, MT-bench, the prompt mix, the kinds set): such a text would let a head learn
the answer it is measured on, so ``clean`` drops it.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from ..analysis.prompts import PROMPT_SETS

MIN_CHARS, MAX_CHARS = 2_000, 60_000
SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "ensurepip", "turtledemo", "__pycache__"}
PROBE_CHARS = 40  # the part of a prompt's first line that, found in a text, marks the text as a leak


def stdlib_texts(limit_chars: int = 2_000_000) -> list[tuple[str, str]]:
    """``(name, source)`` of standard-library modules of ``MIN_CHARS`` to ``MAX_CHARS`` characters (tests and
    vendored trees left out), in path order, until ``limit_chars`` characters. Deterministic for one Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if set(path.relative_to(root).parts[:-1]) & SKIPPED_DIRS:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not MIN_CHARS <= len(text) <= MAX_CHARS:
            continue
        out.append((str(path.relative_to(root)), text))
        total += len(text)
        if total >= limit_chars:
            break
    return out


def stdlib_range(start_chars: int, end_chars: int) -> list[tuple[str, str]]:
    """The modules ``stdlib_texts(end_chars)`` adds to ``stdlib_texts(start_chars)``: the next stretch of the standard
    library, for a run that adds data to one trained on its first ``start_chars`` characters."""
    return stdlib_texts(end_chars)[len(stdlib_texts(start_chars)) if start_chars > 0 else 0:]


def pydoc_texts() -> list[tuple[str, str]]:
    """``(topic, text)`` of the Python reference topics ``pydoc`` shows (``pydoc_data.topics``: about 80 topics,
    465,000 characters of English prose and examples for Python 3.11), in name order."""
    from pydoc_data.topics import topics

    return [(f"pydoc:{name}", topics[name]) for name in sorted(topics)]


def python_version() -> str:
    """The interpreter whose standard library ``stdlib_texts`` reads (for a head's card)."""
    return sys.version.split()[0]


def bench_probes() -> list[str]:
    """A stretch of each bench prompt's first substantial line (``PROBE_CHARS`` characters)."""
    probes = set()
    for load in PROMPT_SETS.values():
        for prompt in load():
            for line in prompt.text.splitlines():
                line = line.strip()
                if len(line) >= PROBE_CHARS:
                    probes.add(line[:PROBE_CHARS])
                    break
    return sorted(probes)


def leaks(text: str, probes: list[str]) -> list[str]:
    """The bench prompts' probes found in ``text``."""
    return [p for p in probes if p in text]


def clean(texts: list[tuple[str, str]], probes: list[str] | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """``texts`` without those that hold a bench prompt, and the names dropped."""
    probes = bench_probes() if probes is None else probes
    kept, dropped = [], []
    for name, text in texts:
        if leaks(text, probes):
            dropped.append(name)
        else:
            kept.append((name, text))
    return kept, dropped
