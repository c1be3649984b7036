"""The stage supervisor on plain child processes (no broker): a child that dies is restarted with
backoff while its siblings keep running, each restart counted and logged; a crash loop stops the
supervision with a message naming the stage; a released child stays down."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from relaygr.infra.supervisor import CrashLoop, RestartPolicy, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
FAILING = [sys.executable, "-c", "print('cannot start: no model'); raise SystemExit(3)"]
QUICK = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, max_restarts=3, window_s=120.0)


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "logs", QUICK, poll_s=0.02, echo=None)
    yield sup
    sup.stop(grace_s=5)


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout_s:.0f} s: {what}")
        time.sleep(0.02)


def test_a_killed_child_is_restarted_and_its_siblings_keep_running(supervisor: Supervisor) -> None:
    first = supervisor.spawn("ranker-0", SLEEPER, dict(os.environ))
    sibling = supervisor.spawn("retrieval", SLEEPER, dict(os.environ))
    os.kill(first.pid, signal.SIGKILL)
    _until(lambda: supervisor.processes()["ranker-0"].pid != first.pid, "ranker-0 restarted")
    again = supervisor.processes()["ranker-0"]
    assert again.poll() is None
    assert supervisor.processes()["retrieval"] is sibling and sibling.poll() is None
    assert supervisor.restarts == {"ranker-0": 1}
    supervisor.check()  # one restart is no crash loop
    log = (supervisor.log_dir / "supervisor.log").read_text()
    assert "stage ranker-0 exited with code -9; restarting" in log and "restart 1" in log
    # The stage's own log says where its previous run ended.
    assert "exited with code -9" in (supervisor.log_dir / "ranker-0.log").read_text()


def test_a_crash_loop_gives_up_with_a_clear_message(supervisor: Supervisor) -> None:
    sibling = supervisor.spawn("preprocess", SLEEPER, dict(os.environ))
    supervisor.spawn("retrieval", FAILING, dict(os.environ))
    _until(lambda: supervisor.failure is not None, "the crash loop detected")
    assert supervisor.restarts["retrieval"] == QUICK.max_restarts
    with pytest.raises(CrashLoop) as err:
        supervisor.check()
    message = str(err.value)
    assert "stage retrieval exited 4 times within 120 s (last exit code 3)" in message
    assert "cannot start: no model" in message  # the tail of the stage's log
    # Nothing is restarted once the supervisor gave up, and it never touched the healthy stage.
    time.sleep(0.3)
    assert supervisor.restarts["retrieval"] == QUICK.max_restarts
    assert sibling.poll() is None and "preprocess" not in supervisor.restarts


def test_backoff_doubles_while_a_child_keeps_failing(tmp_path: Path) -> None:
    policy = RestartPolicy(initial_backoff_s=0.1, max_backoff_s=0.3, max_restarts=10, window_s=120.0)
    sup = Supervisor(tmp_path / "logs", policy, poll_s=0.02, echo=None)
    try:
        sup.spawn("ingress-requests", FAILING, dict(os.environ))
        _until(lambda: sup.restarts["ingress-requests"] >= 4, "four restarts")
    finally:
        sup.stop(grace_s=5)
    delays = [
        line.split("restarting in ")[1].split(" s")[0]
        for line in (tmp_path / "logs" / "supervisor.log").read_text().splitlines()
        if "restarting in" in line
    ]
    assert delays[:4] == ["0.1", "0.2", "0.3", "0.3"]  # doubling, up to the ceiling


def test_a_released_child_is_not_restarted(supervisor: Supervisor) -> None:
    proc = supervisor.spawn("ranker-1", SLEEPER, dict(os.environ))
    supervisor.release("ranker-1", kill=True)
    assert proc.returncode == -signal.SIGKILL
    time.sleep(0.3)
    assert "ranker-1" not in supervisor.processes() and not supervisor.restarts


def test_stop_ends_every_child_and_restarts_nothing(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs", QUICK, poll_s=0.02, echo=None)
    procs = [sup.spawn(name, SLEEPER, dict(os.environ)) for name in ("a", "b", "c")]
    sup.stop(grace_s=5)
    assert all(p.returncode is not None for p in procs)
    time.sleep(0.2)
    assert not sup.processes() and not sup.restarts


def test_an_adopted_replacement_is_supervised_and_the_old_process_is_not(supervisor: Supervisor) -> None:
    old = supervisor.spawn("ranker-0", SLEEPER, dict(os.environ))
    standby = supervisor.start_standby("ranker-0", ["--standby"])
    assert standby.args[-1] == "--standby" and supervisor.processes()["ranker-0"] is old
    assert supervisor.adopt("ranker-0", standby) is old
    os.kill(old.pid, signal.SIGKILL)  # the old process's exit restarts nothing
    old.wait()
    time.sleep(0.2)
    assert supervisor.processes()["ranker-0"] is standby and not supervisor.restarts
    os.kill(standby.pid, signal.SIGKILL)  # the replacement's crash restarts the child's own command
    _until(lambda: supervisor.processes()["ranker-0"].pid != standby.pid, "ranker-0 restarted")
    assert supervisor.processes()["ranker-0"].args == SLEEPER
    assert supervisor.restarts == {"ranker-0": 1}
