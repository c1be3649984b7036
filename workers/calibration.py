"""Calibration: how long full ranking takes on this machine, as the ``LatencyModel`` others use.

Primitives:
- ``CALIBRATION_LENGTHS``: the history lengths timed by default.
- ``calibrate(model, lengths, candidates, repeats, threads)``: the median time of ``rank_full``
  per history length, and the latency model fitted to them.
- ``calibrate_and_save(model, out, ...)``: the same, written as a calibration file (JSON: the
  coefficients, the samples, the model version, device and thread count) that workers load
  through ``RELAYGR_CALIBRATION_FILE``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from relaygr.workers.devices import keep_host_pages
from relaygr.workers.latency_model import LatencyModel
from relaygr.workers.model import HSTURanker
from relaygr.workers.prefix_kv import Events

CALIBRATION_LENGTHS: tuple[int, ...] = (64, 256, 512, 1024, 2048)
"""History lengths timed by default: short to long enough to see the quadratic term."""


def calibrate(
    model: HSTURanker,
    lengths: tuple[int, ...] = CALIBRATION_LENGTHS,
    candidates: int = 128,
    repeats: int = 3,
    threads: int = 0,
) -> tuple[LatencyModel, list[tuple[int, float]]]:
    """Median time of ``rank_full`` per history length on this machine, and the fitted model.
    ``threads`` (0 = leave as is): the torch CPU threads to time with — the worker's own count."""
    keep_host_pages()  # time it the way a worker runs it
    if threads:
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return calibrate(model, lengths, candidates, repeats)
        finally:
            torch.set_num_threads(old)
    gen = torch.Generator().manual_seed(0)
    cands = torch.randint(1, model.config.num_items + 1, (candidates,), generator=gen)
    samples = []
    for n in lengths:
        hist = Events(
            torch.randint(1, model.config.num_items + 1, (n,), generator=gen),
            torch.randint(1, model.config.num_actions + 1, (n,), generator=gen),
            torch.arange(n, dtype=torch.float64) * 60.0,
        )
        model.rank_full(hist, cands, float(n) * 60.0)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.rank_full(hist, cands, float(n) * 60.0)
            times.append((time.perf_counter() - t0) * 1000)
        samples.append((n, statistics.median(times)))
    return LatencyModel.fit(samples), samples


def calibrate_and_save(
    model: HSTURanker,
    out: Path,
    *,
    lengths: tuple[int, ...] = CALIBRATION_LENGTHS,
    candidates: int = 128,
    repeats: int = 3,
    threads: int = 0,
) -> tuple[LatencyModel, list[tuple[int, float]]]:
    """``calibrate`` and write the result to ``out``; returns what ``calibrate`` returns."""
    lat, samples = calibrate(model, lengths, candidates, repeats, threads)
    lat.save(
        Path(out),
        samples=samples,
        model_version=model.model_version,
        device=str(model.device),
        threads=threads,
    )
    return lat, samples
