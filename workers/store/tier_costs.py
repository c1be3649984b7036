"""What bringing a prefix back from each tier costs, against recomputing it: the expander's choice.

Primitives:
- ``TierCosts``: each cold tier's promotion speed (bytes per second, the whole path: for disk the
  read, checksum, decoding and copy to the device; for host the copy to the device) and fixed
  cost per promotion (ms), and where the figures come from (``measured`` or ``default``).
  - ``promote_ms(tier, nbytes)``; ``to_dict()`` / ``from_dict(d)``;
  - ``from_calibration(path) -> TierCosts | None``: the ``tier_costs`` a calibration file holds.
- ``DEFAULT_TIER_COSTS``: figures for a machine that was not calibrated (a quick measurement on
  a 2-core CPU machine with a virtio disk: a memory copy at about 2 GB/s, a cold disk promotion
  at about 0.8 GB/s; docs/store.md).
- ``measure_tier_costs(folder, device, nbytes=64 MiB, repeats=3) -> TierCosts``: this machine's
  figures: a large buffer copied to ``device`` (pinned on CUDA), and a blob file of ``nbytes`` in
  ``folder`` read cold (its pages dropped first) the way the disk tier reads it (staging buffer,
  checksum and copy to the device included).
- ``TierChoice(costs, recompute_ms)``: ``worth(tier, nbytes, length, from_length=0)`` is True when
  promoting ``nbytes`` from ``tier`` is predicted faster than computing the prefix's ``length``
  events from a valid ``from_length``-event prefix (``recompute_ms(length) -
  recompute_ms(from_length)``); the placement asks it before serving from or writing to a tier.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from relaygr.workers.store.blob_files import BlobFiles, RecyclingBuffers
from relaygr.workers.store.kv_codec import crc32
from relaygr.workers.store.staging import staging_for

COLD_TIERS = ("host", "disk")


@dataclass(frozen=True)
class TierCosts:
    host_bytes_per_s: float
    disk_bytes_per_s: float
    host_fixed_ms: float = 0.05
    disk_fixed_ms: float = 0.5
    source: str = "default"

    def __post_init__(self) -> None:
        if self.host_bytes_per_s <= 0 or self.disk_bytes_per_s <= 0:
            raise ValueError(f"tier costs need positive speeds, got {self}")
        if self.host_fixed_ms < 0 or self.disk_fixed_ms < 0:
            raise ValueError(f"tier costs need fixed costs >= 0, got {self}")

    def promote_ms(self, tier: str, nbytes: int) -> float:
        if tier == "host":
            return self.host_fixed_ms + 1e3 * nbytes / self.host_bytes_per_s
        if tier == "disk":
            return self.disk_fixed_ms + 1e3 * nbytes / self.disk_bytes_per_s
        raise ValueError(f"no promotion cost for tier {tier!r} (one of {', '.join(COLD_TIERS)})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TierCosts:
        try:
            return cls(
                **{k: d[k] for k in ("host_bytes_per_s", "disk_bytes_per_s")},
                **{k: d[k] for k in ("host_fixed_ms", "disk_fixed_ms", "source") if k in d},
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"tier costs need host_bytes_per_s and disk_bytes_per_s ({e})") from None

    @classmethod
    def from_calibration(cls, path: str | os.PathLike[str]) -> TierCosts | None:
        """The ``tier_costs`` of a calibration file; None when it has none (an older file)."""
        data = json.loads(Path(path).read_text())
        costs = data.get("tier_costs") if isinstance(data, dict) else None
        return None if costs is None else cls.from_dict(costs)


DEFAULT_TIER_COSTS = TierCosts(host_bytes_per_s=2e9, disk_bytes_per_s=0.8e9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_speed(device: torch.device, nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.fill_(1)
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        _sync(device)
        t0 = time.perf_counter()
        src.to(device, copy=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:])


def _disk_speed(folder: str, device: torch.device, nbytes: int, repeats: int) -> float:
    """A cold read as the store's disk reader does it: into the pinned staging buffer and on to
    the device on CUDA, else into a recycled buffer (its pages touched by an untimed first read)."""
    staging = staging_for(device)
    alloc = staging.alloc if staging is not None else RecyclingBuffers(keep=1).alloc
    with tempfile.TemporaryDirectory(prefix="tier-costs-", dir=folder) as tmp:
        files = BlobFiles(tmp)
        try:
            body = os.urandom(nbytes - 4)
            files.write(1, body + crc32(body).to_bytes(4, "little"))
            times = []
            for i in range(repeats + 1):
                files.drop_cached(1)
                _sync(device)
                t0 = time.perf_counter()
                got = files.read(1, nbytes, alloc)
                assert got is not None
                if device.type != "cpu":  # on a CPU the read buffer becomes the prefix
                    torch.frombuffer(got.blob, dtype=torch.uint8).to(device, non_blocking=True)
                _sync(device)
                if i:  # the first one touches the buffer's pages
                    times.append(time.perf_counter() - t0)
                del got
        finally:
            files.close()
    return nbytes / statistics.median(times)


def measure_tier_costs(
    folder: str | os.PathLike[str], device: torch.device | str, nbytes: int = 64 << 20, repeats: int = 3
) -> TierCosts:
    """This machine's promotion speeds (see the module docstring). ``folder``: where the disk
    tier lives (its filesystem is what is measured)."""
    if nbytes < 4096 or repeats < 1:
        raise ValueError("measure_tier_costs needs nbytes >= 4096 and repeats >= 1")
    dev = torch.device(device)
    host = _host_speed(dev, nbytes, repeats)
    disk = _disk_speed(os.fspath(folder), dev, nbytes, repeats)
    return TierCosts(host_bytes_per_s=host, disk_bytes_per_s=disk, source="measured")


@dataclass(frozen=True)
class TierChoice:
    costs: TierCosts
    recompute_ms: Callable[[int], float]

    def worth(self, tier: str, nbytes: int, length: int, from_length: int = 0) -> bool:
        """Promoting is predicted faster than recomputing (see the module docstring)."""
        recompute = self.recompute_ms(length) - (self.recompute_ms(from_length) if from_length else 0.0)
        return self.costs.promote_ms(tier, nbytes) < recompute
