"""How much of the host's CPU the rest of the machine took while a benchmark measured.

On a shared virtual machine the hypervisor gives a guest's cores to its neighbours for a while
("steal" in ``/proc/stat``); a block of measurement that lands on such a spell is slower whatever
the pipeline does. A benchmark that compares two conditions reports each one's steal next to its
figures so a reader can tell the pipeline's ratio from the host's.

Primitives:
- ``read_cpu_times()``: the host's cumulative (busy, steal, total) ticks, or None off Linux.
- ``HostCpuSampler``: samples them every ``every_s``; ``switch(label)`` starts a block of the
  condition ``label``; ``stop()`` gives, per label over all its blocks, the busy and steal shares
  (%) and the largest steal share of any one-second window.
- ``summarise(blocks)``: those figures from the samples of one condition's blocks.
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
    """The host's busy and steal shares per condition, sampled every ``every_s``; blocks of
    several conditions may alternate (``switch``)."""

    def __init__(self, every_s: float = 0.5, read=read_cpu_times, label: str = "all") -> None:
        self.every_s, self._read = every_s, read
        self._blocks: list[tuple[str, list[tuple[int, int, int]]]] = [(label, [])]
        self._task: asyncio.Task | None = None

    def start(self) -> HostCpuSampler:
        self._sample()
        self._task = asyncio.create_task(self._run())
        return self

    def _sample(self) -> None:
        s = self._read()
        if s is not None:
            self._blocks[-1][1].append(s)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self._sample()

    def switch(self, label: str) -> None:
        """End the current block at this moment and start one of condition ``label``."""
        self._sample()
        self._blocks.append((label, []))
        self._sample()

    async def stop(self) -> dict[str, dict[str, float | None]]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sample()
        window = max(1, round(1.0 / self.every_s))
        labels = dict.fromkeys(label for label, _ in self._blocks)
        return {
            label: summarise([b for lb, b in self._blocks if lb == label], window=window) for label in labels
        }


def summarise(blocks: list[list[tuple[int, int, int]]], window: int = 2) -> dict[str, float | None]:
    """Busy and steal shares (%) over the blocks' sampled spans together, and the largest steal
    share over ``window`` consecutive sample intervals within any one block."""
    none: dict[str, float | None] = {"busy_pct": None, "steal_pct": None, "steal_pct_max_1s": None}
    blocks = [b for b in blocks if len(b) >= 2 and b[-1][2] > b[0][2]]
    if not blocks:
        return none

    def delta(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
        return b[0] - a[0], b[1] - a[1], b[2] - a[2]

    spans = [delta(b[0], b[-1]) for b in blocks]
    total = max(1, sum(d[2] for d in spans))
    windows = [
        delta(b[i], b[i + min(window, len(b) - 1)])
        for b in blocks
        for i in range(len(b) - min(window, len(b) - 1))
    ]
    return {
        "busy_pct": round(100.0 * sum(d[0] for d in spans) / total, 1),
        "steal_pct": round(100.0 * sum(d[1] for d in spans) / total, 1),
        "steal_pct_max_1s": round(max(100.0 * d[1] / max(1, d[2]) for d in windows), 1),
    }
