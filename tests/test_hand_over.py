"""A rolling restart's hand-over (``tools.hand_over.complete_hand_over``), with stand-in processes: the old
process is signalled, the standby's states are awaited, and whatever happens the old process,
which nothing supervises any more, does not outlive the call. A stop while a standby warms up gives
the restart up at once (``RollAbandoned``), and the workers not rolled yet are left as they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.tools.hand_over import HandOverFailed, RollAbandoned, complete_hand_over, wait_standby
from relaygr.tools.up import _rolling_restart

# A process that ignores the hand-over signal (as one stuck in its drain would), or both it and SIGTERM.
DEAF = "import signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); {more}print('ready', flush=True); time.sleep(600)"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]  # SIGUSR1 ends it: it "hands over"


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def start(argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, **kw)
        started.append(p)
        return p

    def deaf(*, to_term: bool = False) -> subprocess.Popen:
        more = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if to_term else ""
        p = start([sys.executable, "-c", DEAF.format(more=more)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"  # its handlers are in place
        return p

    start.deaf = deaf
    yield start
    for p in started:
        p.kill()
        p.wait()


def test_a_standby_that_never_serves_fails_the_hand_over_and_ends_the_old_process(
    procs, tmp_path: Path
) -> None:
    files = WorkerFiles(tmp_path)
    standby, old = procs(SLEEPER), procs.deaf()
    files.write_standby("ready", standby.pid)
    with pytest.raises(HandOverFailed, match=rf"not serving within .*pid {standby.pid} is ranker-0 now"):
        complete_hand_over(files, standby, old, name="ranker-0", timeout_s=0.5, old_grace_s=10)
    assert old.poll() is not None and old.returncode == -15  # ended by SIGTERM, not left running
    assert standby.poll() is None  # the supervised worker now: not this call's to end


def test_an_old_process_deaf_to_sigterm_is_killed_after_its_grace(procs, tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path)
    standby = procs(SLEEPER)
    old = procs.deaf(to_term=True)
    with pytest.raises(HandOverFailed, match=r"has exited \(code -9\)"):
        complete_hand_over(files, standby, old, name="ranker-1", timeout_s=0.2, old_grace_s=0.5)
    assert old.returncode == -9


def test_a_standby_that_exits_fails_the_hand_over(procs, tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path)
    standby, old = procs([sys.executable, "-c", "raise SystemExit(3)"]), procs.deaf()
    standby.wait()
    with pytest.raises(HandOverFailed, match="exited with code 3 before serving"):
        complete_hand_over(files, standby, old, name="ranker-0", timeout_s=30, old_grace_s=10)
    assert old.returncode == -15


def test_a_hand_over_that_succeeds_waits_for_the_old_process_to_exit(procs, tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path)
    standby, old = procs(SLEEPER), procs(SLEEPER)
    files.write_standby("joined", standby.pid)  # a later state satisfies the earlier ones
    took = complete_hand_over(files, standby, old, name="ranker-0", timeout_s=30, old_grace_s=10)
    assert set(took) == {"serving", "joined", "old_exit"}
    assert took["serving"] <= took["joined"] <= took["old_exit"]
    assert old.returncode is not None and standby.poll() is None


def test_a_state_written_by_another_pid_does_not_count(procs, tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path)
    standby, old = procs(SLEEPER), procs.deaf()
    files.write_standby("joined", standby.pid + 100_000)  # an earlier standby's file
    with pytest.raises(HandOverFailed, match="not serving"):
        complete_hand_over(files, standby, old, name="ranker-0", timeout_s=0.3, old_grace_s=10)


def test_a_stop_while_the_standby_warms_up_gives_the_restart_up_at_once(procs, tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path)
    standby = procs(SLEEPER)
    with pytest.raises(RollAbandoned, match="given up before ready"):
        wait_standby(files, standby, "ready", 600.0, abandon=lambda: True)  # not the 600 s
    files.write_standby("ready", standby.pid)
    wait_standby(files, standby, "ready", 600.0, abandon=lambda: False)


class _Rolled:
    """A deployment of three workers whose roll records the calls; a stop comes during the first."""

    def __init__(self, stop_during: int | None) -> None:
        self.n, self.calls, self.stopping = 3, [], False
        self.stop_during = stop_during

    def roll_worker(self, i: int, *, abandon) -> dict[str, float]:
        self.calls.append(i)
        if i == self.stop_during:
            self.stopping = True
            if abandon():
                raise RollAbandoned("the standby was given up before ready: stopping")
        return {"warm": 1.0, "serving": 0.01, "joined": 0.1, "old_exit": 0.2}


def test_a_rolling_restart_stops_rolling_once_the_deployment_stops(capsys) -> None:
    pipe = _Rolled(stop_during=1)
    _rolling_restart(pipe, lambda: pipe.stopping)
    assert pipe.calls == [0, 1]  # ranker-2 is left as it is
    err = capsys.readouterr().err
    assert "rolling restart of ranker-1 given up" in err
    pipe = _Rolled(stop_during=None)
    _rolling_restart(pipe, lambda: pipe.stopping)
    assert pipe.calls == [0, 1, 2] and "ranker-2 replaced" in capsys.readouterr().out
