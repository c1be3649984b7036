"""The device check's pipeline points, sized from the device's own calibration so that they decide.

A point holds the SLO when the one-sided upper bound of its miss rate is at most 1 % (the
experiment's stopping rule): with fewer than ``requests_to_hold(0)`` requests (299 at 1 %, 95 %)
no point can hold even with no miss at all. And a grid picked for one machine may hold nowhere on
another, leaving both ratios undefined. So the check calibrates the trained model on the device
first, as the demo does, and picks:

- requests per point: the fewest with which 0 misses holds (``requests_to_hold(0)``);
- seq-len lengths: from a point where the baseline holds (full ranking predicted within
  ``COMFORT_FRACTION`` of B, keeping the device ``BASELINE_UTILISATION`` busy at ``SEQ_LEN_QPS``)
  up to the model's serving cap (where relay's reach ends) or the longest the device tier holds,
  ``LENGTHS`` of them, spaced geometrically, at that rate;
- throughput: the history of such a point at ``THROUGHPUT_MIN_QPS`` (at most half the cap);
  rates from the one at which full ranking keeps the device ``BASELINE_UTILISATION`` busy (a few
  per second) up to where relay rankings are predicted to saturate it, at most ``MAX_QPS`` (what
  the stages sustain), ``RATES`` of them, spaced geometrically;
- points are dropped (the middle ones first) until the predicted sending time fits ``--seconds``
  (or, where the check gives the step a deadline, ``RELAYGR_STEP_DEADLINE``, what is left of it
  less ``--reserve`` for the pipelines' start and warm-up);
- the prefix store sized to the device: the experiment's users all come back within a point
  (299 requests of the ML-100K window are 7 users' sessions), so the device tier gets
  ``DEVICE_TIER_SHARE`` of the device's memory and each partition may hold that much (the trigger's
  footprint bound); a length whose users' prefixes would not fit it is not tried. With the
  defaults (a 1 GiB tier, 512 MiB a partition) a ``large`` prefix of 32k events (537 MB in
  float32) is never admitted, and relay there falls back to full ranking.

``python -m relaygr.device.points --model DIR --device cuda --budget-ms 50 --work W
[--seconds S] -- EXPERIMENT_ARGS`` calibrates into ``W/calibration.json``, prints the sizing as
one JSON line (``"bench": "device-points"``) and runs ``relaygr experiment seq-len throughput``
with EXPERIMENT_ARGS and the sized points.

Primitives: ``PointPlan``, ``geometric(lo, hi, count, grid)``, ``size_points(latency, ...)``,
``experiment_args(plan)``, ``StoreSizing`` / ``size_store(...)``, ``window_users(requests)``,
``sending_seconds(...)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relaygr.tools.experiment.stopping import requests_to_hold
from relaygr.tools.sizing import GRID, NO_PACE, Pace, relay_ms
from relaygr.workers.engine.latency_model import LatencyModel

SHORT_TERM = 64  # the experiment's short-term suffix (tools.experiment.protocol)
COMFORT_FRACTION = 0.4
"""The baseline's points: full ranking predicted at most at this share of B (room for queueing)."""
BASELINE_UTILISATION = 0.2
"""The baseline's points keep full ranking this busy: Poisson bursts then stay within B."""
SEQ_LEN_QPS = 20.0
"""The seq-len rate where the device allows: 299 requests in 15 s."""
THROUGHPUT_MIN_QPS = 15.0
"""The lowest throughput rate where the device allows: 299 requests in 20 s (at 10/s the two modes'
first point alone took a third of the sending time, and a length had to go)."""
MAX_QPS = 120.0
"""The highest rate tried: about what one set of stage processes sustains next to the ranker."""
MIN_QPS = 2.0
LENGTHS = 3
RATES = 3
MIN_LENGTH = 256
FIRST_ROUND = 100
"""Requests of a point's first round: one that misses often stops there."""
POINT_OVERHEAD_S = 6.0
"""Per point and mode besides sending: the other mode stopped, users warmed up, results drained."""
DEVICE_TIER_SHARE = 0.3
"""Of the device's memory, the prefix store's device tier: the model, two pipelines' activations
and the allocator's slack keep the rest."""
DEADLINE_ENV = "RELAYGR_STEP_DEADLINE"
"""Set by the device check: the wall-clock time (epoch seconds) at which the step is stopped."""


@dataclass
class StoreSizing:
    """The prefix store the experiment's workers get, and the lengths it leaves out."""

    device_tier_mb: float
    footprint_mb: float
    bytes_per_token: int
    users: int
    longest: int  # the longest history whose users' prefixes all fit the device tier

    def env(self) -> dict[str, str]:
        return {
            "RELAYGR_DEVICE_CACHE_MB": f"{self.device_tier_mb:.0f}",
            "RELAYGR_FOOTPRINT_BOUND_MB": f"{self.footprint_mb:.0f}",
        }


def size_store(device_bytes: int, bytes_per_token: int, users: int, cap: int) -> StoreSizing:
    """A device tier of ``DEVICE_TIER_SHARE`` of ``device_bytes``; each partition may fill it (the
    tier's leases bound the whole); the longest length on the grid (at most ``cap``) at which
    ``users`` prefixes fit it."""
    tier = DEVICE_TIER_SHARE * device_bytes
    fits = int(tier // max(1, users * bytes_per_token))
    longest = max(MIN_LENGTH, min(cap, fits // GRID * GRID))
    mb = tier / (1 << 20)
    return StoreSizing(round(mb), round(mb), bytes_per_token, users, longest)


def window_users(requests: int, min_prior: int = 20) -> int:
    """Distinct users among the experiment's first ``requests`` requests (its default window:
    ML-100K's interactions with ``min_prior`` earlier ones, from the middle)."""
    from relaygr.tools.trace import eligible_interactions
    from relaygr.workers.training.movielens import load_movielens

    rows = eligible_interactions(load_movielens(), min_prior)
    start = len(rows) // 2
    return len({u for _, u, _ in rows[start : start + requests]})


def sending_seconds(seconds: float, reserve: float, now: float, deadline: str | None) -> float:
    """The time the points may take: ``seconds``, or what the step's deadline leaves after
    ``reserve`` when the check set one."""
    if not deadline:
        return seconds
    return max(0.0, min(seconds, float(deadline) - now - reserve))


@dataclass
class PointPlan:
    requests: int
    lengths: list[int]
    seq_len_qps: float
    history: int
    rates: list[float]
    predicted_full_ms: dict[str, float]
    predicted_relay_ms: dict[str, float]
    seconds: float  # predicted time of sending every point in both modes
    dropped: list[str] = field(default_factory=list)
    why: list[str] = field(default_factory=list)


def geometric(lo: float, hi: float, count: int, grid: float = 1.0) -> list[float]:
    """``count`` values from ``lo`` to ``hi`` spaced by a constant factor, rounded to ``grid``,
    without repeats (fewer when the range is narrow)."""
    if hi <= lo or count <= 1:
        return [round(lo / grid) * grid]
    step = (hi / lo) ** (1 / (count - 1))
    out: list[float] = []
    for i in range(count):
        v = max(grid, round(lo * step**i / grid) * grid)
        if not out or v > out[-1]:
            out.append(v)
    return out


def _seconds(plan: PointPlan) -> float:
    """Predicted sending time: relay at every point; the baseline (stopped by ``--patience 1``)
    at the first two of each experiment, where it holds and then misses, stopped after its first
    round by the lower bound."""

    def sending(rates: list[float], requests: list[int]) -> float:
        return sum(n / q + POINT_OVERHEAD_S for q, n in zip(rates, requests, strict=False))

    first = min(FIRST_ROUND, plan.requests)
    seq = [plan.seq_len_qps] * len(plan.lengths)
    relay = sending(seq, [plan.requests] * len(seq)) + sending(plan.rates, [plan.requests] * len(plan.rates))
    return relay + sending(seq[:2], [plan.requests, first]) + sending(plan.rates[:2], [plan.requests, first])


def _fit(plan: PointPlan, seconds: float) -> None:
    """Drop middle points (rates first: theirs are the longest to send) until sending fits."""
    while _seconds(plan) > seconds:
        if len(plan.rates) > 2:
            plan.dropped.append(f"rate {plan.rates.pop(len(plan.rates) // 2):g}/s")
        elif len(plan.lengths) > 2:
            plan.dropped.append(f"length {plan.lengths.pop(len(plan.lengths) // 2)}")
        else:
            break
    plan.seconds = round(_seconds(plan), 1)


def _baseline_point(latency: LatencyModel, budget_ms: float, hi: int, max_qps: float) -> tuple[int, float]:
    """The longest length (on the grid, at least ``MIN_LENGTH``, at most ``hi``) whose full ranking
    is predicted within ``COMFORT_FRACTION`` of B and, at ``max_qps``, keeps the device at most
    ``BASELINE_UTILISATION`` busy; and the rate (within ``[MIN_QPS, max_qps]``) that keeps full
    ranking there that busy: a point where the baseline holds, if it holds anywhere."""
    ms = min(COMFORT_FRACTION * budget_ms, BASELINE_UTILISATION * 1000 / max_qps)
    n = max(MIN_LENGTH, min(hi, latency.max_tokens_within(ms)) // GRID * GRID)
    qps = min(max_qps, max(MIN_QPS, BASELINE_UTILISATION * 1000 / latency.predict_ms(n)))
    return n, round(qps, 1)


def size_points(
    latency: LatencyModel,
    budget_ms: float,
    max_seq_len: int,
    *,
    relay_pace: Pace = NO_PACE,
    miss_rate: float = 0.01,
    confidence: float = 0.95,
    seconds: float = math.inf,
) -> PointPlan:
    """The points of both experiments for a device calibrated as ``latency`` (see the module doc)."""
    n = requests_to_hold(0, miss_rate, confidence)
    lo, seq_qps = _baseline_point(latency, budget_ms, max_seq_len, SEQ_LEN_QPS)
    lengths = [int(x) for x in geometric(lo, max_seq_len, LENGTHS, GRID)]
    history, r_lo = _baseline_point(latency, budget_ms, max_seq_len // 2, THROUGHPUT_MIN_QPS)
    relay_h = relay_ms(latency, history, SHORT_TERM, relay_pace=relay_pace)
    saturates = 1000 / max(relay_h, 1e-3)
    rates = [round(r, 1) for r in geometric(r_lo, max(r_lo, min(MAX_QPS, saturates)), RATES, 0.1)]
    full = {str(x): round(latency.predict_ms(x), 2) for x in (*lengths, history)}
    relay = {
        str(x): round(relay_ms(latency, x, SHORT_TERM, relay_pace=relay_pace), 2) for x in (*lengths, history)
    }
    comfort = f"≤ {COMFORT_FRACTION:.0%} of B = {budget_ms:g} ms"
    plan = PointPlan(
        requests=n,
        lengths=lengths,
        seq_len_qps=seq_qps,
        history=history,
        rates=rates,
        predicted_full_ms=full,
        predicted_relay_ms=relay,
        seconds=0.0,
        why=[
            f"{n} requests a point: the fewest with which 0 misses holds (miss-rate bound ≤ {miss_rate:.0%} "
            f"at {confidence:.0%})",
            f"lengths from {lo} (full ranking predicted at {full[str(lo)]:.1f} ms; the baseline's point wants "
            f"{comfort}) to {max_seq_len} (the serving cap, or the device tier), at {seq_qps:g}/s (full ranking at {lo} "
            f"{BASELINE_UTILISATION:.0%} busy, at most {SEQ_LEN_QPS:g}/s)",
            f"throughput at {history} events (full ranking predicted at {full[str(history)]:.1f} ms, relay at "
            f"{relay_h:.2f} ms): rates from {rates[0]:g}/s (full ranking {BASELINE_UTILISATION:.0%} busy) to "
            f"{rates[-1]:g}/s (relay saturates the device at {saturates:.0f}/s; at most {MAX_QPS:g}/s)",
        ],
    )
    _fit(plan, seconds)
    return plan


def experiment_args(plan: PointPlan) -> list[str]:
    """The sized points as ``relaygr experiment seq-len throughput`` flags."""
    return [
        "--lengths", ",".join(str(x) for x in plan.lengths),
        "--qps", f"{plan.seq_len_qps:g}",
        "--history", str(plan.history),
        "--qps-list", ",".join(f"{r:g}" for r in plan.rates),
        "--max-requests", str(plan.requests),
        # Two rounds: a point that holds sends just the n it needs; one that misses often is
        # stopped by the lower bound after the first.
        "--min-round", str(min(FIRST_ROUND, plan.requests)),
        "--max-round", str(-(-plan.requests // 2)),
    ]  # fmt: skip


def _device_bytes(device: str) -> int:
    """The accelerator's memory (0 on CPU: the store keeps its defaults there)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    if dev.type == "npu":
        return int(torch.npu.get_device_properties(dev).total_memory)  # type: ignore[attr-defined]
    return 0


def _store_for(model: Path, device: str, requests: int, cap: int) -> StoreSizing | None:
    from relaygr.workers.engine.ranker import kv_bytes_per_token
    from relaygr.workers.model.model import HSTURanker

    total = _device_bytes(device)
    if not total:
        return None
    per_token = kv_bytes_per_token(HSTURanker.load(model, device="cpu"))
    return size_store(total, per_token, window_users(requests), cap)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-ms", type=float, default=50.0)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=math.inf, help="time to send every point in")
    parser.add_argument(
        "--reserve",
        type=float,
        default=45.0,
        help=f"with {DEADLINE_ENV} set: seconds of the step kept for the pipelines' start and warm-up",
    )
    args = parser.parse_args(own)
    from relaygr.tools.experiment.deployment import calibrate_latency
    from relaygr.tools.sizing import relay_pace_of

    args.work.mkdir(parents=True, exist_ok=True)
    calibration = args.work / "calibration.json"
    latency, samples = calibrate_latency(args.model, 1, calibration, args.device)
    pace = relay_pace_of(json.loads(calibration.read_text()))
    cap = int(json.loads((args.model / "config.json").read_text()).get("max_seq_len") or 8192)
    store = _store_for(args.model, args.device, requests_to_hold(0), cap)
    seconds = sending_seconds(args.seconds, args.reserve, time.time(), os.environ.get(DEADLINE_ENV))
    longest = store.longest if store else cap
    plan = size_points(latency, args.budget_ms, longest, relay_pace=pace, seconds=seconds)
    if store:
        plan.why.append(
            f"device tier {store.device_tier_mb:.0f} MiB ({DEVICE_TIER_SHARE:.0%} of the device), each partition "
            f"may fill it: {store.users} users' prefixes at {store.bytes_per_token} bytes an event fit it up to "
            f"{store.longest} events (serving cap {cap})"
        )
        os.environ.update(store.env())
    row = {"bench": "device-points", **asdict(plan), "max_seq_len": cap, "budget_ms": args.budget_ms,
           "sending_s": round(seconds, 1), "store": asdict(store) if store else None,
           "calibration": [[n, round(ms, 2)] for n, ms in samples]}  # fmt: skip
    print(json.dumps(row), flush=True)
    cmd = [
        sys.executable,
        "-m",
        "relaygr.cli",
        "experiment",
        "seq-len",
        "throughput",
        *rest,
        *experiment_args(plan),
    ]
    print("$ " + " ".join(cmd), flush=True)
    os.execv(sys.executable, cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
