"""The import graph of server/, engine/ and models/, read from the source: no module circles (of
any length; imports inside functions count, those under `if TYPE_CHECKING:` do not: they never
run), and no private name (`_name`) imported from another module.

A circle makes import order matter and hides which module owns what; a private name imported
elsewhere is a name its module may change without knowing who depends on it. `from pkg import
name`, where the package's `__init__` re-exports `name` from one of its modules, counts as an
import of that module (as the package itself is only a list of its modules' names).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("server", "engine", "models")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found[module_name(path)] = path
    return found


MODULES = sources()


def absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from ... import` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text())


def type_checking_only(module: str) -> set[int]:
    """The ids of the import nodes under `if TYPE_CHECKING:` in `module`."""
    out = set()
    for node in ast.walk(tree(module)):
        test = node.test if isinstance(node, ast.If) else None
        name = getattr(test, "id", None) or getattr(test, "attr", None)
        if name == "TYPE_CHECKING":
            for inner in node.body:
                out |= {id(n) for n in ast.walk(inner)}
    return out


@cache
def re_exports(package: str) -> dict[str, str]:
    """A package `__init__`'s names -> the module of the package that defines each."""
    path = MODULES.get(package)
    if path is None or path.name != "__init__.py":
        return {}
    out = {}
    for node in ast.walk(tree(package)):
        if isinstance(node, ast.ImportFrom):
            source = absolute(node, package, True)
            if source in MODULES and source.startswith(package + "."):
                for alias in node.names:
                    out[alias.asname or alias.name] = source
    return out


@cache
def imports(module: str, run_time_only: bool = False) -> list[tuple[str, str | None, int]]:
    """(module imported, name imported from it or None, line) for each import in `module`
    (with `run_time_only`, not those under `if TYPE_CHECKING:`)."""
    path = MODULES[module]
    skip = type_checking_only(module) if run_time_only else set()
    out = []
    for node in ast.walk(tree(module)):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = absolute(node, module, path.name == "__init__.py")
            out += [(source, a.name, node.lineno) for a in node.names]
    return out


@cache
def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for source, name, _ in imports(module, run_time_only=True):
            if name is not None and f"{source}.{name}" in MODULES:
                target = f"{source}.{name}"  # `from pkg import submodule`
            elif name is not None and name in re_exports(source) and source != module:
                target = re_exports(source)[name]
            else:
                target = source
            while target and target not in MODULES:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph = edges()
    assert "server.openai.serving" in graph
    assert "server.generation.loop" in graph["server.openai.serving"]
    assert "engine.request" in graph["engine.batch"]


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package: str):
    inside = {m: {t for t in ts if t.split(".")[0] in PACKAGES} for m, ts in edges().items()}
    mine = [c for c in circles(inside) if any(m.split(".")[0] == package for m in c)]
    assert mine == [], f"modules that import each other (directly or around a circle): {mine}"


def test_no_private_names_imported_across_modules():
    crossing = []
    for module in MODULES:
        for source, name, line in imports(module):
            if source.split(".")[0] not in PACKAGES or name is None:
                continue
            if name.startswith("_") and not name.startswith("__") and source != module:
                crossing.append(f"{module}:{line} imports {name} from {source}")
    assert crossing == []
