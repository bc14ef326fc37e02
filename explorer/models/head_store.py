"""Which EAGLE-3 head drafts for a pair: the one a user names, else the one shipped for the pair's target
(``assets/heads/<name>/``, each with ``card.json`` naming its target), loaded once per pair."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .eagle3 import Eagle3Head, HeadError, load_head, weight_files

HEADS_DIR = Path(__file__).resolve().parents[2] / "assets" / "heads"
CARD = "card.json"


def shipped_head(target_id: str, root: Path = HEADS_DIR) -> Path | None:
    """The folder under ``assets/heads`` whose card names ``target_id`` as its target, or None."""
    if not root.is_dir():
        return None
    for folder in sorted(p for p in root.iterdir() if (p / CARD).is_file()):
        try:
            card = json.loads((folder / CARD).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        data = card.get("data") if isinstance(card, dict) else None
        if isinstance(data, dict) and data.get("target") == target_id:
            return folder
    return None


def head_path(pair, path: str = "") -> Path:
    """The head folder a run of ``pair`` drafts with: ``path``, else the one shipped for its target.

    Raises:
        HeadError: no path given and no head shipped for the target.
    """
    if path:
        return Path(path).expanduser()
    found = shipped_head(pair.target_id)
    if found is None:
        raise HeadError(f"no EAGLE-3 head is shipped for {pair.target_id}: give one (--head DIR, or the app's head "
                        "folder) or train one with `python -m explorer heads train`")
    return found


def has_head(pair, path: str = "") -> bool:
    """Whether a head folder is at hand for ``pair`` (``path``, else one shipped for its target); not loaded."""
    return bool(path) or shipped_head(pair.target_id) is not None


def head_for(pair, path: str = "") -> tuple[Eagle3Head, Path]:
    """The loaded head (``head_path``) on the target's device and dtype, its embedding the target's, and its folder;
    loaded once per pair and folder (``pair.heads``), shared by the pair's engines (read-only).

    Raises:
        HeadError: as ``head_path`` and ``eagle3.load_head`` (a malformed or foreign checkpoint, one that does not fit
            the target).
    """
    folder = head_path(pair, path).resolve()
    key = str(folder)
    if key not in pair.heads:
        with pair.lock:
            pair.heads[key] = load_head(folder, target=pair.target)
    return pair.heads[key], folder


_DIGESTS: dict[tuple, str] = {}


def weights_sha256(folder: Path) -> str:
    """The first 16 hex digits of the sha256 of a head folder's safetensors files (in ``eagle3.weight_files``'
    order), computed once per file version (path, size, modification time): a replay tells a trace drafted by
    another version of the head from one that left its run for another reason. "" where the folder has none."""
    files = weight_files(Path(folder))
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        for f in files:
            with f.open("rb") as handle:
                while chunk := handle.read(1 << 22):
                    digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()[:16] if files else ""
    return _DIGESTS[key]


def describe(head: Eagle3Head, folder: Path, n_target_layers: int) -> dict:
    """What a trace records of a head: its folder (``assets/heads/<name>`` for a shipped one), the sha256 of its
    config (sorted JSON) and of its weights (``weights_sha256``), its draft vocabulary (size and target ids, so a
    replay can tell which committed tokens the head could not have proposed) and the target layers it reads."""
    config = json.dumps(head.config.to_dict(), sort_keys=True)
    shipped = folder.parent == HEADS_DIR.resolve()  # named as in the repository, not this machine's path
    return {"path": f"assets/heads/{folder.name}" if shipped else str(folder),
            "config_sha256": hashlib.sha256(config.encode()).hexdigest()[:16],
            "weights_sha256": weights_sha256(folder),
            "draft_vocab_size": head.config.draft_vocab_size, "draft_ids": head.target_ids().tolist(),
            "target_layers": list(head.config.aux_layers(n_target_layers))}
