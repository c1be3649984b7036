"""Rank with a cached prefix vs full inference, per prefix length: latency, GFLOP/s and the roofline.

For each prefix length the benchmark builds one synthetic history (prefix + short-term suffix),
pre-infers the prefix, then times, interleaved so that both see the same machine:

- ``rank``: the suffix and the candidates against the cached prefix (the relay path),
- ``rank_full``: the whole history and the candidates, no cache (the baseline, same blockwise code),

and separately ``prefill`` of the prefix and ``extend`` of the prefix by the suffix. Every line
reports the achieved GFLOP/s of each path (projections and attention, ``HSTURanker.flops``) next to
a plain fp32 matmul measured just before it on the same device: the machine's roofline, and the
minor page faults of a ranking call (the host heap kept, ``devices.keep_host_pages``, as serving
keeps it: a call should fault in next to nothing).
One JSON line per measurement with ``--json``; a table otherwise.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable

import numpy as np
import torch

from relaygr.workers.devices import keep_host_pages, resolve_device, synchronize
from relaygr.workers.model import HSTUConfig, HSTURanker
from relaygr.workers.prefix_kv import Events

DEFAULT_LENGTHS = "256,512,1024,2048,4096,8192"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prefix lengths, comma separated")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per path and length")
    parser.add_argument("--suffix", type=int, default=64, help="short-term (suffix) events")
    parser.add_argument("--candidates", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument(
        "--heads",
        type=int,
        default=1,
        help="attention heads, head dim = dim / heads (same FLOPs for any count; fewer heads, fewer scores)",
    )
    parser.add_argument("--block", type=int, default=512, help="attention block size")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)


def synthetic_history(n: int, num_items: int, gen: torch.Generator) -> Events:
    """Random items and ratings; gaps of seconds to days (some ties), oldest first."""
    gaps = torch.randint(0, 4, (n,), generator=gen).double() * 10.0 ** torch.randint(
        0, 5, (n,), generator=gen
    )
    return Events(
        item_ids=torch.randint(1, num_items + 1, (n,), generator=gen),
        action_ids=torch.randint(1, 6, (n,), generator=gen),
        timestamps=8.8e8 + torch.cumsum(gaps, 0),
    )


def _timed(fn: Callable[[], object], device: torch.device, faults: list[int] | None = None) -> float:
    """Seconds of one call; with ``faults``, also appends the minor page faults it took."""
    synchronize(device)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    fn()
    synchronize(device)
    took = time.perf_counter() - t
    if faults is not None:
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return took


def matmul_roofline(device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of a plain fp32 ``n x n`` matmul (median of ``repeats``)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    _timed(lambda: a @ b, device)
    secs = sorted(_timed(lambda: a @ b, device) for _ in range(repeats))
    return 2 * n**3 / secs[len(secs) // 2] / 1e9


def _stats(secs: list[float]) -> tuple[float, float]:
    ms = np.asarray(secs) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def run(args: argparse.Namespace) -> int:
    keep_host_pages()  # as a serving worker runs
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    head = args.dim // args.heads
    config = HSTUConfig(
        layers=args.layers,
        heads=args.heads,
        dim=args.dim,
        attn_dim=head,
        linear_dim=head,
        attn_block=args.block,
        candidate_batch=args.candidates,
        dropout=0.0,
        dtype=args.dtype,
        device=args.device,
    )
    model = HSTURanker(config).eval()
    gen = torch.Generator().manual_seed(args.seed)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    common = {
        "bench": "model",
        "device": str(device),
        "dtype": args.dtype,
        "layers": args.layers,
        "dim": args.dim,
        "heads": args.heads,
        "threads": torch.get_num_threads(),
        "model_version": model.model_version,
    }
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)

    for p in lengths:
        h = synthetic_history(p + args.suffix, config.num_items, gen)
        cands = torch.randint(1, config.num_items + 1, (args.candidates,), generator=gen)
        when = float(h.timestamps[-1]) + 30.0
        prefix_events, suffix = h.slice(0, p), h.slice(p)
        roof = matmul_roofline(device)
        prefix = model.prefill(prefix_events)
        relay_scores = model.rank(prefix, suffix, cands, when)  # warm-up, and the exactness check
        full_scores = model.rank_full(h, cands, when)
        max_diff = float((relay_scores - full_scores).abs().max())
        relay, full, relay_faults, full_faults = [], [], [], []
        for _ in range(args.repeats):  # interleaved: both paths see the same machine load
            relay.append(_timed(lambda: model.rank(prefix, suffix, cands, when), device, relay_faults))  # noqa: B023
            full.append(_timed(lambda: model.rank_full(h, cands, when), device, full_faults))  # noqa: B023
        r50, r99 = _stats(relay)
        f50, f99 = _stats(full)
        rf, ff = (
            model.flops(p, args.suffix, args.candidates),
            model.flops(0, p + args.suffix, args.candidates),
        )
        emit(
            {
                **common,
                "kind": "rank",
                "prefix_len": p,
                "suffix_len": args.suffix,
                "candidates": args.candidates,
                "relay_ms_p50": round(r50, 3),
                "relay_ms_p99": round(r99, 3),
                "full_ms_p50": round(f50, 3),
                "full_ms_p99": round(f99, 3),
                "speedup": round(f50 / r50, 2),
                "relay_gflops": round(rf / r50 / 1e6, 2),
                "full_gflops": round(ff / f50 / 1e6, 2),
                "roofline_gflops": round(roof, 2),
                "relay_roofline_frac": round(rf / r50 / 1e6 / roof, 3),
                "full_roofline_frac": round(ff / f50 / 1e6 / roof, 3),
                "relay_gflop": round(rf / 1e9, 3),
                "full_gflop": round(ff / 1e9, 3),
                "max_abs_diff": max_diff,
                # Minor page faults per call (median), with the host heap kept as serving keeps it.
                "relay_page_faults_p50": int(np.median(relay_faults)),
                "full_page_faults_p50": int(np.median(full_faults)),
                "repeats": args.repeats,
            }
        )
        pre = [_timed(lambda: model.prefill(prefix_events), device) for _ in range(args.repeats)]  # noqa: B023
        ext = [_timed(lambda: model.extend(prefix, h), device) for _ in range(args.repeats)]  # noqa: B023
        for kind, secs, flops, new in (
            ("prefill", pre, model.flops(0, p, 0), p),
            ("extend", ext, model.flops(p, args.suffix, 0), args.suffix),
        ):
            p50, p99 = _stats(secs)
            emit(
                {
                    **common,
                    "kind": kind,
                    "prefix_len": p,
                    "new_tokens": new,
                    "ms_p50": round(p50, 3),
                    "ms_p99": round(p99, 3),
                    "gflops": round(flops / p50 / 1e6, 2),
                    "roofline_gflops": round(roof, 2),
                    "kv_bytes": prefix.nbytes(),
                    "repeats": args.repeats,
                }
            )
    if not args.json:
        print(
            f"{'prefix':>7} {'relay p50/p99 ms':>18} {'full p50/p99 ms':>18} {'speedup':>8} "
            f"{'relay GF/s':>10} {'full GF/s':>9} {'roof GF/s':>9} {'full/roof':>9} "
            f"{'prefill ms':>10} {'extend ms':>9}"
        )
        by = {(r["kind"], r["prefix_len"]): r for r in rows}
        for p in lengths:
            r, pf, ex = by[("rank", p)], by[("prefill", p)], by[("extend", p)]
            print(
                f"{p:>7} {r['relay_ms_p50']:>8.2f}/{r['relay_ms_p99']:<9.2f} {r['full_ms_p50']:>8.2f}/{r['full_ms_p99']:<9.2f}"
                f" {r['speedup']:>8.1f} {r['relay_gflops']:>10.1f} {r['full_gflops']:>9.1f} {r['roofline_gflops']:>9.1f}"
                f" {r['full_roofline_frac']:>9.2f} {pf['ms_p50']:>10.2f} {ex['ms_p50']:>9.2f}"
            )
    return 0
