"""How much of the host's CPU the rest of the machine took during a measured phase.

On a shared virtual machine the hypervisor gives a guest's cores to its neighbours for a while
("steal" in ``/proc/stat``); a phase that lands on such a spell is slower whatever the pipeline
does. A benchmark that compares two phases reports each one's steal next to its figures so a
reader can tell the pipeline's ratio from the host's.

Primitives:
- ``read_cpu_times()``: the host's cumulative (busy, steal, total) ticks, or None off Linux.
- ``HostCpuSampler``: samples them every ``every_s`` while a phase runs; ``stop()`` gives the
  phase's busy and steal shares (%) and the largest steal share of any one-second window.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

PROC_STAT = Path("/proc/stat")


def read_cpu_times(path: Path = PROC_STAT) -> tuple[int, int, int] | None:
    """(busy, steal, total) ticks of all CPUs since boot; None where there is no ``/proc/stat``."""
    try:
        with path.open() as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already
    # counted in user and nice.
    ticks = [int(x) for x in first[1:9]] + [0] * max(0, 9 - len(first))
    idle, steal = ticks[3] + ticks[4], ticks[7]
    total = sum(ticks[:8])
    return total - idle - steal, steal, total


class HostCpuSampler:
    """The host's busy and steal shares over a phase, sampled every ``every_s``."""

    def __init__(self, every_s: float = 0.5, read=read_cpu_times) -> None:
        self.every_s, self._read = every_s, read
        self._samples: list[tuple[int, int, int]] = []
        self._task: asyncio.Task | None = None

    def start(self) -> HostCpuSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            s = self._read()
            if s is not None:
                self._samples.append(s)
            await asyncio.sleep(self.every_s)

    async def stop(self) -> dict[str, float | None]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        s = self._read()
        if s is not None:
            self._samples.append(s)
        return summarise(self._samples, window=max(1, round(1.0 / self.every_s)))


def summarise(samples: list[tuple[int, int, int]], window: int = 2) -> dict[str, float | None]:
    """Busy and steal shares (%) between the first and last sample, and the largest steal share
    over ``window`` consecutive sample intervals."""
    none: dict[str, float | None] = {"busy_pct": None, "steal_pct": None, "steal_pct_max_1s": None}
    if len(samples) < 2 or samples[-1][2] <= samples[0][2]:
        return none

    def share(a: tuple[int, int, int], b: tuple[int, int, int], i: int) -> float:
        return 100.0 * (b[i] - a[i]) / max(1, b[2] - a[2])

    w = min(window, len(samples) - 1)
    return {
        "busy_pct": round(share(samples[0], samples[-1], 0), 1),
        "steal_pct": round(share(samples[0], samples[-1], 1), 1),
        "steal_pct_max_1s": round(
            max(share(samples[i], samples[i + w], 1) for i in range(len(samples) - w)), 1
        ),
    }
