"""`relaygr up --rolling-restart` finds the running `relaygr up` of the same home through its pid
file and sends it SIGUSR1 (no broker: a stand-in process records the signal)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relaygr.infra.settings import Settings
from relaygr.tools.up import signal_running_up

RECORDER = """
import signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: (print("rolled", flush=True), sys.exit(0)))
print("ready", flush=True)
time.sleep(60)
"""


def test_no_running_up_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no running `relaygr up`"):
        signal_running_up(Settings(home=tmp_path))


def test_the_running_up_gets_sigusr1(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", RECORDER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        (tmp_path / "up.pid").write_text(str(proc.pid))
        assert signal_running_up(Settings(home=tmp_path)) == proc.pid
        out, _ = proc.communicate(timeout=30)
        assert out.strip() == "rolled" and proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
