"""The package's layers hold: import-linter's contracts (pyproject.toml) on the code as installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from package_layout import installed_layout, laid_out_modules, source_modules

ROOT = Path(__file__).resolve().parents[1]


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


def test_the_layout_holds_every_module(tmp_path: Path) -> None:
    """The linted layout leaves no module out: subpackages (``tools/experiment``) included."""
    laid_out = laid_out_modules(installed_layout(tmp_path))
    assert "relaygr.tools.experiment.command" in laid_out
    assert laid_out == source_modules()
