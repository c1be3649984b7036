"""How a stage process ends when nothing else would end it.

A stage stops by draining what it holds and committing it. With the broker unreachable, those
steps wait on client retries without end; and a stage whose supervisor died (SIGKILL, the OOM
killer) would go on running unsupervised, beside the stages of the next deployment.

Primitives:
- ``StopDeadline(grace_s, label)``: ``arm()`` (from a stop signal's handler; the first call counts)
  starts the grace; a process still running when it ends says so on stderr and exits at once with
  ``STOP_OVERDUE_EXIT``. Nothing is lost by that: what the stage had not committed is delivered
  again to the partitions' next owner.
- ``watch_supervisor(pid, on_gone)``: a daemon thread that calls ``on_gone`` once this process's
  parent is no longer ``pid`` (the supervisor is gone and the process was re-parented).
  ``watch_supervisor_from_env(on_gone)`` takes the pid from ``SUPERVISOR_PID_ENV``, which
  ``Supervisor`` sets for its children (nothing is watched without it). The parent's pid is polled
  rather than asked of the kernel (``PR_SET_PDEATHSIG``) because that signal follows the thread
  that started the child, and the supervisor restarts children from a thread of its own.
- ``process_alive(pid)``: whether a process runs (a zombie counts as gone).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

SUPERVISOR_PID_ENV = "RELAYGR_SUPERVISOR_PID"
STOP_OVERDUE_EXIT = 75
"""Exit code of a stage that did not finish stopping within its grace (EX_TEMPFAIL)."""


class StopDeadline:
    """Ends the process ``grace_s`` after ``arm()`` if it has not ended by itself."""

    def __init__(self, grace_s: float, label: str, *, exit_now: Callable[[int], None] = os._exit) -> None:
        if grace_s <= 0:
            raise ValueError(f"stop grace {grace_s} s: must be above 0")
        self.grace_s = grace_s
        self.label = label
        self._exit_now = exit_now
        self._armed = threading.Event()

    @property
    def armed(self) -> bool:
        return self._armed.is_set()

    def arm(self) -> None:
        """Start the grace (once; later calls change nothing)."""
        if self._armed.is_set():
            return
        self._armed.set()
        threading.Thread(target=self._expire, name="stop-deadline", daemon=True).start()

    def _expire(self) -> None:
        time.sleep(self.grace_s)
        print(
            f"{self.label}: still stopping {self.grace_s:g} s after the stop signal (is the broker "
            f"reachable?): exiting now; what was not committed is delivered again to the next owner",
            file=sys.stderr,
            flush=True,
        )
        self._exit_now(STOP_OVERDUE_EXIT)


def watch_supervisor(pid: int, on_gone: Callable[[], None], *, poll_s: float = 0.5) -> threading.Thread:
    """Call ``on_gone`` (once, from a daemon thread) when this process's parent is no longer ``pid``."""

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(poll_s)
        on_gone()

    thread = threading.Thread(target=watch, name="supervisor-watch", daemon=True)
    thread.start()
    return thread


def watch_supervisor_from_env(on_gone: Callable[[], None], *, poll_s: float = 0.5) -> threading.Thread | None:
    """``watch_supervisor`` of the pid in ``SUPERVISOR_PID_ENV``; ``None`` (nothing watched) without it."""
    raw = os.environ.get(SUPERVISOR_PID_ENV, "")
    if not raw:
        return None
    try:
        pid = int(raw)
    except ValueError:
        print(
            f"{SUPERVISOR_PID_ENV}={raw!r} is not a process id: the supervisor is not watched",
            file=sys.stderr,
        )
        return None
    if os.getppid() != pid and process_alive(pid):  # inherited from elsewhere: that process is not our parent
        print(f"{SUPERVISOR_PID_ENV}={pid} is not this process's parent: it is not watched", file=sys.stderr)
        return None
    return watch_supervisor(pid, on_gone, poll_s=poll_s)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie of this process's own children counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True
