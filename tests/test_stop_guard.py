"""How a stage ends when nothing else would end it (no broker): the stop deadline, and the stages
of a supervisor that died, even by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from relaygr.infra.stop_guard import (
    STOP_OVERDUE_EXIT,
    SUPERVISOR_PID_ENV,
    StopDeadline,
    process_alive,
    watch_supervisor_from_env,
)
from relaygr.streams.history import HistoryTable
from relaygr.workers.store.tiers import DiskTier


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)


def test_an_armed_deadline_ends_the_process_once_its_grace_is_over() -> None:
    codes: list[int] = []
    ended = threading.Event()
    deadline = StopDeadline(0.05, "stage t", exit_now=lambda code: (codes.append(code), ended.set()))
    assert not deadline.armed
    deadline.arm()
    deadline.arm()  # a second signal starts no second grace
    assert ended.wait(30)
    time.sleep(0.2)
    assert codes == [STOP_OVERDUE_EXIT]


def test_a_deadline_never_armed_ends_nothing() -> None:
    codes: list[int] = []
    StopDeadline(0.01, "stage t", exit_now=codes.append)
    time.sleep(0.1)
    assert codes == []
    with pytest.raises(ValueError, match="above 0"):
        StopDeadline(0, "stage t")


CHILD = textwrap.dedent(
    """
    import os, signal, time
    from relaygr.infra.stop_guard import watch_supervisor_from_env
    ended = []
    signal.signal(signal.SIGTERM, lambda *_: ended.append(1))  # a stage's stop: it then exits by itself
    assert watch_supervisor_from_env(lambda: os.kill(os.getpid(), signal.SIGTERM), poll_s=0.05)
    while not ended:
        time.sleep(0.05)
    """
)

SUPERVISING = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from relaygr.infra.supervisor import Supervisor
    sup = Supervisor(Path(sys.argv[1]), echo=None)
    print(sup.spawn("stage", [sys.executable, "-c", sys.argv[2]], dict(os.environ)).pid, flush=True)
    time.sleep(300)
    """
)


def test_the_stages_of_a_supervisor_killed_with_sigkill_stop_by_themselves(tmp_path: Path) -> None:
    sup = subprocess.Popen(
        [sys.executable, "-c", SUPERVISING, str(tmp_path / "logs"), CHILD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sup.stdout is not None
        child = int(sup.stdout.readline())
        time.sleep(0.5)
        assert process_alive(child)  # supervised: it runs
        sup.send_signal(signal.SIGKILL)  # no chance to stop its children
        sup.wait()
        _until(lambda: not process_alive(child), f"stage pid {child} stopped after its supervisor died")
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()


def test_only_a_supervisor_that_is_this_processs_parent_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.delenv(SUPERVISOR_PID_ENV, raising=False)
    assert watch_supervisor_from_env(lambda: calls.append(1)) is None  # started by hand: nothing to watch
    monkeypatch.setenv(SUPERVISOR_PID_ENV, "not-a-pid")
    assert watch_supervisor_from_env(lambda: calls.append(1)) is None
    monkeypatch.setenv(SUPERVISOR_PID_ENV, str(os.getpid()))  # alive, and not our parent: inherited
    assert watch_supervisor_from_env(lambda: calls.append(1)) is None
    monkeypatch.setenv(SUPERVISOR_PID_ENV, str(os.getppid()))
    assert watch_supervisor_from_env(lambda: calls.append(1), poll_s=0.01) is not None
    time.sleep(0.1)
    assert calls == []  # our parent is alive


OVERDUE_WRITER = textwrap.dedent(
    """
    import sys, time
    from relaygr.infra.stop_guard import StopDeadline
    from relaygr.schemas import BehaviorEvent
    from relaygr.streams.history import HistoryTable
    from relaygr.workers.store.tiers import DiskTier
    history = HistoryTable(sys.argv[1] + "/history")
    for offset in range(3):
        history.append(0, offset, BehaviorEvent(user_id="u", item_id=10 + offset, ts=float(offset), action=1))
    disk = DiskTier(sys.argv[1] + "/prefixes", 1 << 20)
    disk.write(("u", "m1"), b"kv" * 100, 3, b"fp")
    StopDeadline(0.05, "stage t").arm()  # a stop that never finishes: no close, no flush
    time.sleep(60)
    """
)


def test_state_written_before_an_overdue_stop_reopens_whole(tmp_path: Path) -> None:
    """A stage that exits at its stop deadline closes none of its RocksDB folders; the next
    process on that machine opens them (no stale lock) and finds every write they took."""
    done = subprocess.run([sys.executable, "-c", OVERDUE_WRITER, str(tmp_path)], timeout=120)
    assert done.returncode == STOP_OVERDUE_EXIT
    history = HistoryTable(tmp_path / "history")
    try:
        assert history.get("u").item_ids.tolist() == [10, 11, 12] and history.next_offset(0) == 3
    finally:
        history.close()
    disk = DiskTier(tmp_path / "prefixes", 1 << 20)
    try:
        blob, _ = disk.read(("u", "m1")) or (b"", 0)
        meta = disk.meta(("u", "m1"))
        assert (
            bytes(blob) == b"kv" * 100 and meta is not None and (meta.length, meta.fingerprint) == (3, b"fp")
        )
    finally:
        disk.close()
