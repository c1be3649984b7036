"""The package's layers hold: import-linter's contracts (pyproject.toml) on the code as installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def installed_layout(dest: Path) -> Path:
    """Lay the repository's folders out as the installed ``relaygr`` package (``package-dir``) under
    ``dest``: import-linter finds subpackages in their parent's folder, not through the mapping."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dirs.items():
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for src in (ROOT / folder).glob("*.py"):
            shutil.copy2(src, target / src.name)
    return dest


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    config = ROOT / "pyproject.toml"
    code = f"import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports({str(config)!r}, no_cache=True))"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,  # not the repository, whose relaygr/ folder would shadow the laid-out package
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_no_module_imports_upward(tmp_path: Path) -> None:
    done = lint_imports(installed_layout(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 3 kept, 0 broken." in done.stdout, done.stdout
