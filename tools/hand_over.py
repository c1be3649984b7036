"""The supervisor's side of a ranking worker's hand-over to its standby, after the standby is warm.

``Pipeline.roll_worker`` (``tools.pipeline``) starts the standby and waits until it is ready; then
``complete_hand_over`` tells the old process to hand over (SIGUSR1), waits until the standby serves
and has joined the group, and makes sure the old process, which nothing supervises any more, does
not outlive the call whatever fails. The standby says how far it got in its worker's files
(``streams.ranking.worker_files``); ``wait_standby`` reads them.

Primitives: ``complete_hand_over``, ``wait_standby``, ``RollAbandoned`` (a restart given up before
its hand-over: the deployment is stopping), ``HandOverFailed`` (it failed after the signal).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

from relaygr.infra.supervisor import end_process
from relaygr.streams.ranking.worker_files import STANDBY_STATES, WorkerFiles


class RollAbandoned(RuntimeError):
    """A rolling restart given up before its hand-over because the deployment is stopping."""


class HandOverFailed(RuntimeError):
    """A rolling restart that failed after the old process was told to hand over: the standby,
    already adopted, is the supervised process of the worker's id, and the old one has ended."""


def complete_hand_over(
    files: WorkerFiles,
    standby: subprocess.Popen,
    old: subprocess.Popen,
    *,
    name: str,
    timeout_s: float = 60.0,
    old_grace_s: float = 30.0,
) -> dict[str, float]:
    """Tell ``old`` to hand over to the adopted ``standby`` (SIGUSR1) and wait until the standby
    serves and has joined, each within ``timeout_s``, then until ``old`` has exited. Returns seconds
    from the signal: ``serving``, ``joined``, ``old_exit``. Whatever fails, ``old`` does not outlive
    this call: it was told to leave, and nothing supervises it any more (SIGTERM, then SIGKILL after
    ``old_grace_s``, above a stage's stop grace, under which the hand-over runs)."""
    took: dict[str, float] = {}
    t1 = time.monotonic()
    try:
        old.send_signal(signal.SIGUSR1)
        wait_standby(files, standby, "serving", timeout_s, old)
        took["serving"] = time.monotonic() - t1
        wait_standby(files, standby, "joined", timeout_s, old)
        took["joined"] = time.monotonic() - t1
    except (RuntimeError, TimeoutError) as e:
        end_process(old, grace_s=old_grace_s)  # first, so that the message names how it ended
        raise HandOverFailed(
            f"{name}: {e}; pid {standby.pid} is {name} now (restarted as a plain worker if it exits), "
            f"the old pid {old.pid} was told to hand over and has exited (code {old.returncode})"
        ) from e
    finally:  # whatever happened; after a hand-over it exits on its own (ending it then only waits)
        end_process(old, grace_s=old_grace_s)
    took["old_exit"] = time.monotonic() - t1
    return took


def wait_standby(
    files: WorkerFiles,
    proc: subprocess.Popen,
    state: str,
    timeout_s: float,
    old: subprocess.Popen | None = None,
    *,
    abandon: Callable[[], bool] | None = None,
) -> None:
    """Wait until the standby ``proc`` says it reached ``state`` (or a later one); meanwhile reap
    ``old`` once it exits (a process that crashed instead of handing over is seen gone). Raises
    ``RollAbandoned`` as soon as ``abandon()`` is true."""
    deadline = time.monotonic() + timeout_s
    want = STANDBY_STATES.index(state)
    while time.monotonic() < deadline:
        if abandon is not None and abandon():
            raise RollAbandoned(f"the standby (pid {proc.pid}) was given up before {state}: stopping")
        if old is not None:
            old.poll()
        seen = files.read_standby()
        if seen is not None and seen[1] == proc.pid and STANDBY_STATES.index(seen[0]) >= want:
            return
        if proc.poll() is not None:
            raise RuntimeError(
                f"the standby (pid {proc.pid}) exited with code {proc.returncode} before {state}"
            )
        time.sleep(0.02)
    raise TimeoutError(f"the standby (pid {proc.pid}) was not {state} within {timeout_s:.0f} s")
