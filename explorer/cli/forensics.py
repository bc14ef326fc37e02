"""``python -m explorer forensics``: rejection forensics over a prompt set (``analysis/forensics.py``).

Runs ``generate``'s pair, method and sampling options over ``--prompt`` / ``--prompt-file`` (``--save-traces DIR``
keeps each run), or reads saved traces (``--trace``: files or folders of ``*.json``; a file that cannot be read is
reported by name and the report is made from the rest), then writes ``OUT/forensics.json`` and ``OUT/forensics.html``
(``analysis/forensics_report.py``) and prints the tables by token class and depth, the top confusions and the
costliest rejections (trace file and step: open them in the Explorer's Load trace). ``--compare A`` (an earlier
``forensics.json`` on the same prompts) adds where this run gains and loses against it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..analysis.forensics import Forensics, run_category
from ..analysis.forensics_report import ForensicsError, diff, load_forensics, write_forensics_report
from ..trace.records import TraceError, load_run, save_run
from .args import (add_method_args, add_model_args, add_prompt_or_trace_args, add_sampling_args, load_pair_from_args,
                   method_config_from_args, prompts_from_args, runs_from_args)


def trace_files(paths: list[str]) -> list[Path]:
    """The trace files named: files as given, folders as their ``*.json`` files in name order."""
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    return out


def cmd_forensics(args) -> int:
    result, problems = Forensics(), []
    if args.trace:
        for path in trace_files(args.trace):
            try:
                trace = load_run(path)
            except (TraceError, OSError) as exc:
                problems.append(f"{path}: {exc}")
                continue
            result.add(trace, prompt=trace.prompt_info.get("id") or path.stem, category=run_category(trace),
                       source=str(path))
    else:
        config = method_config_from_args(args)
        prompts = prompts_from_args(args)
        pair = load_pair_from_args(args)
        keep = Path(args.save_traces) if args.save_traces else None

        def refused(prompt, exc):  # too long for the models, say: named, and the report is made from the rest
            problems.append(f"prompt {prompt.id}: {exc}")

        for n, prompt, trace in runs_from_args(args, pair, prompts, config, on_error=refused):
            source = ""
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                source = str(keep / f"trace_{n:03d}.json")
                save_run(trace, source)
            result.add(trace, prompt=prompt.id, category=run_category(trace), source=source)
            print(f"[forensics] {prompt.id}: {len(trace.steps)} steps", file=sys.stderr, flush=True)
    for problem in problems:
        print(f"skipped {problem}", file=sys.stderr)
    if not result.prompts:
        print("error: no run to read" + (f" ({len(problems)} files could not be read)" if problems else ""),
              file=sys.stderr)
        return 2
    data = result.to_dict()
    data["skipped"] = problems
    if args.compare:
        try:
            data["diff"] = diff(load_forensics(args.compare), data)
        except ForensicsError as exc:
            print(f"error: --compare {exc}", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "forensics.json").write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
    page = write_forensics_report(data, out)
    _print(data)
    print(f"wrote {out / 'forensics.json'}, {page}", file=sys.stderr)
    return 0


def _rate(t: dict) -> str:
    exp = t["expected_rate"]
    return (f"{t['tested']:6d} tested  {t['rate']:.2f} accepted" + (f"  {exp:.2f} expected" if exp is not None
                                                                       else ""))


def _print(data: dict) -> None:
    print(f"{data['nodes']} tested drafted nodes in {len(data['prompts'])} runs")
    for line, runs in data.get("settings", {}).items():
        print(f"  {runs} runs of {line}")
    for title, key in (("by token class", "by_class"), ("by depth", "by_depth"), ("by draft source", "by_source")):
        print(f"\n{title}:")
        for name, t in data[key].items():
            print(f"  {name:>18}  {_rate(t)}")
    print("\ntop confusions (drafted -> committed instead):")
    for c in data["confusions"][:10]:
        print(f"  {c['drafted']!r:>14} -> {c['committed']!r:<14} x{c['count']}  mean p {c['mean_p']:.2f}  "
              f"mean q {c['mean_q']:.2f}  near ties {c['near_tie_share']:.0%}")
    if data.get("diff"):
        print("\nB (this run) against A (--compare), acceptance by token class:")
        for name, r in data["diff"]["by_class"].items():
            if r["delta"] is not None:
                print(f"  {name:>18}  {r['a']:.2f} -> {r['b']:.2f}  ({r['delta']:+.2f})")
    print("\ncostliest rejections (expected tokens cut):")
    for r in data["costliest"][:10]:
        where = f"{r['trace']} step {r['step'] + 1}" if r["trace"] else f"{r['prompt']} step {r['step'] + 1}"
        print(f"  {r['expected_tokens_cut']:5.2f}  {r['token']!r} ({r['class']}, depth {r['depth']})  {where}")


def add_forensics_parser(sub) -> None:
    fo = sub.add_parser("forensics", help="which drafted tokens the target rejects over a prompt set, where and why")
    add_prompt_or_trace_args(fo, many=True, trace_help="saved traces: files, or folders of *.json")
    fo.add_argument("--save-traces", metavar="DIR", help="keep each run's trace (DIR/trace_NNN.json)")
    fo.add_argument("--out", default="reports/forensics", help="folder for forensics.json and forensics.html")
    fo.add_argument("--compare", metavar="A", help="an earlier forensics.json (or its folder) on the same prompts: "
                                                   "this run is B, and the report says where B gains and loses")
    add_method_args(fo)
    add_sampling_args(fo)
    add_model_args(fo)
    fo.set_defaults(func=cmd_forensics)
