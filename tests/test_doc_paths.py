"""Every module the docs name exists: a file path (``workers/engine/ranker.py``, ``streams/ranking/``)
or a dotted name (``relaygr.workers.model.vocab.item_key``, ``workers.engine.cores``) in the README,
in ``docs/*.md``, or in a docstring or comment of the program and its tests. A dotted name resolves
to its longest module, and what follows must be a name that module defines or imports, so a module
that moved or was split fails here instead of leading a reader nowhere.

The check stays off prose: a path must begin with one of the repository's folders, a dotted name
with a folder of the program (``relaygr.`` before one, or before a module of ``relaygr/``, is
allowed), and ``relaygr.<word>`` that is neither (the topics, ``relaygr.requests``) is not a module
name at all."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from package_layout import ROOT, SETUPTOOLS, module_files

# Installed subpackage -> its folder in the repository ("relaygr.workers" -> "workers").
FOLDERS = {pkg.split(".", 1)[1]: folder for pkg, folder in SETUPTOOLS["package-dir"].items() if "." in pkg}
PATH_TOPS = sorted({*FOLDERS.values(), "relaygr", "tests", "docs"})
PATH_RE = re.compile(rf"(?<![\w./-])((?:{'|'.join(PATH_TOPS)})/[\w/.-]*\w/?)")
DOTTED_RE = re.compile(r"(?<![\w.])((?:relaygr\.)?(?:\w+)(?:\.\w+)+)")

# Stale names ("path:name") in files being rewritten elsewhere, each with its reason; an entry goes
# once its file names the module as it is (test_allowed_stale_names_are_still_there says when).
ALLOWED_STALE: dict[str, str] = {}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def source_files() -> list[Path]:
    tests = sorted((ROOT / "tests").glob("*.py"))
    return [path for _, path in module_files()] + tests


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of what a reader reads: a whole page, or a module's docstrings and comments."""
    source = path.read_text()
    if path.suffix == ".md":
        yield 1, source
        return
    documented = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, documented) and (docstring := ast.get_docstring(node, clean=False)):
            yield node.body[0].lineno, docstring
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


@cache
def modules() -> dict[str, Path]:
    """Dotted name without the ``relaygr.`` prefix (``workers.engine.ranker``) -> its source file."""
    return {name.removeprefix("relaygr."): path for name, path in module_files() if "." in name}


@cache
def defined_names(path: Path) -> frozenset[str]:
    """The names a module binds at its top level: definitions, assignments and imports."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING imports, optional imports
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import | ast.ImportFrom):
                    names |= {(alias.asname or alias.name).split(".")[0] for alias in sub.names}
    return frozenset(names)


def path_exists(text: str) -> bool:
    """A repository path, or an installed one (``relaygr/streams/...`` is ``streams/...``)."""
    parts = text.rstrip("/").split("/")
    if parts[0] == "relaygr" and len(parts) > 1 and parts[1] in FOLDERS:
        parts = [FOLDERS[parts[1]], *parts[2:]]
    return ROOT.joinpath(*parts).exists()


def dotted_is_module_name(text: str) -> bool:
    """Whether a dotted word names the program's modules at all (not a topic, an attribute, prose)."""
    parts = text.split(".")
    if parts[0] == "relaygr":
        parts = parts[1:]
        return parts[0] in FOLDERS or parts[0] in modules()
    return parts[0] in FOLDERS


def dotted_resolves(text: str) -> bool:
    """The longest module the name begins with exists, and the next word is a name it binds."""
    parts = text.removeprefix("relaygr.").split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in modules():
            rest = parts[cut:]
            return not rest or rest[0] in defined_names(modules()[module])
    return False


def stale_names(path: Path) -> list[str]:
    found = []
    for line, text in prose(path):
        for match in PATH_RE.finditer(text):
            if not path_exists(match.group(1)):
                found.append(f"{line + text[: match.start()].count(chr(10))}: {match.group(1)}")
        for match in DOTTED_RE.finditer(text):
            name = match.group(1)
            if dotted_is_module_name(name) and not dotted_resolves(name):
                found.append(f"{line + text[: match.start()].count(chr(10))}: {name}")
    return found


def all_stale() -> dict[str, list[str]]:
    """Relative path -> its stale names ("line: name"), the allowed ones left out."""
    stale = {}
    for path in doc_files() + source_files():
        rel = path.relative_to(ROOT).as_posix()
        found = [f for f in stale_names(path) if f"{rel}:{f.partition(': ')[2]}" not in ALLOWED_STALE]
        if found:
            stale[rel] = found
    return stale


def test_docs_and_docstrings_name_only_modules_that_exist() -> None:
    stale = all_stale()
    assert not stale, f"names of modules that do not exist: {stale}"


def test_allowed_stale_names_are_still_there() -> None:
    for key in ALLOWED_STALE:
        rel, _, name = key.partition(":")
        names = {f.partition(": ")[2] for f in stale_names(ROOT / rel)}
        assert name in names, f"{key} names what exists now: remove it from ALLOWED_STALE"


def test_the_check_sees_a_stale_name_and_passes_prose(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See `workers/engine/ranker.py` and `relaygr/streams/ranking/` (installed), "
        "`relaygr.workers.model.vocab.item_key`, `workers.engine.cores`.\n"
        "Gone: `workers/ranker.py`, `workers/model/fused_scoring.py`, `workers.pacing`,\n"
        "`relaygr.workers.engine.ranker.NoSuchThing`, `streams.standby`.\n"
        "Prose: the topics `relaygr.requests`, `itertools.product`, e.g. `cfg.workers.count`.\n"
    )
    assert stale_names(page) == [
        "2: workers/ranker.py",
        "2: workers/model/fused_scoring.py",
        "2: workers.pacing",
        "3: relaygr.workers.engine.ranker.NoSuchThing",
        "3: streams.standby",
    ]
    source = tmp_path / "mod.py"
    source.write_text(
        '"""Over ``workers/store/placement.py``."""\n\nx = "workers/gone.py"  # see workers.gone\n'
    )
    assert stale_names(source) == ["3: workers.gone"]
