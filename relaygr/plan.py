"""Capacity plan: cache bytes, device time and ranking workers for a user base and a load.

From the model's KV bytes per event in each cold-tier format (exact, bf16, int8) and the latency
model calibrated on this machine (``<model>/calibration.json`` or ``RELAYGR_CALIBRATION_FILE``;
``relaygr calibrate`` writes it), for ``--users`` users sending ``--qps`` requests per second with
histories of median ``--history-p50`` and 99th percentile ``--history-p99`` events (log-normal,
capped at the model's ``max_seq_len``): the bytes per cached user on device, host and disk, users
per GB (10^9 bytes) of each tier, the pre-inference device time per second, and the ranking
workers needed for ``--hit-rate`` (their tier budgets are the RELAYGR_*_CACHE_MB settings).
The models behind each figure are those of ``relaygr.workers.engine.capacity``, restated in the output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from relaygr.tools.args import float_above, int_at_least, open_fraction

if TYPE_CHECKING:
    from relaygr.streams.config import PipelineSettings
    from relaygr.workers.engine.capacity import WorkerShape

ASSUMPTIONS = (
    "cached users: those the trigger pre-infers (full ranking of min(history, max_seq_len) predicted "
    "over budget x theta); a cached user holds the whole served history (retain_suffix)",
    "bytes: device tier in the model's dtype; host in the cold format; disk in the cold format plus "
    "the blob's header, alignment, checksum and sequence number",
    "device time: pre-inference of p events (predict(p) - predict(0)) x prefill_pace on a miss (and "
    "the events new since the last ranking beyond the suffix on a hit); relay ranking (predict(p + "
    "suffix + C) - predict(p)) x relay_pace; full ranking predict(n); the paces come from `relaygr "
    "calibrate` (1 when the calibration file has none)",
    "hit rate: LRU with equally active users holds the most recent ones, so hit rate = the share of "
    "at-risk users the workers' tiers hold together (skewed activity only raises it)",
    "workers: enough for the cached users in device + host + disk budgets, and for the device time "
    "at --max-utilisation; the workers on one device (--workers-per-device) share its time, each "
    "with its share of its memory",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--users", type=int_at_least(1), required=True, help="users of the service")
    parser.add_argument("--qps", type=float_above(0), required=True, help="ranking requests per second")
    parser.add_argument("--history-p50", type=int_at_least(1), required=True, help="median history events")
    parser.add_argument("--history-p99", type=int_at_least(1), required=True, help="99th percentile events")
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: RELAYGR_MODEL_DIR)")
    parser.add_argument(
        "--preset",
        help="a model shape of workers.presets (small, large, xl) instead of a trained model's; without a "
        "latency model (--calibration) only the bytes per cached user are printed",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", help="the device tier's dtype with --preset (default bfloat16)"
    )
    parser.add_argument("--calibration", type=Path, help="latency model JSON (default: the model's)")
    parser.add_argument(
        "--format",
        choices=["exact", "bf16", "int8", "all"],
        default="all",
        help="cold-tier format(s) to plan for (default: all three side by side)",
    )
    parser.add_argument("--hit-rate", type=open_fraction, default=0.9, help="target hit rate of cached users")
    parser.add_argument(
        "--new-events", type=int_at_least(0), default=0, help="events a returning user adds between requests"
    )
    parser.add_argument(
        "--max-utilisation", type=open_fraction, default=0.7, help="device busy share a worker may run at"
    )
    parser.add_argument(
        "--workers-per-device",
        type=int_at_least(1),
        default=None,
        help="ranking workers sharing a device (default RELAYGR_WORKERS_PER_DEVICE): they share its "
        "time, and each has its share of its memory",
    )
    parser.add_argument(
        "--device-memory-gb",
        type=float_above(0),
        default=None,
        help="the accelerator's memory, GB, to size each sharing worker's device tier from it (as a "
        "worker does); default: the RELAYGR_DEVICE_CACHE_MB budget split between them",
    )
    parser.add_argument("--json", action="store_true", help="one JSON line")


def run(args: argparse.Namespace) -> int:
    from relaygr.streams.config import PipelineSettings
    from relaygr.streams.trigger import TriggerConfig
    from relaygr.workers.engine.capacity import (
        ModelShape,
        Workload,
        capacity_plan,
        lognormal_lengths,
    )
    from relaygr.workers.engine.latency_model import LatencyModel

    if args.history_p99 < args.history_p50:
        raise SystemExit("plan: --history-p99 must be at least --history-p50")
    settings = PipelineSettings()
    model_dir = args.model or settings.model_dir
    config = _preset_config(args.preset, args.dtype) if args.preset else _model_config(Path(model_dir))
    if args.preset and args.calibration is None:
        return _print_bytes(bytes_per_user(config, args), args)
    calibration = args.calibration or settings.calibration_file or Path(model_dir) / "calibration.json"
    if not Path(calibration).exists():
        raise SystemExit(f"plan: no latency model at {calibration} (write one with `relaygr calibrate`)")
    latency = LatencyModel.load(calibration)
    calibrated = json.loads(Path(calibration).read_text())
    paces = {k: tuple(map(tuple, calibrated.get(k, [[0.0, 1.0]]))) for k in ("prefill_pace", "relay_pace")}
    shape = ModelShape.of(config)
    workload = Workload(
        users=args.users,
        qps=args.qps,
        budget_ms=settings.budget_ms,
        theta=settings.theta,
        short_term=settings.short_term,
        min_prefix=TriggerConfig.model_fields["min_prefix"].default,
        candidates=settings.max_rank_candidates,
        hit_rate=args.hit_rate,
        new_events=args.new_events,
        slice_ms=settings.device_slice_ms,
        **paces,
    )
    worker = _worker_shape(args, settings)
    formats = ("exact", "bf16", "int8") if args.format == "all" else (args.format,)
    lengths = lognormal_lengths(args.history_p50, args.history_p99, shape.max_seq_len)
    plan = capacity_plan(shape, latency, lengths, workload, worker, formats)
    out = {
        "plan": plan,
        "history_p50": args.history_p50,
        "history_p99": args.history_p99,
        "max_seq_len": shape.max_seq_len,
        "latency_model": {
            "coeffs": latency.coeffs(),
            "file": str(calibration),
            **paces,
            "paces_measured": all(k in calibrated for k in paces),
        },
        "worker_budgets_bytes": {
            "device": worker.device_bytes,
            "host": worker.host_bytes,
            "disk": worker.disk_bytes,
        },
        "assumptions": list(ASSUMPTIONS),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    _print_table(out)
    return 0


def _worker_shape(args: argparse.Namespace, settings: PipelineSettings) -> WorkerShape:
    """One worker's budgets: the RELAYGR_*_CACHE_MB settings, its device tier the share of a
    device it shares with ``--workers-per-device`` - 1 others (``split_device``)."""
    from relaygr.workers.engine.capacity import WorkerShape
    from relaygr.workers.engine.device_split import split_device

    mib = 1 << 20
    per_device = args.workers_per_device or settings.workers_per_device
    share = split_device(
        per_device,
        settings.device_cache_mb,
        settings.graph_pool_mb,
        int(args.device_memory_gb * 1e9) if args.device_memory_gb else None,
    )
    device_mb = share.cache_mb if per_device > 1 or args.device_memory_gb else settings.device_cache_mb
    worker = WorkerShape(
        workers_per_device=per_device,
        device_bytes=int(device_mb * mib),
        host_bytes=int(settings.host_cache_mb * mib),
        disk_bytes=int(settings.disk_cache_mb * mib),
        max_utilisation=args.max_utilisation,
    )
    return worker


def _model_config(model_dir: Path):
    from relaygr.workers.model.model import HSTUConfig

    config_file = model_dir / "config.json"
    if not config_file.exists():
        raise SystemExit(f"plan: no model in {model_dir} (train one with `relaygr train --out {model_dir}`)")
    return HSTUConfig.model_validate(json.loads(config_file.read_text()))


def _preset_config(name: str, dtype: str):
    from relaygr.workers.model.presets import preset

    try:
        return preset(name).config(dtype=dtype)
    except ValueError as e:
        raise SystemExit(f"plan: {e}") from None


def bytes_per_user(config, args: argparse.Namespace) -> dict:
    """Bytes of one cached user at the median, 99th percentile and serving cap history, per cold
    format, on each tier (what ``capacity_plan`` counts, without a latency model). The disk blob's
    overhead grows linearly with the length (positions, timestamps): measured at two short lengths
    and extended, so that no full-size blob is built."""
    from relaygr.workers.engine.capacity import ModelShape, disk_overhead_bytes

    shape = ModelShape.of(config)
    formats = ("exact", "bf16", "int8") if args.format == "all" else (args.format,)
    lengths = {"p50": min(args.history_p50, shape.max_seq_len), "p99": min(args.history_p99, shape.max_seq_len),
               "cap": shape.max_seq_len}  # fmt: skip
    out: dict = {"shape": {k: getattr(shape, k) for k in ("layers", "heads", "attn_dim", "linear_dim", "max_seq_len")},
                 "device_dtype": str(shape.dtype).removeprefix("torch."), "lengths": lengths, "formats": {}}  # fmt: skip
    for fmt in formats:
        o64, o128 = disk_overhead_bytes(shape, 64, fmt), disk_overhead_bytes(shape, 128, fmt)
        out["formats"][fmt] = {
            name: {
                "device": shape.token_bytes("exact") * n,
                "host": shape.token_bytes(fmt) * n,
                "disk": shape.token_bytes(fmt) * n + o64 + (o128 - o64) * (n - 64) // 64,
            }
            for name, n in lengths.items()
        }
    return out


def _print_bytes(out: dict, args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({"bytes_per_cached_user": out}))
        return 0
    s, n = out["shape"], out["lengths"]
    print(
        f"{args.preset}: {s['layers']} layers, {s['heads']} heads of {s['attn_dim']}/{s['linear_dim']}, serving cap "
        f"{s['max_seq_len']}; device tier in {out['device_dtype']} (no latency model: bytes only)"
    )
    print(
        f"{'format':7s} {'history':>8s} {'events':>7s} {'device MB/user':>15s} {'host MB/user':>13s} {'disk MB/user':>13s}"
    )
    for fmt, by_len in out["formats"].items():
        for name, b in by_len.items():
            print(
                f"{fmt:7s} {name:>8s} {n[name]:7d} {b['device'] / 1e6:15.1f} {b['host'] / 1e6:13.1f} {b['disk'] / 1e6:13.1f}"
            )
    return 0


def _print_table(out: dict) -> None:
    plan = out["plan"]
    print(
        f"{plan['users']} users, {plan['qps']:g} req/s, history p50 {out['history_p50']} / p99 "
        f"{out['history_p99']} events (max_seq_len {out['max_seq_len']})"
    )
    print(
        f"at risk (cached): {plan['at_risk_share']:.1%} of users, mean cached length "
        f"{plan['mean_cached_len']:.0f} events; {plan['cached_users_for_hit_rate']:.0f} users cached for "
        f"hit rate {plan['hit_rate']:g}"
    )
    print(
        f"device time: pre-inference {plan['preinfer_device_ms_per_s']:.1f} ms/s, ranking "
        f"{plan['rank_device_ms_per_s']:.1f} ms/s -> {plan['devices_for_device_time']} device(s), "
        f"{plan['workers_for_device_time']} worker(s) at {plan['workers_per_device']} a device"
    )
    print(
        f"{'format':7s} {'device B/user':>14s} {'host B/user':>12s} {'disk B/user':>12s} "
        f"{'host users/GB':>14s} {'disk users/GB':>14s} {'for cache':>10s} {'workers':>8s} {'devices':>8s}"
    )
    for fmt, f in plan["formats"].items():
        b, u = f["bytes_per_cached_user"], f["users_per_gb"]
        print(
            f"{fmt:7s} {b['device']:14.0f} {b['host']:12.0f} {b['disk']:12.0f} "
            f"{u['host'] or 0:14.0f} {u['disk'] or 0:14.0f} {f['workers_for_cache']:10d} {f['workers']:8d} "
            f"{f['devices']:8d}"
        )
    for line in out["assumptions"]:
        print(f"  - {line}")
