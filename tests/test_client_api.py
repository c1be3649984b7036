"""``relaygr.client`` exports exactly its own API: ``__all__`` names every public class and function
the module defines (and its ``StartAt`` type), nothing it imports, and is what ``import *`` gives."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import relaygr.client as client

# Public names of the module that are not its API: the logger and a tuning constant.
NOT_API = {"log", "REMEMBERED_IDS"}


def _defined_here() -> set[str]:
    """Public top-level names the module's own source defines (classes, functions, assignments)."""
    names: set[str] = set()
    for node in ast.parse(inspect.getsource(client)).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


def test_all_names_exactly_what_the_module_defines() -> None:
    assert len(client.__all__) == len(set(client.__all__)), "a name is listed twice"
    assert set(client.__all__) == _defined_here() - NOT_API


def test_nothing_imported_is_exported() -> None:
    for name in ("AIOKafkaConsumer", "AIOKafkaProducer", "AsyncIterator", "Iterable", "Settings"):
        assert hasattr(client, name), f"{name} is no longer imported: drop it from this list"
        assert name not in client.__all__
    for name in client.__all__:
        obj = getattr(client, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__ == client.__name__, f"{name} comes from {obj.__module__}"


def test_star_import_gives_the_api() -> None:
    namespace: dict[str, object] = {}
    exec("from relaygr.client import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(client.__all__)


def test_the_docstring_names_every_exported_name() -> None:
    doc = client.__doc__ or ""
    assert [name for name in client.__all__ if f"``{name}" not in doc] == []


def test_the_integration_page_names_every_exported_name() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "integration.md").read_text()
    assert [name for name in client.__all__ if f"`{name}" not in page] == []
