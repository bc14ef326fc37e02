"""Versions of the trace's JSON and the reader that upgrades older ones (no torch).

Version 1 (2026-11, the first writers) let a step leave out whatever the engine did not record yet, and the fields
added to ``StepTrace``, ``NodeTrace`` and ``StopSignal`` since then were read with their defaults. Version 2 writes
every field of every step, node and stop signal, and names its writer (``producer``: ``{"name", "version"}``); a
version 2 step, node or stop signal that lacks a field is malformed. ``upgrade`` turns a version 1 trace into
version 2 by filling each missing field with the value that means "not recorded" (``STEP_FIELDS_ADDED``,
``NODE_FIELDS_ADDED``, ``STOP_FIELDS_ADDED``), so the shipped lessons and old downloads keep opening; it never
changes a field that is there.
"""

from __future__ import annotations

import copy

SCHEMA_VERSION = 2
"""The version this build writes."""

READABLE_VERSIONS = (1, 2)

V1_PRODUCER = {"name": "spec-explorer", "version": "unknown (schema 1)"}
"""``producer`` of an upgraded version 1 trace, whose writer did not name itself."""

STEP_FIELDS_ADDED = {
    "verifier": "", "finished": False, "forward_ms": None, "drafter": {}, "expected_tokens": None, "timeline": [],
    "adaptation": {}, "fallback": {}, "host_syncs": None, "cost": {}, "prefill_rows": 0, "stop_signals": [],
}
"""Step fields a version 1 trace may lack (its reader filled them in), with the value that means "not recorded"."""

NODE_FIELDS_ADDED = {
    "committed": False, "branch": None, "q": None, "p": None, "u": None, "ratio": None, "residual_top": [],
    "p_top": [], "q_top": [], "provenance": None, "accept_prob": None, "slot_prob": None, "test_order": None,
    "predicted_accept": None,
}
"""Node fields a version 1 trace may lack (its reader filled them in), with the value that means "not recorded"."""

STOP_FIELDS_ADDED = {"pruned": [], "expected": None, "forwards": None, "cost_pruned": [], "row_floor": None,
                     "chances": {}}
"""Stop-signal fields a version 1 trace may lack, with the value that means "not recorded"."""


class SchemaError(ValueError):
    """A trace whose ``schema_version`` this build cannot read; the message says which it reads."""


def upgrade(d: dict) -> dict:
    """A version 2 copy of trace dict ``d`` (``d`` itself is left alone; a version 2 dict is returned as is).

    Raises:
        SchemaError: ``schema_version`` missing, not an int, or not in ``READABLE_VERSIONS`` (a newer one says
            that a newer build wrote it).
    """
    version = d.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version not in READABLE_VERSIONS:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION
        hint = "; a newer spec-explorer wrote it" if newer else ""
        raise SchemaError(f"trace schema version {version!r} is not supported (this build reads "
                          f"{', '.join(map(str, READABLE_VERSIONS))}{hint})")
    if version == SCHEMA_VERSION:
        return d
    out = copy.deepcopy(d)
    out["schema_version"] = SCHEMA_VERSION
    out["producer"] = dict(V1_PRODUCER)
    steps = out.get("steps")
    if isinstance(steps, list):
        for step in steps:
            if not isinstance(step, dict):
                continue  # the reader says what is wrong with it
            for name, value in STEP_FIELDS_ADDED.items():
                step.setdefault(name, copy.deepcopy(value))
            for key, added in (("nodes", NODE_FIELDS_ADDED), ("stop_signals", STOP_FIELDS_ADDED)):
                for item in step[key] if isinstance(step.get(key), list) else []:
                    if isinstance(item, dict):
                        for name, value in added.items():
                            item.setdefault(name, copy.deepcopy(value))
    return out


def missing_fields(d: dict, names) -> list[str]:
    """The names in ``names`` that object ``d`` lacks, in order."""
    return [n for n in names if n not in d]
