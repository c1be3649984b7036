"""The Triton forward kernel of ``hstu_mha`` (CUDA; CPU under ``TRITON_INTERPRET=1``).

Primitives:
- ``triton_hstu_mha(q, k, v, batch, bias_table, params)``: the interface's ``hstu_mha``, same
  signature and result as the reference; it picks a ``KernelConfig`` and calls ``hstu_forward``.
- ``hstu_forward(..., config=)``: one launch of ``_hstu_fwd_kernel`` (one head per program) or
  ``_hstu_fwd_grouped_kernel`` (a group of heads sharing each pair's bias and weight) over (query
  block, user, head group x key split), plus one small ``_sum_splits_kernel`` launch when the keys
  are split.
- ``KernelConfig``: block sizes, warps, pipeline stages, key splits and heads per program.
- ``choose_config(...)``: the config for a call's shape and dtype on a device;
  ``kernel_constants(config, ...)``: the kernel it launches and its compile-time arguments.
- The per-batch tensors it reads besides the batch's own (``frames``: the causal skip's limits,
  int32 relative positions), derived once per batch for all layers.

With a row index (``batch.k_rows``), ``k`` and ``v`` are whole tensors (a paged pool's layer) and
each key tile is loaded through the index (one indirect row load per tile, no gathered copy); the
keys past the last user's (a static capacity's unused tail) are never read.

Each program holds one block of one user's queries for its heads and loops over that user's key
blocks inside the kernel: ``silu(q k^T + bias)`` times the pair's weight, then times ``v``, summed in
float32; no score matrix is ever in memory. The bias index comes from positions and timestamps
exactly as ``buckets.py`` computes it (int32 position gap from the per-user relative positions,
float64 time gap rounded to float32, their bit patterns shifted), an int32 index. HSTU has no
softmax, so a user's keys can be split across programs and their partial sums simply added: that
is the split-K path, taken when the grid alone would leave multiprocessors idle (a relay ranking:
few queries, many keys). Each user's keys are split by its own key count, so that a batch sized
for a larger capacity than its users fill still keeps every split busy.

One job in one module: the kernel and its launch. The jitted helpers are the kernel's body, and
``KernelConfig``, ``choose_config`` and ``kernel_constants`` are the compile-time constants that
body is written for (block sizes, key splits, heads per program), so a change to either is a
change to both. The batch's layout is ``batch``, its per-batch frames ``frames``, the entry point
that picks this kernel ``interface``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from relaygr.workers.kernels.batch import AttentionParams, JaggedBatch, check_key_rows
from relaygr.workers.kernels.buckets import EXACT_POSITIONS, F32_EXP_BIAS
from relaygr.workers.kernels.frames import POSITION_SPAN, causal_limits, position_frames

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
MIN_BLOCK = 16  # tl.dot's smallest side
# The bucket constants as the kernel sees them (buckets.py is the source of truth).
MAX_POSITION_GAP = tl.constexpr(POSITION_SPAN)
EXACT = tl.constexpr(EXACT_POSITIONS)
# position_bucket's log part: (bits >> 21) - POSITION_LOG_OFFSET; time_bucket's likewise (>> 22).
POSITION_LOG_OFFSET = tl.constexpr(((F32_EXP_BIAS + 4) << 2) - EXACT_POSITIONS)
TIME_LOG_OFFSET = tl.constexpr(F32_EXP_BIAS << 1)
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
def _query_terms(Q_POS, Q_TS, q_tok, row_ok, near_keys, far_keys):
    """A query block's timestamps and far-key scale ``min(1, far / (pos - near + 1))``."""
    q_pos = tl.load(Q_POS + q_tok, mask=row_ok, other=0)
    q_ts = tl.load(Q_TS + q_tok, mask=row_ok, other=0.0)
    far_scale = tl.minimum(far_keys / tl.maximum(q_pos - near_keys + 1, 1).to(tl.float32), 1.0)
    return q_ts, far_scale


@triton.jit
def _pair_terms(
    q_pos, q_ts, own, far_scale, k_pos, k_ts, cols, bias_ptr, num_pos, num_time, near_keys,
    HAS_FAR: tl.constexpr,
):  # fmt: skip
    """Per (query, key) pair of a tile: the bias (float32) and the weight (visibility x far).
    Every index is clamped into the table, so padded rows and keys gather without a mask (their
    keys and values load as zeros, their rows are never stored)."""
    # The gap clamped to [0, 2^30] answers "dpos > 0" and "dpos >= near_keys" too (near_keys is
    # far below 2^30). In int32 unless the user's positions span over 2^30 (then int64).
    d = tl.minimum(tl.maximum(q_pos[:, None] - k_pos[None, :], 0), MAX_POSITION_GAP).to(tl.int32)
    log_part = (d.to(tl.float32).to(tl.int32, bitcast=True) >> 21) - POSITION_LOG_OFFSET
    pos_row = tl.minimum(tl.where(d < EXACT, d, log_part), num_pos - 1) * num_time
    # The gap in float64, then float32 (``time_bucket``); its bit pattern's code clamped as the
    # reference clamps it (a gap under 1.5 s, negative or NaN with the sign set, is code 254).
    gap = (q_ts[:, None] - k_ts[None, :]).to(tl.float32).to(tl.int32, bitcast=True) >> 22
    time_code = tl.minimum(tl.maximum(gap, TIME_LOG_OFFSET), TIME_LOG_OFFSET + num_time - 1)
    bias = tl.load(bias_ptr + (pos_row + time_code)).to(tl.float32)
    visible = (d > 0) | (cols[None, :] == own[:, None])
    if HAS_FAR:
        weight = tl.where(visible, tl.where(d >= near_keys, far_scale[:, None], 1.0), 0.0)
    else:
        weight = tl.where(visible, 1.0, 0.0)
    return bias, weight


@triton.jit
def _head_keys(
    q, q_pos, q_ts, own, far_scale, K, V, BIAS, K_POS, K_TS, ROWS, lo, hi,
    stride_kt, stride_vt, num_pos, num_time, near_keys,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_FAR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, HAS_ROWS: tl.constexpr,
):  # fmt: skip
    """One head's sum over key blocks ``[lo, hi)``: ``K_POS``, ``K_TS`` (and ``ROWS``) point at the
    user's first key; ``K``, ``V`` at the head of the user's first key, or with ``HAS_ROWS`` of row
    0 (key ``j``'s row is ``ROWS[j]``)."""
    d_qk = tl.arange(0, BLOCK_DQK)
    d_v = tl.arange(0, BLOCK_DV)
    offs = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    # Tile pointers start at key ``lo`` (64-bit) and step by a block: 32-bit offsets in the tile.
    k_ptrs = K + lo.to(tl.int64) * stride_kt + offs[None, :] * stride_kt + d_qk[:, None]
    v_ptrs = V + lo.to(tl.int64) * stride_vt + offs[:, None] * stride_vt + d_v[None, :]
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs
        col_ok = cols < hi
        if HAS_ROWS:  # the tile's rows, wherever they lie
            key_rows = tl.load(ROWS + cols, mask=col_ok, other=0).to(tl.int64)
            k_ptrs = K + key_rows[None, :] * stride_kt + d_qk[:, None]
            v_ptrs = V + key_rows[:, None] * stride_vt + d_v[None, :]
        k_t = tl.load(
            k_ptrs,
            mask=col_ok[None, :] & (d_qk[:, None] < D_QK),
            other=0.0,
        )
        if UPCAST:
            k_t = k_t.to(tl.float32)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION)
        k_pos = tl.load(K_POS + cols, mask=col_ok, other=0)
        k_ts = tl.load(K_TS + cols, mask=col_ok, other=0.0)
        bias, weight = _pair_terms(
            q_pos, q_ts, own, far_scale, k_pos, k_ts, cols, BIAS, num_pos, num_time, near_keys, HAS_FAR
        )
        scores = scores + bias
        act = scores * tl.sigmoid(scores) * weight
        v = tl.load(
            v_ptrs,
            mask=col_ok[:, None] & (d_v[None, :] < D_V),
            other=0.0,
        )
        if UPCAST:
            acc += tl.dot(
                act.to(V.dtype.element_ty).to(tl.float32), v.to(tl.float32), input_precision=DOT_PRECISION
            )
        else:
            acc += tl.dot(act.to(v.dtype), v, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt
    return acc


@triton.jit
def _group_keys(
    q, q_pos, q_ts, own, far_scale, K, V, BIAS, K_POS, K_TS, ROWS, lo, hi,
    stride_kt, stride_kh, stride_vt, stride_vh, num_pos, num_time, near_keys,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_FAR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, GROUP: tl.constexpr, HAS_ROWS: tl.constexpr,
):  # fmt: skip
    """``_head_keys`` for ``GROUP`` heads at once (``K``, ``V`` at the group's first head): each
    pair's bias and weight, the same for every head, are derived once per tile (batched products)."""
    d_qk = tl.arange(0, BLOCK_DQK)
    d_v = tl.arange(0, BLOCK_DV)
    offs = tl.arange(0, BLOCK_N)
    g = tl.arange(0, GROUP)
    acc = tl.zeros((GROUP, BLOCK_M, BLOCK_DV), dtype=tl.float32)
    k_ptrs = (K + lo.to(tl.int64) * stride_kt
              + offs[None, None, :] * stride_kt + g[:, None, None] * stride_kh + d_qk[None, :, None])  # fmt: skip
    v_ptrs = (V + lo.to(tl.int64) * stride_vt
              + offs[None, :, None] * stride_vt + g[:, None, None] * stride_vh + d_v[None, None, :])  # fmt: skip
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs
        col_ok = cols < hi
        if HAS_ROWS:  # the tile's rows, wherever they lie
            key_rows = tl.load(ROWS + cols, mask=col_ok, other=0).to(tl.int64)
            k_ptrs = (K + key_rows[None, None, :] * stride_kt + g[:, None, None] * stride_kh
                      + d_qk[None, :, None])  # fmt: skip
            v_ptrs = (V + key_rows[None, :, None] * stride_vt + g[:, None, None] * stride_vh
                      + d_v[None, None, :])  # fmt: skip
        k_pos = tl.load(K_POS + cols, mask=col_ok, other=0)
        k_ts = tl.load(K_TS + cols, mask=col_ok, other=0.0)
        bias, weight = _pair_terms(
            q_pos, q_ts, own, far_scale, k_pos, k_ts, cols, BIAS, num_pos, num_time, near_keys, HAS_FAR
        )
        k_t = tl.load(
            k_ptrs,
            mask=col_ok[None, None, :] & (d_qk[None, :, None] < D_QK),
            other=0.0,
        )  # fmt: skip
        v = tl.load(
            v_ptrs,
            mask=col_ok[None, :, None] & (d_v[None, None, :] < D_V),
            other=0.0,
        )  # fmt: skip
        if UPCAST:
            k_t = k_t.to(tl.float32)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) + bias[None, :, :]
        act = scores * tl.sigmoid(scores) * weight[None, :, :]
        if UPCAST:
            act = act.to(V.dtype.element_ty).to(tl.float32)
            v = v.to(tl.float32)
        acc += tl.dot(act.to(v.dtype), v, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kt
        v_ptrs += BLOCK_N * stride_vt
    return acc


@triton.jit
def _key_range(CAUSAL_OK, user, n_q, n_k, m0, split, num_splits, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """The user's keys this program reads: its split (of ``num_splits``, whole key blocks, by the
    user's own key count), cut after the block's last own key where the user's positions allow it
    (every later key is hidden from all the block's queries)."""
    hi = tl.where(tl.load(CAUSAL_OK + user) != 0, n_k - n_q + tl.minimum(m0 + BLOCK_M, n_q), n_k)
    split_keys = tl.cdiv(tl.cdiv(n_k, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_keys
    return lo, tl.minimum(hi, lo + split_keys)


@triton.jit
def _user_keys(K, V, k_start, stride_kt, stride_vt, HAS_ROWS: tl.constexpr):
    """Where a user's keys and values start; with a row index, ``K`` and ``V`` whole (the user's
    keys are rows ``K_ROWS[k_start:]``)."""
    k_user = K
    v_user = V
    if not HAS_ROWS:
        k_user = K + k_start * stride_kt
        v_user = V + k_start * stride_vt
    return k_user, v_user


@triton.jit
def _hstu_fwd_kernel(
    Q, K, V, OUT, BIAS, Q_OFFSETS, K_OFFSETS, Q_POS, Q_TS, K_POS, K_TS, Q_REL, K_REL, POS32_OK, CAUSAL_OK,
    K_ROWS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_os, stride_ot, stride_oh,
    num_heads, num_splits, num_pos, num_time, normaliser, near_keys, far_keys,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_FAR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, HAS_ROWS: tl.constexpr,
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
    q_ts, far_scale = _query_terms(Q_POS, Q_TS, q_tok, row_ok, near_keys, far_keys)
    own = n_k - n_q + rows  # each query's own key, counted within the user's keys
    lo, hi = _key_range(CAUSAL_OK, user, n_q, n_k, m0, split, num_splits, BLOCK_M, BLOCK_N)
    k_user, v_user = _user_keys(K, V, k_start, stride_kt, stride_vt, HAS_ROWS)
    if tl.load(POS32_OK + user) != 0:  # int32 positions relative to the user's first
        q_rel = tl.load(Q_REL + q_tok, mask=row_ok, other=0)
        acc = _head_keys(
            q, q_rel, q_ts, own, far_scale,
            k_user + head * stride_kh, v_user + head * stride_vh, BIAS - TIME_LOG_OFFSET,
            K_REL + k_start, K_TS + k_start, K_ROWS + k_start, lo, hi, stride_kt, stride_vt, num_pos,
            num_time, near_keys, D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M,
            BLOCK_N, HAS_FAR, DOT_PRECISION, UPCAST, HAS_ROWS,
        )  # fmt: skip
    else:  # a user spanning over 2^30 positions: the gaps in int64
        q_pos = tl.load(Q_POS + q_tok, mask=row_ok, other=0)
        acc = _head_keys(
            q, q_pos, q_ts, own, far_scale,
            k_user + head * stride_kh, v_user + head * stride_vh, BIAS - TIME_LOG_OFFSET,
            K_POS + k_start, K_TS + k_start, K_ROWS + k_start, lo, hi, stride_kt, stride_vt, num_pos,
            num_time, near_keys, D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M,
            BLOCK_N, HAS_FAR, DOT_PRECISION, UPCAST, HAS_ROWS,
        )  # fmt: skip
    acc = acc / normaliser
    out_ptrs = (
        OUT + split.to(tl.int64) * stride_os + q_tok[:, None] * stride_ot + head * stride_oh + d_v[None, :]
    )
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (d_v[None, :] < D_V))


@triton.jit
def _hstu_fwd_grouped_kernel(
    Q, K, V, OUT, BIAS, Q_OFFSETS, K_OFFSETS, Q_POS, Q_TS, K_POS, K_TS, Q_REL, K_REL, POS32_OK, CAUSAL_OK,
    K_ROWS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_os, stride_ot, stride_oh,
    num_heads, num_splits, num_pos, num_time, normaliser, near_keys, far_keys,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_FAR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, GROUP: tl.constexpr, HAS_ROWS: tl.constexpr,
):  # fmt: skip
    """``_hstu_fwd_kernel`` for ``GROUP`` heads at once (``_group_keys``)."""
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
    q_ts, far_scale = _query_terms(Q_POS, Q_TS, q_tok, row_ok, near_keys, far_keys)
    own = n_k - n_q + rows  # each query's own key, counted within the user's keys
    lo, hi = _key_range(CAUSAL_OK, user, n_q, n_k, m0, split, num_splits, BLOCK_M, BLOCK_N)
    k_user, v_user = _user_keys(K, V, k_start, stride_kt, stride_vt, HAS_ROWS)
    if tl.load(POS32_OK + user) != 0:  # int32 positions relative to the user's first
        q_rel = tl.load(Q_REL + q_tok, mask=row_ok, other=0)
        acc = _group_keys(
            q, q_rel, q_ts, own, far_scale,
            k_user + first_head * stride_kh, v_user + first_head * stride_vh,
            BIAS - TIME_LOG_OFFSET, K_REL + k_start, K_TS + k_start, K_ROWS + k_start, lo, hi, stride_kt,
            stride_kh, stride_vt, stride_vh, num_pos, num_time, near_keys,
            D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M,
            BLOCK_N, HAS_FAR, DOT_PRECISION, UPCAST, GROUP, HAS_ROWS,
        )  # fmt: skip
    else:  # a user spanning over 2^30 positions: the gaps in int64
        q_pos = tl.load(Q_POS + q_tok, mask=row_ok, other=0)
        acc = _group_keys(
            q, q_pos, q_ts, own, far_scale,
            k_user + first_head * stride_kh, v_user + first_head * stride_vh,
            BIAS - TIME_LOG_OFFSET, K_POS + k_start, K_TS + k_start, K_ROWS + k_start, lo, hi, stride_kt,
            stride_kh, stride_vt, stride_vh, num_pos, num_time, near_keys,
            D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M,
            BLOCK_N, HAS_FAR, DOT_PRECISION, UPCAST, GROUP, HAS_ROWS,
        )  # fmt: skip
    acc = acc / normaliser
    out_ptrs = (
        OUT + split.to(tl.int64) * stride_os + q_tok[None, :, None] * stride_ot + heads[:, None, None] * stride_oh
        + d_v[None, None, :]
    )  # fmt: skip
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[None, :, None] & (d_v[None, None, :] < D_V))


@triton.jit
def _sum_splits_kernel(
    PARTIAL, OUT, splits, stride_ps, width, BLOCK: tl.constexpr,
):  # fmt: skip
    """``OUT[i] = sum_s PARTIAL[s, i]`` in float32, stored in ``OUT``'s dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, splits):
        total += tl.load(PARTIAL + s * stride_ps + offs, mask=ok, other=0.0)
    tl.store(OUT + offs, total.to(OUT.dtype.element_ty), mask=ok)


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
    on CUDA cores) take 64 x 16, and float32 heads over 64 wide 32 x 16. Key splits when the grid
    holds under two programs per multiprocessor (a relay's few queries; also evens out jagged
    users and causal blocks)."""
    wide = max(_block_dim(d_qk), _block_dim(d_v))
    half = dtype != torch.float32
    group = 2 if half and wide <= 64 and heads % 2 == 0 else 1
    block_m = 64 if half or wide <= 64 else 32
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
    constants = {"HAS_ROWS": has_rows,
        "D_QK": d_qk, "D_V": d_v, "BLOCK_DQK": _block_dim(d_qk), "BLOCK_DV": _block_dim(d_v),
        "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "HAS_FAR": has_far,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast,
    }  # fmt: skip
    if config.head_group == 1:
        return _hstu_fwd_kernel, constants
    return _hstu_fwd_grouped_kernel, {**constants, "GROUP": config.head_group}


def hstu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: JaggedBatch,
                 bias_table: torch.Tensor, params: AttentionParams,
                 config: KernelConfig | None = None) -> torch.Tensor:  # fmt: skip
    """``hstu_mha`` with an explicit ``config`` (``None``: ``choose_config``)."""
    _check(q, k, v, batch, bias_table, params)
    q, k, v = _rows(q), _rows(k), _rows(v)
    tokens, heads, d_qk = q.shape
    d_v = v.shape[2]
    out = q.new_empty((tokens, heads, d_v))
    if tokens == 0:
        return out
    if config is None:
        config = choose_config(q.dtype, d_qk, d_v, batch.max_q, batch.max_k, batch.users, heads,
                               _sm_count(q.device))  # fmt: skip
    if heads % config.head_group:
        raise ValueError(f"head_group {config.head_group} does not divide {heads} heads")
    # At most ``config.splits``, of whole key blocks at ``max_k`` keys; the kernel divides each user's
    # own keys among them.
    split_keys = triton.cdiv(triton.cdiv(batch.max_k, max(1, config.splits)), config.block_n) * config.block_n
    splits = max(1, triton.cdiv(batch.max_k, split_keys))
    target = (
        out
        if splits == 1
        else torch.empty((splits, tokens, heads, d_v), dtype=torch.float32, device=q.device)
    )
    o_strides = (0, *out.stride()[:2]) if splits == 1 else target.stride()[:3]
    # The interpreter multiplies bfloat16 tiles as raw bits: it gets them in float32 instead.
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    has_rows = batch.k_rows is not None
    kernel, constants = kernel_constants(config, q.dtype, d_qk, d_v, params.near_keys > 0, upcast, has_rows)
    grid = (triton.cdiv(batch.max_q, config.block_m), batch.users, heads // config.head_group * splits)
    per_token = (_dense(t) for t in (batch.q_pos, batch.q_ts, batch.k_pos, batch.k_ts))
    kernel[grid](
        q, k, v, target, _dense(bias_table.reshape(-1)), _dense(batch.q_offsets), _dense(batch.k_offsets),
        *per_token, *position_frames(batch), causal_limits(batch),
        batch.k_rows if has_rows else batch.k_offsets,  # (not read without rows)
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *o_strides,
        heads, splits, params.num_pos, params.num_time, float(params.normaliser),
        params.near_keys, float(params.far_keys), **constants,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if splits > 1:
        width = tokens * heads * d_v
        block = 1024
        _sum_splits_kernel[(triton.cdiv(width, block),)](
            target, out, splits, target.stride(0), width, BLOCK=block
        )
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
