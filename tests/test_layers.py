"""The package's layers hold: import-linter's contracts (pyproject.toml) on the code as installed,
and each contract fails on a deliberate bad import (a fixture that breaks it)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from package_layout import installed_layout, laid_out_modules, source_modules

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = {
    c["id"]: c
    for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
}


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    config = ROOT / "pyproject.toml"
    code = f"import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports({str(config)!r}, no_cache=True))"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,  # not the repository, whose relaygr/ folder would shadow the laid-out package
        # A wide terminal: a contract's name and its verdict stay on one line.
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "COLUMNS": "400"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_no_module_imports_upward(tmp_path: Path) -> None:
    done = lint_imports(installed_layout(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in done.stdout, done.stdout
    assert len(CONTRACTS) == 7


def test_the_layout_holds_every_module(tmp_path: Path) -> None:
    """The linted layout leaves no module out: subpackages (``tools/experiment``) included."""
    laid_out = laid_out_modules(installed_layout(tmp_path))
    assert "relaygr.tools.experiment.command" in laid_out
    assert laid_out == source_modules()


def test_the_kernels_contract_names_every_other_module() -> None:
    """``kernels-alone`` forbids the rest of the project by name: a new top-level module or room
    of ``workers/`` must join its list, or the kernels could import it unseen."""
    forbidden = set(CONTRACTS["kernels-alone"]["forbidden_modules"])
    kernels = "relaygr.workers.kernels"
    for module in source_modules():
        if module == kernels or module.startswith(kernels + "."):
            continue
        parts = module.split(".")
        # The package relaygr.workers itself holds nothing but its docstring.
        covered = {".".join(parts[:n]) for n in range(2, len(parts) + 1)}
        assert module == "relaygr.workers" or covered & forbidden, f"{module} is not in kernels-alone's list"


# (contract id, file of the laid-out tree, the import that breaks it): a new module, or a line
# added to an existing one.
BAD_IMPORTS = [
    ("layers", "relaygr/workers/engine/bad_import.py", "import relaygr.streams.config"),
    ("workers-alone", "relaygr/workers/engine/bad_import.py", "import relaygr.infra.kafka"),
    ("workers-rooms", "relaygr/workers/model/bad_import.py", "import relaygr.workers.engine.scheduler"),
    ("workers-rooms", "relaygr/workers/engine/bad_import.py", "import relaygr.workers.training.fit"),
    (
        "serving-without-training",
        "relaygr/streams/bad_import.py",
        "import relaygr.workers.training.movielens",
    ),
    ("serving-without-training", "relaygr/infra/kafka.py", "from relaygr.workers.training import quality"),
    (
        "store-knows-the-prefix-only",
        "relaygr/workers/store/placement.py",
        "import relaygr.workers.model.model",
    ),
    ("store-knows-the-prefix-only", "relaygr/workers/store/bad_import.py", "import relaygr.workers.kernels"),
    ("kernels-alone", "relaygr/workers/kernels/bad_import.py", "import relaygr.workers.prefix_kv"),
    ("kernels-alone", "relaygr/workers/kernels/cpu.py", "from relaygr.schemas import events"),
    ("schemas-pure", "relaygr/schemas/bad_import.py", "import torch"),
]


@pytest.mark.parametrize(("contract", "where", "line"), BAD_IMPORTS)
def test_a_bad_import_breaks_its_contract(tmp_path: Path, contract: str, where: str, line: str) -> None:
    tree = installed_layout(tmp_path)
    target = tree / where
    before = target.read_text() if target.exists() else '"""A module that breaks a contract."""\n'
    target.write_text(before + f"\n{line}  # noqa\n")
    done = lint_imports(tree)
    assert done.returncode != 0, done.stdout + done.stderr
    assert f"{CONTRACTS[contract]['name']} BROKEN" in done.stdout, done.stdout


def test_every_contract_has_a_bad_import() -> None:
    assert {contract for contract, _, _ in BAD_IMPORTS} == set(CONTRACTS)


@pytest.mark.parametrize("module", ["relaygr.streams.ingress", "relaygr.streams.preprocess", "relaygr.cli"])
def test_stages_before_ranking_start_without_torch(module: str) -> None:
    # torch costs a process about 2 CPU-seconds and 250 MB to import: only what runs a model pays it.
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, f"{module} imports torch: {proc.stderr[-2000:]}"
