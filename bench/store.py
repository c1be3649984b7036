"""Prefix store tiers vs recompute: time to get a prefix's KV onto the device, per prefix length.

For each prefix length (``--lengths``, default 1k, 4k and 8k events) the benchmark builds one
HSTU ranker (4 layers, dim 128 by default, or a ``--preset`` shape; random weights: timing does
not depend on training)
and measures, in one run:

- ``recompute``: ``HSTURanker.prefill`` of the whole history (what a miss costs);
- ``device``: ``PrefixStore.lookup`` of an entry already in the device tier, through the full
  lookup path (lock, lease expiry check, fingerprint validation, LRU touch, metrics);
  ``validate`` is the history's fingerprint alone (the validity check, proportional to length),
  and ``store_overhead`` is the same device-tier lookup with that fingerprint precomputed: the
  store's own bookkeeping;
- ``host_to_device``: lookup of an entry in the host tier (promotion, demoting another entry);
  on a CPU-only machine both tiers are CPU memory and promotion moves no bytes, so
  ``host_copy`` also reports a forced single-threaded copy of every tensor of the prefix (what
  moving that many bytes costs on this machine's memory bus, a stand-in for a real transfer);
- ``disk``: lookup of an entry only on disk (RocksDB read, checksum, decode, placement); the
  file is in the OS page cache after the first read, as on a worker re-reading hot users.

Median and p99 in milliseconds, and each tier's speed-up over recompute. ``--json`` prints one
JSON line per length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import torch

from relaygr.workers.model.devices import keep_host_pages, synchronize
from relaygr.workers.model.presets import PRESETS, resolve_shape
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store import prefix_store as prefix_store_module
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

STORE_SHAPE = {"layers": 4, "dim": 128, "heads": 2}  # without --preset

TARGETS = {"host_to_device_speedup_4k": 10.0, "disk_speedup": 3.0, "store_overhead_ms": 0.2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths",
        default="1024,4096,8192",
        help="comma-separated prefix lengths in events (default: 1k,4k,8k)",
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model shape (workers.presets); explicit --layers / --dim / --heads win",
    )
    parser.add_argument("--layers", type=int, default=None, help="HSTU layers (default 4)")
    parser.add_argument("--dim", type=int, default=None, help="model dimension (default 128)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default 2)")
    parser.add_argument("--device", default="cpu", help="model and device-tier device (default cpu)")
    parser.add_argument(
        "--recompute-repeats", type=int, default=3, help="timed prefills per length (default 3)"
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed promotions / disk loads per length")
    parser.add_argument("--hit-repeats", type=int, default=2000, help="timed device-tier hits per length")
    parser.add_argument("--disk-path", default=None, help="RocksDB folder (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON line per length")


def _stats(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"median_ms": statistics.median(ms), "p99_ms": p99, "n": len(ms)}


def _history(n: int, num_items: int, gen: torch.Generator) -> Events:
    return Events(
        item_ids=torch.randint(1, num_items + 1, (n,), generator=gen),
        action_ids=torch.randint(1, 6, (n,), generator=gen),
        timestamps=1.7e9 + torch.cumsum(torch.rand(n, generator=gen, dtype=torch.float64) * 600, 0),
    )


def _sync(device: torch.device) -> None:
    synchronize(device)


async def _time_async(fn: Callable[[], Awaitable[Any]], repeats: int, device: torch.device) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _clone(p: PrefixKV, device: torch.device) -> PrefixKV:
    return PrefixKV(
        keys=[k.to(device, copy=True) for k in p.keys],
        values=[v.to(device, copy=True) for v in p.values],
        positions=p.positions.to(device, copy=True),
        timestamps=p.timestamps.to(device, copy=True),
        length=p.length,
        fingerprint=p.fingerprint,
        model_version=p.model_version,
    )


async def _measure_length(n: int, args: argparse.Namespace, model: Any, disk_root: str) -> dict[str, Any]:
    device = model.device
    gen = torch.Generator().manual_seed(args.seed + n)
    ha, hb = _history(n, model.config.num_items, gen), _history(n, model.config.num_items, gen)

    # recompute: the first prefill warms up and yields the prefix the store will serve; the
    # second user's prefix reuses its tensors under its own history (the store never reads them)
    pa = model.prefill(ha)
    pb = replace(_clone(pa, device), timestamps=hb.timestamps.to(device), fingerprint=history_fingerprint(hb))
    _sync(device)
    recompute = []
    for _ in range(args.recompute_repeats):
        t0 = time.perf_counter()
        model.prefill(ha)
        _sync(device)
        recompute.append(time.perf_counter() - t0)
    nbytes = pa.nbytes()
    version = model.model_version

    # device-tier hit through the full lookup path, and the fingerprint alone
    with PrefixStore(
        PrefixStoreConfig(device=str(device), device_budget_bytes=4 * nbytes, host_budget_bytes=0), version
    ) as s:
        s.put("a", pa)
        assert (await s.lookup("a", ha)).tier == "device"
        device_hit = await _time_async(lambda: s.lookup("a", ha), args.hit_repeats, device)
        # the same hits with the fingerprint precomputed: what the store itself adds
        known = {n: history_fingerprint(ha, n)}
        real_fp = prefix_store_module.history_fingerprint
        prefix_store_module.history_fingerprint = lambda h, k=None: known[k]
        try:
            overhead = await _time_async(lambda: s.lookup("a", ha), args.hit_repeats, device)
        finally:
            prefix_store_module.history_fingerprint = real_fp
    validate = []
    for _ in range(args.hit_repeats):
        t0 = time.perf_counter()
        history_fingerprint(ha, n)
        validate.append(time.perf_counter() - t0)

    # host -> device: a device tier of one entry; each lookup promotes one and demotes the other
    cfg = PrefixStoreConfig(device=str(device), device_budget_bytes=nbytes, host_budget_bytes=2 * nbytes)
    with PrefixStore(cfg, version) as s:
        s.put("a", pa)
        s.put("b", pb)  # "a" is now in host memory
        users = [("a", ha), ("b", hb)]
        tiers: list[str] = []

        async def promote() -> None:
            user, h = users[len(tiers) % 2]
            tiers.append((await s.lookup(user, h)).tier)

        host_to_device = await _time_async(promote, args.repeats, device)
        assert set(tiers) == {"host"}, tiers
        promotions = s.metrics()["promotions_host_to_device"]
    # A memory-bound copy: one thread, so that a busy machine's thread barriers do not dominate.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        host_copy = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            _clone(pa, device)
            _sync(device)
            host_copy.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)

    # disk: memory tiers of one device entry and no host tier; each lookup loads from RocksDB
    path = tempfile.mkdtemp(prefix=f"store-{n}-", dir=disk_root)
    cfg = PrefixStoreConfig(
        device=str(device),
        device_budget_bytes=nbytes,
        host_budget_bytes=0,
        disk_path=path,
        disk_budget_bytes=8 * nbytes + (1 << 20),
        disk_write_policy="write_through",
    )
    with PrefixStore(cfg, version) as s:
        s.put("a", pa)
        s.put("b", pb)
        s.flush()
        tiers = []

        async def load() -> None:
            user, h = users[len(tiers) % 2]
            got = await s.lookup(user, h)
            tiers.append(got.tier)

        disk = await _time_async(load, args.repeats, device)
        assert set(tiers) == {"disk"}, tiers
        m = s.metrics()
        disk_bytes = m["disk_bytes_written"] // max(1, m["disk_writes"])

    rec = _stats(recompute)
    row: dict[str, Any] = {
        "bench": "store",
        "length": n,
        "prefix_bytes": nbytes,
        "disk_blob_bytes": disk_bytes,
        "device": str(device),
        "model": {"layers": model.config.layers, "dim": model.config.dim, "heads": model.config.heads},
        "recompute": rec,
        "device_hit": _stats(device_hit),
        "validate": _stats(validate),
        "store_overhead": _stats(overhead),
        "host_to_device": _stats(host_to_device),
        "host_to_device_moves_bytes": device.type != "cpu",
        # The host tier pins its tensors on CUDA (the store's default), so promotion is a DMA copy.
        "host_pinned": device.type == "cuda",
        "host_copy": _stats(host_copy),
        "disk": _stats(disk),
        "promotions_counted": promotions,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0],
    }
    row["store_overhead_ms"] = row["store_overhead"]["median_ms"]
    for tier in ("device_hit", "host_to_device", "host_copy", "disk"):
        row[f"speedup_{tier}"] = rec["median_ms"] / max(row[tier]["median_ms"], 1e-9)
    row["meets"] = {
        "store_overhead_le_0.2ms": row["store_overhead_ms"] <= TARGETS["store_overhead_ms"],
        "disk_ge_3x": row["speedup_disk"] >= TARGETS["disk_speedup"],
        "host_to_device_ge_10x": row["speedup_host_to_device"] >= TARGETS["host_to_device_speedup_4k"],
        "host_copy_ge_10x": row["speedup_host_copy"] >= TARGETS["host_to_device_speedup_4k"],
    }
    return row


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'length':>6} {'MB':>6} {'recompute':>10} {'device hit':>11} {'overhead':>9} "
        f"{'host->dev':>10} {'host copy':>10} {'disk':>8}   speed-up vs recompute (host, copy, disk)"
    )
    print(head)
    for r in rows:
        print(
            f"{r['length']:>6} {r['prefix_bytes'] / 1e6:>6.1f} {r['recompute']['median_ms']:>8.1f}ms "
            f"{r['device_hit']['median_ms']:>9.3f}ms {r['store_overhead_ms']:>7.3f}ms "
            f"{r['host_to_device']['median_ms']:>8.3f}ms {r['host_copy']['median_ms']:>8.2f}ms "
            f"{r['disk']['median_ms']:>6.2f}ms   "
            f"{r['speedup_host_to_device']:.0f}x, {r['speedup_host_copy']:.0f}x, {r['speedup_disk']:.0f}x"
        )
    print("(medians; p99 and fingerprint-validation time in --json)")


def run(args: argparse.Namespace) -> int:
    from relaygr.workers.model.model import HSTUConfig, HSTURanker  # only the recompute baseline needs it

    lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    keep_host_pages()  # as a serving worker runs
    torch.manual_seed(args.seed)
    shape = resolve_shape(
        args.preset, fallback=STORE_SHAPE, layers=args.layers, heads=args.heads, dim=args.dim
    )
    head = shape["dim"] // shape["heads"]
    # A preset's heads split its width; without one, the config's own head dimensions (as before).
    dims = {"attn_dim": head, "linear_dim": head} if args.preset else {}
    cfg = HSTUConfig(**shape, **dims, dropout=0.0, device=args.device)
    model = HSTURanker(cfg).eval()
    rows = []
    with tempfile.TemporaryDirectory(prefix="relaygr-bench-store-", dir=args.disk_path) as root:
        for n in lengths:
            row = asyncio.run(_measure_length(n, args, model, root))
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"length {n}: done", file=sys.stderr, flush=True)
    if not args.json:
        _print_table(rows)
    return 0
