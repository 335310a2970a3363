"""Every script under benchmarks/ has its line in benchmarks/README.md, under its folder's heading."""

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SHARED = {"common.py", "__init__.py"}


def listed() -> set[str]:
    """'group/script.py' for every `- `script.py`` bullet under a '### `group/`' heading."""
    found, group = set(), None
    for line in (BENCH / "README.md").read_text().splitlines():
        heading = re.match(r"#{2,3} `([\w-]+)/`", line)
        if heading:
            group = heading.group(1)
        elif line.startswith("#"):
            group = None
        elif group and (item := re.match(r"- `([\w-]+\.py)`", line)):
            found.add(f"{group}/{item.group(1)}")
    return found


def scripts() -> set[str]:
    return {p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*.py")
            if p.name not in SHARED and "__pycache__" not in p.parts}


def test_every_benchmark_script_is_listed_in_the_readme():
    missing = sorted(scripts() - listed())
    assert not missing, f"benchmarks/README.md has no line for: {', '.join(missing)}"


def test_the_readme_lists_no_script_that_is_gone():
    assert not sorted(listed() - scripts())


def test_scripts_sit_in_a_group_folder():
    assert all("/" in s for s in scripts()), "a script directly under benchmarks/ belongs in a group folder"
