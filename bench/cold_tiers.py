"""Cold-tier formats (exact, bf16, int8): ranking error, bytes per cached user, promotion from disk.

On the trained model (``--model``, default ``RELAYGR_MODEL_DIR``; trained first if missing), over
``--requests`` requests of real MovieLens-100K users, every format side by side in one run:

- **error**: each request is a user's real history cut at one of its events (a different cut per
  round over the users), lengthened by time-shifted repeats of itself to ``length`` events (the
  shortest history whose full ranking the calibrated latency model puts at risk, ``budget ×
  theta``, within the model's ``max_seq_len``; ``--length`` overrides), and ``--candidates``
  random items. The prefix (all but the last ``--suffix`` events) is pre-inferred once, written
  in each format through the disk codec, read back, decoded, and the suffix ranked against it.
  Against ``rank_full`` of the whole history: the worst and mean absolute score difference, the
  top-10 overlap, and NDCG@10 of the relay ranking with the full ranking as the truth (graded
  relevance ``10 - rank`` for the full ranking's top 10). ``exact`` shows the float-rounding floor.
- **bytes**: ``--store-users`` users' prefixes put into a real ``PrefixStore`` per format, once
  into the host tier and once onto its disk tier (blob files): the bytes the store accounts per cached user,
  and users per GB (10^9 bytes) relative to exact.
- **promote**: the same users looked up from the disk tier only (``--promote-rounds`` rounds), cold
  (each file's pages dropped first): read, checksum, decode and (for bf16 / int8) decompression on the model's device, median and
  P99 ms per format, and the ratio to exact; once more for prefixes of ``--long-prefix`` events
  (``promote_long``: there the bytes read, checked and copied dominate the fixed costs).

One JSON line with ``--json`` (the length, load and where the length came from included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relaygr.tools.args import int_at_least
from relaygr.workers.model.devices import synchronize
from relaygr.workers.prefix_kv import Events, PrefixKV
from relaygr.workers.store.kv_codec import decode, encode
from relaygr.workers.store.kv_formats import COLD_FORMATS, to_cold, to_warm

TARGETS = {
    "int8": {"users_per_gb_x": 3.5, "top10_overlap": 0.99},
    "bf16": {"users_per_gb_x": 1.9, "top10_overlap": 0.999},
}
TOP_K = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: RELAYGR_MODEL_DIR)")
    parser.add_argument("--requests", type=int_at_least(1), default=3000, help="requests scored")
    parser.add_argument(
        "--length", type=int_at_least(2), help="events per request (default: from the calibration)"
    )
    parser.add_argument("--suffix", type=int_at_least(1), default=64, help="short-term events ranked")
    parser.add_argument("--candidates", type=int_at_least(TOP_K), default=128)
    parser.add_argument("--store-users", type=int_at_least(1), default=32, help="users per store")
    parser.add_argument("--promote-rounds", type=int_at_least(1), default=5)
    parser.add_argument(
        "--long-prefix",
        type=int_at_least(1),
        default=4096,
        help="events of the long prefixes whose promotion from disk is also timed (capped at max_seq_len)",
    )
    parser.add_argument("--device", help="model device (default: the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON line")


# ---------------------------------------------------------------------- ranking comparisons


def top_k(scores: torch.Tensor, k: int = TOP_K) -> list[int]:
    """Indices of the ``k`` highest scores, ties broken by index (stable)."""
    order = torch.argsort(-scores.double(), stable=True)
    return order[:k].tolist()


def top_k_overlap(ref: torch.Tensor, got: torch.Tensor, k: int = TOP_K) -> float:
    return len(set(top_k(ref, k)) & set(top_k(got, k))) / k


def ndcg_at_k(ref: torch.Tensor, got: torch.Tensor, k: int = TOP_K) -> float:
    """NDCG@k of the ranking by ``got`` when the truth is the ranking by ``ref``: the item at
    ``ref`` rank r (0-based, r < k) has relevance k - r, every other item 0."""
    relevance = {item: k - r for r, item in enumerate(top_k(ref, k))}
    dcg = sum(relevance.get(item, 0) / math.log2(i + 2) for i, item in enumerate(top_k(got, k)))
    ideal = sum((k - r) / math.log2(r + 2) for r in range(k))
    return dcg / ideal


def through_disk(prefix: PrefixKV, fmt: str, device: torch.device) -> PrefixKV:
    """``prefix`` as a promotion from the disk tier returns it: cold form, blob, decoded, warm."""
    return to_warm(decode(encode(to_cold(prefix, fmt))), device)


# ---------------------------------------------------------------------- the workload


def request_length(model: Any, latency: Any, budget_ms: float, theta: float, suffix: int) -> tuple[int, str]:
    """The shortest history the trigger would pre-infer (full ranking predicted over budget × theta),
    within the model's ``max_seq_len`` and at least ``4 × suffix``; and how it was chosen."""
    at_risk = latency.max_tokens_within(budget_ms * theta) + 1
    cap = int(model.config.max_seq_len)
    n = min(cap, max(4 * suffix, at_risk))
    why = (
        f"calibration: full ranking predicted over {budget_ms * theta:.1f} ms (budget {budget_ms:g} ms x "
        f"theta {theta:g}) from {at_risk} events; max_seq_len {cap}; at least 4 x suffix"
    )
    return n, why


def requests_of(histories: dict[int, Events], count: int, length: int) -> list[tuple[int, Events]]:
    """``count`` requests round-robin over the users: round r cuts each history before its last
    r events, then lengthens it to ``length`` events (users with too few events are skipped)."""
    from relaygr.tools.long_users import lengthen

    users = sorted(histories)
    out: list[tuple[int, Events]] = []
    r = 0
    while len(out) < count:
        added = 0
        for u in users:
            h = histories[u]
            if len(h) - r < 2:
                continue
            out.append((u, lengthen(h.slice(0, len(h) - r), length)))
            added += 1
            if len(out) == count:
                break
        if not added:
            raise SystemExit("cold-tiers: the dataset has too few events for that many requests")
        r += 1
    return out


def score_errors(
    model: Any, requests: list[tuple[int, Events]], suffix: int, candidates: int, seed: int
) -> dict[str, dict[str, float]]:
    """Per format: worst and mean |score - full score|, mean top-10 overlap, mean NDCG@10."""
    gen = torch.Generator().manual_seed(seed)
    diffs: dict[str, list[float]] = {f: [] for f in COLD_FORMATS}
    worst: dict[str, float] = dict.fromkeys(COLD_FORMATS, 0.0)
    overlap: dict[str, list[float]] = {f: [] for f in COLD_FORMATS}
    ndcg: dict[str, list[float]] = {f: [] for f in COLD_FORMATS}
    for i, (_, history) in enumerate(requests):
        if i and i % 500 == 0:
            print(f"   {i}/{len(requests)} requests scored", file=sys.stderr, flush=True)
        cands = torch.randperm(model.config.num_items, generator=gen)[:candidates] + 1
        ts = float(history.timestamps[-1]) + 60.0
        p = len(history) - suffix
        full = model.rank_full(history, cands, ts)
        prefix = model.prefill(history.slice(0, p))
        for fmt in COLD_FORMATS:
            got = model.rank(through_disk(prefix, fmt, model.device), history.slice(p), cands, ts)
            d = (got - full).abs()
            diffs[fmt].append(float(d.mean()))
            worst[fmt] = max(worst[fmt], float(d.max()))
            overlap[fmt].append(top_k_overlap(full, got))
            ndcg[fmt].append(ndcg_at_k(full, got))
    return {
        f: {
            "max_abs_score_diff": worst[f],
            "mean_abs_score_diff": statistics.fmean(diffs[f]),
            "top10_overlap": statistics.fmean(overlap[f]),
            "top10_overlap_min": min(overlap[f]),
            "ndcg10_vs_full": statistics.fmean(ndcg[f]),
        }
        for f in COLD_FORMATS
    }


# ---------------------------------------------------------------------- the store


def host_bytes_per_user(model: Any, prefixes: list[tuple[int, Events, PrefixKV]], fmt: str) -> float:
    """Host-tier bytes per cached user as the store accounts them in ``fmt``."""
    from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

    total = sum(p.nbytes() for _, _, p in prefixes)
    copies = ThreadPoolExecutor(1, thread_name_prefix="cold-tiers-copy")
    cfg = PrefixStoreConfig(
        device=str(model.device), device_budget_bytes=0, host_budget_bytes=2 * total, cold_kv_format=fmt
    )
    with PrefixStore(cfg, model.model_version, executor=copies) as store:
        for u, _, p in prefixes:
            store.put(u, p)
        copies.submit(lambda: None).result()  # the compressing copies have landed
        host = store.metrics()
    copies.shutdown()
    return host["bytes_host"] / max(1, host["entries_host"])


def _drop_cached(store: Any, user: int) -> None:
    """Drop the pages of ``user``'s blob file from the page cache."""
    disk = store.placement.disk
    meta = disk.meta(store.placement.key(user))
    if meta is not None:
        disk.files.drop_cached(meta.seq)


async def disk_tier_figures(
    model: Any, prefixes: list[tuple[int, Events, PrefixKV]], root: str, rounds: int
) -> dict[str, dict[str, float]]:
    """Per format, disk bytes per cached user and promotion from disk (cold reads: each file's pages
    dropped before its lookup; the device synchronised around it): one store per format, the
    lookups interleaved (each user in every format in turn, the order rotating), so that whatever
    else the machine does falls on every format alike."""
    from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

    total = sum(p.nbytes() for _, _, p in prefixes)
    copies = ThreadPoolExecutor(1, thread_name_prefix="cold-tiers-copy")
    stores = {}
    for fmt in COLD_FORMATS:
        cfg = PrefixStoreConfig(
            device=str(model.device),
            device_budget_bytes=0,
            host_budget_bytes=0,
            disk_path=f"{root}/{fmt}",
            disk_budget_bytes=4 * total,
            disk_backlog_bytes=4 * total,
            cold_kv_format=fmt,
            persist_on_close=False,
        )
        stores[fmt] = PrefixStore(cfg, model.model_version, executor=copies)
    times: dict[str, list[float]] = {f: [] for f in COLD_FORMATS}
    try:
        for store in stores.values():
            for u, _, p in prefixes:
                store.put(u, p)
            store.flush()
        turn = 0
        for _ in range(rounds):
            for u, history, _ in prefixes:
                turn += 1
                for fmt in COLD_FORMATS[turn % 3 :] + COLD_FORMATS[: turn % 3]:
                    _drop_cached(stores[fmt], u)  # a cold read, as a returning user's is
                    synchronize(model.device)
                    t0 = time.perf_counter()
                    found = await stores[fmt].lookup(u, history)
                    synchronize(model.device)
                    times[fmt].append((time.perf_counter() - t0) * 1e3)
                    assert found.tier == "disk", found.tier
        disk = {f: s.metrics() for f, s in stores.items()}
    finally:
        for store in stores.values():
            store.close()
        copies.shutdown()
    out = {}
    for f, ts in times.items():
        ts.sort()
        out[f] = {
            "disk_bytes_per_user": disk[f]["bytes_disk"] / max(1, disk[f]["entries_disk"]),
            "promote_disk_median_ms": statistics.median(ts),
            "promote_disk_p99_ms": ts[min(len(ts) - 1, round(0.99 * (len(ts) - 1)))],
        }
    return out


async def store_tier_figures(
    model: Any, prefixes: list[tuple[int, Events, PrefixKV]], root: str, rounds: int
) -> dict[str, dict[str, float]]:
    """Per format: host and disk bytes per cached user as the store accounts them, and promotion
    from disk (``disk_tier_figures``)."""
    disk = await disk_tier_figures(model, prefixes, root, rounds)
    return {
        f: {"host_bytes_per_user": host_bytes_per_user(model, prefixes, f), **disk[f]} for f in COLD_FORMATS
    }


def store_figures(
    model: Any, requests: list[tuple[int, Events]], users: int, prefix_len: int, rounds: int
) -> dict[str, dict[str, float]]:
    """``store_tier_figures`` for the first ``users`` users' prefixes of
    ``prefix_len`` events (their histories lengthened as the requests' are)."""
    from relaygr.tools.long_users import lengthen

    chosen: dict[int, Events] = {}
    for u, history in requests:
        chosen.setdefault(u, history)
        if len(chosen) == users:
            break
    prefixes = []
    for u, history in chosen.items():
        prefix_events = lengthen(history, prefix_len)
        prefixes.append((u, prefix_events, model.prefill(prefix_events)))
    with tempfile.TemporaryDirectory(prefix="relaygr-cold-tiers-") as root:
        return asyncio.run(store_tier_figures(model, prefixes, root, rounds))


def long_promotions(store: dict[str, dict[str, float]], length: int) -> dict[str, Any]:
    """Promotion from disk of long prefixes per format, and the ratio to exact."""
    exact = store["exact"]["promote_disk_median_ms"]
    return {
        "prefix_len": length,
        **{
            f: {
                "promote_disk_median_ms": s["promote_disk_median_ms"],
                "promote_disk_p99_ms": s["promote_disk_p99_ms"],
                "promote_disk_x_exact": s["promote_disk_median_ms"] / exact,
            }
            for f, s in store.items()
        },
    }


# ---------------------------------------------------------------------- the report


def summarise(errors: dict[str, dict[str, float]], store: dict[str, dict[str, float]]) -> dict[str, Any]:
    exact = store["exact"]
    formats: dict[str, Any] = {}
    for f in COLD_FORMATS:
        s = store[f]
        formats[f] = {
            **errors[f],
            **s,
            "host_users_per_gb": 1e9 / s["host_bytes_per_user"],
            "disk_users_per_gb": 1e9 / s["disk_bytes_per_user"],
            "host_users_per_gb_x": exact["host_bytes_per_user"] / s["host_bytes_per_user"],
            "disk_users_per_gb_x": exact["disk_bytes_per_user"] / s["disk_bytes_per_user"],
            "promote_disk_x_exact": s["promote_disk_median_ms"] / exact["promote_disk_median_ms"],
        }
    met = {}
    for f, t in TARGETS.items():
        r = formats[f]
        met[f] = (
            min(r["host_users_per_gb_x"], r["disk_users_per_gb_x"]) >= t["users_per_gb_x"]
            and r["top10_overlap"] >= t["top10_overlap"]
        )
    met["int8_promote_disk_le_exact"] = (
        formats["int8"]["promote_disk_x_exact"] <= 1.0
    )  # at the request length
    return {"formats": formats, "targets": TARGETS, "met": met}


def run(args: argparse.Namespace) -> int:
    from relaygr.streams.config import PipelineSettings
    from relaygr.tools.prepare import ensure_calibration, ensure_model
    from relaygr.workers.engine.latency_model import LatencyModel
    from relaygr.workers.model.model import HSTURanker
    from relaygr.workers.model.runner import ModelRunner
    from relaygr.workers.training.movielens import load_movielens

    settings = PipelineSettings()
    model_dir = args.model or settings.model_dir
    ensure_model(model_dir)
    calibration = model_dir / "calibration.json"
    latency = LatencyModel.load(calibration if calibration.exists() else ensure_calibration(model_dir))
    model = ModelRunner(HSTURanker.load(model_dir, device=args.device))
    if args.length is not None:
        length, why = args.length, "--length"
    else:
        length, why = request_length(model, latency, settings.budget_ms, settings.theta, args.suffix)
    if args.suffix >= length:
        raise SystemExit(f"cold-tiers: --suffix {args.suffix} must be shorter than the length {length}")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    requests = requests_of(load_movielens("ml-100k").histories, args.requests, length)
    t0 = time.perf_counter()
    errors = score_errors(model, requests, args.suffix, args.candidates, args.seed)
    store = store_figures(model, requests, args.store_users, length - args.suffix, args.promote_rounds)
    long_len = min(model.config.max_seq_len, args.long_prefix)
    long = long_promotions(
        store_figures(model, requests, args.store_users, long_len, args.promote_rounds), long_len
    )
    out = {
        "bench": "cold-tiers",
        "model_version": model.model_version,
        "model": {
            k: getattr(model.config, k) for k in ("layers", "heads", "attn_dim", "linear_dim", "dtype")
        },
        "device": str(model.device),
        "requests": len(requests),
        "users": len({u for u, _ in requests}),
        "length": length,
        "prefix_len": length - args.suffix,
        "suffix": args.suffix,
        "candidates": args.candidates,
        "length_from": why,
        "store_users": args.store_users,
        "promote_rounds": args.promote_rounds,
        **summarise(errors, store),
        "promote_long": long,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"cold tiers: {out['requests']} requests of {length} events ({why})")
    for f, r in out["formats"].items():
        print(
            f"  {f:5s}  max|d| {r['max_abs_score_diff']:.2e}  mean|d| {r['mean_abs_score_diff']:.2e}  "
            f"top10 {r['top10_overlap']:.4f}  ndcg10 {r['ndcg10_vs_full']:.4f}  "
            f"host x{r['host_users_per_gb_x']:.2f}  disk x{r['disk_users_per_gb_x']:.2f}  "
            f"promote {r['promote_disk_median_ms']:.2f} ms (x{r['promote_disk_x_exact']:.2f})"
        )
    lp = out["promote_long"]
    print(
        f"  promote from disk at {lp['prefix_len']} events: "
        + ", ".join(f"{f} {lp[f]['promote_disk_median_ms']:.2f} ms" for f in COLD_FORMATS)
    )
    print(f"  targets met: {out['met']}")
    return 0
