"""The house rules, checked over the source: no import cycle between modules (type-only
imports aside), and every package keeps the rules its `__init__` docstring states.

A package's docstring may hold two rule lines, which apply to every module under it:
  `Imports from this project: a, b.c` (only these of our packages/modules; "nothing")
  `Never imports: torch, ray` (third-party top-level packages it must not touch)
Imports inside functions count too: a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("actors", "cluster", "router")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for pkg in OURS for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test)


def _imported_names(module: str) -> set[str]:
    """Dotted names `module` imports at run time (TYPE_CHECKING blocks skipped)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                for branch in child.orelse:
                    visit(branch)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                found.update(
                    f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                    for a in child.names
                )
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _ours(name: str) -> str | None:
    """The module of ours that `name` (a module or a name inside one) resolves to."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


GRAPH = {m: {o for n in _imported_names(m) if (o := _ours(n)) and o != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_no_import_cycle_between_modules():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _rules(package: str) -> tuple[list[str] | None, list[str]]:
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    allowed, never = None, []
    for line in doc.splitlines():
        key, _, value = line.strip().partition(":")
        names = [n.strip().strip("`") for n in value.replace(".", ".").split(",") if n.strip()]
        if key == "Imports from this project":
            allowed = [] if names == ["nothing"] else names
        elif key == "Never imports":
            never = names
    return allowed, never


PACKAGES = sorted(m for m, p in MODULES.items() if p.name == "__init__.py")


def _within(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_states_what_it_owns(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text()))
    assert doc and len(doc.splitlines()) >= 2, (
        f"{package}/__init__.py: say what the package owns and what it may import"
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_keeps_its_import_rules(package):
    allowed, never = _rules(package)
    members = [m for m in MODULES if _within(m, [package])]
    broken = []
    for module in members:
        for name in _imported_names(module):
            ours = _ours(name)
            if ours and allowed is not None and not _within(ours, [package, *allowed]):
                broken.append(f"{module} imports {ours}")
            if not ours and name.split(".")[0] in never:
                broken.append(f"{module} imports {name}")
    assert broken == []


def test_the_rules_are_read():
    assert _rules("router") == ([], ["torch", "ray", "transformers"])


def _readme_map() -> set[str]:
    """Paths named at the start of a line in the README's layout block."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    return {line.split()[0] for line in block.splitlines() if line and not line[0].isspace()}


def test_the_readme_map_lists_every_module_and_nothing_else():
    listed = _readme_map()
    modules = {str(p.relative_to(ROOT)) for p in MODULES.values() if p.name != "__init__.py"}
    packages = {
        str(p.parent.relative_to(ROOT)) + "/" for p in MODULES.values() if p.name == "__init__.py"
    }
    assert sorted(modules - listed) == []
    assert sorted(packages - listed) == []
    assert sorted(p for p in listed if not (ROOT / p).exists()) == []


def _import_time_names(module: str) -> set[str]:
    """Dotted names `module` imports when it is imported: module and class bodies, not
    function bodies, not TYPE_CHECKING blocks."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if _type_checking_only(node):
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []))

    visit(ast.parse(MODULES[module].read_text()).body)
    return found


def _packages_of(module: str) -> list[str]:
    """The package __init__ modules importing `module` runs first."""
    parts = module.split(".")
    return [p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in MODULES]


def test_the_fleet_controller_starts_workers_without_importing_torch():
    """A fleet change waits for the new controller's imports before any worker starts: the
    actor shells leave torch, transformers and the engines to the workers themselves."""
    seen, todo, heavy = set(), ["cluster.controller", "cluster.fleet"], []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in _import_time_names(module):
            if (ours := _ours(name)) is not None:
                todo += [ours, *_packages_of(ours)]
            elif name.split(".")[0] in ("torch", "transformers", "xgrammar"):
                heavy.append((module, name))
    assert "actors.decode" in seen and heavy == [], heavy
