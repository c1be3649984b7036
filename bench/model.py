"""Rank with a cached prefix vs full inference, per prefix length: latency, GFLOP/s and the roofline.

For each prefix length the benchmark builds one synthetic history (prefix + short-term suffix),
pre-infers the prefix, then times, interleaved so that both see the same machine:

- ``rank``: the suffix and the candidates against the cached prefix (the relay path),
- ``rank_full``: the whole history and the candidates, no cache (the baseline, the same forward),

and separately ``prefill`` of the prefix and ``extend`` of the prefix by the suffix. Every line
reports the achieved GFLOP/s of each path (projections and attention, ``HSTURanker.flops``) next to
a plain fp32 matmul measured just before it on the same device: the machine's roofline, and the
minor page faults of a ranking call (the host heap kept, ``devices.keep_host_pages``, as serving
keeps it: a call should fault in next to nothing). A ``rank`` line also gives tokens computed per
second on each path, the speed-up against its FLOP bound, the KV bytes of the prefix (all layers
and per layer) and the exactness of relay against full: the worst absolute score difference and
the top-10 agreement, and the same relay ranking in a bucketed static forward over the paged
prefix pool (``relay_graphed_ms_p50``: replayed from a CUDA graph on CUDA, the same forward eagerly
elsewhere; ``graph_error`` when a capture failed, which never fails the run). ``--budget-ms`` adds a ``budget`` line: the largest history each path ranked
within that P99. ``--users N`` adds a ``users`` line per length: N users' relay rankings (each its
own prefix of that length, suffix and candidates) one ``rank_and_extend`` at a time vs one
``rank_users`` forward (the ranking worker's batch), in ms per request, and that forward as one
bucket's graph replay (``batched_graphed_ms_per_request_p50``; ``device_rankings_per_s``: the
rankings a second the device serves at that batch, the host's work aside). ``--preset`` takes a model shape of ``workers.model.presets``; ``--dtype`` one or more.
``--anchor`` prints instead an ``anchor`` line per batch (1 and 8) at NVIDIA's cached HSTU block's
shape (``model_anchor``: the ``nvidia-block`` preset, 3,968 cached events, 128 new, 256
candidates), its B200 figure beside ours; on a CPU only with ``--quick`` (one layer, one repeat).
One JSON line per measurement with ``--json``; a table otherwise.

Primitives: ``batched_graphed_columns``, ``synthetic_history``, ``matmul_roofline``, ``kv_bytes_per_layer``, ``top_k_agreement``,
``budget_row``, ``users_row``;
``add_arguments`` / ``run``.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable

import numpy as np
import torch

from relaygr.workers.model.devices import (
    device_name,
    keep_host_pages,
    resolve_device,
    resolve_dtype,
    synchronize,
)
from relaygr.workers.model.graph_runner import pool_tokens_for
from relaygr.workers.model.model import FAR_KEYS, NEAR_KEYS, HSTUConfig, HSTURanker
from relaygr.workers.model.presets import PRESETS, resolve_shape
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events, PrefixKV

DEFAULT_LENGTHS = "256,512,1024,2048,4096,8192"
BENCH_SHAPE = {"layers": 4, "dim": 128, "heads": 1}  # without --preset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--lengths", type=event_counts, default=DEFAULT_LENGTHS, help="prefix lengths, comma separated"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per path and length")
    parser.add_argument("--suffix", type=int, default=64, help="short-term (suffix) events")
    parser.add_argument("--candidates", type=int, default=128)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model shape (workers.model.presets); explicit --layers / --dim / --heads win "
        f"(without a preset: {BENCH_SHAPE['layers']} layers, d={BENCH_SHAPE['dim']}, {BENCH_SHAPE['heads']} head)",
    )
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument(
        "--heads",
        type=int,
        default=None,
        help="attention heads, head dim = dim / heads (same FLOPs for any count; fewer heads, fewer scores)",
    )
    parser.add_argument(
        "--block", type=int, default=512, help="most events of one pre-inference forward (attn_block)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="float32, bfloat16 or float16; several, comma separated, measure one after the other",
    )
    parser.add_argument(
        "--budget-ms",
        type=float,
        default=None,
        help="also print the largest history each path ranks within this P99 (a 'budget' line)",
    )
    parser.add_argument(
        "--roofline-n", type=int, default=2048, help="size of the square fp32 matmul of the roofline"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-graphs",
        dest="graphs",
        action="store_false",
        help="leave out the bucketed relay ranking (relay_graphed_ms: a CUDA graph's replay on CUDA)",
    )
    parser.add_argument(
        "--users", type=int, default=0, help="also rank this many users one at a time vs batched (0: no)"
    )
    parser.add_argument(
        "--anchor",
        action="store_true",
        help="NVIDIA's cached HSTU block shape (nvidia-block) at batch 1 and 8 instead (bench/model_anchor.py)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="with --anchor: one layer and one repeat (what a CPU can run)"
    )
    parser.add_argument(
        "--users-lengths",
        type=event_counts,
        default=[],
        help="the lengths of --lengths with a users line (default: every one)",
    )


def event_counts(text: str) -> list[int]:
    """An argument of comma-separated positive event counts (a usage error otherwise)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = [0]
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"positive event counts, comma separated, got {text!r}")
    return out


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


def kv_bytes_per_layer(prefix: PrefixKV) -> int:
    """Bytes of one layer's keys and values (every layer caches the same shapes)."""
    prefix = prefix.dense()  # a paged prefix's tokens, gathered
    if not prefix.keys:
        return 0
    return sum(t.numel() * t.element_size() for t in (prefix.keys[0], prefix.values[0]))


def top_k_agreement(a: torch.Tensor, b: torch.Tensor, k: int = 10) -> float:
    """Share of ``a``'s top ``k`` candidates that are in ``b``'s top ``k``."""
    k = min(k, len(a))
    if k == 0:
        return 1.0
    top_a, top_b = set(a.topk(k).indices.tolist()), set(b.topk(k).indices.tolist())
    return len(top_a & top_b) / k


def _model(args: argparse.Namespace, dtype: str) -> ModelRunner:
    shape = resolve_shape(
        args.preset, fallback=BENCH_SHAPE, layers=args.layers, heads=args.heads, dim=args.dim
    )
    head = shape["dim"] // shape["heads"]
    torch.manual_seed(args.seed)
    config = HSTUConfig(
        layers=shape["layers"],
        heads=shape["heads"],
        dim=shape["dim"],
        attn_dim=head,
        linear_dim=head,
        attn_block=args.block,
        candidate_batch=args.candidates,
        dropout=0.0,
        near_keys=NEAR_KEYS,  # the arithmetic `relaygr train` trains
        far_keys=FAR_KEYS,
        dtype=dtype,
        device=args.device,
    )
    # The model as the engine serves it, with pages for every user's longest prefix at once.
    pool = pool_tokens_for(max(args.lengths) + 2 * args.suffix, max(1, args.users) + 1)
    return ModelRunner(HSTURanker(config).eval(), pool_tokens=pool)


def _rank_row(
    model: HSTURanker, p: int, args: argparse.Namespace, gen: torch.Generator
) -> tuple[dict, tuple]:
    """Relay vs full at prefix length ``p``: the ``rank`` line, and what prefill/extend reuse."""
    device, n_cand = model.device, args.candidates
    h = synthetic_history(p + args.suffix, model.config.num_items, gen)
    cands = torch.randint(1, model.config.num_items + 1, (n_cand,), generator=gen)
    when = float(h.timestamps[-1]) + 30.0
    prefix_events, suffix = h.slice(0, p), h.slice(p)
    roof = matmul_roofline(device, args.roofline_n)
    prefix = model.prefill(prefix_events)
    relay_scores = model.rank(prefix, suffix, cands, when)  # warm-up, and the exactness check
    full_scores = model.rank_full(h, cands, when)
    relay, full, relay_faults, full_faults = [], [], [], []
    for _ in range(args.repeats):  # interleaved: both paths see the same machine load
        relay.append(_timed(lambda: model.rank(prefix, suffix, cands, when), device, relay_faults))
        full.append(_timed(lambda: model.rank_full(h, cands, when), device, full_faults))
    r50, r99 = _stats(relay)
    f50, f99 = _stats(full)
    graphed = graphed_columns(model, (prefix, suffix, cands, when), relay_scores, args) if args.graphs else {}
    rf, ff = model.flops(p, args.suffix, n_cand), model.flops(0, p + args.suffix, n_cand)
    row = {
        "kind": "rank",
        "prefix_len": p,
        "suffix_len": args.suffix,
        "candidates": n_cand,
        "relay_ms_p50": round(r50, 3),
        "relay_ms_p99": round(r99, 3),
        "full_ms_p50": round(f50, 3),
        "full_ms_p99": round(f99, 3),
        "speedup": round(f50 / r50, 2),
        # The FLOP bound of the speed-up (what relay saves in arithmetic) and the share of it won.
        "flop_bound": round(ff / rf, 2),
        "speedup_of_flop_bound": round(f50 / r50 / (ff / rf), 3),
        # Tokens computed per second: relay computes the suffix and the candidates, full all of them.
        "relay_tokens_per_s": round((args.suffix + n_cand) / (r50 / 1e3)),
        "full_tokens_per_s": round((p + args.suffix + n_cand) / (f50 / 1e3)),
        "relay_gflops": round(rf / r50 / 1e6, 2),
        "full_gflops": round(ff / f50 / 1e6, 2),
        "roofline_gflops": round(roof, 2),
        "relay_roofline_frac": round(rf / r50 / 1e6 / roof, 3),
        "full_roofline_frac": round(ff / f50 / 1e6 / roof, 3),
        "relay_gflop": round(rf / 1e9, 3),
        "full_gflop": round(ff / 1e9, 3),
        "max_abs_diff": float((relay_scores.float() - full_scores.float()).abs().max()),
        "top10_agreement": top_k_agreement(relay_scores, full_scores),
        "kv_bytes": prefix.nbytes(),
        "kv_bytes_per_layer": kv_bytes_per_layer(prefix),
        # Minor page faults per call (median), with the host heap kept as serving keeps it.
        "relay_page_faults_p50": int(np.median(relay_faults)),
        "full_page_faults_p50": int(np.median(full_faults)),
        "repeats": args.repeats,
        **graphed,
    }
    return row, (h, prefix_events, prefix, roof)


def graphed_columns(
    model: HSTURanker, request: tuple[PrefixKV, Events, torch.Tensor, float], eager: torch.Tensor, args
) -> dict:
    """The same relay ranking through ``use_graph_relay`` (a bucketed forward over the pages:
    a CUDA graph's replay on CUDA, the same forward eagerly elsewhere): its milliseconds, its worst
    difference from the eager relay scores, whether it was captured, and the error of a capture
    that failed (``graph_error``; the ranking then ran eagerly, and the step goes on)."""
    prefix, suffix, cands, when = request
    out: dict = {"relay_graphed_ms_p50": None, "relay_graphed_ms_p99": None, "graph_error": None}
    try:
        relay = model.use_graph_relay(True, prefix_tokens=prefix.length)
        assert relay is not None
        scores = model.rank(prefix, suffix, cands, when)  # the capture, and the exactness check
        secs = [
            _timed(lambda: model.rank(prefix, suffix, cands, when), model.device) for _ in range(args.repeats)
        ]
        g50, g99 = _stats(secs)
        counters = relay.counters()
        out |= {
            "relay_graphed_ms_p50": round(g50, 3),
            "relay_graphed_ms_p99": round(g99, 3),
            "graph_captured": counters["captured"],
            "graph_error": counters["graph_error"],
            "graphed_rankings": counters["graphed_rankings"],
            "graphed_max_abs_diff": float((scores.float() - eager.float()).abs().max()),
        }
    except Exception as e:  # a failure here must not cost the eager columns
        out["graph_error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        model.graph_relay = None  # off again, whatever failed
    return out


def _prefill_extend_rows(model: HSTURanker, p: int, args: argparse.Namespace, reuse: tuple) -> list[dict]:
    h, prefix_events, prefix, roof = reuse
    device = model.device
    pre = [_timed(lambda: model.prefill(prefix_events), device) for _ in range(args.repeats)]
    ext = [_timed(lambda: model.extend(prefix, h), device) for _ in range(args.repeats)]
    rows = []
    for kind, secs, flops, new in (
        ("prefill", pre, model.flops(0, p, 0), p),
        ("extend", ext, model.flops(p, args.suffix, 0), args.suffix),
    ):
        p50, p99 = _stats(secs)
        rows.append(
            {
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
    return rows


def users_row(model: HSTURanker, p: int, args: argparse.Namespace, gen: torch.Generator) -> dict:
    """``args.users`` users' relay rankings at prefix length ``p``: one ``rank_and_extend`` at a
    time vs one ``rank_users`` forward, ms per request (interleaved), and their worst difference."""
    from relaygr.workers.model.inference import UserRanking

    reqs = []
    for _ in range(args.users):
        h = synthetic_history(p + args.suffix, model.config.num_items, gen)
        cands = torch.randint(1, model.config.num_items + 1, (args.candidates,), generator=gen)
        reqs.append(UserRanking(model.prefill(h.slice(0, p)), h, cands, float(h.timestamps[-1]) + 30.0))

    def alone() -> list[torch.Tensor]:
        return [model.rank_and_extend(r.prefix, r.history, r.candidates, r.request_ts)[0] for r in reqs]

    def batched() -> list[torch.Tensor]:
        return [scores for scores, _ in model.rank_users(reqs)]

    alone_scores = alone()
    diff = max(
        float((a - b).abs().max()) for a, b in zip(alone_scores, batched(), strict=True)
    )  # and warm-up
    one, many = [], []
    for _ in range(args.repeats):
        one.append(_timed(alone, model.device))
        many.append(_timed(batched, model.device))
    o50, _ = _stats(one)
    m50, _ = _stats(many)
    graphed = batched_graphed_columns(model, batched, alone_scores, p, args) if args.graphs else {}
    return {
        "kind": "users",
        "prefix_len": p,
        "suffix_len": args.suffix,
        "candidates": args.candidates,
        "users": args.users,
        "alone_ms_per_request_p50": round(o50 / args.users, 3),
        "batched_ms_per_request_p50": round(m50 / args.users, 3),
        "speedup": round(o50 / m50, 2),
        "max_abs_diff": diff,
        "repeats": args.repeats,
        **graphed,
    }


def batched_graphed_columns(
    model: HSTURanker, batched: Callable[[], list[torch.Tensor]], alone: list[torch.Tensor], p: int, args
) -> dict:
    """The users' one forward through ``use_graph_relay`` (one bucket's replay on CUDA): ms per
    request, the rankings a second the device then serves (its time only, the host's aside), the
    worst difference from ranking each user alone, and the error of a capture that failed."""
    users = len(alone)
    out: dict = {
        "batched_graphed_ms_per_request_p50": None,
        "device_rankings_per_s": None,
        "graph_error": None,
    }
    try:
        relay = model.use_graph_relay(True, prefix_tokens=p)
        assert relay is not None
        got = batched()  # the capture, and the exactness check
        g50, _ = _stats([_timed(batched, model.device) for _ in range(args.repeats)])
        counters = relay.counters()
        out |= {
            "batched_graphed_ms_per_request_p50": round(g50 / users, 3),
            "device_rankings_per_s": round(1000 * users / g50, 1),
            "graph_captured": counters["captured"],
            "graph_error": counters["graph_error"],
            "batched_graphed_rankings": counters["graphed_rankings"],
            "batched_graphed_max_abs_diff": max(
                float((a.float() - b.float()).abs().max()) for a, b in zip(got, alone, strict=True)
            ),
        }
    except Exception as e:  # a failure here must not cost the eager columns
        out["graph_error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        model.graph_relay = None
    return out


def budget_row(rank_rows: list[dict], budget_ms: float) -> dict:
    """The largest history (prefix + suffix events) each path ranked with its P99 within
    ``budget_ms``, among the measured lengths (None: not even the shortest), and their ratio."""

    def largest(path: str) -> int | None:
        fit = [r["prefix_len"] + r["suffix_len"] for r in rank_rows if r[f"{path}_ms_p99"] <= budget_ms]
        return max(fit, default=None)

    relay, full = largest("relay"), largest("full")
    longest = max((r["prefix_len"] + r["suffix_len"] for r in rank_rows), default=0)
    return {
        "kind": "budget",
        "budget_ms": budget_ms,
        "relay_max_history": relay,
        "full_max_history": full,
        "ratio": round(relay / full, 2) if relay and full else None,
        # When the relay path held the longest length measured, its ratio is a lower bound.
        "relay_at_longest_measured": relay == longest,
        "measured_lengths": [r["prefix_len"] + r["suffix_len"] for r in rank_rows],
    }


def _print_table(rows: list[dict], lengths: list[int]) -> None:
    print(
        f"{'dtype':>8} {'prefix':>7} {'relay p50/p99 ms':>18} {'full p50/p99 ms':>18} {'speedup':>8} "
        f"{'relay GF/s':>10} {'full GF/s':>9} {'roof GF/s':>9} {'full/roof':>9} "
        f"{'prefill ms':>10} {'extend ms':>9}"
    )
    by = {(r["dtype"], r["kind"], r.get("prefix_len")): r for r in rows}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for p in lengths:
            r, pf, ex = by[(dtype, "rank", p)], by[(dtype, "prefill", p)], by[(dtype, "extend", p)]
            print(
                f"{dtype:>8} {p:>7} {r['relay_ms_p50']:>8.2f}/{r['relay_ms_p99']:<9.2f} {r['full_ms_p50']:>8.2f}/{r['full_ms_p99']:<9.2f}"
                f" {r['speedup']:>8.1f} {r['relay_gflops']:>10.1f} {r['full_gflops']:>9.1f} {r['roofline_gflops']:>9.1f}"
                f" {r['full_roofline_frac']:>9.2f} {pf['ms_p50']:>10.2f} {ex['ms_p50']:>9.2f}"
            )
    for r in rows:
        if r["kind"] == "users":
            print(
                f"{r['dtype']}: {r['users']} users at prefix {r['prefix_len']}: "
                f"{r['alone_ms_per_request_p50']:.2f} ms/request alone, "
                f"{r['batched_ms_per_request_p50']:.2f} batched ({r['speedup']}x)"
                + (
                    f", {r['batched_graphed_ms_per_request_p50']:.2f} graphed "
                    f"({r['device_rankings_per_s']:.0f} rankings/s on the device)"
                    if r.get("batched_graphed_ms_per_request_p50") is not None
                    else ""
                )
            )
        if r["kind"] == "budget":
            print(
                f"{r['dtype']}: within {r['budget_ms']:g} ms P99: relay {r['relay_max_history']} events, "
                f"full {r['full_max_history']} events (ratio {r['ratio']})"
            )


def run(args: argparse.Namespace) -> int:
    keep_host_pages()  # as a serving worker runs
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.anchor:
        from relaygr.bench.model_anchor import run_anchor

        return run_anchor(args, synthetic_history)
    if args.users < 0:
        raise SystemExit(f"relaygr bench model: --users must be >= 0, got {args.users}")
    device = resolve_device(args.device)
    lengths = args.lengths
    users_at = set(args.users_lengths) or set(lengths)
    if not users_at <= set(lengths):
        raise SystemExit(
            f"relaygr bench model: --users-lengths {sorted(users_at - set(lengths))} not in --lengths"
        )
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for d in dtypes:
        resolve_dtype(d)  # a bad name fails before anything is measured
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)

    for dtype in dtypes:
        model = _model(args, dtype)
        common = {
            "bench": "model",
            "device": str(device),
            "device_name": device_name(device),
            "dtype": dtype,
            "layers": model.config.layers,
            "dim": model.config.dim,
            "heads": model.config.heads,
            "preset": args.preset,
            "threads": torch.get_num_threads(),
            "model_version": model.model_version,
        }
        gen = torch.Generator().manual_seed(args.seed)
        ranks = []
        for p in lengths:
            row, reuse = _rank_row(model, p, args, gen)
            ranks.append(row)
            emit({**common, **row})
            for r in _prefill_extend_rows(model, p, args, reuse):
                emit({**common, **r})
            if args.users > 0 and p in users_at:
                emit({**common, **users_row(model, p, args, gen)})
        if args.budget_ms is not None:
            emit({**common, **budget_row(ranks, args.budget_ms)})
        del model
    if not args.json:
        _print_table(rows, lengths)
    return 0
