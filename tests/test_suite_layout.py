"""The test suite's own layout: what test modules share lives in tests/helpers/ or
tests/conftest.py, so no test module imports another (a test module's import runs its module-level
setup and ties the two modules' fixtures and names together)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def is_test_module(name: str) -> bool:
    return any(part.startswith("test_") for part in name.lstrip(".").split("."))


def test_no_test_module_imports_another():
    files = sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "helpers").glob("*.py"))
    files.append(TESTS / "conftest.py")
    assert len(files) > 50
    offenders = {
        str(path.relative_to(TESTS)): sorted(n for n in imported_modules(path) if is_test_module(n))
        for path in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_sees_an_import_of_a_test_module(tmp_path):
    """The check above is not vacuous: each spelling of such an import is caught."""
    for line in (
        "from tests.test_models_real import ATOL",
        "import tests.test_kquant",
        "from . import test_kquant",
        "from .test_kquant import random_rows",
        "def f():\n    from tests import test_kquant",
    ):
        path = tmp_path / "m.py"
        path.write_text(line + "\n")
        assert any(is_test_module(n) for n in imported_modules(path)), line
    path.write_text("from tests.helpers.oracles import ATOL\nimport pytest\n")
    assert not any(is_test_module(n) for n in imported_modules(path))
