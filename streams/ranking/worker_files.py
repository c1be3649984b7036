"""The files a ranking worker keeps in its folder, through which a replacement takes over from it.

A worker's folder (``deployment_dir(settings, "workers") / worker_id``) holds what outlives one
process: ``events.jsonl`` (the audit trail the reports read, shared by every process of the worker)
and the generations of its local state. A generation (``gen-<n>``: the history table, the prefix
store's disk tier, the lineage book) is opened by one process at a time (RocksDB locks it); a
replacement builds the next generation while the active process still serves from the current one.

Primitives:
- ``WorkerFiles(folder)``:
  - ``state_dir()``: the current generation (the folder itself for a worker that never rolled);
    ``new_generation()``: a fresh one for a standby; ``promote(gen)``: make it current;
    ``remove_stale_generations()``: delete every generation but the current one.
  - ``write_assignment(partitions)`` / ``read_assignment()`` / ``active_pid()``: the partitions
    the active process owns and its pid (``assignment.json``, rewritten at every assignment and
    revocation).
  - ``write_handover(offsets, pid, answered=False)`` / ``read_handover()`` /
    ``handover_answered()`` / ``clear_handover()``: the offsets (topic -> partition -> offset) from
    which a process that hands over leaves the records to its successor, and whether it has
    answered every request before them (``handover.json``).
  - ``write_standby(state, pid)`` / ``read_standby()``: how far a replacement is
    (``standby.json``: ``warming``, ``ready``, ``serving``, ``joined``).
  - ``write_spilled(standby_pid, report)`` / ``read_spilled(standby_pid)`` / ``clear_spilled()``:
    what the active process wrote to its disk tier for the standby ``standby_pid`` to adopt (the
    folder, None without a disk tier; the model version; prefixes and bytes; when:
    ``spilled.json``).
  - ``write_latency_samples(samples)`` / ``read_latency_samples()``: the full-ranking timings
    (history length, ms) a process that hands over measured while serving, so that its successor
    plans, and tells the trigger, with them rather than with the calibration alone
    (``latency_samples.json``).
- ``STANDBY_STATES``: those states, in order.

Every file is written to a temporary name and renamed: a reader sees the old content or the new.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

STANDBY_STATES = ("warming", "ready", "serving", "joined")
_LEGACY_STATE = ("history", "prefix-store", "lineage.json")  # state kept in the folder itself


class WorkerFiles:
    """The hand-over files and state generations of one ranking worker's folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    # ------------------------------------------------------------------ generations

    def state_dir(self) -> Path:
        """The current generation's folder."""
        current = self._read("current.json")
        if current is None:
            return self.folder
        return self.folder / str(current["generation"])

    def new_generation(self) -> Path:
        """A fresh, empty generation folder, numbered after every existing one."""
        numbers = [int(p.name[4:]) for p in self.folder.glob("gen-*") if p.name[4:].isdigit()]
        gen = self.folder / f"gen-{max(numbers, default=0) + 1}"
        gen.mkdir(parents=True)
        return gen

    def promote(self, generation: Path) -> None:
        """Make ``generation`` the one a (re)started worker opens."""
        self._write("current.json", {"generation": generation.name})

    def remove_stale_generations(self) -> list[Path]:
        """Delete every generation but the current one (their processes have exited)."""
        current = self.state_dir()
        stale = [p for p in self.folder.glob("gen-*") if p != current]
        if current != self.folder:
            stale += [self.folder / name for name in _LEGACY_STATE if (self.folder / name).exists()]
        for p in stale:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return stale

    # ------------------------------------------------------------------ hand-over

    def write_assignment(self, partitions: list[int]) -> None:
        self._write("assignment.json", {"partitions": sorted(set(partitions)), "pid": os.getpid()})

    def read_assignment(self) -> list[int] | None:
        data = self._read("assignment.json")
        return None if data is None else [int(p) for p in data["partitions"]]

    def active_pid(self) -> int | None:
        """The pid of the process that wrote the assignment (the active one), if known."""
        data = self._read("assignment.json")
        return None if data is None else int(data["pid"])

    def write_handover(self, offsets: dict[str, dict[int, int]], pid: int, *, answered: bool = False) -> None:
        self._write("handover.json", {"pid": pid, "offsets": offsets, "answered": answered})

    def handover_answered(self) -> bool:
        """Whether the process that handed over has answered every request before the offsets."""
        data = self._read("handover.json")
        return bool(data and data.get("answered"))

    def read_handover(self) -> tuple[dict[str, dict[int, int]], int] | None:
        """(topic -> partition -> first offset left to the successor, the pid that handed over),
        or None."""
        data = self._read("handover.json")
        if data is None:
            return None
        offsets = {t: {int(p): int(o) for p, o in parts.items()} for t, parts in data["offsets"].items()}
        return offsets, int(data["pid"])

    def write_spilled(self, standby_pid: int, report: dict[str, Any]) -> None:
        self._write(
            "spilled.json", {**report, "standby_pid": standby_pid, "pid": os.getpid(), "t": time.time()}
        )

    def read_spilled(self, standby_pid: int) -> dict[str, Any] | None:
        """What the active process spilled for the standby ``standby_pid`` (not for an earlier one)."""
        data = self._read("spilled.json")
        return data if data is not None and data.get("standby_pid") == standby_pid else None

    def clear_spilled(self) -> None:
        (self.folder / "spilled.json").unlink(missing_ok=True)

    def write_latency_samples(self, samples: list[tuple[int, float]]) -> None:
        self._write("latency_samples.json", {"samples": [[int(n), float(ms)] for n, ms in samples]})

    def read_latency_samples(self) -> list[tuple[int, float]]:
        data = self._read("latency_samples.json")
        return [] if data is None else [(int(n), float(ms)) for n, ms in data["samples"]]

    def clear_handover(self) -> None:
        (self.folder / "handover.json").unlink(missing_ok=True)

    def write_standby(self, state: str, pid: int) -> None:
        if state not in STANDBY_STATES:
            raise ValueError(f"unknown standby state {state!r} (one of {', '.join(STANDBY_STATES)})")
        self._write("standby.json", {"state": state, "pid": pid})

    def read_standby(self) -> tuple[str, int] | None:
        """(state, pid) of the replacement, or None."""
        data = self._read("standby.json")
        return None if data is None else (str(data["state"]), int(data["pid"]))

    def clear_standby(self) -> None:
        (self.folder / "standby.json").unlink(missing_ok=True)

    # ------------------------------------------------------------------ plumbing

    def _write(self, name: str, data: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.folder / name)

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.folder / name).read_text())
        except FileNotFoundError:
            return None
