"""Parsing JSON that comes from users (uploaded traces and reports, cards): one place for the size limit and for
turning parse errors into the caller's own error type with a message a user can act on. No torch."""

from __future__ import annotations

import json
from pathlib import Path


def read_file(path: str | Path, error: type[Exception], label: str = "") -> bytes:
    """The bytes of ``path``, raising ``error("cannot read {label}{path}: ...")`` when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise error(f"cannot read {label}{path}: {exc.strerror or exc}") from None


def parse_json(text: str | bytes, error: type[Exception], what: str, max_bytes: int | None = None):
    """``json.loads(text)``, raising ``error`` when ``text`` is larger than ``max_bytes`` or not valid JSON.

    ``what`` names the document in the message (e.g. ``"trace"``, a file path).
    """
    if max_bytes is not None and len(text) > max_bytes:
        raise error(f"{what} is {len(text) / 1e6:.1f} MB; the limit is {max_bytes / 1e6:.0f} MB")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not valid JSON: {exc}") from None
