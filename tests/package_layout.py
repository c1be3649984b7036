"""The repository's folders as the installed ``relaygr`` package: ``[tool.setuptools] package-dir``
maps each top-level folder (``workers``, ``tools``, ...) to a subpackage, subfolders included."""

from __future__ import annotations

import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def module_files() -> Iterator[tuple[str, Path]]:
    """(installed module name, source file) for every module of the program, subpackages included."""
    for package, folder in SETUPTOOLS["package-dir"].items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [*package.split("."), *rel.parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def source_modules() -> set[str]:
    """Every module name of the program as installed (packages included, the top one left out)."""
    return {name for name, _ in module_files() if "." in name}


def installed_layout(dest: Path) -> Path:
    """Lay the repository's modules out under ``dest`` as installed: import-linter finds
    subpackages in their parent's folder, not through the mapping."""
    for name, src in module_files():
        parts = name.split(".")
        target = (
            dest.joinpath(*parts, "__init__.py")
            if src.name == "__init__.py"
            else dest.joinpath(*parts[:-1], src.name)
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    return dest


def laid_out_modules(dest: Path) -> set[str]:
    """The module names a layout under ``dest`` holds."""
    out = set()
    for path in dest.rglob("*.py"):
        parts = list(path.relative_to(dest).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1:
            out.add(".".join(parts))
    return out
