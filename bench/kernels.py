"""HSTU attention kernels: the CPU backend vs the Triton kernel, per shape, one JSON line.

One call of ``hstu_mha`` (one layer; a forward runs it ``layers`` times) for each model shape
(``--presets``: ``large`` 4 heads of 64, ``xl`` 8 heads of 128, ``nvidia-block`` 4 heads of 256)
and key count (``--lengths``):

- ``relay_1``: one user's relay ranking: 64 new history tokens and 128 candidates as queries
  against the user's keys (cached prefix, new tokens, candidates); ``nvidia-block``: 128 and 256,
  its anchor's shape (``--lengths 4096`` is its 3,968 cached events, 128 new and 256 candidates);
- ``relay_batch``: ``--batch-users`` users at once, key counts spread from half the length to
  the length (a jagged batch);
- ``full``: a full ranking, as many queries as keys (causal).

Per row: median milliseconds of the CPU backend (``reference_ms``, the name the device report
reads) and of the Triton kernel (CUDA events after warm-up, ``--repeats`` timed calls), the
TFLOP/s each achieves on the visible pairs' useful work (``2 (d_qk + d_v)`` per pair and head), the
speed-up, the worst absolute difference of the kernel from the CPU backend, and
``triton_gated_ms``: the kernel with what follows it in a layer (``hstu_mha_gated``). The
attention constants are the model's defaults (64 x 64 bias buckets, normaliser 256, far keys
beyond 64 positions weighing 128 keys). On a CPU the benchmark runs a tiny shape, the kernel
through Triton's interpreter where ``TRITON_INTERPRET=1`` is set, else the CPU backend alone.
``--sweep`` times a grid of tile configs per shape instead (tuning ``choose_config``: tiles and
head groups, then warps, stages, key splits and per-key row terms around the two best;
``--sweep-limit`` caps each stage, ``--dry-run`` lists the first stage without timing);
``--build sm_90`` only compiles the configs ``choose_config`` picks, with no GPU, and reports each
one's registers per thread, stack bytes (spills) and key-loop SASS instruction counts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from relaygr.workers.kernels import AttentionParams, JaggedBatch
from relaygr.workers.kernels.cpu import cpu_hstu_mha

SHAPES = {"tiny": (2, 16), "large": (4, 64), "xl": (8, 128), "nvidia-block": (4, 256)}  # heads, head dim
LAYERS = {"tiny": 2, "large": 8, "xl": 24, "nvidia-block": 8}
PARAMS = AttentionParams(num_pos=64, num_time=64, normaliser=256.0, near_keys=64, far_keys=128.0)
NEW_TOKENS, CANDIDATES = 64, 128
RELAY_QUERIES = {"nvidia-block": (128, 256)}
"""A shape's relay ranking (new events, candidates) where it is not ``NEW_TOKENS``, ``CANDIDATES``:
NVIDIA's cached HSTU block ranks 256 candidates after 128 new events."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--presets", default="large,xl" if cuda else "tiny", help="shapes: tiny, large, xl, nvidia-block"
    )
    parser.add_argument("--lengths", default="2048,8192" if cuda else "256", help="keys per user")
    parser.add_argument("--kinds", default="relay_1,relay_batch,full", help="which calls to time")
    parser.add_argument("--batch-users", type=int, default=32 if cuda else 3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16" if cuda else "fp32")
    parser.add_argument("--repeats", type=int, default=20 if cuda else 2)
    parser.add_argument("--sweep", action="store_true", help="time a grid of tile configs instead")
    parser.add_argument(
        "--sweep-limit", type=int, default=0, help="with --sweep: at most this many configs a stage"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="with --sweep: list the first stage's configs, time nothing"
    )
    parser.add_argument(
        "--build",
        default=None,
        metavar="SM",
        help="only compile the chosen configs for a target (sm_90), no GPU needed: registers, spills",
    )
    parser.add_argument(
        "--paged", action="store_true", help="with --build: the kernel that reads keys through a row index"
    )
    parser.add_argument("--seed", type=int, default=0)


def _user(gen: torch.Generator, n_k: int, n_q: int, candidates: int):
    history = n_k - candidates
    pos = torch.cat([torch.arange(history), torch.full((candidates,), history)])
    gaps = 10 ** (torch.rand(history, generator=gen, dtype=torch.float64) * 6 - 1)
    ts = 1.7e9 + torch.cumsum(gaps, 0)
    ts = torch.cat([ts, (ts[-1] + 5.0).expand(candidates)])
    return pos, ts, pos[n_k - n_q :], ts[n_k - n_q :]


def _visible_pairs(n_k: int, n_q: int, candidates: int) -> int:
    """Pairs a query sees (keys before it and its own key): the useful work."""
    history = n_k - candidates
    first = history - (n_q - candidates)  # position of the first history query
    hist_pairs = sum(range(first + 1, history + 1))
    return hist_pairs + candidates * (history + 1)


def make_call(preset: str, kind: str, length: int, users: int, dtype: torch.dtype, device: str, seed: int):
    """(args of hstu_mha, useful FLOPs) of one benchmark call."""
    heads, d = SHAPES[preset]
    gen = torch.Generator().manual_seed(seed)
    new, candidates = RELAY_QUERIES.get(preset, (NEW_TOKENS, CANDIDATES))
    queries = new + candidates
    if kind != "full" and length < queries:
        raise ValueError(f"length {length} is under the {queries} queries of a relay ranking")
    if kind == "full":
        sizes = [(length, length, 0)]
    elif kind == "relay_1":
        sizes = [(length, queries, candidates)]
    elif kind == "relay_batch":
        spread = [length - b * length // (2 * users) for b in range(users)]
        sizes = [(max(n_k, queries), queries, candidates) for n_k in spread]
    else:
        raise ValueError(f"unknown kind {kind!r}: use relay_1, relay_batch or full")
    parts = [_user(gen, *s) for s in sizes]
    batch = JaggedBatch.build(
        [s[1] for s in sizes],
        [s[0] for s in sizes],
        *(torch.cat([p[i] for p in parts]).to(device) for i in (2, 3, 0, 1)),
    )
    n_q, n_k = sum(s[1] for s in sizes), sum(s[0] for s in sizes)

    def rand(n: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(n, heads, d, generator=gen) * scale).to(dtype).to(device)

    args = (rand(n_q, d**-0.5), rand(n_k), rand(n_k), batch,
            (torch.randn(PARAMS.num_pos * PARAMS.num_time, generator=gen) * 0.3).to(device), PARAMS)  # fmt: skip
    flops = sum(_visible_pairs(*s) for s in sizes) * heads * 2 * (d + d)
    return args, flops


def time_ms(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median milliseconds of ``repeats`` calls after two warm-up calls."""
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def _kernel_runs(device: str) -> bool:
    return device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"


def measure(preset: str, kind: str, length: int, args: argparse.Namespace) -> dict:
    call, flops = make_call(
        preset, kind, length, args.batch_users, DTYPES[args.dtype], args.device, args.seed
    )
    batch = call[3]
    row = {"preset": preset, "layers": LAYERS[preset], "kind": kind, "users": batch.users,
           "keys": int(batch.k_pos.shape[0]), "queries": int(batch.q_pos.shape[0]), "gflop": flops / 1e9}  # fmt: skip
    ref_ms = time_ms(lambda: cpu_hstu_mha(*call), args.repeats, args.device)
    row.update(reference_ms=round(ref_ms, 4), reference_tflops=_sig(flops / ref_ms / 1e9))
    row.update(triton_ms=None, triton_tflops=None, speedup=None, worst_diff=None, triton_gated_ms=None)
    if _kernel_runs(args.device):
        from relaygr.workers.kernels.triton_hstu import hstu_forward

        try:  # a shape the kernel fails on is a row that says so, not a lost benchmark
            tri_ms = time_ms(lambda: hstu_forward(*call), args.repeats, args.device)
            diff = (hstu_forward(*call).float() - cpu_hstu_mha(*call).float()).abs().max()
        except Exception as exc:
            row.update(triton_error=f"{type(exc).__name__}: {str(exc)[:300]}")
            return row
        row.update(triton_ms=round(tri_ms, 4), triton_tflops=_sig(flops / tri_ms / 1e9),
                   speedup=round(ref_ms / tri_ms, 2), worst_diff=float(diff),
                   triton_gated_ms=round(time_ms(_gated_call(call), args.repeats, args.device), 4))  # fmt: skip
    return row


def _gated_call(call: tuple) -> Callable[[], object]:
    """The call with what follows attention in a layer (``hstu_forward_gated``: norm, gate)."""
    from relaygr.workers.kernels.triton_hstu import hstu_forward_gated

    q, _, v = call[:3]
    width = q.shape[1] * v.shape[2]
    gate = torch.ones(q.shape[0], width, dtype=q.dtype, device=q.device)
    out = torch.empty_like(gate)
    norm = (torch.ones(width, device=q.device), torch.zeros(width, device=q.device), 1e-5)
    return lambda: hstu_forward_gated(*call, norm, gate, out)


def _fields(config) -> list:
    return [config.block_m, config.block_n, config.num_warps, config.num_stages, config.splits,
            config.head_group, config.row_terms]  # fmt: skip


def _try(config, call, flops: int, repeats: int, device: str) -> dict:
    from relaygr.workers.kernels.triton_hstu import hstu_forward

    try:
        ms = time_ms(lambda: hstu_forward(*call, config=config), repeats, device)
    except Exception as err:  # a config the compiler refuses (shared memory, registers)
        return {"config": _fields(config), "error": f"{type(err).__name__}: {str(err)[:80]}"}
    return {"config": _fields(config), "ms": round(ms, 4), "tflops": _sig(flops / ms / 1e9)}


def sweep_grid(heads: int, d: int, limit: int = 0) -> list:
    """The sweep's first stage: tiles (queries x keys) and heads per program, 8 warps for 128-query
    tiles and 4 otherwise, 2 stages, automatic splits, pair terms per pair."""
    from relaygr.workers.kernels.triton_hstu import KernelConfig

    groups = [g for g in (1, 2, 4) if heads % g == 0 and g * d <= 512]
    grid = [KernelConfig(bm, bn, 8 if bm == 128 else 4, 2, 0, g)
            for bm, bn, g in itertools.product((64, 128, 32), (16, 32, 64), groups)]  # fmt: skip
    return grid[:limit] if limit > 0 else grid


def around(best, splits: int, kind: str, limit: int = 0) -> list:
    """The sweep's second stage around a config: warps, stages, key splits (1, and a quarter to
    twice ``splits``, the automatic count for the shape) and per-key row terms (relay only)."""
    from relaygr.workers.kernels.triton_hstu import KernelConfig

    counts = (
        (0,)
        if kind == "full"
        else tuple(sorted({0, 1, max(1, splits // 4), max(1, splits // 2), 2 * splits}))
    )
    rows = (False,) if kind == "full" else (False, True)
    grid = [KernelConfig(best.block_m, best.block_n, warps, stages, s, best.head_group, row_terms)
            for warps, stages, s, row_terms in itertools.product((4, 8), (2, 3), counts, rows)]  # fmt: skip
    return grid[:limit] if limit > 0 else grid


def _ranked(results: list[dict]) -> list[dict]:
    return sorted(results, key=lambda r: r.get("ms", float("inf")))


def sweep(preset: str, kind: str, length: int, args: argparse.Namespace) -> dict:
    """Milliseconds per tile config for one shape, best first (``sweep_grid``, then ``around`` the
    two best). Config fields: block_m, block_n, num_warps, num_stages, splits (0: automatic),
    head_group, row_terms. With ``--dry-run`` the first stage's configs, untimed."""
    from relaygr.workers.kernels.triton_hstu import KernelConfig, choose_config

    heads, d = SHAPES[preset]
    grid = sweep_grid(heads, d, args.sweep_limit)
    if args.dry_run:
        return {"preset": preset, "kind": kind, "length": length, "first_stage": [_fields(c) for c in grid]}
    call, flops = make_call(
        preset, kind, length, args.batch_users, DTYPES[args.dtype], args.device, args.seed
    )
    repeats = max(3, args.repeats // 4)
    batch = call[3]
    sm_count = (torch.cuda.get_device_properties(args.device).multi_processor_count
                if args.device.startswith("cuda") else 132)  # fmt: skip
    chosen = choose_config(DTYPES[args.dtype], d, d, batch.max_q, batch.max_k, batch.users, heads, sm_count)
    first = _ranked([_try(c, call, flops, repeats, args.device) for c in grid])
    second = []
    for best in (r for r in first[:2] if "ms" in r):
        bm, bn, _, _, _, g, _ = best["config"]
        for config in around(KernelConfig(bm, bn, head_group=g), chosen.splits, kind, args.sweep_limit):
            second.append(_try(config, call, flops, repeats, args.device))
    results = _ranked(first + second)
    return {"preset": preset, "kind": kind, "length": length, "chosen": _try(chosen, call, flops, repeats, args.device),
            "top": results[:5], "configs": len(results), "errors": [r for r in results if "error" in r][:3]}  # fmt: skip


POINTER_ARGS = {"BIAS": "*fp32", "Q_OFFSETS": "*i64", "K_OFFSETS": "*i64", "Q_POS": "*i64", "K_POS": "*i64",
                "Q_TS": "*fp64", "K_TS": "*fp64", "Q_REL": "*i32", "K_REL": "*i32", "POS32_OK": "*i32",
                "CAUSAL_OK": "*i32", "K_ROWS": "*i64"}  # fmt: skip
FLOAT_ARGS = ("normaliser", "far_keys")
TRITON_TYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


def _loop_sizes(sass: str) -> list[int]:
    """Instructions between each backward branch of a SASS listing and its target (the loops)."""
    import re

    sizes = []
    for line in sass.splitlines():
        found = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?P\d\s+)?BRA\s+0x([0-9a-f]+)", line)
        if found and int(found.group(2), 16) < int(found.group(1), 16):
            sizes.append((int(found.group(1), 16) - int(found.group(2), 16)) // 16 + 1)
    return sizes


def build(preset: str, kind: str, length: int, args: argparse.Namespace) -> dict:
    """Compile (no GPU needed) the config ``choose_config`` picks for a shape, for ``--build``'s
    target (``sm_90``: the H100 and H200): registers per thread, stack (spills) and shared memory."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from relaygr.workers.kernels.triton_hstu import choose_config, kernel_constants

    heads, d = SHAPES[preset]
    queries = length if kind == "full" else sum(RELAY_QUERIES.get(preset, (NEW_TOKENS, CANDIDATES)))
    users = args.batch_users if kind == "relay_batch" else 1
    config = choose_config(DTYPES[args.dtype], d, d, queries, length, users, heads, 132)
    kernel, constants = kernel_constants(
        config, DTYPES[args.dtype], d, d, PARAMS.near_keys > 0, has_rows=args.paged
    )
    signature = {
        name: "constexpr" if name in constants
        else TRITON_TYPES[args.dtype] if name in ("Q", "K", "V", "OUT")
        else POINTER_ARGS.get(name, "fp32" if name in FLOAT_ARGS else "i32")
        for name in kernel.arg_names
    }  # fmt: skip
    if args.build.startswith("sm_"):
        capability = int(args.build[3:])
    else:
        raise SystemExit(f"--build: a target like sm_90, got {args.build!r}")
    compiled = triton.compile(
        ASTSource(kernel, signature, constants),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": config.num_warps, "num_stages": config.num_stages, "enable_fp_fusion": True},
    )
    row = {"preset": preset, "kind": kind, "length": length, "config": config.__dict__,
           "shared_bytes": compiled.metadata.shared, "registers": None, "stack_bytes": None,
           "loop_instructions": None}  # fmt: skip
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if tool.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run(
                [str(tool), "--dump-resource-usage", cubin.name], capture_output=True, text=True
            )
            sass = subprocess.run([str(tool), "-sass", cubin.name], capture_output=True, text=True)
        found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage.stdout)
        if found:
            row.update(registers=int(found.group(1)), stack_bytes=int(found.group(2)))
        # The key loops' SASS instructions (one per position path): a static proxy of a tile's work.
        row["loop_instructions"] = _loop_sizes(sass.stdout)
    return row


def run(args: argparse.Namespace) -> int:
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    for p in presets:
        if p not in SHAPES:
            raise SystemExit(f"--presets: no shape {p!r}; use {sorted(SHAPES)}")
    if args.repeats < 1 or args.batch_users < 1:
        raise SystemExit("--repeats and --batch-users must be at least 1")
    step = build if args.build else sweep if args.sweep else measure
    rows = [step(p, k, n, args) for p in presets for n in lengths for k in kinds]
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(json.dumps({"bench": "kernels", "device": args.build or name, "dtype": args.dtype, "sweep": args.sweep,
                      "interpreted": not args.device.startswith("cuda") and _kernel_runs(args.device),
                      "rows": rows}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
