"""Prefix store tiers vs recompute: time to get a prefix's KV onto the device, per prefix length,
each figure checked against the link it crosses, measured in the same run.

For each prefix length (``--lengths``, default 1k, 4k and 8k events) the benchmark builds one
HSTU ranker (4 layers, dim 128 by default, or a ``--preset`` shape; random weights: timing does
not depend on training) and measures, in one run:

- ``links`` (once per run, in the disk folder; measured and checked by ``bench.links``):
  ``host_to_device``, a large pinned buffer copied to the device (on a CPU-only machine: a
  single-threaded memory copy); ``disk``, the sequential read of a large file in the same folder,
  cold: the better of ``O_DIRECT`` reads and buffered reads after its pages were dropped
  (``posix_fadvise(DONTNEED)``);
- ``recompute``: ``ModelRunner.prefill`` of the whole history (what a miss costs);
- ``device``: ``PrefixStore.lookup`` of an entry already in the device tier, through the full
  lookup path; ``validate`` is the history's fingerprint alone, and ``store_overhead`` the same
  lookup with that fingerprint precomputed: the store's own bookkeeping;
- ``host_to_device``: lookup of an entry in the host tier whose tensors are verified to be in host
  memory (pinned on CUDA) before each timed promotion; on a CPU-only machine promotion moves no
  bytes, so ``host_copy`` also reports a single-threaded copy of every tensor of the prefix;
- ``disk``: lookup of an entry verified to be on disk only, its file's pages dropped first: a
  cold read (the tier reads with ``O_DIRECT`` where the filesystem allows it), checksum, decode,
  copy to the device and placement.
- ``pages`` (``device_pages``): the device tier's pages as the engine wires them (the runner reads
  and writes the store's pages, bucketed relay rankings on: replayed on CUDA, the same forward
  eagerly elsewhere). ``prefix_device_copies``: the pages in use after a bucketed ranking of the
  cached prefix (the buckets' own rows aside) over the prefix's own, measured (the earlier graph
  pool held a second copy: 2); ``grow_copied_bytes``: bytes of already cached tokens copied when
  the prefix is extended by the suffix, as pre-inference extends it and as a ranking keeps its
  suffix (measured by the pages' counters; ``grow_written_bytes``: the new tokens written); and
  ``device_bytes_per_user`` and ``users_per_gb`` now (whole pages of keys, values and a timestamp
  per token) and before (computed from the earlier layout: the device tier's tensors, positions
  and timestamps included, plus the graph pool's copy in 256-token blocks; the extension's
  ``torch.cat`` copied every cached token's keys and values).

Every timed device operation synchronises before and after. Each promotion's tier is checked
after it ran: a sample served from another tier is left out and reported (``unexpected_tiers``),
never timed as the tier it was meant to measure. ``link_check`` gives each figure's bytes per
second against its link's; a figure faster than its link (beyond ``--link-tolerance``) is an
error (``errors``), not a result. Medians and p99 in milliseconds, and each tier's speed-up over
recompute; ``--json`` prints one JSON line per length. The machine may be shared: medians.
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

from relaygr.bench.links import check_links, measure_links, one_thread, timed
from relaygr.workers.kv_pages import KVLayout
from relaygr.workers.model.devices import keep_host_pages, synchronize
from relaygr.workers.model.presets import PRESETS, resolve_shape
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store import prefix_store as prefix_store_module
from relaygr.workers.store.kv_formats import COLD_FORMATS, cold_nbytes
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig
from relaygr.workers.store.tier_costs import TierCosts

STORE_SHAPE = {"layers": 4, "dim": 128, "heads": 2}  # without --preset

TARGETS = {
    "host_to_device_speedup_4k": 10.0,
    "disk_speedup": 3.0,
    "store_overhead_ms": 0.2,
    "disk_fraction_of_link": 0.5,
    "host_to_device_fraction_of_link": 0.7,
    "users_per_gb_x": 1.9,
}
EARLIER_POOL_BLOCK = 256  # tokens of a block of the earlier graph pool (its second copy)
SUFFIX = 64  # events a ranking or a pre-inference adds to the cached prefix
CPU_CACHE_BYTES = 64 << 20  # a CPU memory copy of fewer bytes may run from the caches, past DRAM


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
    parser.add_argument("--disk-path", default=None, help="disk tier folder (default: a temporary folder)")
    parser.add_argument(
        "--link-mb", type=int, default=256, help="size of the link measurements' buffer and file (MB)"
    )
    parser.add_argument(
        "--link-tolerance",
        type=float,
        default=0.10,
        help="how much faster than its link a figure may be before it is an error (default 0.10)",
    )
    parser.add_argument(
        "--cold-format",
        choices=COLD_FORMATS,
        default="exact",
        help="the host and disk tiers' format (default exact: the model's dtype)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON line per length")


def _stats(samples_s: list[float]) -> dict[str, float]:
    if not samples_s:
        return {"median_ms": float("nan"), "p99_ms": float("nan"), "n": 0}
    ms = sorted(s * 1e3 for s in samples_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return {"median_ms": statistics.median(ms), "p99_ms": p99, "n": len(ms)}


def _history(n: int, num_items: int, gen: torch.Generator) -> Events:
    return Events(
        item_ids=torch.randint(1, num_items + 1, (n,), generator=gen),
        action_ids=torch.randint(1, 6, (n,), generator=gen),
        timestamps=1.7e9 + torch.cumsum(torch.rand(n, generator=gen, dtype=torch.float64) * 600, 0),
    )


async def _timed_async(fn: Callable[[], Awaitable[Any]], device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    await fn()
    synchronize(device)
    return time.perf_counter() - t0


def _clone(p: PrefixKV, device: torch.device) -> PrefixKV:
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, copy=True)

    return replace(
        p,
        keys=[move(k) for k in p.keys],
        values=[move(v) for v in p.values],
        positions=move(p.positions),
        timestamps=move(p.timestamps),
    )


# -- per length -----------------------------------------------------------------------------------


def _recompute(model: Any, h: Events, repeats: int) -> list[float]:
    return [timed(lambda: model.prefill(h), model.device) for _ in range(repeats)]


async def _device_hits(
    pa: PrefixKV, ha: Events, repeats: int, device: torch.device
) -> dict[str, list[float]]:
    """Device-tier hits through the full lookup path; the same with the fingerprint precomputed
    (what the store itself adds); the fingerprint alone."""
    n, nbytes = pa.length, pa.nbytes()
    cfg = PrefixStoreConfig(device=str(device), device_budget_bytes=4 * nbytes, host_budget_bytes=0)
    with PrefixStore(cfg, pa.model_version) as s:
        s.put("a", pa)
        if (await s.lookup("a", ha)).tier != "device":
            raise RuntimeError("bench store: the device-tier entry was not found on the device")
        hits = [await _timed_async(lambda: s.lookup("a", ha), device) for _ in range(repeats)]
        known = {n: history_fingerprint(ha, n)}
        real_fp = prefix_store_module.history_fingerprint
        prefix_store_module.history_fingerprint = lambda h, k=None: known[k]
        try:
            overhead = [await _timed_async(lambda: s.lookup("a", ha), device) for _ in range(repeats)]
        finally:
            prefix_store_module.history_fingerprint = real_fp
    validate = [timed(lambda: history_fingerprint(ha, n), torch.device("cpu")) for _ in range(repeats)]
    return {"device_hit": hits, "store_overhead": overhead, "validate": validate}


async def _promotions(
    s: PrefixStore,
    users: list[tuple[str, Events]],
    want: str,
    repeats: int,
    ready: Callable[[str], bool],
    lease_bytes: int = 0,
) -> tuple[list[float], dict[str, int]]:
    """Timed lookups alternating between ``users``; each one's promotion is timed only when
    ``ready(user)`` held before it (the set-up put it where ``want`` says) and it was served from
    ``want`` (verified after). With ``lease_bytes`` the room is made beforehand, untimed, as
    pre-inference does: a lease of that many bytes (released after the lookup). Returns the
    samples and the tiers of the promotions left out."""
    samples: list[float] = []
    unexpected: dict[str, int] = {}
    for i in range(repeats):
        user, h = users[i % len(users)]
        if lease_bytes:
            s.lease(user, 60.0, lease_bytes)
        s.settle()
        placed = ready(user)
        tier = ""

        async def lookup(user: str = user, h: Events = h) -> None:
            nonlocal tier
            tier = (await s.lookup(user, h)).tier

        t = await _timed_async(lookup, s.device)
        if lease_bytes:
            s.release(user)
        if placed and tier == want:
            samples.append(t)
        else:
            key = tier if placed else f"{tier} (set-up: {s.where(user)})"
            unexpected[key] = unexpected.get(key, 0) + 1
    return samples, unexpected


async def _host_to_device(
    pa: PrefixKV, pb: PrefixKV, ha: Events, hb: Events, repeats: int, fmt: str
) -> dict[str, Any]:
    """A device tier of one entry and a host tier of two: before each lookup a lease makes room
    (demoting the other entry, untimed), then the lookup promotes one from host memory (its
    tensors verified there)."""
    device, nbytes = pa.device, pa.nbytes()
    cfg = PrefixStoreConfig(
        device=str(device), device_budget_bytes=nbytes, host_budget_bytes=2 * nbytes, cold_kv_format=fmt
    )
    with PrefixStore(cfg, pa.model_version) as s:
        s.put("a", pa)
        s.put("b", pb)

        def in_host_memory(user: str) -> bool:
            return s.placement.key(user) in s.placement.layout()["host_in_memory"]

        users = [("a", ha), ("b", hb)]
        samples, unexpected = await _promotions(s, users, "host", repeats, in_host_memory, nbytes)
        promotions = s.metrics()["promotions_host_to_device"]
    return {"samples": samples, "unexpected": unexpected, "promotions": promotions}


async def _disk(
    pa: PrefixKV, pb: PrefixKV, ha: Events, hb: Events, repeats: int, root: str, fmt: str
) -> dict[str, Any]:
    """A device tier of one entry, no host tier: each lookup reads one prefix from disk (verified to
    be there alone, its file's pages dropped: a cold read) and the other leaves for disk."""
    device, nbytes = pa.device, pa.nbytes()
    cfg = PrefixStoreConfig(
        device=str(device),
        device_budget_bytes=nbytes,
        host_budget_bytes=0,
        disk_path=tempfile.mkdtemp(prefix=f"store-{pa.length}-", dir=root),
        disk_budget_bytes=8 * nbytes + (1 << 20),
        disk_backlog_bytes=4 * nbytes,  # both write-throughs queue at once: none is dropped
        disk_write_policy="write_through",
        persist_on_close=False,
        cold_kv_format=fmt,
    )
    with PrefixStore(cfg, pa.model_version) as s:
        s.put("a", pa)
        s.put("b", pb)
        disk = s.placement.disk
        assert disk is not None

        def cold_on_disk(user: str) -> bool:
            meta = disk.meta((user, pa.model_version))
            if s.where(user) != "disk" or meta is None:
                return False
            disk.files.drop_cached(meta.seq)
            return True

        samples, unexpected = await _promotions(s, [("a", ha), ("b", hb)], "disk", repeats, cold_on_disk)
        m = s.metrics()
    blob_bytes = m["disk_bytes_written"] // max(1, m["disk_writes"])
    return {
        "samples": samples,
        "unexpected": unexpected,
        "blob_bytes": blob_bytes,
        "drops": m["disk_write_drops"],
    }


def _host_copy(pa: PrefixKV, repeats: int) -> list[float]:
    """A single-threaded copy of every tensor of the prefix: what moving its bytes costs."""
    return one_thread(lambda: [timed(lambda: _clone(pa, pa.device), pa.device) for _ in range(repeats)])  # type: ignore[return-value]


async def _measure_length(
    n: int, args: argparse.Namespace, model: Any, root: str, links: dict[str, Any]
) -> dict[str, Any]:
    device = model.device
    gen = torch.Generator().manual_seed(args.seed + n)
    ha, hb = _history(n, model.config.num_items, gen), _history(n, model.config.num_items, gen)
    # The first prefill warms up and yields the prefix the store serves; the second user's reuses
    # its tensors under its own history (the store never reads them).
    pa = model.prefill(ha).dense()  # as a colder tier hands it over: the store writes it into pages
    pb = replace(_clone(pa, device), timestamps=hb.timestamps.to(device), fingerprint=history_fingerprint(hb))
    recompute = _recompute(model, ha, args.recompute_repeats)
    hits = await _device_hits(pa, ha, args.hit_repeats, device)
    host = await _host_to_device(pa, pb, ha, hb, args.repeats, args.cold_format)
    host_copy = _host_copy(pa, args.repeats)
    disk = await _disk(pa, pb, ha, hb, args.repeats, root, args.cold_format)
    pages = await device_pages(model, n, args.seed)
    stats = {
        "recompute": _stats(recompute),
        **{k: _stats(v) for k, v in hits.items()},
        "host_to_device": _stats(host["samples"]),
        "host_copy": _stats(host_copy),
        "disk": _stats(disk["samples"]),
    }
    row: dict[str, Any] = {
        "bench": "store",
        "length": n,
        "prefix_bytes": pa.nbytes(),
        "disk_blob_bytes": disk["blob_bytes"],
        "cold_format": args.cold_format,
        "host_bytes": cold_nbytes(pa, args.cold_format),
        "device": str(device),
        "model": {"layers": model.config.layers, "dim": model.config.dim, "heads": model.config.heads},
        **stats,
        "host_to_device_moves_bytes": device.type != "cpu",
        # The host tier pins its tensors on CUDA (the store's default), so promotion is a DMA copy.
        "host_pinned": device.type == "cuda",
        "disk_reads": "cold (pages dropped before each read; the tier reads with O_DIRECT where it can)",
        "unexpected_tiers": {"host_to_device": host["unexpected"], "disk": disk["unexpected"]},
        "disk_write_drops": disk["drops"],
        "promotions_counted": host["promotions"],
        **pages,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0],
        "links": links,
    }
    _judge(row, args.link_tolerance)
    return row


def _judge(row: dict[str, Any], tolerance: float) -> None:
    """Speed-ups over recompute, the link check, the errors and the targets met, into ``row``."""
    rec = row["recompute"]["median_ms"]
    for tier in ("device_hit", "host_to_device", "host_copy", "disk"):
        row[f"speedup_{tier}"] = rec / max(row[tier]["median_ms"], 1e-9)
    row["store_overhead_ms"] = row["store_overhead"]["median_ms"]
    links = row["links"]
    figures = {"disk": (row["disk_blob_bytes"], row["disk"]["median_ms"] / 1e3)}
    link_of = {"disk": (links["disk"]["bytes_per_s"], links["disk"]["best_bytes_per_s"])}
    copy = "host_to_device" if row["host_to_device_moves_bytes"] else "host_copy"
    moved = row["host_bytes"] if copy == "host_to_device" else row["prefix_bytes"]
    figures[copy] = (moved, row[copy]["median_ms"] / 1e3)
    link_of[copy] = (links["host_to_device_bytes_per_s"], links["host_to_device_best_bytes_per_s"])
    # A CPU copy small enough for the caches is not held to the DRAM link.
    cached = copy == "host_copy" and row["prefix_bytes"] < CPU_CACHE_BYTES
    figures = {k: v for k, v in figures.items() if row[k]["n"] and not (k == copy and cached)}
    row["link_check"], errors = check_links(figures, link_of, tolerance)
    for tier, left_out in row["unexpected_tiers"].items():
        if left_out:
            errors.append(
                f"{tier}: {sum(left_out.values())} promotion(s) served otherwise, left out: {left_out}"
            )
        if not row[tier]["n"]:
            errors.append(f"{tier}: no promotion was served from the tier measured")
    # Whether the expander's choice agrees with the times measured is a figure, not an error: a
    # few cold reads on a loaded machine can put either side ahead.
    row["expander_choice"] = expander_choice(row, TierCosts.from_dict(links["tier_costs"]))
    row["errors"] = errors
    fraction = {k: c["fraction_of_link"] for k, c in row["link_check"].items()}
    row["meets"] = {
        "store_overhead_le_0.2ms": row["store_overhead_ms"] <= TARGETS["store_overhead_ms"],
        "disk_ge_3x": row["speedup_disk"] >= TARGETS["disk_speedup"],
        "host_to_device_ge_10x": row["speedup_host_to_device"] >= TARGETS["host_to_device_speedup_4k"],
        "host_copy_ge_10x": row["speedup_host_copy"] >= TARGETS["host_to_device_speedup_4k"],
        "disk_ge_half_of_link": fraction.get("disk", 0.0) >= TARGETS["disk_fraction_of_link"],
        f"{copy}_ge_0.7_of_link": fraction.get(copy, 0.0) >= TARGETS["host_to_device_fraction_of_link"],
        "no_figure_faster_than_its_link": not any(not c["accepted"] for c in row["link_check"].values()),
        "one_device_copy": row["prefix_device_copies"] == 1,
        "extension_copies_nothing": row["grow_copied_bytes"] == 0,
        "users_per_gb_ge_1.9x": row["users_per_gb_x"] >= TARGETS["users_per_gb_x"],
        "expander_choice_matches_the_times": all(c["matches"] for c in row["expander_choice"].values()),
    }


def expander_choice(row: dict[str, Any], costs: TierCosts) -> dict[str, dict[str, Any]]:
    """Per cold tier measured: the promotion time the tier costs predict, whether the expander
    would serve from it (predicted faster than the measured recompute), whether it is faster, and
    whether the two agree."""
    rec = row["recompute"]["median_ms"]
    out = {}
    for tier, nbytes in (("host_to_device", row["host_bytes"]), ("disk", row["disk_blob_bytes"])):
        if not row[tier]["n"] or (tier == "host_to_device" and not row["host_to_device_moves_bytes"]):
            continue
        predicted = costs.promote_ms("host" if tier == "host_to_device" else "disk", nbytes)
        serves, faster = predicted < rec, row[tier]["median_ms"] < rec
        out[tier] = {
            "predicted_ms": predicted,
            "serves": serves,
            "faster": faster,
            "matches": serves == faster,
        }
    return out


async def device_pages(model: Any, n: int, seed: int) -> dict[str, Any]:
    """The ``pages`` figures of a prefix of ``n`` events (see the module docstring)."""
    from relaygr.workers.model.graph_runner import NEW_ROWS
    from relaygr.workers.model.inference import UserRanking
    from relaygr.workers.model.runner import ModelRunner

    gen = torch.Generator().manual_seed(seed + 7 * n)
    h = _history(n + 2 * SUFFIX, model.config.num_items, gen)
    cands = torch.randint(1, model.config.num_items + 1, (128,), generator=gen)
    runner = ModelRunner(model.model)
    layout = runner.kv_layout()
    cfg = PrefixStoreConfig(
        device=str(model.device),
        device_budget_bytes=2 * layout.bytes_for(n + 2 * SUFFIX),
        host_budget_bytes=0,
    )
    with PrefixStore(cfg, runner.model_version) as store:
        rows = min(NEW_ROWS, 4 * (SUFFIX + 128))  # the buckets' rows: this one's and more
        runner.use_pages(store.device_pages(layout, reserve_tokens=rows))
        graphs = runner.use_graph_relay(True, prefix_tokens=n + 2 * SUFFIX, rows_tokens=rows)
        assert graphs is not None
        pages = runner.pages
        store.put("u", runner.prefill(h.slice(0, n)))
        found = (await store.lookup("u", h.slice(0, n + SUFFIX))).prefix
        ts = float(h.timestamps[-1]) + 30.0
        runner.rank(found, h.slice(n, n + SUFFIX), cands, ts)  # through a bucket, reading the pages
        own = len(found.pages.pages)
        copies = (pages.used_pages - graphs.rows_reserved() // pages.page_tokens) / own
        before = pages.counters()
        grown = runner.extend(found, h.slice(0, n + SUFFIX))  # as pre-inference extends a prefix
        store.put("u", grown)
        ((_, grow),) = runner.rank_users([UserRanking(grown, h, cands, ts)])  # a ranking keeps its suffix
        store.put("u", grow(), keep_longer=True)
        after = pages.counters()
        graphed = graphs.counters()["graphed_rankings"]
        runner.use_graph_relay(False)
    now = layout.bytes_for(n)
    earlier = _earlier_bytes(layout, n)
    return {
        "page_tokens": layout.page_tokens,
        "prefix_device_copies": round(copies, 3),
        "graphed_rankings": graphed,
        "grow_copied_bytes": (after["rows_copied"] - before["rows_copied"]) * layout.token_bytes,
        "grow_written_bytes": (after["rows_written"] - before["rows_written"]) * layout.token_bytes,
        "grow_copied_bytes_before": n * (layout.token_bytes - 8),  # torch.cat: every cached token's K and V
        "device_bytes_per_user": now,
        "device_bytes_per_user_before": earlier,
        "users_per_gb": round(1e9 / now, 2),
        "users_per_gb_before": round(1e9 / earlier, 2),
        "users_per_gb_x": round(earlier / now, 3),
    }


def _earlier_bytes(layout: KVLayout, n: int) -> int:
    """Device bytes of a cached user of ``n`` events in the earlier layout: the device tier's
    tensors (keys, values, int64 positions, float64 timestamps) and the graph pool's copy (keys,
    values and a timestamp a row, in whole 256-token blocks)."""
    kv = layout.token_bytes - 8
    pool_rows = -(-n // EARLIER_POOL_BLOCK) * EARLIER_POOL_BLOCK
    return n * (kv + 16) + pool_rows * (kv + 8)


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'length':>6} {'MB':>6} {'recompute':>10} {'device hit':>11} {'overhead':>9} "
        f"{'host->dev':>10} {'host copy':>10} {'disk':>8} {'disk/link':>9}   speed-up (host, copy, disk)"
    )
    for r in rows:
        disk_fraction = r["link_check"].get("disk", {}).get("fraction_of_link", float("nan"))
        print(
            f"{r['length']:>6} {r['prefix_bytes'] / 1e6:>6.1f} {r['recompute']['median_ms']:>8.1f}ms "
            f"{r['device_hit']['median_ms']:>9.3f}ms {r['store_overhead_ms']:>7.3f}ms "
            f"{r['host_to_device']['median_ms']:>8.3f}ms {r['host_copy']['median_ms']:>8.2f}ms "
            f"{r['disk']['median_ms']:>6.2f}ms {disk_fraction:>9.2f}   "
            f"{r['speedup_host_to_device']:.0f}x, {r['speedup_host_copy']:.0f}x, {r['speedup_disk']:.1f}x"
        )
        for e in r["errors"]:
            print(f"  ERROR {e}")
        for t, c in r["expander_choice"].items():
            if not c["matches"]:
                print(
                    f"  MISS the expander {'serves' if c['serves'] else 'skips'} {t}, yet it was the {'slower' if c['serves'] else 'faster'} here"
                )
    print("(medians; disk reads are cold; p99, links and fingerprint-validation time in --json)")
    print(f"{'length':>6} {'copies':>6} {'grow copied':>11} {'MB/user':>8} {'before':>8} {'users/GB x':>10}")
    for r in rows:
        print(
            f"{r['length']:>6} {r['prefix_device_copies']:>6} {r['grow_copied_bytes']:>11} "
            f"{r['device_bytes_per_user'] / 1e6:>8.2f} {r['device_bytes_per_user_before'] / 1e6:>8.2f} "
            f"{r['users_per_gb_x']:>9.2f}x"
        )


def _model(args: argparse.Namespace) -> Any:
    from relaygr.workers.model.model import HSTUConfig, HSTURanker  # only the recompute baseline needs it
    from relaygr.workers.model.runner import ModelRunner

    shape = resolve_shape(
        args.preset, fallback=STORE_SHAPE, layers=args.layers, heads=args.heads, dim=args.dim
    )
    head = shape["dim"] // shape["heads"]
    # A preset's heads split its width; without one, the config's own head dimensions (as before).
    dims = {"attn_dim": head, "linear_dim": head} if args.preset else {}
    return ModelRunner(HSTURanker(HSTUConfig(**shape, **dims, dropout=0.0, device=args.device)).eval())


def run(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in str(args.lengths).split(",") if x.strip()]
    if not lengths or min(lengths) < 1:
        raise SystemExit(f"bench store: --lengths needs positive lengths, got {args.lengths!r}")
    if args.repeats < 1 or args.link_mb < 1 or args.link_tolerance < 0:
        raise SystemExit("bench store: --repeats and --link-mb must be >= 1, --link-tolerance >= 0")
    keep_host_pages()  # as a serving worker runs
    torch.manual_seed(args.seed)
    model = _model(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="relaygr-bench-store-", dir=args.disk_path) as root:
        links = measure_links(model.device, root, args.link_mb << 20)
        for n in lengths:
            row = asyncio.run(_measure_length(n, args, model, root, links))
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"length {n}: done", file=sys.stderr, flush=True)
    if not args.json:
        _print_table(rows)
    return 1 if any(r["errors"] for r in rows) else 0
