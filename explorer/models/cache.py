"""Where the project keeps what it builds once per machine (no torch): assembled and converted models, calibrated
decision models, built lesson pages."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Folder for assembled GGUF files, converted weights and other built files: ``$SPEC_EXPLORER_CACHE``, else
    ``$XDG_CACHE_HOME/spec-explorer``, else ``~/.cache/spec-explorer``."""
    root = os.environ.get("SPEC_EXPLORER_CACHE")
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spec-explorer"
