"""Long prompts (about 700-1,500 tokens) for decoding at a long context: summaries of, and
questions about, sections of the Python language reference that ship with Python itself
(``pydoc_data.topics``), so nothing is downloaded and nothing comes from Spec-Bench or MT-Bench.

The short held-out prompts (``categories.jsonl``) leave the KV cache at 150-250 entries, where
attention is a small share of a forward; a user's summarisation or retrieval-augmented prompt
holds a thousand tokens or more. The text depends on the Python version (3.11 here); the file
this writes says which.

Usage:  python benchmarks/prompts/long_prompts.py [--chars 5000] [--out runs/long.jsonl]
then    cadence bench --tasks custom --custom runs/long.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydoc_data.topics import topics

# (topic, kind, what to ask): sections of 6,000-14,000 characters, cut to --chars at a paragraph
ASKS = [
    ("execmodel", "summary", "Summarize the passage above in one paragraph."),
    ("import", "qa", "According to the passage, what happens when a module is imported a second time?"),
    ("try", "summary", "Explain the passage above to a beginner in a few sentences."),
    ("calls", "qa", "According to the passage, how are keyword arguments matched to parameters?"),
    ("naming", "summary", "Summarize the main rules described in the passage above."),
    ("function", "qa", "According to the passage, when are default parameter values evaluated?"),
    ("comparisons", "summary", "List the key points of the passage above as short bullet points."),
    ("assignment", "qa", "According to the passage, how does assignment to a target list work?"),
    ("customization", "summary", "Summarize the passage above in one paragraph."),
    ("attribute-access", "qa", "According to the passage, when is __getattr__ called?"),
    ("strings", "summary", "Summarize the passage above in a few sentences."),
    ("typesmapping", "qa", "According to the passage, what does the get method of a dictionary do?"),
]


def cut(text: str, chars: int) -> str:
    """The first paragraphs of ``text`` that fit in ``chars`` characters (at least one)."""
    out = ""
    for para in text.strip().split("\n\n"):
        if out and len(out) + len(para) + 2 > chars:
            break
        out = f"{out}\n\n{para}" if out else para
    return out[: max(chars, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, default=5000, help="most characters of reference text per prompt")
    ap.add_argument("--out", default="runs/long.jsonl")
    args = ap.parse_args()
    version = ".".join(map(str, sys.version_info[:2]))
    rows = []
    for i, (topic, kind, ask) in enumerate(ASKS):
        passage = cut(topics[topic], args.chars)
        rows.append({"id": f"long-{kind}-{i}", "category": f"long-{kind}",
                     "prompt": f"{passage}\n\n{ask}", "source": f"Python {version} reference, {topic}"})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts of {min(len(r['prompt']) for r in rows)}-{max(len(r['prompt']) for r in rows)} "
          f"characters (Python {version}) -> {out}")


if __name__ == "__main__":
    main()
