"""The links a prefix's bytes cross, measured on this machine, and every figure checked against them.

- ``host_to_device_link(device, nbytes)``: bytes per second of a large pinned copy to the device
  (on a CPU-only machine, a single-threaded memory copy); its median and best.
- ``disk_link(folder, nbytes)``: the cold sequential read of a large file in ``folder``, the better
  of ``O_DIRECT`` reads and buffered reads after its pages were dropped (``posix_fadvise``).
- ``measure_links(device, folder, nbytes)``: both, with the prefix store's tier costs as
  ``relaygr calibrate --tier-costs`` measures them.
- ``check_links(figures, links, tolerance)``: each figure's speed against its link's; one faster
  than the link was ever seen to go (beyond the tolerance) is an error line, not a result.
- ``timed(fn, device)`` and ``one_thread(fn)``: one device operation timed between two
  synchronisations; a memory-bound copy run on one thread.

``bench store`` (``store``) measures the tiers and judges its figures here.
"""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from relaygr.workers.model.devices import synchronize
from relaygr.workers.store.tier_costs import measure_tier_costs

LINK_CHUNK = 64 << 20  # one read request of the disk link measurement


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn()`` takes on ``device``, synchronised before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def one_thread(fn: Callable[[], float]) -> float:
    """A memory-bound copy on one thread: a busy machine's thread barriers do not dominate."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def host_to_device_link(device: torch.device, nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """Bytes per second of a large copy to ``device`` into a buffer allocated beforehand: from
    pinned memory on CUDA; on a CPU a single-threaded memory copy (the stand-in for a transfer).
    The median and the best of ``repeats``."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def measure() -> list[float]:
        dst.copy_(src, non_blocking=True)  # warm-up: first touch of the destination's pages
        return [timed(lambda: dst.copy_(src, non_blocking=True), device) for _ in range(repeats)]

    times = one_thread(measure) if device.type == "cpu" else measure()  # type: ignore[arg-type]
    return nbytes / statistics.median(times), nbytes / min(times)


def _read_file(path: str, buf: memoryview, direct: bool) -> float:
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0, done = time.perf_counter(), 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done : done + LINK_CHUNK]], done)
            if n == 0:
                break
            done += n
        return done / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def disk_link(folder: str, nbytes: int, repeats: int = 3) -> dict[str, float | None]:
    """Cold sequential read speed of a file of ``nbytes`` in ``folder``: ``O_DIRECT`` reads (None
    where the filesystem refuses them) and buffered reads after dropping its pages; ``bytes_per_s``
    is the better of the two medians, ``best_bytes_per_s`` the fastest read seen."""
    nbytes -= nbytes % mmap.PAGESIZE
    buf = memoryview(mmap.mmap(-1, nbytes))  # page-aligned, as O_DIRECT needs
    fd, path = tempfile.mkstemp(prefix="link-", dir=folder)
    try:
        block = os.urandom(1 << 20)
        for _ in range(nbytes >> 20):
            os.write(fd, block)
        os.fsync(fd)  # dirty pages cannot be dropped
        os.close(fd)
        buffered = [_read_file(path, buf, direct=False) for _ in range(repeats)]
        try:
            direct = [_read_file(path, buf, direct=True) for _ in range(repeats)]
        except OSError:
            direct = []
    finally:
        os.unlink(path)
    medians = [statistics.median(buffered), statistics.median(direct) if direct else 0.0]
    return {
        "direct_bytes_per_s": medians[1] or None,
        "buffered_cold_bytes_per_s": medians[0],
        "bytes_per_s": max(medians),
        "best_bytes_per_s": max(buffered + direct),
    }


def measure_links(device: torch.device, folder: str, nbytes: int) -> dict[str, Any]:
    """The links, and the store's tier costs as ``relaygr calibrate --tier-costs`` measures them."""
    return {
        "tier_costs": measure_tier_costs(folder, device, min(nbytes, 64 << 20)).to_dict(),
        **dict(
            zip(
                ("host_to_device_bytes_per_s", "host_to_device_best_bytes_per_s"),
                host_to_device_link(device, nbytes),
                strict=True,
            )
        ),
        "disk": disk_link(folder, nbytes),
        "bytes": nbytes,
    }


def check_links(
    figures: dict[str, tuple[int, float]], links: dict[str, tuple[float, float]], tolerance: float
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each figure ``name -> (bytes moved, median seconds)`` against its link ``links[name] =
    (median, best bytes per second)``: its speed, the fraction of the link's median, and whether
    it is accepted (at most ``1 + tolerance`` times the fastest the link was seen to go). Returns
    the checks and an error line per refused figure."""
    checks: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    for name, (nbytes, seconds) in figures.items():
        link, best = links[name]
        speed = nbytes / seconds if seconds > 0 else float("inf")
        accepted = speed <= best * (1 + tolerance)
        checks[name] = {
            "bytes_per_s": speed,
            "link_bytes_per_s": link,
            "link_best_bytes_per_s": best,
            "fraction_of_link": speed / link,
            "accepted": accepted,
        }
        if not accepted:
            errors.append(
                f"{name}: {nbytes / 1e6:.1f} MB in {seconds * 1e3:.3f} ms is {speed / 1e9:.2f} GB/s, faster "
                f"than its link ever went ({best / 1e9:.2f} GB/s): the timing ends before the transfer does"
            )
    return checks, errors
