"""The Triton forward kernels of ``hstu_mha`` and their launch (CUDA; CPU under ``TRITON_INTERPRET=1``).

Primitives:
- ``triton_hstu_mha(q, k, v, batch, bias_table, params)``: the interface's ``hstu_mha``, same
  signature and result as the oracle; it picks a ``KernelConfig`` and calls ``hstu_forward``.
- ``hstu_forward(..., config=)``: one launch of ``_hstu_fwd_kernel`` (one head per program) or
  ``_hstu_fwd_grouped_kernel`` (a group of heads sharing each pair's bias and weight) over (query
  block, user, head group x key split), plus one ``_finish_kernel`` launch when the keys are split.
- ``hstu_forward_gated(..., norm, gate, out, config=)`` (``triton_hstu_mha_gated``): what follows
  attention in a layer too, ``layer_norm(attention) * gate`` into ``out``: the attention kernel
  and one ``_finish_kernel`` launch, which adds the key splits' partial sums, normalises each row
  over its heads and multiplies it by the gate (three launches and two passes over the output
  fewer than attention, a norm and a product apart).
- ``KernelConfig``: block sizes, warps, pipeline stages, key splits and heads per program.
- ``choose_config(...)``: the config for a call's shape and dtype on a device;
  ``kernel_constants(config, ...)``: the kernel it launches and its compile-time arguments.
- The per-batch tensors it reads besides the batch's own (``frames``: the causal skip's limits,
  int32 relative positions), derived once per batch for all layers.

With a row index (``batch.k_rows``), ``k`` and ``v`` are whole tensors (a paged pool's layer) and
each key tile is loaded through the index (one indirect row load per tile, no gathered copy); the
keys past the last user's (a static capacity's unused tail) are never read.

Each program holds one block of one user's queries for its heads and loops over that user's key
blocks inside the kernel (``triton_tiles``): ``silu(q k^T + bias)`` times the pair's weight, then
times ``v``, summed in float32; no score matrix is ever in memory. HSTU has no softmax, so a user's
keys can be split across programs and their partial sums simply added (no running maximum, no
rescaling, as flash-decoding needs for a softmax): the split-K path, taken when the grid alone would
leave multiprocessors idle (a relay ranking: a few hundred queries, thousands of keys). Each user's
keys are split by its own key count, so that a batch sized for a larger capacity than its users
fill still keeps every split busy. The splits' float32 partial sums are added in a fixed order
(deterministic, no atomics) by ``_finish_kernel``, many rows per program; nothing on the launch
path reads the device (CUDA graphs capture it).

The kernels' body is ``triton_tiles``; here the kernels, the compile-time constants they are
launched with (``KernelConfig``, ``choose_config``, ``kernel_constants``) and the launch. The
batch's layout is ``batch``, its per-batch frames ``frames``, the entry point ``interface``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from relaygr.workers.kernels.batch import AttentionParams, JaggedBatch, check_key_rows
from relaygr.workers.kernels.frames import causal_limits, position_frames
from relaygr.workers.kernels.triton_tiles import (
    MAX_POSITION_GAP,
    TIME_LOG_OFFSET,
    group_keys,
    head_keys,
    key_range,
    query_terms,
    user_keys,
)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
MIN_BLOCK = 16  # tl.dot's smallest side
FINISH_ELEMENTS = 4096  # a finishing program's rows x padded row width
DEFAULT_SM_COUNT = 132  # where the device has no count to read (the interpreter)
MIN_SPLIT_BLOCKS = 4  # a key split holds at least this many key blocks


@dataclass(frozen=True)
class KernelConfig:
    """How one call is tiled: ``splits`` 0 chooses the key splits from the grid and the device."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    splits: int = 0
    head_group: int = 1  # heads per program: the pairs' bias and weight serve them all
    # A uniform query block's pair terms derived per key (``triton_tiles``). Off by default: at the
    # chosen tiles each thread's pairs lie in distinct key columns, so a per-key row costs each
    # thread as much as its pairs (``docs/kernels.md``); the sweep times it at wider tiles.
    row_terms: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            size = getattr(self, name)
            if size < MIN_BLOCK or size & (size - 1):
                raise ValueError(f"{name} must be a power of two of at least {MIN_BLOCK}, got {size}")
        if self.head_group < 1 or self.head_group & (self.head_group - 1):
            raise ValueError(f"head_group must be a power of two, got {self.head_group}")
        if self.splits < 0:
            raise ValueError(f"splits must be 0 (automatic) or positive, got {self.splits}")


@triton.jit
def _hstu_fwd_kernel(
    Q, K, V, OUT, BIAS, Q_OFFSETS, K_OFFSETS, Q_POS, Q_TS, K_POS, K_TS, Q_REL, K_REL, POS32_OK, CAUSAL_OK, K_ROWS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_os, stride_ot, stride_oh,
    num_heads, num_splits, num_pos, num_time, normaliser, near_keys, far_keys,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_FAR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, HAS_ROWS: tl.constexpr, ROW_TERMS: tl.constexpr,
):  # fmt: skip
    # The heaviest causal blocks (the last queries) are launched first.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    user = tl.program_id(1)
    head = tl.program_id(2) % num_heads
    split = tl.program_id(2) // num_heads
    q_start = tl.load(Q_OFFSETS + user)
    n_q = (tl.load(Q_OFFSETS + user + 1) - q_start).to(tl.int32)
    m0 = m_block * BLOCK_M
    if m0 >= n_q:
        return
    k_start = tl.load(K_OFFSETS + user)
    n_k = (tl.load(K_OFFSETS + user + 1) - k_start).to(tl.int32)

    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    d_qk = tl.arange(0, BLOCK_DQK)
    d_v = tl.arange(0, BLOCK_DV)
    q_tok = q_start + rows
    q = tl.load(
        Q + q_tok[:, None] * stride_qt + head * stride_qh + d_qk[None, :],
        mask=row_ok[:, None] & (d_qk[None, :] < D_QK),
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    own = n_k - n_q + rows  # each query's own key, counted within the user's keys
    lo, hi = key_range(CAUSAL_OK, user, n_q, n_k, m0, split, num_splits, BLOCK_M, BLOCK_N)
    k_user, v_user = user_keys(K, V, k_start, stride_kt, stride_vt, HAS_ROWS)
    first = q_start + m0
    if tl.load(POS32_OK + user) != 0:  # int32 positions relative to the user's first
        q_ts, far_scale, q_rel, uniform, pos0, ts0, far0 = query_terms(
            Q_POS, Q_TS, Q_REL, q_tok, first, row_ok, near_keys, far_keys
        )
        # One position and time for every row: the pair terms per key (where the config says so).
        if uniform if ROW_TERMS else False:
            acc = head_keys(
                q, q_rel, q_ts, own, far_scale, pos0, ts0, far0,
                k_user + head * stride_kh, v_user + head * stride_vh, BIAS - TIME_LOG_OFFSET,
                K_REL + k_start, K_TS + k_start, K_ROWS + k_start, lo, hi, stride_kt, stride_vt, num_pos,
                num_time, near_keys, D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M,
                BLOCK_N, HAS_FAR, DOT_PRECISION, UPCAST, HAS_ROWS, True,
            )  # fmt: skip
        else:
            acc = head_keys(
                q, q_rel, q_ts, own, far_scale, pos0, ts0, far0,
                k_user + head * stride_kh, v_user + head * stride_vh, BIAS - TIME_LOG_OFFSET,
                K_REL + k_start, K_TS + k_start, K_ROWS + k_start, lo, hi, stride_kt, stride_vt, num_pos,
                num_time, near_keys, D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M,
                BLOCK_N, HAS_FAR, DOT_PRECISION, UPCAST, HAS_ROWS, False,
            )  # fmt: skip
    else:  # a user spanning over 2^30 positions: the gaps in int64, pair by pair
        q_ts, far_scale, q_pos, uniform, pos0_wide, ts0, far0 = query_terms(
            Q_POS, Q_TS, Q_POS, q_tok, first, row_ok, near_keys, far_keys
        )
        acc = head_keys(
            q, q_pos, q_ts, own, far_scale, pos0_wide, ts0, far0,
            k_user + head * stride_kh, v_user + head * stride_vh, BIAS - TIME_LOG_OFFSET,
            K_POS + k_start, K_TS + k_start, K_ROWS + k_start, lo, hi, stride_kt, stride_vt, num_pos,
            num_time, near_keys, D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M,
            BLOCK_N, HAS_FAR, DOT_PRECISION, UPCAST, HAS_ROWS, False,
        )  # fmt: skip
    acc = acc / normaliser
    out_ptrs = (
        OUT + split.to(tl.int64) * stride_os + q_tok[:, None] * stride_ot + head * stride_oh + d_v[None, :]
    )
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (d_v[None, :] < D_V))


@triton.jit
def _hstu_fwd_grouped_kernel(
    Q, K, V, OUT, BIAS, Q_OFFSETS, K_OFFSETS, Q_POS, Q_TS, K_POS, K_TS, Q_REL, K_REL, POS32_OK, CAUSAL_OK, K_ROWS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_os, stride_ot, stride_oh,
    num_heads, num_splits, num_pos, num_time, normaliser, near_keys, far_keys,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_FAR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, GROUP: tl.constexpr, HAS_ROWS: tl.constexpr, ROW_TERMS: tl.constexpr,
):  # fmt: skip
    """``_hstu_fwd_kernel`` for ``GROUP`` heads at once (``triton_tiles.group_keys``)."""
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    user = tl.program_id(1)
    groups = num_heads // GROUP
    first_head = (tl.program_id(2) % groups) * GROUP
    heads = first_head + tl.arange(0, GROUP)
    split = tl.program_id(2) // groups
    q_start = tl.load(Q_OFFSETS + user)
    n_q = (tl.load(Q_OFFSETS + user + 1) - q_start).to(tl.int32)
    m0 = m_block * BLOCK_M
    if m0 >= n_q:
        return
    k_start = tl.load(K_OFFSETS + user)
    n_k = (tl.load(K_OFFSETS + user + 1) - k_start).to(tl.int32)

    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    d_qk = tl.arange(0, BLOCK_DQK)
    d_v = tl.arange(0, BLOCK_DV)
    q_tok = q_start + rows
    q = tl.load(
        Q + q_tok[None, :, None] * stride_qt + heads[:, None, None] * stride_qh + d_qk[None, None, :],
        mask=row_ok[None, :, None] & (d_qk[None, None, :] < D_QK),
        other=0.0,
    )  # [GROUP, BLOCK_M, BLOCK_DQK]
    if UPCAST:
        q = q.to(tl.float32)
    own = n_k - n_q + rows  # each query's own key, counted within the user's keys
    lo, hi = key_range(CAUSAL_OK, user, n_q, n_k, m0, split, num_splits, BLOCK_M, BLOCK_N)
    k_user, v_user = user_keys(K, V, k_start, stride_kt, stride_vt, HAS_ROWS)
    first = q_start + m0
    if tl.load(POS32_OK + user) != 0:  # int32 positions relative to the user's first
        q_ts, far_scale, q_rel, uniform, pos0, ts0, far0 = query_terms(
            Q_POS, Q_TS, Q_REL, q_tok, first, row_ok, near_keys, far_keys
        )
        # One position and time for every row: the pair terms per key (where the config says so).
        if uniform if ROW_TERMS else False:
            acc = group_keys(
                q, q_rel, q_ts, own, far_scale, pos0, ts0, far0,
                k_user + first_head * stride_kh, v_user + first_head * stride_vh,
                BIAS - TIME_LOG_OFFSET, K_REL + k_start, K_TS + k_start, K_ROWS + k_start, lo, hi, stride_kt,
                stride_kh, stride_vt, stride_vh, num_pos, num_time, near_keys,
                D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M,
                BLOCK_N, HAS_FAR, DOT_PRECISION, UPCAST, GROUP, HAS_ROWS, True,
            )  # fmt: skip
        else:
            acc = group_keys(
                q, q_rel, q_ts, own, far_scale, pos0, ts0, far0,
                k_user + first_head * stride_kh, v_user + first_head * stride_vh,
                BIAS - TIME_LOG_OFFSET, K_REL + k_start, K_TS + k_start, K_ROWS + k_start, lo, hi, stride_kt,
                stride_kh, stride_vt, stride_vh, num_pos, num_time, near_keys,
                D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M,
                BLOCK_N, HAS_FAR, DOT_PRECISION, UPCAST, GROUP, HAS_ROWS, False,
            )  # fmt: skip
    else:  # a user spanning over 2^30 positions: the gaps in int64, pair by pair
        q_ts, far_scale, q_pos, uniform, pos0_wide, ts0, far0 = query_terms(
            Q_POS, Q_TS, Q_POS, q_tok, first, row_ok, near_keys, far_keys
        )
        acc = group_keys(
            q, q_pos, q_ts, own, far_scale, pos0_wide, ts0, far0,
            k_user + first_head * stride_kh, v_user + first_head * stride_vh,
            BIAS - TIME_LOG_OFFSET, K_POS + k_start, K_TS + k_start, K_ROWS + k_start, lo, hi, stride_kt,
            stride_kh, stride_vt, stride_vh, num_pos, num_time, near_keys,
            D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M,
            BLOCK_N, HAS_FAR, DOT_PRECISION, UPCAST, GROUP, HAS_ROWS, False,
        )  # fmt: skip
    acc = acc / normaliser
    out_ptrs = (
        OUT + split.to(tl.int64) * stride_os + q_tok[None, :, None] * stride_ot + heads[:, None, None] * stride_oh
        + d_v[None, None, :]
    )  # fmt: skip
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[None, :, None] & (d_v[None, None, :] < D_V))


@triton.jit
def _finish_kernel(
    PARTIAL, OUT, GATE, NORM_W, NORM_B, splits, rows, width, stride_ps, stride_pt, stride_ot, stride_gt, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """Rows of ``OUT [rows, width]`` (``width``: heads x value dim) from the float32 partial sums
    ``PARTIAL [splits, rows, width]``, added in split order; with ``GATED``, each row's layer norm
    (over its ``width``, ``NORM_W`` and ``NORM_B`` applied) times the row of ``GATE``."""
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.arange(0, BLOCK_W)
    col_ok = c < width
    ok = (r < rows)[:, None] & col_ok[None, :]
    parts = PARTIAL + r.to(tl.int64)[:, None] * stride_pt + c[None, :]
    total = tl.zeros((BLOCK_ROWS, BLOCK_W), dtype=tl.float32)
    for _ in range(0, splits):
        total += tl.load(parts, mask=ok, other=0.0)
        parts += stride_ps
    if GATED:
        mean = tl.sum(total, 1) / width
        centred = tl.where(ok, total - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(centred * centred, 1) / width + eps)
        scale = tl.load(NORM_W + c, mask=col_ok, other=0.0).to(tl.float32)
        shift = tl.load(NORM_B + c, mask=col_ok, other=0.0).to(tl.float32)
        gate = tl.load(GATE + r.to(tl.int64)[:, None] * stride_gt + c[None, :], mask=ok, other=0.0)
        total = (centred * rstd[:, None] * scale[None, :] + shift[None, :]) * gate.to(tl.float32)
    tl.store(OUT + r.to(tl.int64)[:, None] * stride_ot + c[None, :], total.to(OUT.dtype.element_ty), mask=ok)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT


def _block_dim(d: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(d))


def choose_config(dtype: torch.dtype, d_qk: int, d_v: int, max_q: int, max_k: int, users: int,
                  heads: int, sm_count: int) -> KernelConfig:  # fmt: skip
    """Tiles for a call: the sm_90 builds (``bench kernels --build sm_90``) that do not spill.
    16-bit heads up to 64 wide go two per program on 64 x 16 tiles (each pair's bias serves both);
    a single 16-bit head up to 64 wide takes 64 x 32; wider heads and float32 (whose products run
    on CUDA cores) take 64 x 16, float32 heads over 64 wide and 16-bit heads over 128 wide (the
    ``nvidia-block`` shape's 256: 616 bytes of spills at 64 x 16, none at 32 x 16) 32 x 16. Key
    splits when the grid holds under two programs per multiprocessor (a relay's few queries; also
    evens out jagged users and causal blocks)."""
    wide = max(_block_dim(d_qk), _block_dim(d_v))
    half = dtype != torch.float32
    group = 2 if half and wide <= 64 and heads % 2 == 0 else 1
    block_m = 64 if wide <= 64 or (half and wide <= 128) else 32
    block_n = 32 if half and group == 1 and wide <= 64 else 16
    programs = triton.cdiv(max_q, block_m) * users * (heads // group)
    splits = 1
    if programs < 2 * sm_count:
        splits = max(1, min(triton.cdiv(2 * sm_count, programs), max_k // (block_n * MIN_SPLIT_BLOCKS)))
    return KernelConfig(block_m, block_n, 8, 2, splits, group)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: JaggedBatch,
           bias_table: torch.Tensor, params: AttentionParams) -> None:  # fmt: skip
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, dim], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v must share one dtype of {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.shape[:2] != v.shape[:2] or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"shapes do not agree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if max(q.shape[2], v.shape[2]) > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported, got {q.shape[2]} and {v.shape[2]}")
    if q.shape[0] != batch.q_pos.shape[0]:
        raise ValueError(
            f"{q.shape[0]} queries and {k.shape[0]} keys for a batch of {batch.q_pos.shape[0]} queries"
        )
    check_key_rows(batch, k, v)
    if not 0 <= params.near_keys < MAX_POSITION_GAP:
        raise ValueError(f"near_keys must be in [0, 2^30), got {params.near_keys}")
    if bias_table.numel() != params.num_pos * params.num_time:
        raise ValueError(
            f"bias table of {bias_table.numel()} entries for {params.num_pos} x {params.num_time} buckets"
        )
    devices = {t.device for t in (q, k, v, bias_table, batch.q_offsets, batch.k_pos)}
    if batch.k_rows is not None:
        devices.add(batch.k_rows.device)
    if len(devices) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(2) == 1 else t.contiguous()


def kernel_constants(config: KernelConfig, dtype: torch.dtype, d_qk: int, d_v: int, has_far: bool,
                     upcast: bool = False, has_rows: bool = False) -> tuple[triton.JITFunction, dict]:  # fmt: skip
    """The kernel a config launches and its compile-time arguments (also for builds without a GPU)."""
    constants = {"HAS_ROWS": has_rows, "ROW_TERMS": config.row_terms,
        "D_QK": d_qk, "D_V": d_v, "BLOCK_DQK": _block_dim(d_qk), "BLOCK_DV": _block_dim(d_v),
        "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "HAS_FAR": has_far,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast,
    }  # fmt: skip
    if config.head_group == 1:
        return _hstu_fwd_kernel, constants
    return _hstu_fwd_grouped_kernel, {**constants, "GROUP": config.head_group}


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: JaggedBatch,
               bias_table: torch.Tensor, params: AttentionParams, config: KernelConfig | None,
               out: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
    """Launches the attention kernel into ``out`` (``[Tq, H, dv]``) where the keys are not split
    and ``out`` is given, else into float32 partial sums ``[splits, Tq, H, dv]``, which it returns
    (``None``: ``out`` holds the result, or there are no queries)."""
    tokens, heads, d_qk = q.shape
    d_v = v.shape[2]
    if tokens == 0:
        return None
    if config is None:
        config = choose_config(q.dtype, d_qk, d_v, batch.max_q, batch.max_k, batch.users, heads,
                               _sm_count(q.device))  # fmt: skip
    if heads % config.head_group:
        raise ValueError(f"head_group {config.head_group} does not divide {heads} heads")
    # At most ``config.splits``, of whole key blocks at ``max_k`` keys; the kernel divides each user's
    # own keys among them.
    split_keys = triton.cdiv(triton.cdiv(batch.max_k, max(1, config.splits)), config.block_n) * config.block_n
    splits = max(1, triton.cdiv(batch.max_k, split_keys))
    partial = None
    if splits > 1 or out is None:
        partial = torch.empty((splits, tokens, heads, d_v), dtype=torch.float32, device=q.device)
    o_strides = (0, *out.stride()[:2]) if partial is None else partial.stride()[:3]
    # The interpreter multiplies bfloat16 tiles as raw bits: it gets them in float32 instead.
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    has_rows = batch.k_rows is not None
    kernel, constants = kernel_constants(config, q.dtype, d_qk, d_v, params.near_keys > 0, upcast, has_rows)
    grid = (triton.cdiv(batch.max_q, config.block_m), batch.users, heads // config.head_group * splits)
    per_token = (_dense(t) for t in (batch.q_pos, batch.q_ts, batch.k_pos, batch.k_ts))
    kernel[grid](
        q, k, v, out if partial is None else partial, _dense(bias_table.reshape(-1)),
        _dense(batch.q_offsets), _dense(batch.k_offsets), *per_token, *position_frames(batch),
        causal_limits(batch), batch.k_rows if has_rows else batch.k_offsets,  # (not read without rows)
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *o_strides,
        heads, splits, params.num_pos, params.num_time, float(params.normaliser),
        params.near_keys, float(params.far_keys), **constants,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return partial


def _finish(partial: torch.Tensor, out: torch.Tensor, gated: tuple[torch.Tensor, torch.Tensor,
            torch.Tensor, float] | None = None) -> None:  # fmt: skip
    """One ``_finish_kernel`` launch: ``out [Tq, width]`` (rows strided, elements not) from the
    partial sums; ``gated``: (gate ``[Tq, width]``, norm weight, norm bias, eps)."""
    splits, tokens = partial.shape[:2]
    width = partial[0, 0].numel()
    block_w = triton.next_power_of_2(width)
    block_rows = max(1, FINISH_ELEMENTS // block_w)
    gate, norm_w, norm_b, eps = gated if gated is not None else (out, out, out, 0.0)
    _finish_kernel[(triton.cdiv(tokens, block_rows),)](
        partial, out, gate, norm_w, norm_b, splits, tokens, width, partial.stride(0),
        width, out.stride(0), gate.stride(0), float(eps),
        BLOCK_ROWS=block_rows, BLOCK_W=block_w, GATED=gated is not None, num_warps=4,
    )  # fmt: skip


def hstu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: JaggedBatch,
                 bias_table: torch.Tensor, params: AttentionParams,
                 config: KernelConfig | None = None) -> torch.Tensor:  # fmt: skip
    """``hstu_mha`` with an explicit ``config`` (``None``: ``choose_config``)."""
    _check(q, k, v, batch, bias_table, params)
    q, k, v = _rows(q), _rows(k), _rows(v)
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    partial = _attention(q, k, v, batch, bias_table, params, config, out)
    if partial is not None:
        _finish(partial, out.view(out.shape[0], -1))
    return out


def hstu_forward_gated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: JaggedBatch,
                       bias_table: torch.Tensor, params: AttentionParams,
                       norm: tuple[torch.Tensor, torch.Tensor, float], gate: torch.Tensor, out: torch.Tensor,
                       config: KernelConfig | None = None) -> torch.Tensor:  # fmt: skip
    """``layer_norm(hstu_mha(...)) * gate`` into ``out`` (``interface.hstu_mha_gated``), with an
    explicit ``config``: the attention's float32 sums are normalised and gated before their one
    rounding to ``out``'s dtype."""
    _check(q, k, v, batch, bias_table, params)
    q, k, v = _rows(q), _rows(k), _rows(v)
    width = q.shape[1] * v.shape[2]
    weight, bias, eps = norm
    for name, t in (("gate", gate), ("out", out)):
        if t.shape != (q.shape[0], width) or t.stride(1) != 1 or t.device != q.device:
            raise ValueError(f"{name} must be [{q.shape[0]}, {width}] with unit column stride on {q.device}, "
                             f"got {tuple(t.shape)} strides {t.stride()} on {t.device}")  # fmt: skip
    if weight.numel() != width or bias.numel() != width:
        raise ValueError(f"the norm's weight and bias must have {width} elements each")
    partial = _attention(q, k, v, batch, bias_table, params, config, None)
    if partial is not None:
        _finish(partial, out, (gate, _dense(weight.reshape(-1)), _dense(bias.reshape(-1)), eps))
    return out


def triton_hstu_mha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: JaggedBatch,
    bias_table: torch.Tensor,
    params: AttentionParams,
) -> torch.Tensor:
    """``hstu_mha`` in Triton (see ``interface``): one kernel launch, two when the keys are split."""
    return hstu_forward(q, k, v, batch, bias_table, params)


def triton_hstu_mha_gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: JaggedBatch,
    bias_table: torch.Tensor,
    params: AttentionParams,
    norm: tuple[torch.Tensor, torch.Tensor, float],
    gate: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``interface.hstu_mha_gated`` in Triton: two kernel launches, whatever the key splits."""
    return hstu_forward_gated(q, k, v, batch, bias_table, params, norm, gate, out)
