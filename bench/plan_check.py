"""``relaygr plan`` against a measured run: predicted and measured bytes and device time, side by side.

At small scale, on the trained model (``--model``; trained first if missing) and a latency model
calibrated at the start of the run (single-threaded, as a worker's device thread runs): ``--users``
MovieLens-100K users, each history lengthened to one of the lengths ``relaygr plan`` assumes for
``--history-p50`` / ``--history-p99`` (equally spaced quantiles of the log-normal, capped at
``max_seq_len``), one request each through a real ``RankingEngine`` (device scheduler, prefix store)
in the way the pipeline drives it: the trigger's decision, then for an admitted user a
pre-inference and a relay ranking, else a full ranking. Every request is a miss (first visit).

Measured: the device time the scheduler reports per priority (pre-inference, ranking): with
``--clock cpu`` (the default) the device thread's CPU time (``cpu_s``) against a calibration timed
the same way, so that other processes on a shared machine inflate neither; with ``--clock wall``
wall time (``busy_s``) against a wall-clock calibration. The ratio of the two is reported too.
and the bytes the prefix store reports per cached user (device tier after the run; host and disk
tiers per cold format from stores holding the same prefixes). Predicted: ``capacity_plan`` on the
same lengths at hit rate 0. Each figure with its ratio (measured / predicted) and whether it is
within ``--tolerance`` (20 %). One JSON line with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relaygr.tools.args import float_above, int_at_least

CANDIDATES = 128  # as the calibration times full ranking


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: RELAYGR_MODEL_DIR)")
    parser.add_argument("--users", type=int_at_least(4), default=48, help="users, one request each")
    parser.add_argument(
        "--history-p50",
        type=int_at_least(1),
        help="median history events (default: 1.5 x the shortest at-risk history of the calibration)",
    )
    parser.add_argument(
        "--history-p99", type=int_at_least(1), help="99th percentile events (default: 4 x the median)"
    )
    parser.add_argument(
        "--qps", type=float_above(0), default=10.0, help="load the per-second figures are for"
    )
    parser.add_argument("--tolerance", type=float_above(0), default=0.2)
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="device time as the device thread's CPU time (default: on a CPU device, the work "
        "itself, whatever else shares the machine) or as wall time (an accelerator's, or a quiet machine)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON line")


async def _measure(model: Any, latency: Any, histories: list[tuple[int, Any]], root: str) -> dict[str, Any]:
    """One request per user through the engine; device busy time and the store's bytes."""
    from relaygr.streams.config import PipelineSettings, engine_config, trigger_config
    from relaygr.streams.trigger import SequenceAwareTrigger
    from relaygr.workers.engine.ranker import RankingEngine, kv_bytes_per_token
    from relaygr.workers.engine.scheduler import DeviceScheduler, Priority
    from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

    settings = PipelineSettings()
    total = sum(len(h) for _, h in histories) * kv_bytes_per_token(model)
    store = PrefixStore(
        PrefixStoreConfig(device=str(model.device), device_budget_bytes=2 * total, host_budget_bytes=0),
        model.model_version,
    )
    scheduler = DeviceScheduler("plan-check", on_start=lambda: torch.set_num_threads(1))
    engine = RankingEngine(model, store, scheduler, engine_config(settings), latency)
    tcfg = trigger_config(settings, kv_bytes_per_token(model), model.config.max_seq_len)
    trigger = SequenceAwareTrigger(
        tcfg.model_copy(
            update={
                "footprint_bound_bytes": 4 * total,
                "prefill_rate_per_s": 1e9,
                "prefill_burst": 1e9,
                "backlog_bound_ms": 1e12,
            }
        ),
        latency,
    )
    await engine.warm_up()
    busy0, cpu0 = dict(scheduler.busy_s), dict(scheduler.cpu_s)
    gen = torch.Generator().manual_seed(0)
    admitted = 0
    for u, history in histories:
        cands = torch.randperm(model.config.num_items, generator=gen)[:CANDIDATES] + 1
        ts = float(history.timestamps[-1]) + 60.0
        decision = trigger.decide(0, len(history), time.monotonic())
        if decision.admitted:
            admitted += 1
            await engine.prefill(str(u), history, prefix_len=decision.prefix_len)
            await engine.drain()  # the upstream window: what pre-inference extends lands first
        await engine.rank(str(u), history, cands, ts, time.time() + 600.0)
    await engine.drain()
    busy = {p: scheduler.busy_s[p] - busy0[p] for p in (Priority.PREFILL, Priority.RANK)}
    cpu = {p: scheduler.cpu_s[p] - cpu0[p] for p in (Priority.PREFILL, Priority.RANK)}
    metrics = store.metrics()
    prefixes = []
    for u, history in histories:
        found = await store.lookup(str(u), history)
        if found.prefix is not None:
            prefixes.append((str(u), history.slice(0, found.prefix.length), found.prefix))
    engine.close()

    from relaygr.bench.cold_tiers import store_tier_figures

    if not prefixes:
        raise SystemExit(
            "relaygr bench plan: the trigger admitted none of the users at these history lengths, so "
            "nothing was cached to measure: raise --history-p50 (see the calibration's at-risk length)"
        )
    tiers = await store_tier_figures(model, prefixes, root, 1)
    n = len(histories)
    return {
        "admitted": admitted,
        "wall": {
            "preinfer_ms_per_request": busy[Priority.PREFILL] * 1e3 / n,
            "rank_ms_per_request": busy[Priority.RANK] * 1e3 / n,
        },
        "cpu": {
            "preinfer_ms_per_request": cpu[Priority.PREFILL] * 1e3 / n,
            "rank_ms_per_request": cpu[Priority.RANK] * 1e3 / n,
        },
        "device_bytes_per_user": metrics["bytes_device"] / max(1, metrics["entries_device"]),
        "tiers": tiers,
    }


def _side_by_side(predicted: float, measured: float, tolerance: float) -> dict[str, Any]:
    ratio = measured / predicted if predicted else float("nan")
    return {
        "predicted": predicted,
        "measured": measured,
        "ratio": ratio,
        "within": bool(abs(ratio - 1) <= tolerance),
    }


def run(args: argparse.Namespace) -> int:
    from relaygr.streams.config import PipelineSettings
    from relaygr.workers.engine.capacity import ModelShape, WorkerShape, capacity_plan

    settings = PipelineSettings()
    model, latency, samples, paces = _calibrated(args, settings)
    shape = ModelShape.of(model.config)
    history = _histories(args, settings, shape.max_seq_len, latency)
    plan = capacity_plan(
        shape,
        latency,
        np.array([len(h) for _, h in history["histories"]]),
        _workload(args, settings, paces),
        WorkerShape(1, 1, 1),
    )
    with tempfile.TemporaryDirectory(prefix="relaygr-plan-check-") as root:
        measured = asyncio.run(_measure(model, latency, history["histories"], root))
    checks = _checks(args, plan, measured)
    p50, p99, lengths = history["p50"], history["p99"], history["lengths"]
    out = {
        "bench": "plan",
        "model_version": model.model_version,
        "users": args.users,
        "qps": args.qps,
        "history_p50": p50,
        "history_p99": p99,
        "history_from": history["from"],
        "lengths": {
            "min": int(lengths.min()),
            "median": float(np.median(lengths)),
            "max": int(lengths.max()),
        },
        "at_risk": {"predicted": round(plan["at_risk_share"] * args.users), "admitted": measured["admitted"]},
        "clock": args.clock,
        "calibration": {"coeffs": latency.coeffs(), "samples": samples, **paces},
        "device_wall_over_cpu": (sum(measured["wall"].values()) / max(1e-9, sum(measured["cpu"].values()))),
        "checks": checks,
        "all_within": all(c["within"] for c in checks.values()),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"plan vs measured: {args.users} users, history p50 {p50} / p99 {p99} ({out['history_from']}), "
        f"{args.qps:g} req/s; at risk predicted {out['at_risk']['predicted']}, admitted {measured['admitted']}"
    )
    for name, c in checks.items():
        mark = "ok" if c["within"] else "OUT"
        print(
            f"  {name:28s} predicted {c['predicted']:12.1f}  measured {c['measured']:12.1f}  x{c['ratio']:.3f} {mark}"
        )
    return 0


def _calibrated(args: argparse.Namespace, settings: Any) -> tuple[Any, Any, Any, dict]:
    """The model on one thread, its latency model and paces calibrated on ``--clock``: (model,
    latency model, calibration samples, paces)."""
    from relaygr.tools.prepare import ensure_model
    from relaygr.workers.engine.calibration import calibrate, measure_paces
    from relaygr.workers.model.model import HSTURanker
    from relaygr.workers.model.runner import ModelRunner

    model_dir = args.model or settings.model_dir
    ensure_model(model_dir)
    torch.set_num_threads(1)
    model = ModelRunner(HSTURanker.load(model_dir))
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    latency, samples = calibrate(model, candidates=CANDIDATES, threads=1, clock=clock)
    paces = measure_paces(
        model,
        latency,
        slice_ms=settings.device_slice_ms,
        chunk=settings.prefill_chunk,
        suffix=settings.short_term,
        candidates=CANDIDATES,
        clock=clock,
    )
    return model, latency, samples, paces


def _histories(args: argparse.Namespace, settings: Any, max_seq_len: int, latency: Any) -> dict[str, Any]:
    """The users' histories: MovieLens users lengthened to log-normal lengths (p50 and p99 given,
    or the p50 at 1.5 × the length where the trigger starts to admit), long and short interleaved."""
    from relaygr.tools.long_users import lengthen
    from relaygr.workers.engine.capacity import lognormal_lengths
    from relaygr.workers.training.movielens import load_movielens

    at_risk = latency.max_tokens_within(settings.budget_ms * settings.theta) + 1
    p50 = args.history_p50 or min(max_seq_len, max(settings.short_term * 2, round(1.5 * at_risk)))
    p99 = args.history_p99 or 4 * p50
    if p99 < p50:
        raise SystemExit("bench plan: --history-p99 must be at least --history-p50")
    lengths = lognormal_lengths(p50, p99, max_seq_len, points=args.users)
    ml = load_movielens("ml-100k")
    users = sorted(ml.histories)[: args.users]
    rng = np.random.default_rng(0)
    order = rng.permutation(len(lengths))  # long and short users interleaved, as traffic comes
    return {
        "p50": p50,
        "p99": p99,
        "from": "arguments" if args.history_p50 else f"calibration: at risk from {at_risk} events",
        "lengths": lengths,
        "histories": [
            (u, lengthen(ml.histories[u], int(lengths[i]))) for u, i in zip(users, order, strict=False)
        ],
    }


def _workload(args: argparse.Namespace, settings: Any, paces: dict) -> Any:
    from relaygr.streams.trigger import TriggerConfig
    from relaygr.workers.engine.capacity import Workload

    return Workload(
        users=args.users,
        qps=args.qps,
        budget_ms=settings.budget_ms,
        theta=settings.theta,
        short_term=settings.short_term,
        min_prefix=TriggerConfig.model_fields["min_prefix"].default,
        candidates=CANDIDATES,
        hit_rate=0.0,  # every request of the run is a first visit
        slice_ms=settings.device_slice_ms,
        **paces,
    )


def _checks(args: argparse.Namespace, plan: dict, measured: dict) -> dict[str, Any]:
    """Each planned figure beside its measurement, within ``--tolerance`` or not."""
    tol = args.tolerance
    device = measured[args.clock]
    checks: dict[str, Any] = {
        "preinfer_device_ms_per_s": _side_by_side(
            plan["preinfer_device_ms_per_s"], device["preinfer_ms_per_request"] * args.qps, tol
        ),
        "rank_device_ms_per_s": _side_by_side(
            plan["rank_device_ms_per_s"], device["rank_ms_per_request"] * args.qps, tol
        ),
        "device_bytes_per_user": _side_by_side(
            plan["formats"]["exact"]["bytes_per_cached_user"]["device"],
            measured["device_bytes_per_user"],
            tol,
        ),
    }
    for fmt, got in measured["tiers"].items():
        for tier in ("host", "disk"):
            predicted = plan["formats"][fmt]["bytes_per_cached_user"][tier]
            checks[f"{tier}_bytes_per_user_{fmt}"] = _side_by_side(
                predicted, got[f"{tier}_bytes_per_user"], tol
            )
    return checks
