"""The body of the Triton HSTU kernel: what one program computes over its user's keys.

Primitives (``triton.jit`` functions, inlined into the kernels of ``triton_hstu``):
- ``query_terms``: what a block of queries reads once (timestamps, far-key scale), and whether its
  rows all share one position and one timestamp (``uniform``, with that row's terms).
- ``pair_terms``: each (query, key) pair of a tile: its bias (the bias index exactly as
  ``buckets.py`` derives it, gathered from the layer's table) and its weight (visibility x far).
- ``tile_terms``: ``pair_terms``, or for a uniform block the same terms derived once per key and
  broadcast over the rows (the per-pair work of a tile becomes per-key work).
- ``head_keys`` / ``group_keys``: one head's (a group of heads') sum over a range of key blocks:
  ``silu(q k^T + bias) * weight @ v`` in float32, keys loaded in place or through a row index.
- ``key_range``: the keys of a user one program reads (its key split, cut after the block's last
  own key where the user's positions allow it); ``user_keys``: where the user's keys start.

A relay ranking's queries are a user's new events and its candidates, and the candidates (and a
bucket's padded events) all sit at the position after the history, at the request's time: most
query blocks of a relay ranking are uniform, so their bias and weight cost one gather and a few
integer operations per key instead of per pair. The bias index, the bias and the weight do not
depend on the head: ``group_keys`` derives them once per tile for all the heads it holds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from relaygr.workers.kernels.buckets import EXACT_POSITIONS, F32_EXP_BIAS
from relaygr.workers.kernels.frames import POSITION_SPAN

# The bucket constants as the kernel sees them (buckets.py is the source of truth).
MAX_POSITION_GAP = tl.constexpr(POSITION_SPAN)
EXACT = tl.constexpr(EXACT_POSITIONS)
# position_bucket's log part: (bits >> 21) - POSITION_LOG_OFFSET; time_bucket's likewise (>> 22).
POSITION_LOG_OFFSET = tl.constexpr(((F32_EXP_BIAS + 4) << 2) - EXACT_POSITIONS)
TIME_LOG_OFFSET = tl.constexpr(F32_EXP_BIAS << 1)


@triton.jit
def query_terms(Q_POS, Q_TS, POS, q_tok, first, row_ok, near_keys, far_keys):
    """A query block's timestamps and far-key scale ``min(1, far / (pos - near + 1))``, its
    positions as the pairs read them (``POS``: relative int32, or ``Q_POS``); whether its rows share
    one position and timestamp (``uniform``), and its ``first`` row's position (from ``POS``),
    timestamp and far scale."""
    q_pos = tl.load(Q_POS + q_tok, mask=row_ok, other=0)
    q_ts = tl.load(Q_TS + q_tok, mask=row_ok, other=0.0)
    far_scale = tl.minimum(far_keys / tl.maximum(q_pos - near_keys + 1, 1).to(tl.float32), 1.0)
    pos = tl.load(POS + q_tok, mask=row_ok, other=0)
    pos0 = tl.load(POS + first)
    ts0 = tl.load(Q_TS + first)
    far0 = tl.minimum(far_keys / tl.maximum(tl.load(Q_POS + first) - near_keys + 1, 1).to(tl.float32), 1.0)
    # NaN timestamps compare unequal: such a block takes the per-pair path.
    differs = tl.sum(tl.where(row_ok & ((pos != pos0) | (q_ts != ts0)), 1, 0), 0)
    return q_ts, far_scale, pos, differs == 0, pos0, ts0, far0


@triton.jit
def _bias_and_far(q_pos, k_pos, dt, far, bias_ptr, num_pos, num_time, near_keys, HAS_FAR: tl.constexpr):
    """For position differences ``q_pos - k_pos`` and time gaps ``dt`` (float64) of any matching
    shapes: the gap clamped to ``[0, 2^30]`` (int32), the bias (float32) and the far factor (the
    query's ``far`` where the key is at least ``near_keys`` back, else 1). The index is clamped into
    the table, so padded rows and keys gather without a mask."""
    # The clamped gap answers "dpos > 0" and "dpos >= near_keys" too (near_keys is far below 2^30).
    # In int32 unless the user's positions span over 2^30 (then the difference is int64).
    d = tl.minimum(tl.maximum(q_pos - k_pos, 0), MAX_POSITION_GAP).to(tl.int32)
    log_part = (d.to(tl.float32).to(tl.int32, bitcast=True) >> 21) - POSITION_LOG_OFFSET
    pos_row = tl.minimum(tl.where(d < EXACT, d, log_part), num_pos - 1) * num_time
    # The gap in float64, then float32 (``time_bucket``); its bit pattern's code clamped as
    # ``time_bucket`` clamps it (a gap under 1.5 s, negative or NaN with the sign set, is code 254).
    gap = dt.to(tl.float32).to(tl.int32, bitcast=True) >> 22
    time_code = tl.minimum(tl.maximum(gap, TIME_LOG_OFFSET), TIME_LOG_OFFSET + num_time - 1)
    bias = tl.load(bias_ptr + (pos_row + time_code)).to(tl.float32)
    # Without far keys: 1 everywhere, in the tile's shape.
    far_weight = tl.where(d >= near_keys, far, 1.0) if HAS_FAR else tl.where(d >= 0, 1.0, 0.0)
    return d, bias, far_weight


@triton.jit
def pair_terms(
    q_pos, q_ts, own, far_scale, k_pos, k_ts, cols, bias_ptr, num_pos, num_time, near_keys,
    HAS_FAR: tl.constexpr,
):  # fmt: skip
    """Per (query, key) pair of a tile: the bias (float32) and the weight, 0 for a hidden key (not
    before the query, nor its own key), else the far factor."""
    d, bias, far_weight = _bias_and_far(
        q_pos[:, None], k_pos[None, :], q_ts[:, None] - k_ts[None, :], far_scale[:, None],
        bias_ptr, num_pos, num_time, near_keys, HAS_FAR,
    )  # fmt: skip
    visible = (d > 0) | (cols[None, :] == own[:, None])
    return bias, tl.where(visible, far_weight, 0.0)


@triton.jit
def tile_terms(
    q_pos, q_ts, own, far_scale, pos0, ts0, far0, k_pos, k_ts, cols, bias_ptr, num_pos,
    num_time, near_keys, HAS_FAR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROW_TERMS: tl.constexpr,
):  # fmt: skip
    """``pair_terms``; with ``ROW_TERMS`` (a uniform block: every row at position ``pos0`` and time
    ``ts0``), the same values derived once per key and broadcast over the rows: only whether a key
    is a row's own key is per pair."""
    if ROW_TERMS:
        d, bias_row, far_row = _bias_and_far(
            pos0, k_pos[None, :], ts0 - k_ts[None, :], far0, bias_ptr, num_pos, num_time, near_keys, HAS_FAR
        )  # [1, BLOCK_N]
        bias = tl.broadcast_to(bias_row, (BLOCK_M, BLOCK_N))
        weight = tl.where(cols[None, :] == own[:, None], far_row, tl.where(d > 0, far_row, 0.0))
    else:
        bias, weight = pair_terms(
            q_pos, q_ts, own, far_scale, k_pos, k_ts, cols, bias_ptr, num_pos, num_time, near_keys, HAS_FAR
        )
    return bias, weight


@triton.jit
def head_keys(
    q, q_pos, q_ts, own, far_scale, pos0, ts0, far0, K, V, BIAS, K_POS, K_TS, ROWS, lo, hi,
    stride_kt, stride_vt, num_pos, num_time, near_keys,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_FAR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, HAS_ROWS: tl.constexpr, ROW_TERMS: tl.constexpr,
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
        k_t = tl.load(k_ptrs, mask=col_ok[None, :] & (d_qk[:, None] < D_QK), other=0.0)
        if UPCAST:
            k_t = k_t.to(tl.float32)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION)
        k_pos = tl.load(K_POS + cols, mask=col_ok, other=0)
        k_ts = tl.load(K_TS + cols, mask=col_ok, other=0.0)
        bias, weight = tile_terms(
            q_pos, q_ts, own, far_scale, pos0, ts0, far0, k_pos, k_ts, cols, BIAS, num_pos,
            num_time, near_keys, HAS_FAR, BLOCK_M, BLOCK_N, ROW_TERMS,
        )  # fmt: skip
        scores = scores + bias
        act = scores * tl.sigmoid(scores) * weight
        v = tl.load(v_ptrs, mask=col_ok[:, None] & (d_v[None, :] < D_V), other=0.0)
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
def group_keys(
    q, q_pos, q_ts, own, far_scale, pos0, ts0, far0, K, V, BIAS, K_POS, K_TS, ROWS, lo, hi,
    stride_kt, stride_kh, stride_vt, stride_vh, num_pos, num_time, near_keys,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_FAR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, GROUP: tl.constexpr, HAS_ROWS: tl.constexpr, ROW_TERMS: tl.constexpr,
):  # fmt: skip
    """``head_keys`` for ``GROUP`` heads at once (``K``, ``V`` at the group's first head): each
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
        bias, weight = tile_terms(
            q_pos, q_ts, own, far_scale, pos0, ts0, far0, k_pos, k_ts, cols, BIAS, num_pos,
            num_time, near_keys, HAS_FAR, BLOCK_M, BLOCK_N, ROW_TERMS,
        )  # fmt: skip
        k_t = tl.load(k_ptrs, mask=col_ok[None, None, :] & (d_qk[None, :, None] < D_QK), other=0.0)
        v = tl.load(v_ptrs, mask=col_ok[None, :, None] & (d_v[None, None, :] < D_V), other=0.0)
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
def key_range(CAUSAL_OK, user, n_q, n_k, m0, split, num_splits, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """The user's keys this program reads: its split (of ``num_splits``, whole key blocks, by the
    user's own key count), cut after the block's last own key where the user's positions allow it
    (every later key is hidden from all the block's queries)."""
    hi = tl.where(tl.load(CAUSAL_OK + user) != 0, n_k - n_q + tl.minimum(m0 + BLOCK_M, n_q), n_k)
    split_keys = tl.cdiv(tl.cdiv(n_k, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_keys
    return lo, tl.minimum(hi, lo + split_keys)


@triton.jit
def user_keys(K, V, k_start, stride_kt, stride_vt, HAS_ROWS: tl.constexpr):
    """Where a user's keys and values start; with a row index, ``K`` and ``V`` whole (the user's
    keys are rows ``K_ROWS[k_start:]``)."""
    k_user = K
    v_user = V
    if not HAS_ROWS:
        k_user = K + k_start * stride_kt
        v_user = V + k_start * stride_vt
    return k_user, v_user
