"""The broker's CLI: start/status/stop through `relaygr broker`, and a clear line when java is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from relaygr.infra.local import broker
from relaygr.infra.settings import Settings

pytestmark = pytest.mark.broker


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relaygr.cli", *args], capture_output=True, text=True, env=env, timeout=180
    )


@pytest.mark.slow(seconds=40)
def test_start_status_stop_cycle(tmp_path: Path) -> None:
    env = {**os.environ, "RELAYGR_HOME": str(tmp_path / "home")}
    env.pop("RELAYGR_BOOTSTRAP", None)
    assert _cli(["broker", "status"], env).returncode == 1
    started = _cli(["broker", "start"], env)
    assert started.returncode == 0, started.stderr
    line = started.stdout.strip().splitlines()[-1]
    assert line.startswith("bootstrap=127.0.0.1:")
    port = int(line.rsplit(":", 1)[1])
    try:
        st = _cli(["broker", "status"], env)
        assert st.returncode == 0 and "up" in st.stdout and "log=" in st.stdout
        state = broker.read_state(Settings(home=tmp_path / "home"))
        assert state is not None and state.port == port and Path(state.data_dir).is_dir()
        assert broker.port_open(port)
        again = _cli(["broker", "start"], env)  # second start reuses the running broker
        assert again.stdout.strip().splitlines()[-1] == line
    finally:
        stopped = _cli(["broker", "stop"], env)
    assert stopped.returncode == 0
    assert not Path(state.data_dir).exists()
    assert not broker.port_open(port)
    assert _cli(["broker", "status"], env).returncode == 1


def test_missing_java_gives_one_clear_line(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # Only python on PATH: no java, no mvn. Use a cache dir without jars so Maven is needed.
    os.symlink(sys.executable, bindir / "python")
    env = {
        "PATH": str(bindir),
        "HOME": str(tmp_path),
        "RELAYGR_HOME": str(tmp_path / "home"),
        "RELAYGR_CACHE_DIR": str(tmp_path / "cache"),
    }
    r = _cli(["broker", "start"], env)
    assert r.returncode == 1
    assert "not found" in r.stderr and "docker compose" in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_no_broker_means_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "RELAYGR_HOME": str(tmp_path / "nohome")}
    env.pop("RELAYGR_BOOTSTRAP", None)
    r = _cli(["topics", "create"], env)
    assert r.returncode == 1
    assert "relaygr broker start" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(shutil.which("java") is None, reason="needs java")
def test_jars_are_cached_outside_the_repo(kafka_settings) -> None:
    jars = broker.jars_dir(Settings())
    assert (jars / ".complete").exists()
    names = {p.name for p in jars.glob("*.jar")}
    assert any(n.startswith("kafka_2.13-") for n in names)
    assert sum(n.startswith("log4j-slf4j-impl") for n in names) == 1
    repo = Path(__file__).resolve().parents[1]
    assert repo not in jars.resolve().parents
