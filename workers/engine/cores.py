"""An emulated accelerator on a CPU machine: each ranking worker's device thread gets a core of
its own, and every other process of the deployment stays off those cores.

On a CPU-only machine the "device" of a ranking worker is whatever CPU time its device thread
gets; shared with the stages, the broker and the load generator, its compute time measures the
machine. Pinning makes the device the worker's: one core per ranking worker (the highest ones),
the rest for everything else. On a machine with an accelerator the device is the accelerator
and none of this applies.

Primitives:
- ``CoreLayout``: the device cores (one per ranking worker), the shared cores, whether it pins,
  and ``describe()`` (the protocol's words).
- ``plan_cores(workers, available, pin=True, stages=())``: the layout for ``workers`` ranking
  workers on the cores this process may use (with ``stages``, a core of its own for each of those
  stage processes too, ``PIPELINE_STAGES`` being the local pipeline's, where the machine has them); unless ``MIN_SHARED_CORES`` are left for everything else it does not
  pin (and says so), and then the stage processes other than the ranking workers run at ``STAGE_NICE``: the
  shared CPU goes to ranking first, as a device of its own would.
- ``nice_tasks(pid, level)`` and ``may_renice_to(level)``: every thread of ``pid`` at a nice
  level, and whether this process may go back down to one (a standby warms up at a lower priority
  than the workers serving beside it).
- ``pin_tasks(pid, cores)``: every thread of process ``pid`` onto ``cores`` (a process's threads
  each carry their own mask; new threads inherit their creator's).
- ``pin_this_thread(core)``: the calling thread onto one core (the device thread).
- ``parse_cores("0,2-3")``: a core list as written in ``RELAYGR_CPU_CORES``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreLayout:
    device: tuple[int, ...]  # ranking worker i's device thread: device[i]
    shared: tuple[int, ...]  # every other thread and process
    pinned: bool
    note: str = ""
    stage_nice: int = 0  # not pinned: nice level of the non-ranking stages
    stages: tuple[tuple[str, int], ...] = ()  # (stage process, its own core), where it has one

    def device_core(self, worker: int) -> int | None:
        return self.device[worker % len(self.device)] if self.pinned and self.device else None

    def cores_of(self, stage: str) -> tuple[int, ...]:
        """Where stage process ``stage``'s threads run (a ranking worker's device thread aside)."""
        own = dict(self.stages).get(stage)
        return (own,) if own is not None else self.shared

    def stage_core_set(self) -> set[int]:
        return {core for _, core in self.stages}

    def describe(self) -> str:
        if not self.pinned:
            text = f"not pinned: {self.note}" if self.note else "not pinned"
            if self.stage_nice:
                text += (
                    f"; ingress, retrieval and pre-processing at nice {self.stage_nice}, so the "
                    "ranking workers get the shared cores first"
                )
            return text
        dev = ", ".join(f"ranker-{i}: core {c}" for i, c in enumerate(self.device))
        own = ", ".join(f"{name}: core {c}" for name, c in self.stages)
        rest = "every other thread and process" + (
            " (broker, load generator)" if own else " (stages, broker, load generator)"
        )
        return (
            f"device thread of each ranking worker on a core of its own ({dev}); "
            + (f"each stage process on a core of its own ({own}); " if own else "")
            + f"{rest} on core(s) {format_cores(self.shared)}"
            + (f"; {self.note}" if self.note else "")
        )


PIPELINE_STAGES = ("ingress-requests", "ingress-behaviors", "retrieval", "preprocess")
"""The stage processes of a local pipeline besides the ranking workers (``tools.pipeline.Pipeline``)."""

MIN_SHARED_CORES = 2
"""Cores that must stay for the stages, the broker and the load generator before a device thread
gets one of its own. With one, they starve: on 2 cores, pinning raised `bench pipeline`'s hop P99
from 33 ms to 3.2 s, more than any device time it saved."""


STAGE_NICE = 10
"""Nice level of the ingress, retrieval and pre-processing processes when the ranking workers share
their cores: at 10 a thread weighs 110 against ranking's 1024 in Linux's fair scheduler, so a
ranking that wants a contended core gets about 90 % of it instead of an equal share. The broker
stays at 0: every rank request crosses it."""


def available_cores() -> set[int]:
    return set(os.sched_getaffinity(0))


def plan_cores(
    workers: int,
    available: set[int] | None = None,
    *,
    pin: bool = True,
    stage_nice: int = STAGE_NICE,
    stages: tuple[str, ...] = (),
) -> CoreLayout:
    """One device core per ranking worker (the highest), the others shared; no pinning unless
    ``pin`` and ``MIN_SHARED_CORES`` remain shared (``workers + 2`` cores or more). Unpinned, the
    other processes run at ``stage_nice`` (0: as the ranking workers). With ``stages`` (names of
    stage processes; a ranking worker's is ``ranker-<i>``), each also gets a core of its own (the
    next highest) where ``MIN_SHARED_CORES`` still remain; otherwise they share (and the note says
    why)."""
    cores = sorted(available_cores() if available is None else available)
    if workers < 1:
        return CoreLayout((), tuple(cores), False, "no ranking worker")
    if not pin:
        return CoreLayout((), tuple(cores), False, "", stage_nice)
    if len(cores) < workers + MIN_SHARED_CORES:
        return CoreLayout(
            (),
            tuple(cores),
            False,
            f"{len(cores)} core(s) for {workers} ranking worker(s): a device core each and "
            f"{MIN_SHARED_CORES} for the rest needs {workers + MIN_SHARED_CORES}, so every thread "
            "shares every core",
            stage_nice,
        )
    device, rest = tuple(cores[-workers:][::-1]), cores[:-workers]
    if not stages:
        return CoreLayout(device, tuple(rest), True)
    if len(rest) < len(stages) + MIN_SHARED_CORES:
        note = (
            f"no core of its own for each of {len(stages)} stage processes: that needs "
            f"{workers + len(stages) + MIN_SHARED_CORES} cores, {len(cores)} here"
        )
        return CoreLayout(device, tuple(rest), True, note)
    own = tuple(zip(stages, rest[::-1], strict=False))
    return CoreLayout(device, tuple(rest[: len(rest) - len(stages)]), True, stages=own)


def _each_thread(pid: int, action: Callable[[int], None]) -> int:
    """``action(tid)`` for every thread of ``pid``; returns for how many it worked (threads that
    end meanwhile, or that may not be changed, are skipped)."""
    n = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = [str(pid)]
    for tid in tids:
        try:
            action(int(tid))
            n += 1
        except OSError:
            continue
    return n


def pin_tasks(pid: int, cores: tuple[int, ...] | set[int]) -> int:
    """Every thread of ``pid`` onto ``cores``; returns how many were pinned."""
    return _each_thread(pid, lambda tid: os.sched_setaffinity(tid, set(cores)))


def nice_tasks(pid: int, level: int) -> int:
    """Every thread of ``pid`` at nice ``level`` (on Linux a nice level is a thread's); returns
    how many were set."""
    return _each_thread(pid, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, level))


def may_renice_to(level: int) -> bool:
    """Whether this process may set a thread's nice level back down to ``level`` (root, or
    RLIMIT_NICE allows it)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or 20 - soft <= level


def pin_this_thread(core: int) -> None:
    os.sched_setaffinity(threading.get_native_id(), {core})


def parse_cores(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return tuple(sorted(set(out)))


def format_cores(cores: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))
