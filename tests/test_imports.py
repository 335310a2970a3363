"""cadence's import graph: module-level and function-level imports alike. No module imports
itself through others (no cycle), and no import climbs the layer order that
docs/architecture.md documents (its ``## Layers`` list, read here). Function-level imports
are few and each says why it is not at the top."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "cadence"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_FUNCTION_IMPORTS = 30


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``package`` (``__init__`` = the package)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(mods: dict[str, Path]) -> list[tuple[str, str, bool, int, str]]:
    """(importer, imported module, inside a function, line, the line's text) for every import of
    a module of the package, relative imports and ``importlib.import_module("...")`` of a
    literal included (``COMMANDS``-style tuples of module names are read too)."""
    out = []
    for mod, path in mods.items():
        text = path.read_text()
        lines = text.splitlines()
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                targets = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        parts = package.split(".")[:len(package.split(".")) - child.level + 1]
                        base = ".".join(parts + ([base] if base else []))
                    targets = [base] + [f"{base}.{a.name}" for a in child.names]
                elif isinstance(child, ast.Constant) and isinstance(child.value, str) \
                        and re.fullmatch(r"cadence(\.\w+)+", child.value):
                    targets = [child.value]  # a module named for importlib
                for t in targets:
                    r = _resolve(t, mods) if t.startswith("cadence") else None
                    if r and r != mod and (isinstance(child, (ast.Import, ast.ImportFrom)) or r == t):
                        out.append((mod, r, in_function, child.lineno, lines[child.lineno - 1]))
                if not _type_checking(child):
                    visit(child, inner)
        visit(ast.parse(text), False)
    return out


def function_imports(mods: dict[str, Path]) -> list[tuple[str, int, str]]:
    """Every import statement inside a function (of any module, cadence's or not)."""
    out = []
    for mod, path in mods.items():
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):  # the reason: on its line or the next
                        out.append((mod, node.lineno, "\n".join(lines[node.lineno - 1:node.end_lineno + 1])))
    return sorted(set(out))


def cycles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def layers(doc: Path = ARCHITECTURE) -> list[list[str]]:
    """The documented layer order, bottom first: the numbered list under ``## Layers``, each
    item's code spans naming the units of one layer (``cadence.`` prefixed)."""
    text = doc.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        m = re.match(r"\s*\d+\.\s+(.*)", line)
        if m:
            names = re.findall(r"`([\w.]+)`", m.group(1).split(":", 1)[0])
            out.append(["cadence." + n for n in names])
    return out


def layer_of(module: str, order: list[list[str]]) -> int | None:
    """The layer of ``module``: that of the longest unit that is it or contains it."""
    best = None
    for i, units in enumerate(order):
        for u in units:
            if (module == u or module.startswith(u + ".")) and (best is None or len(u) > best[1]):
                best = (i, len(u))
    return None if best is None else best[0]


def climbing(found: list, order: list[list[str]]) -> list[str]:
    return [f"{a} (layer {layer_of(a, order)}) imports {b} (layer {layer_of(b, order)}), line {line}"
            for a, b, _, line, _ in found
            if layer_of(a, order) is not None and layer_of(b, order) is not None
            and layer_of(b, order) > layer_of(a, order)]


def test_no_import_cycle():
    mods = modules(PACKAGE)
    assert cycles([(a, b) for a, b, *_ in imports(mods)]) == []


def test_every_module_has_a_layer_and_no_import_climbs():
    mods = modules(PACKAGE)
    order = layers()
    assert len(order) >= 10
    assert [m for m in mods if m != "cadence" and layer_of(m, order) is None] == []
    assert climbing(imports(mods), order) == []


def test_few_function_level_imports_each_with_its_reason():
    found = function_imports(modules(PACKAGE))
    assert len(found) < MAX_FUNCTION_IMPORTS, "\n".join(f"{m}:{n}: {t.strip()}" for m, n, t in found)
    print(f"{len(found)} function-level imports")
    assert [f"{m}:{n}" for m, n, t in found if "#" not in t] == []


def test_the_checks_fail_on_a_planted_cycle_and_a_climbing_import(tmp_path):
    """The same functions on a small package with a cycle (a -> b -> a) and an import that
    climbs (low imports high): both are found."""
    pkg = tmp_path / "cadence"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from cadence.low import b\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from cadence.low.a import x  # lazy\n")
    (pkg / "high.py").write_text("import cadence.low.a\n")
    (pkg / "low" / "c.py").write_text("from cadence import high\n")
    doc = tmp_path / "architecture.md"
    doc.write_text("## Layers\n\n1. `low`: bottom\n2. `high`: top\n")
    mods = modules(pkg)
    found = imports(mods)
    assert cycles([(a, b) for a, b, *_ in found]) == [["cadence.low.a", "cadence.low.b"]]
    assert climbing(found, layers(doc)) == ["cadence.low.c (layer 0) imports cadence.high (layer 1), line 1"]


def test_decoding_never_imports_training():
    mods = modules(PACKAGE)
    decoding = ("cadence.decode", "cadence.draft", "cadence.schedulers", "cadence.verify", "cadence.methods")
    reach: dict[str, set[str]] = {}
    for a, b, *_ in imports(mods):
        reach.setdefault(a, set()).add(b)
    for start in (m for m in mods if m.startswith(decoding)):
        seen, todo = set(), [start]
        while todo:
            for nxt in reach.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert not [m for m in seen if m.startswith(("cadence.training", "cadence.calibration"))], start


@pytest.mark.parametrize("limit", [10])
def test_few_modules_flat_in_the_package(limit):
    flat = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(flat) < limit, flat
