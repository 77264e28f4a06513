"""The shape of the package stays as docs/architecture.md describes it: no import cycles (lazy imports count), no
function over 60 lines, no private name of one package used from another, and a module map that matches the tree."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tandem"
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imports(name: str) -> Iterator[str]:
    """The tandem modules `name` imports anywhere in its body (inside functions too)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    yield f"{base}.{alias.name}"
                elif base in MODULES:
                    yield base


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in state and (found := visit(w)) is not None:
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)) is not None:
            return found
    return None


def _package_of(module: str) -> str:
    """tandem.engine.engine -> tandem.engine; top-level modules (tandem.config) are their own package."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_modules() -> None:
    graph = {m: set(_imports(m)) - {m} for m in MODULES}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_import_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for m in MODULES:
        graph.setdefault(_package_of(m), set()).update(_package_of(w) for w in _imports(m) if _package_of(w) != _package_of(m))
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_layers_sit_below_models_and_runner() -> None:
    """runner -> models -> layers, and nothing below points back up."""
    below = {"tandem.layers": {"tandem.models", "tandem.runner", "tandem.engine"}, "tandem.models": {"tandem.runner", "tandem.engine"}}
    for m in MODULES:
        forbidden = below.get(_package_of(m), set())
        bad = sorted(w for w in _imports(m) if _package_of(w) in forbidden)
        assert not bad, f"{m} imports {bad}"


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_function_over_60_lines() -> None:
    long = [
        f"{MODULES[m].relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"  # type: ignore[operator]
        for m, tree in TREES.items()
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES  # type: ignore[operator]
    ]
    assert not long, long


def test_no_lru_cache_on_a_method() -> None:
    """A cache on a method keeps every `self` it saw alive (docs/architecture.md: nothing holds one)."""
    cached = [
        f"{MODULES[m].relative_to(ROOT)}:{f.lineno} {cls.name}.{f.name}"
        for m, tree in TREES.items()
        for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
        for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for d in f.decorator_list
        if ast.unparse(d).split("(")[0].split(".")[-1] in ("lru_cache", "cache")
    ]
    assert not cached, cached


def _private_names_defined(package: str) -> set[str]:
    """Every `_name` a package defines: functions, classes, assignments, attributes set on self / objects."""
    names: set[str] = set()
    for m, tree in TREES.items():
        if _package_of(m) != package:
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names.add(n.attr)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
    return {x for x in names if x.startswith("_") and not x.startswith("__")}


def test_no_private_name_crosses_a_package() -> None:
    """A `_name` read as an attribute or imported must be defined in the reader's own package."""
    own = {p: _private_names_defined(p) for p in {_package_of(m) for m in MODULES}}
    bad = []
    for m, tree in TREES.items():
        mine = own[_package_of(m)]
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                if _root_name(n) in LIBRARIES:
                    continue  # a library's own private API (e.g. torch.ops.mkldnn._linear_pointwise), not a seam
                name = n.attr
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("tandem"):
                bad += [f"{m} imports {n.module}.{a.name}" for a in n.names
                        if a.name.startswith("_") and _package_of(n.module or "") != _package_of(m)]
                continue
            else:
                continue
            if name.startswith("_") and not name.startswith("__") and name not in mine:
                bad.append(f"{m}:{n.lineno} reads .{name}")
    assert not bad, bad


LIBRARIES = {"torch", "np", "numpy", "xgr", "xgrammar", "llguidance", "os", "sys", "mp", "ctypes"}


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def test_module_map_matches_the_tree() -> None:
    """Every module in docs/architecture.md's map exists, and every module of the tree is in the map."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    mapped: set[str] = set()
    for line in block.splitlines():
        paths = line.split("  ", 1)[0].strip()
        folder = ""
        for entry in re.split(r",\s*", paths):
            entry = entry.removeprefix("tandem/")
            if "/" in entry.rstrip("/"):
                folder = entry.rsplit("/", 1)[0] + "/"
            elif folder:
                entry = folder + entry  # "structured/a.py, b.py": b.py is in structured/ too
            if entry.endswith("/"):
                mapped.add(entry.rstrip("/"))
            elif entry.endswith(".py") and not entry.endswith("__init__.py"):
                mapped.add(entry.removesuffix(".py"))
    tree = {str(p.relative_to(PACKAGE).with_suffix("")) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    packages = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists()}
    missing_in_tree = sorted(m for m in mapped if m not in tree and m not in packages)
    assert not missing_in_tree, f"the map names modules that do not exist: {missing_in_tree}"
    covered = {m for m in tree if m in mapped or any(m.startswith(p + "/") for p in mapped)}
    assert tree == covered, f"modules missing from the map: {sorted(tree - covered)}"
