"""The PyTorch reference of ``hstu_mha``: what runs on CPU and NPU, and the oracle of every kernel.

Primitives:
- ``reference_hstu_mha(q, k, v, batch, bias_table, params)``: the users padded to one dense
  ``[B, H, max_q, max_k]`` score tensor per layer. What does not depend on the layer (each pair's
  bias index, and its weight: visibility, far factor and normaliser together) is derived once per
  batch and kept in ``batch.scratch``, so a layer costs a fixed handful of operations whatever the
  history length.
- ``pair_layout(batch, params)``: that once-per-batch part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from relaygr.workers.kernels.buckets import position_bucket, time_bucket
from relaygr.workers.kernels.interface import AttentionParams, JaggedBatch


@dataclass(frozen=True)
class PairLayout:
    """Once per batch: the dense slot of each packed token, and per (user, query, key) slot the
    bias index and the pair's weight (0 for a hidden pair or padding)."""

    q_slots: torch.Tensor | None  # [Tq] rows of the [B * max_q] layout; None for one user
    k_slots: torch.Tensor | None
    index: torch.Tensor  # [B, max_q, max_k] int64
    weight: torch.Tensor  # [B, 1, max_q, max_k] float32


def _dense(
    values: torch.Tensor, slots: torch.Tensor | None, users: int, rows: int, fill: float
) -> torch.Tensor:
    if slots is None:
        return values.reshape(1, rows, *values.shape[1:])
    out = values.new_full((users * rows, *values.shape[1:]), fill)
    return out.index_copy_(0, slots, values).reshape(users, rows, *values.shape[1:])


def _slots(offsets: torch.Tensor, total: int, rows: int) -> torch.Tensor:
    user = torch.searchsorted(offsets[1:], torch.arange(total, device=offsets.device), right=True)
    return user * rows + (torch.arange(total, device=offsets.device) - offsets[user])


def pair_layout(batch: JaggedBatch, params: AttentionParams) -> PairLayout:
    """The layer-independent part of the reference (kept in ``batch.scratch``)."""
    key = ("reference", params)
    if key in batch.scratch:
        return batch.scratch[key]
    users, lq, lk = batch.users, batch.max_q, batch.max_k
    single = users == 1
    q_slots = None if single else _slots(batch.q_offsets, int(batch.q_pos.shape[0]), lq)
    k_slots = None if single else _slots(batch.k_offsets, int(batch.k_pos.shape[0]), lk)
    far_pos = -(1 << 40)  # padding: never visible
    q_pos = _dense(batch.q_pos, q_slots, users, lq, 0)
    k_pos = _dense(batch.k_pos, k_slots, users, lk, far_pos)
    q_ts = _dense(batch.q_ts, q_slots, users, lq, 0.0)
    k_ts = _dense(batch.k_ts, k_slots, users, lk, 0.0)
    dpos = q_pos[:, :, None] - k_pos[:, None, :]  # [B, lq, lk]
    index = position_bucket(dpos.clamp(max=1 << 30), params.num_pos).to(torch.int64) * params.num_time
    index = index + time_bucket(q_ts[:, :, None] - k_ts[:, None, :], params.num_time)
    # A query's own key: the user's key slot (n_k - n_q + row). Padding query rows see nothing.
    n_q = (batch.q_offsets[1:] - batch.q_offsets[:-1])[:, None, None]
    n_k = (batch.k_offsets[1:] - batch.k_offsets[:-1])[:, None, None]
    rows = torch.arange(lq, device=dpos.device)[None, :, None]
    cols = torch.arange(lk, device=dpos.device)[None, None, :]
    own = cols == (n_k - n_q + rows)
    real = (rows < n_q) & (cols < n_k)
    visible = ((dpos > 0) | own) & real
    weight = visible.to(torch.float32) / params.normaliser
    if params.near_keys > 0:
        count = (q_pos - params.near_keys + 1).clamp(min=1).to(torch.float32)
        scale = (params.far_keys / count).clamp(max=1.0)[:, :, None]
        weight = weight * torch.where(dpos >= params.near_keys, scale, torch.ones_like(scale))
    layout = PairLayout(q_slots, k_slots, index, weight.unsqueeze(1))
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
    layout = pair_layout(batch, params)
    users, lq, lk = batch.users, batch.max_q, batch.max_k
    qd = _dense(q, layout.q_slots, users, lq, 0.0).transpose(1, 2)  # [B, H, lq, d]
    kd = _dense(k, layout.k_slots, users, lk, 0.0).permute(0, 2, 3, 1)  # [B, H, d, lk]
    vd = _dense(v, layout.k_slots, users, lk, 0.0).transpose(1, 2)  # [B, H, lk, dv]
    bias = bias_table.to(torch.float32)[layout.index].unsqueeze(1)  # [B, 1, lq, lk]
    scores = F.silu(torch.matmul(qd.to(torch.float32), kd.to(torch.float32)) + bias) * layout.weight
    out = torch.matmul(scores, vd.to(torch.float32)).transpose(1, 2)  # [B, lq, H, dv]
    if layout.q_slots is None:
        return out.reshape(lq, *out.shape[2:]).to(q.dtype)
    return out.reshape(users * lq, *out.shape[2:])[layout.q_slots].to(q.dtype)
