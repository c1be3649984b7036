"""Where a ranking's time goes on the device, next to a fused-attention floor of the same shape.

For each history length (``--lengths``, default 2k and 8k events) the model ranks one synthetic
request both ways, through its public methods only (``prefill``, ``rank``, ``rank_full``):

- ``relay``: the suffix and the candidates against the cached prefix;
- ``full``: the whole history and the candidates;
- ``relay_graphed``: the relay ranking in a bucketed static forward over the paged prefix pool
  (``ModelRunner.use_graph_relay``), replayed from a CUDA graph on CUDA (``graph_error`` when the
  capture failed: it then ran eagerly).

Each ranking runs once under ``torch.profiler`` (after warm-up calls) and its line gives the
kernels it launched, the device's busy time (the union of its kernels' intervals) against the wall
time of the call, and the top kernels by device time. Next to it, the floor: a plain transformer
of the same shape (layers, width, heads; the same U/Q/K/V projection, gating and output per layer)
whose attention is ``scaled_dot_product_attention`` (fused kernels), over the same query and key
counts (relay: suffix + candidates against the cached keys; full: everything, causal), timed
eager and, on CUDA, replayed from a CUDA graph (no launch cost at all). On a CPU (the dry run)
there are no kernels: the top-level operators stand in for them and the graph is left out.

One JSON line per path and length (``"bench": "profile"``).

Primitives: ``FloorTransformer``, ``profile_call(fn, device) -> dict``, ``floor_times``,
``profile_graphed``, ``profile_rows``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from relaygr.bench.model import synthetic_history
from relaygr.workers.model.devices import resolve_dtype, synchronize
from relaygr.workers.model.graph_runner import pool_tokens_for
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.presets import preset
from relaygr.workers.model.runner import ModelRunner

TOP_KERNELS = 5


class FloorTransformer(nn.Module):
    """``layers`` blocks of: LayerNorm, one U/Q/K/V projection with SiLU, fused attention, a
    LayerNorm of its output gated by U, the output projection and the residual."""

    def __init__(self, layers: int, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.uqkv = nn.ModuleList(nn.Linear(dim, 4 * dim) for _ in range(layers))
        self.attn_norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.outs = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # [T, dim] -> [1, H, T, d]
        return t.unflatten(-1, (self.heads, -1)).transpose(0, 1).unsqueeze(0)

    def forward(
        self, x: torch.Tensor, cached: list[tuple[torch.Tensor, torch.Tensor]] | None
    ) -> torch.Tensor:
        """``x [T, dim]``; ``cached``: per layer the keys and values of a prefix (``[1, H, P, d]``),
        which every query sees (relay); None: causal attention over ``x`` alone (full)."""
        for i, (norm, proj, attn_norm, out) in enumerate(
            zip(self.norms, self.uqkv, self.attn_norms, self.outs, strict=True)
        ):
            u, q, k, v = F.silu(proj(norm(x))).chunk(4, dim=-1)
            q, k, v = self._heads(q), self._heads(k), self._heads(v)
            if cached is not None:
                k, v = torch.cat([cached[i][0], k], dim=2), torch.cat([cached[i][1], v], dim=2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=cached is None)
            x = x + out(attn_norm(a.squeeze(0).transpose(0, 1).flatten(-2)) * u)
        return x


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def profile_call(fn: Callable[[], object], device: torch.device) -> dict:
    """One call of ``fn`` under the profiler: kernels, device busy time, wall time, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:  # no kernels on a CPU: the top-level operators stand in for them
        kernels = [e for e in events if e.cpu_parent is None]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.end - e.time_range.start
    busy_ms = _union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return {
        "kernels": len(kernels),
        "wall_ms": round(wall_ms, 3),
        "device_busy_ms": round(busy_ms, 3),
        "busy_share": round(busy_ms / wall_ms, 3) if wall_ms > 0 else None,
        "top_kernels": [{"name": n[:120], "count": c, "ms": round(us / 1e3, 3)} for n, (c, us) in top],
    }


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def floor_times(
    floor: FloorTransformer,
    queries: int,
    cached_len: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
) -> dict:
    """The floor over ``queries`` tokens (against ``cached_len`` cached keys; 0: causal, no cache):
    eager time, kernels, and the time of a CUDA-graph replay (None off CUDA)."""
    heads, head = floor.heads, floor.dim // floor.heads
    x = torch.randn(queries, floor.dim, device=device, dtype=dtype)
    cached = None
    if cached_len:
        shape = (1, heads, cached_len, head)
        cached = [
            (torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype))
            for _ in floor.norms
        ]
    with torch.inference_mode():
        run = lambda: floor(x, cached)  # noqa: E731
        run()
        out = {"floor_eager_ms": _median_ms(run, device, repeats)}
        out["floor_kernels"] = profile_call(run, device)["kernels"]
        out["floor_graph_ms"] = None
        if device.type == "cuda":
            try:
                out["floor_graph_ms"] = _graph_ms(run, device, repeats)
            except RuntimeError as e:  # a capture that fails leaves the eager floor and the profile
                out["floor_graph_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def _graph_ms(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """``run`` captured once in a CUDA graph, then its replays timed."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up on a side stream, as capture requires
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return _median_ms(graph.replay, device, repeats)


def _model(args: argparse.Namespace) -> ModelRunner:
    torch.manual_seed(args.seed)
    shape = preset(args.preset)
    extra = {"layers": args.layers} if args.layers else {}
    config = shape.config(
        dropout=0.0, dtype=args.dtype, device=args.device, candidate_batch=args.candidates, **extra
    )
    longest = max(int(x) for x in args.lengths.split(","))
    # Served as the engine serves it, with pages for the longest history's prefix.
    return ModelRunner(HSTURanker(config).eval(), pool_tokens=pool_tokens_for(longest + args.suffix))


def _profile_length(
    model: ModelRunner, floor: FloorTransformer, n: int, gen: torch.Generator, args
) -> list[dict]:
    """Both paths at ``n`` events: profiled, timed, and their floors."""
    cfg, device, dtype = model.config, model.device, resolve_dtype(args.dtype)
    p = n - args.suffix
    h = synthetic_history(n, cfg.num_items, gen)
    cands = torch.randint(1, cfg.num_items + 1, (args.candidates,), generator=gen)
    when = float(h.timestamps[-1]) + 30.0
    prefix, suffix = model.prefill(h.slice(0, p)), h.slice(p)

    def relay() -> object:
        return model.rank(prefix, suffix, cands, when)

    def full() -> object:
        return model.rank_full(h, cands, when)

    rows = []
    for path, fn, queries, cached in (
        ("relay", relay, args.suffix + args.candidates, p),
        ("full", full, n + args.candidates, 0),
    ):
        for _ in range(args.warmup):
            fn()
        row = {"bench": "profile", "path": path, "length": n, "preset": args.preset, "layers": cfg.layers,
               "dim": cfg.dim, "heads": cfg.heads, "dtype": args.dtype, "device": str(device),
               "ranking_ms_p50": _median_ms(fn, device, args.repeats), **profile_call(fn, device)}  # fmt: skip
        row |= floor_times(floor, queries, cached, device, dtype, args.repeats)
        print(json.dumps(row), flush=True)
        rows.append(row)
    rows.append(profile_graphed(model, relay, p, {k: rows[0][k] for k in GRAPHED_COMMON}, args))
    return rows


GRAPHED_COMMON = ("bench", "length", "preset", "layers", "dim", "heads", "dtype", "device")


def profile_graphed(model: ModelRunner, relay: Callable[[], object], cached: int, common: dict, args) -> dict:
    """The relay ranking again, in a bucketed forward over the paged prefix pool
    (``use_graph_relay``: replayed from a CUDA graph on CUDA): ``path`` ``relay_graphed``. A capture
    that fails leaves its ``graph_error`` (the ranking then ran eagerly); any other failure too,
    without failing the step."""
    row = {**common, "path": "relay_graphed", "graph_error": None}
    try:
        graphs = model.use_graph_relay(True, prefix_tokens=cached)
        assert graphs is not None
        for _ in range(max(1, args.warmup)):  # the first one captures
            relay()
        row |= {
            "ranking_ms_p50": _median_ms(relay, model.device, args.repeats),
            **profile_call(relay, model.device),
        }
        row |= {"graph_captured": graphs.capture, "graph_error": graphs.graph_error}
        row |= {"graphed_rankings": graphs.counters()["graphed_rankings"]}
    except Exception as e:  # the eager rows stand; this one says why it has no numbers
        row["graph_error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        model.graph_relay = None  # off again, whatever failed
    print(json.dumps(row), flush=True)
    return row


def profile_rows(args: argparse.Namespace) -> tuple[list[dict], int]:
    """Every length of ``args.lengths``, each path; and how many lengths failed (each is reported
    as an ``error`` line and the next still runs)."""
    model = _model(args)
    cfg = model.config
    floor = FloorTransformer(cfg.layers, cfg.dim, cfg.heads).to(
        device=model.device, dtype=resolve_dtype(args.dtype)
    )
    gen = torch.Generator().manual_seed(args.seed)
    rows, failed = [], 0
    for n in [int(x) for x in args.lengths.split(",")]:
        try:
            rows += _profile_length(model, floor.eval(), n, gen, args)
        except (RuntimeError, ValueError) as e:  # out of memory, a kernel that failed: the others still run
            failed += 1
            print(
                json.dumps({"bench": "profile", "length": n, "error": f"{type(e).__name__}: {e}"[:500]}),
                flush=True,
            )
    return rows, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="large")
    parser.add_argument("--layers", type=int, help="fewer layers than the preset's (the dry run)")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on an accelerator, float32 on a CPU")
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--candidates", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    _, failed = profile_rows(args)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
