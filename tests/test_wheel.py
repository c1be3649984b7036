"""The built wheel is the whole program: built from the repository, and from the Docker build context
that ``infra/Dockerfile`` copies, it installs into a fresh virtualenv where every module imports and
``relaygr --help`` runs. The editable install of ``./dev`` maps the folders itself and would hide a
package left out of ``pyproject.toml``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from package_layout import SETUPTOOLS, source_modules

ROOT = Path(__file__).resolve().parents[1]

# Imports every module of the installed package and prints their names, one a line.
IMPORT_ALL = """
import importlib, pkgutil, relaygr
names = sorted(m.name for m in pkgutil.walk_packages(relaygr.__path__, "relaygr."))
for name in names:
    importlib.import_module(name)
print("\\n".join(names))
"""


def test_every_package_folder_is_listed() -> None:
    """A folder with an ``__init__.py`` under a mapped folder is a package the wheel must list."""
    found = set()
    for package, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([*package.split("."), *rel.parts]))
    assert found - set(SETUPTOOLS["packages"]) == set(), "add these to [tool.setuptools] packages"


def docker_context(dest: Path) -> Path:
    """What ``infra/Dockerfile`` copies into the image before ``pip install .``, laid out in ``dest``."""
    for line in (ROOT / "infra" / "Dockerfile").read_text().splitlines():
        m = re.match(r"COPY\s+(.+)\s+(\S+)$", line.strip())
        if not m:
            continue
        sources, target = m.group(1).split(), m.group(2)
        for src in sources:
            to = dest / (src if target.endswith("/") or target == "./" else target)
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, to, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / src, to)
    return dest


def repository_copy(dest: Path) -> Path:
    """The project's metadata and every folder that ``package-dir`` maps, copied to ``dest``."""
    for name in ("pyproject.toml", "README.md"):
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    for folder in SETUPTOOLS["package-dir"].values():
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def fresh_venv(path: Path) -> Path:
    """A virtualenv whose dependencies are this one's (a ``.pth`` line: no download), without relaygr."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    purelib = Path(sysconfig.get_paths(vars={"base": str(path), "platbase": str(path)})["purelib"])
    purelib.mkdir(parents=True, exist_ok=True)
    (purelib / "_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path / "bin" / "python"


@pytest.mark.slow(seconds=35)
@pytest.mark.parametrize("source", ["repository", "docker-context"])
def test_wheel_installs_the_whole_program(tmp_path: Path, source: str) -> None:
    # Built from a copy: an in-place build leaves build/ behind, whose stale modules a later
    # build would package.
    src = (
        repository_copy(tmp_path / "src") if source == "repository" else docker_context(tmp_path / "context")
    )
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", dist, src],
        check=True,
        cwd=tmp_path,
        capture_output=True,
    )
    (wheel,) = dist.glob("relaygr-*.whl")
    python = fresh_venv(tmp_path / "venv")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel],
        check=True,
        capture_output=True,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # Run away from the repository, whose top-level relaygr/ folder would shadow the installed one.
    done = subprocess.run(
        [python, "-c", IMPORT_ALL], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    installed = set(done.stdout.split())
    assert source_modules() - installed == set(), "modules the wheel lacks"
    # Neither the tests nor the dev script are installed (relaygr.device is a package of the program).
    assert not {name.split(".")[1] for name in installed if "." in name} & {"tests", "dev"}
    cli = subprocess.run(
        [python.parent / "relaygr", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert cli.returncode == 0, cli.stderr
    assert "demo" in cli.stdout and "experiment" in cli.stdout
