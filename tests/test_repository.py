"""The repository itself: no internal work-period or ticket numbers in tracked text, a tracked
tree small enough to clone quickly, and relative links in the README and docs/ that resolve.

Needs a git checkout (skips without one); reads only what ``git ls-files`` lists.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_TRACKED_BYTES = 60 * 2**20

# Built from pieces so that this file does not match its own pattern.
_NUM = r"\s+[0-9]"
LABELS = re.compile("|".join(("sess" + "ion" + _NUM, "sess" + "ions" + _NUM, "iss" + "ue" + _NUM)), re.IGNORECASE)

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title"), not images
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    try:
        inside = _git("rev-parse", "--is-inside-work-tree").strip() == "true"
    except subprocess.CalledProcessError:
        inside = False
    if not inside or not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout (an sdist or a copy): nothing tracked to check")
    return [p for p in _git("ls-files", "-z").split("\0") if p]


def _text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # listed but deleted in the work tree
        return None
    if b"\0" in data[:8192]:
        return None  # binary
    return data.decode("utf-8", errors="replace")


def test_no_internal_period_or_ticket_numbers(tracked):
    hits = []
    for rel in tracked:
        text = _text(ROOT / rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if LABELS.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, f"{len(hits)} line(s) name a work period or ticket; say what happened (a date, a commit):\n" + \
        "\n".join(hits[:40])


def test_tracked_tree_is_at_most_60_mib(tracked):
    sizes = {rel: (ROOT / rel).stat().st_size for rel in tracked if (ROOT / rel).is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:10]
    assert total <= MAX_TRACKED_BYTES, (f"tracked files total {total / 2**20:.1f} MiB (limit 60 MiB); largest:\n"
                                        + "\n".join(f"{s / 2**20:8.2f} MiB  {p}" for p, s in largest))


def _markdown_files(tracked: list[str]) -> list[str]:
    return [p for p in tracked if p == "README.md" or (p.startswith("docs/") and p.endswith(".md"))]


def _targets(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # links in code blocks are not links
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text) + IMAGE.findall(text)


def test_relative_links_in_readme_and_docs_resolve(tracked):
    files = _markdown_files(tracked)
    assert "README.md" in files
    known = set(tracked)
    dirs = {parent.as_posix() for p in tracked for parent in Path(p).parents}  # a folder link is fine
    broken = []
    for rel in files:
        text = _text(ROOT / rel)
        if text is None:
            continue
        for target in _targets(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
                continue  # http(s):, mailto:, an anchor in the same file
            path = target.split("#", 1)[0].split("?", 1)[0]
            if not path:
                continue
            resolved = Path(path.lstrip("/")) if path.startswith("/") else Path(rel).parent / path
            norm = "/".join(_normalise(resolved.parts))
            if norm not in known and norm not in dirs:
                broken.append(f"{rel}: ({target}) -> {norm}")
    assert not broken, f"{len(broken)} relative link(s) point at no tracked file:\n" + "\n".join(broken[:40])


def _normalise(parts: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for part in parts:
        if part in ("", "."):
            continue
        if part == "..":
            if out:
                out.pop()
            else:
                out.append("..")  # above the repository: cannot be a tracked file
            continue
        out.append(part)
    return out
