"""The PyTorch reference of ``hstu_mha``: what runs on CPU and NPU, and the oracle of every kernel.

Primitives:
- ``reference_hstu_mha(q, k, v, batch, bias_table, params)``: the users laid out in one dense
  ``[B, H, max_q, max_k]`` score tensor per layer (each user's tokens right-aligned, so that a
  query's own key sits on one diagonal for every user). What does not depend on the layer (each
  pair's bias index, and its weight: visibility, far factor and normaliser together) is derived once
  per batch and kept in ``batch.scratch``, so a layer costs a fixed handful of operations (a bias
  gather, two batched matmuls, SiLU and the weight) whatever the history length or user count.
- ``pair_layout(batch, params)``: that once-per-batch part.

The position part of a pair's bias index comes from a table over position differences, built once
per process and shape (``position_bucket`` up to the difference where buckets saturate), so that
the layout reads it with one gather instead of re-deriving buckets pair by pair.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from relaygr.workers.kernels.batch import AttentionParams, JaggedBatch
from relaygr.workers.kernels.buckets import EXACT_POSITIONS, F32_EXP_BIAS, position_bucket

PAD_POSITION = 1 << 40
"""Position of a padding key: after every real query, so no one sees it."""
LUT_LIMIT = 1 << 21
"""Largest position table; beyond it (over ~80 position buckets) buckets are computed per pair."""
_TIME_SHIFT = 22  # a float32 gap's exponent and first mantissa bit: two time codes per doubling
_TIME_CODE0 = F32_EXP_BIAS << 1  # the code of a 1 s gap


@dataclass(frozen=True)
class PairLayout:
    """Once per batch: where each packed token sits in the dense layout (``None`` for one user:
    the packed tensors are the layout), and per (user, query, key) slot the bias index and the
    pair's weight (0 for a hidden pair or padding)."""

    q_slots: torch.Tensor | None  # [Tq] rows of the [B * max_q] layout
    k_slots: torch.Tensor | None  # [Tk] rows of the [B * max_k] layout
    index: torch.Tensor  # [B, max_q, max_k] int32
    weight: torch.Tensor  # [B, max_q, max_k] float32


def saturation(num_pos: int) -> int:
    """The smallest position difference whose bucket is the last one (``num_pos - 1``)."""
    if num_pos <= EXACT_POSITIONS:
        return num_pos - 1
    above = num_pos - 1 - EXACT_POSITIONS  # four buckets per doubling from 16 on
    return (4 + above % 4) << (above // 4 + 2)


@functools.cache
def _position_table(num_pos: int, num_time: int, device: torch.device) -> torch.Tensor | None:
    """``table[d]`` = ``position_bucket(d) * num_time - code(1 s)`` for ``d`` in ``0 ..
    saturation`` (a negative difference has bucket 0, as 0 has); ``None`` when that is over
    ``LUT_LIMIT`` entries. Built from numpy, so it is a real tensor whatever mode the first call
    runs under."""
    top = saturation(num_pos)
    if top + 1 > LUT_LIMIT:
        return None
    d = np.arange(0, top + 1, dtype=np.int32)
    # ``buckets.position_bucket`` in numpy (the same float32 bits; tests hold them equal).
    log_part = (d.astype(np.float32).view(np.int32) >> 21) - (((F32_EXP_BIAS + 4) << 2) - EXACT_POSITIONS)
    bucket = np.where(d < EXACT_POSITIONS, d, log_part).clip(0, num_pos - 1)
    table = torch.from_numpy((bucket * num_time - _TIME_CODE0).astype(np.int32))
    return table if device.type == "cpu" else table.to(device)


def _dense(
    values: torch.Tensor, slots: torch.Tensor | None, users: int, rows: int, fill: float
) -> torch.Tensor:
    if slots is None:
        return values.reshape(1, rows, *values.shape[1:])
    out = values.new_full((users * rows, *values.shape[1:]), fill)
    return out.index_copy_(0, slots, values).reshape(users, rows, *values.shape[1:])


def _slots(offsets: torch.Tensor, total: int, rows: int, users: int) -> torch.Tensor:
    """Dense row of each packed token, users right-aligned: token ``t`` of user ``b`` (which ends
    at ``offsets[b + 1]``) goes to ``(b + 1) * rows - (offsets[b + 1] - t)``."""
    shift = torch.arange(1, users + 1, device=offsets.device) * rows - offsets[1:]
    counts = offsets[1:] - offsets[:-1]
    per_token = torch.repeat_interleave(shift, counts, output_size=total)
    return torch.arange(total, device=offsets.device) + per_token


def _index(d: torch.Tensor, gaps: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """Bias index (int32) of pairs ``d`` (int64) positions apart with time gaps ``gaps`` (float32,
    overwritten): ``buckets.position_bucket`` and ``buckets.time_bucket`` combined."""
    gap = gaps.view(torch.int32).bitwise_right_shift_(_TIME_SHIFT)
    # A gap under 1.5 s (negative, -0 and NaN's sign included) is code 254; the top code repeats.
    gap = gap.clamp_(_TIME_CODE0, _TIME_CODE0 + params.num_time - 1)
    table = _position_table(params.num_pos, params.num_time, d.device)
    if table is None:
        return gap.add_(position_bucket(d, params.num_pos) * params.num_time - _TIME_CODE0)
    near = d.clamp(0, table.shape[0] - 1)
    return gap.add_(torch.index_select(table, 0, near.view(-1)).view(near.shape))


def _weight(
    d: torch.Tensor, q_pos: torch.Tensor, shift: int, params: AttentionParams, dtype: torch.dtype
) -> torch.Tensor:
    """Each pair's weight: ``1 / N`` for a visible near pair, the query's far factor over ``N`` for
    a far one, 0 for a hidden one. ``shift``: the column of row 0's own key."""
    visible = d > 0
    near = (
        visible * (1.0 / params.normaliser)
        if dtype == torch.float32
        else visible.to(dtype).mul_(1.0 / params.normaliser)
    )
    if params.near_keys > 0:
        # min(1, far_keys / (pos - near_keys + 1)) / N per query, the factor in float32 whatever
        # the scores' dtype, rounded as training rounds it (``hstu_attention.far_scale``).
        count = (q_pos - (params.near_keys - 1)).clamp_(min=1)
        factor = (
            torch.reciprocal(count).mul_(params.far_keys).clamp_(max=1.0).to(dtype).div_(params.normaliser)
        )
        near = torch.where(d >= params.near_keys, factor.unsqueeze(-1), near)
    near.diagonal(shift, dim1=-2, dim2=-1).fill_(1.0 / params.normaliser)  # a query's own key
    return near


def pair_layout(
    batch: JaggedBatch, params: AttentionParams, dtype: torch.dtype = torch.float32
) -> PairLayout:
    """The layer-independent part of the reference (kept in ``batch.scratch``); weights in
    ``dtype`` (the scores')."""
    key = ("reference", params, dtype)
    if key in batch.scratch:
        return batch.scratch[key]
    users, lq, lk = batch.users, batch.max_q, batch.max_k
    q_slots = k_slots = None
    if users > 1:
        q_slots = _slots(batch.q_offsets, int(batch.q_pos.shape[0]), lq, users)
        k_slots = _slots(batch.k_offsets, int(batch.k_pos.shape[0]), lk, users)
    q_pos = _dense(batch.q_pos, q_slots, users, lq, 0)
    k_pos = _dense(batch.k_pos, k_slots, users, lk, PAD_POSITION)
    q_ts = _dense(batch.q_ts, q_slots, users, lq, 0.0)
    k_ts = _dense(batch.k_ts, k_slots, users, lk, 0.0)
    d = q_pos[:, :, None] - k_pos[:, None, :]  # [B, lq, lk]: i - j
    # The gaps straight into float32 (computed in float64, rounded once: as ``.to(float32)``).
    gaps = torch.empty(d.shape, dtype=torch.float32, device=d.device)
    index = _index(d, torch.sub(q_ts[:, :, None], k_ts[:, None, :], out=gaps), params)
    layout = PairLayout(q_slots, k_slots, index, _weight(d, q_pos, lk - lq, params, dtype))
    batch.scratch[key] = layout
    return layout


def reference_hstu_mha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: JaggedBatch,
    bias_table: torch.Tensor,
    params: AttentionParams,
) -> torch.Tensor:
    """``hstu_mha`` in PyTorch (see ``interface``)."""
    f32 = torch.float64 if q.dtype == torch.float64 else torch.float32  # sums in float32 at least
    layout = pair_layout(batch, params, f32)
    users, lq, lk = batch.users, batch.max_q, batch.max_k
    heads = q.shape[1]
    qd = _dense(q.to(f32), layout.q_slots, users, lq, 0.0).transpose(1, 2)  # [B, H, lq, d]
    kd = _dense(k.to(f32), layout.k_slots, users, lk, 0.0).permute(0, 2, 3, 1)  # [B, H, d, lk]
    vd = _dense(v.to(f32), layout.k_slots, users, lk, 0.0).transpose(1, 2)  # [B, H, lk, dv]
    # index_select, not advanced indexing: several times faster on a CPU for int32 indices.
    bias = torch.index_select(bias_table.to(f32), 0, layout.index.view(-1)).view(layout.index.shape)
    if users == 1 or heads == 1:  # the bias broadcasts over the flattened (user, head) batch
        flat = users * heads
        scores = torch.baddbmm(bias, qd.reshape(flat, lq, -1), kd.reshape(flat, -1, lk))
        scores = F.silu(scores, inplace=True).mul_(layout.weight).view(users, heads, lq, lk)
    else:
        scores = torch.matmul(qd, kd).add_(bias.unsqueeze(1))
        scores = F.silu(scores, inplace=True).mul_(layout.weight.unsqueeze(1))
    out = torch.matmul(scores, vd).transpose(1, 2)  # [B, lq, H, dv]
    if layout.q_slots is None:
        return out.reshape(lq, *out.shape[2:]).to(q.dtype)
    return out.reshape(users * lq, *out.shape[2:])[layout.q_slots].to(q.dtype)
