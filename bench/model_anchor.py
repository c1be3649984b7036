"""``relaygr bench model --anchor``: NVIDIA's cached HSTU block at its published shape, ours beside it.

NVIDIA's HSTU inference (recsys-examples: a paged GPU KV table, CUDA graphs, bf16) runs its cached
block (8 layers, hidden 1024, 4 heads; per user a 4,096-event history of which 3,968 events are
cached, 128 new events and 256 candidates) on a B200 in about 0.18 ms a forward at batch 1 and about
0.5 ms at batch 8. This runs that shape with the ``nvidia-block`` preset (``workers.model.presets``):
per batch (1 and 8) one line with the relay forward of the batch's users (``rank_users``: one
forward) eagerly and as a bucket's CUDA graph replay over the paged pool (``use_graph_relay``; the
same forward eagerly off CUDA), in ms per forward (P50, P99), with NVIDIA's figure, the H200 target
(0.4 and 1.2 ms) and the graph's bucket: the bucket grids of ``graph_runner`` pad the anchor's 128
events and 256 candidates to a larger bucket, and ``bucket_rows`` against ``rows`` says how much of
the graphed forward is padding.

On a CPU the full shape (about 44M parameters over 4,096-event histories, eight users) takes tens
of minutes: ``--anchor`` refuses it there unless ``--quick`` (one layer, one repeat: the command
and its line work, the figures are not the anchor's).

Primitives: ``ANCHOR`` (the shape), ``NVIDIA_MS`` and ``TARGET_MS`` (per batch); ``anchor_rows(args,
history)``: the lines; ``check_anchor(args)``: the refusal above; ``run_anchor(args, history)``:
``bench model --anchor`` (JSON lines with ``--json``, else a line of text per batch; exit 2 for a
refusal).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from relaygr.workers.model.devices import resolve_device, synchronize
from relaygr.workers.model.graph_runner import bucket_for, pool_tokens_for
from relaygr.workers.model.inference import UserRanking
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.presets import preset
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events

ANCHOR = {"history": 4096, "cached": 3968, "new": 128, "candidates": 256}
NVIDIA_MS = {1: 0.18, 8: 0.5}
"""NVIDIA's cached HSTU block on a B200, ms per forward, by batch."""
TARGET_MS = {1: 0.4, 8: 1.2}
"""The H200 targets, ms per forward, by batch."""
BATCHES = (1, 8)


def check_anchor(args: argparse.Namespace) -> str | None:
    """Why ``--anchor`` cannot run as asked (``None``: it can)."""
    if resolve_device(args.device).type == "cpu" and not args.quick:
        return (
            "--anchor runs NVIDIA's block shape (8 layers of width 1024, 4,096-event histories, "
            "8 users): tens of minutes on a CPU. Run it on a GPU (--device cuda --dtype bfloat16), "
            "or add --quick for one layer and one repeat (its figures are not the anchor's)"
        )
    return None


def _model(args: argparse.Namespace, dtype: str) -> ModelRunner:
    torch.manual_seed(args.seed)
    shape = preset("nvidia-block")
    config = shape.config(
        layers=1 if args.quick else shape.layers, attn_block=args.block,
        candidate_batch=ANCHOR["candidates"], dropout=0.0, dtype=dtype, device=args.device,
    )  # fmt: skip
    # Served as the engine serves it, with pages for every user of every batch at once.
    return ModelRunner(
        HSTURanker(config).eval(), pool_tokens=pool_tokens_for(ANCHOR["history"], 1 + sum(BATCHES))
    )


def _ms(fn: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """P50 and P99 milliseconds of ``repeats`` calls (the device synchronised around each)."""
    secs = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        secs.append(time.perf_counter() - start)
    ms = np.asarray(secs) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def _requests(model: ModelRunner, users: int, history: Callable, gen: torch.Generator) -> list[UserRanking]:
    out = []
    for _ in range(users):
        h = history(ANCHOR["history"], model.config.num_items, gen)
        cands = torch.randint(1, model.config.num_items + 1, (ANCHOR["candidates"],), generator=gen)
        prefix = model.prefill(h.slice(0, ANCHOR["cached"]))
        out.append(UserRanking(prefix, h, cands, float(h.timestamps[-1]) + 30.0))
    return out


def _batch_row(model: ModelRunner, users: int, args, history: Callable, gen: torch.Generator) -> dict:
    device, repeats = model.device, 1 if args.quick else args.repeats
    reqs = _requests(model, users, history, gen)

    def forward() -> list[torch.Tensor]:
        return [scores for scores, _ in model.rank_users(reqs)]

    eager = forward()  # and the warm-up
    e50, e99 = _ms(forward, device, repeats)
    bucket = bucket_for(users, ANCHOR["new"], ANCHOR["candidates"])
    row = {
        "kind": "anchor", "batch": users, **ANCHOR, "layers": model.config.layers, "quick": args.quick,
        "relay_ms_p50": round(e50, 4), "relay_ms_p99": round(e99, 4),
        "relay_graphed_ms_p50": None, "relay_graphed_ms_p99": None, "graph_error": None,
        "rows": users * (ANCHOR["new"] + ANCHOR["candidates"]),
        "bucket": None if bucket is None else [bucket.users, bucket.suffix, bucket.candidates],
        "bucket_rows": None if bucket is None else bucket.rows,
        "nvidia_b200_ms": NVIDIA_MS[users], "target_h200_ms": TARGET_MS[users], "repeats": repeats,
    }  # fmt: skip
    try:
        model.use_graph_relay(True, prefix_tokens=ANCHOR["cached"])
        graphed = forward()  # the capture, and the exactness check
        g50, g99 = _ms(forward, device, repeats)
        counters = model.graph_relay.counters() if model.graph_relay is not None else {}
        row |= {
            "relay_graphed_ms_p50": round(g50, 4), "relay_graphed_ms_p99": round(g99, 4),
            "graph_captured": counters.get("captured"), "graph_error": counters.get("graph_error"),
            "graphed_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(eager, graphed, strict=True)),
        }  # fmt: skip
    except Exception as e:  # a failed capture must not cost the eager figures
        row["graph_error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        model.graph_relay = None
    best = row["relay_graphed_ms_p50"] or row["relay_ms_p50"]
    row["meets_target"] = None if args.quick or device.type != "cuda" else best <= TARGET_MS[users]
    return row


def anchor_rows(
    args: argparse.Namespace, history: Callable[[int, int, torch.Generator], Events]
) -> list[dict]:
    """One ``anchor`` line per batch of ``BATCHES``, in ``args.dtype`` (the first given) on
    ``args.device``; ``history(n, num_items, gen)`` makes a user's events."""
    dtype = next(d.strip() for d in args.dtype.split(",") if d.strip())
    model = _model(args, dtype)
    gen = torch.Generator().manual_seed(args.seed)
    common = {"bench": "model", "device": str(model.device), "dtype": dtype, "preset": "nvidia-block"}
    return [{**common, **_batch_row(model, users, args, history, gen)} for users in BATCHES]


def run_anchor(args: argparse.Namespace, history: Callable[[int, int, torch.Generator], Events]) -> int:
    if reason := check_anchor(args):
        print(f"relaygr bench model: {reason}", file=sys.stderr)
        return 2
    for row in anchor_rows(args, history):
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        graphed = row["relay_graphed_ms_p50"]
        print(
            f"{row['dtype']} batch {row['batch']}: relay {row['relay_ms_p50']:.3f} ms eager, "
            + (f"{graphed:.3f} ms graphed" if graphed is not None else f"not graphed ({row['graph_error']})")
            + f" (bucket {row['bucket']}); NVIDIA's B200 {row['nvidia_b200_ms']} ms, "
            + f"target {row['target_h200_ms']} ms"
            + (" [quick: one layer]" if row["quick"] else ""),
            flush=True,
        )
    return 0
