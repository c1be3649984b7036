"""Calibration: how long full ranking takes on this machine, as the ``LatencyModel`` others use.

Primitives:
- ``CALIBRATION_LENGTHS``: the history lengths timed by default.
- ``calibrate(runner, lengths, candidates, repeats, threads)``: the median time of ``rank_full``
  per history length, and the latency model fitted to them.
- ``measure_paces(runner, latency, slice_ms=..., chunk=...)``: how much slower than the latency
  model's marginal times a sliced pre-inference and a relay ranking run (``prefill_pace``,
  ``relay_pace``; what ``relaygr plan`` multiplies its device time by).
- ``calibrate_and_save(runner, out, ..., paces=None, tier_costs_dir=None)``: the same, written as
  a calibration file (JSON: the coefficients, the samples, the model version, device and thread
  count, the paces when asked for, and with ``tier_costs_dir`` the prefix store's promotion
  speeds measured there: ``tier_costs``, from ``workers.store.tier_costs.measure_tier_costs``)
  that workers load through ``RELAYGR_CALIBRATION_FILE``.
- ``warm_up_work(runner, history_len, num_candidates, rounds, chunk)``: the one-off work a fresh
  process runs before serving (``RankingEngine.warm_up``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.model.devices import keep_host_pages
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events

CALIBRATION_LENGTHS: tuple[int, ...] = (64, 256, 512, 1024, 2048)
"""History lengths timed by default: short to long enough to see the quadratic term."""

PACE_LENGTHS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
"""Cached lengths at which ``measure_paces`` times sliced pre-inference and relay ranking."""


def _synthetic(runner: ModelRunner, n: int, gen: torch.Generator) -> Events:
    return Events(
        torch.randint(1, runner.config.num_items + 1, (n,), generator=gen),
        torch.randint(1, runner.config.num_actions + 1, (n,), generator=gen),
        torch.arange(n, dtype=torch.float64) * 60.0,
    )


def calibrate(
    runner: ModelRunner,
    lengths: tuple[int, ...] = CALIBRATION_LENGTHS,
    candidates: int = 128,
    repeats: int = 3,
    threads: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[LatencyModel, list[tuple[int, float]]]:
    """Median time of ``rank_full`` per history length on this machine, and the fitted model.
    ``threads`` (0 = leave as is): the torch CPU threads to time with — the worker's own count.
    ``clock``: wall time by default; ``time.thread_time`` times the CPU work of one thread alone
    (what a CPU device computes, whatever else shares the machine)."""
    keep_host_pages()  # time it the way a worker runs it
    if threads:
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return calibrate(runner, lengths, candidates, repeats, clock=clock)
        finally:
            torch.set_num_threads(old)
    gen = torch.Generator().manual_seed(0)
    cands = torch.randint(1, runner.config.num_items + 1, (candidates,), generator=gen)
    samples = []
    for n in lengths:
        hist = _synthetic(runner, n, gen)
        runner.rank_full(hist, cands, float(n) * 60.0)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = clock()
            runner.rank_full(hist, cands, float(n) * 60.0)
            times.append((clock() - t0) * 1000)
        samples.append((n, statistics.median(times)))
    return LatencyModel.fit(samples), samples


def measure_paces(
    runner: ModelRunner,
    latency: LatencyModel,
    *,
    slice_ms: float,
    chunk: int,
    suffix: int = 64,
    candidates: int = 128,
    lengths: tuple[int, ...] = PACE_LENGTHS,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[list[float]]]:
    """Per cached length n, how much slower than ``latency`` predicts the two kinds of relay work
    run, as a worker runs them: ``prefill_pace``, a pre-inference sliced as the engine slices it
    (``pacing.Slicer``: chunks of ``slice_ms`` predicted device time at the measured pace, at most
    ``chunk`` events; a chunk late in a long history is skinny against many keys), against
    ``predict(n) - predict(0)``; ``relay_pace``, ranking ``suffix`` events and ``candidates``
    against a cached prefix of n events, against ``predict(n + suffix + C) - predict(n)``.
    Each as ``[[n, pace], ...]``."""
    from relaygr.workers.engine.latency_model import DevicePace
    from relaygr.workers.engine.pacing import Slicer

    gen = torch.Generator().manual_seed(1)
    cands = torch.randint(1, runner.config.num_items + 1, (candidates,), generator=gen)
    out: dict[str, list[list[float]]] = {"prefill_pace": [], "relay_pace": []}
    pace = DevicePace()  # carried from length to length, as a worker's is
    for n in lengths:
        hist = _synthetic(runner, n + suffix, gen)
        head = hist.slice(0, n)
        ts = float(hist.timestamps[-1]) + 60.0
        prefix = runner.prefill(head)  # warm-up, and the prefix the relay ranking reads
        slicer = Slicer(latency, pace, slice_ms, chunk) if slice_ms else None
        steps = runner.prefill_steps(head, slicer or chunk)
        t0 = clock()
        for _ in slicer.measured(steps) if slicer is not None else steps:
            pass
        spent = (clock() - t0) * 1000
        out["prefill_pace"].append([n, spent / (latency.predict_ms(n) - latency.predict_ms(0))])
        runner.rank(prefix, hist.slice(n), cands, ts)  # warm-up
        t0 = clock()
        runner.rank(prefix, hist.slice(n), cands, ts)
        spent = (clock() - t0) * 1000
        out["relay_pace"].append(
            [n, spent / (latency.predict_ms(n + suffix + candidates) - latency.predict_ms(n))]
        )
    return out


def calibrate_and_save(
    runner: ModelRunner,
    out: Path,
    *,
    lengths: tuple[int, ...] = CALIBRATION_LENGTHS,
    candidates: int = 128,
    repeats: int = 3,
    threads: int = 0,
    paces: dict[str, Any] | None = None,
    tier_costs_dir: Path | None = None,
) -> tuple[LatencyModel, list[tuple[int, float]]]:
    """``calibrate`` and write the result to ``out`` (with ``paces`` when given: ``paces(...)``
    of ``measure_paces``' keyword arguments; with ``tier_costs_dir``, the tier costs measured
    in that folder, the disk tier's filesystem, on the model's device); returns what
    ``calibrate`` returns."""
    lat, samples = calibrate(runner, lengths, candidates, repeats, threads)
    extra: dict[str, object] = {}
    if paces is not None:
        old = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            extra = dict(measure_paces(runner, lat, candidates=candidates, **paces))
        finally:
            torch.set_num_threads(old)
    if tier_costs_dir is not None:
        from relaygr.workers.store.tier_costs import measure_tier_costs

        Path(tier_costs_dir).mkdir(parents=True, exist_ok=True)
        extra["tier_costs"] = measure_tier_costs(tier_costs_dir, runner.device).to_dict()
    lat.save(
        Path(out),
        samples=samples,
        model_version=runner.model_version,
        device=str(runner.device),
        threads=threads,
        **extra,
    )
    return lat, samples


def warm_up_work(
    runner: ModelRunner, history_len: int, num_candidates: int, rounds: int, chunk: int
) -> Callable[[], None]:
    """A full ranking, a pre-inference (in ``chunk``-token chunks) and a relay ranking of a
    synthetic user, ``rounds`` times: what ``RankingEngine.warm_up`` runs on the device thread.
    With bucketed relay rankings on, every bucket is built (captured on CUDA) first."""
    cfg = runner.config
    n = max(2, min(history_len, cfg.max_seq_len))
    g = torch.Generator().manual_seed(0)
    hist = Events(
        torch.randint(1, cfg.num_items + 1, (n,), generator=g),
        torch.randint(1, cfg.num_actions + 1, (n,), generator=g),
        torch.arange(n, dtype=torch.float64) * 60.0 + 1e9,
    )
    cands = torch.randint(1, cfg.num_items + 1, (max(1, num_candidates),), generator=g)
    request_ts = float(hist.timestamps[-1]) + 60.0
    split = max(1, n - 64)

    def work() -> None:
        if runner.graph_relay is not None:
            runner.graph_relay.warm_up()
        for _ in range(rounds):
            runner.rank(None, hist, cands, request_ts)
            prefix = runner.prefill(hist.slice(0, split), chunk)
            runner.rank(prefix, hist.slice(split), cands, request_ts)

    return work
