"""The oracle of ``hstu_mha``: its definition, in plain and differentiable PyTorch.

Every backend (``cpu``, ``triton``) is held to it (``tests/test_kernel_oracle.py``), and the training
forward (``workers/model/dense.py``) computes its attention with these same functions, so the
attention arithmetic is written once. Nothing here is tuned: a loop over the users, every pair of
a user materialised, no operation in place (autograd records all of it), the host reads the offsets.

Primitives:
- ``pair_index(dpos, dt, num_pos, num_time)``: each pair's index into a layer's flattened
  ``[num_pos * num_time]`` bias table, from its position difference and time gap (``buckets``).
- ``far_scale(q_pos, near_keys, far_keys)``: each query's far-key factor ``[nq, 1]`` (float32).
- ``pair_weight(dpos, own, scale, near_keys)``: each pair's weight: 0 where the key is hidden from
  the query, the query's far factor where it is far, 1 otherwise.
- ``dense_attention(q, k, v, index, weight, table, normaliser)``: the arithmetic,
  ``silu(q k^T + table[index]) * weight @ v / normaliser``, over any leading batch dimensions.
- ``oracle_hstu_mha(q, k, v, batch, bias_table, params)``: ``hstu_mha`` from these, user by user.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from relaygr.workers.kernels.batch import AttentionParams, JaggedBatch, check_key_rows
from relaygr.workers.kernels.buckets import position_bucket, time_bucket


def pair_index(dpos: torch.Tensor, dt: torch.Tensor, num_pos: int, num_time: int) -> torch.Tensor:
    """Index (int32) into a flattened ``[num_pos, num_time]`` bias table of pairs ``dpos = pos_i -
    pos_j`` positions and ``dt = ts_i - ts_j`` seconds apart."""
    return position_bucket(dpos, num_pos) * num_time + time_bucket(dt, num_time)


def far_scale(q_pos: torch.Tensor, near_keys: int, far_keys: float) -> torch.Tensor:
    """Factor ``[nq, 1]`` (float32) of the far keys of queries at positions ``q_pos [nq]``:
    ``min(1, far_keys / (q_pos - near_keys + 1))`` (1 while a query sees no more than ``far_keys``)."""
    count = (q_pos - near_keys + 1).clamp(min=1).to(torch.float32)
    return (far_keys / count).clamp(max=1.0).reshape(-1, 1)


def pair_weight(dpos: torch.Tensor, own: torch.Tensor, scale: torch.Tensor, near_keys: int) -> torch.Tensor:
    """Weight (float32) of pairs ``dpos`` positions apart: a key is visible when it lies before the
    query (``dpos > 0``) or is the query's own key (``own``); a visible key at least ``near_keys``
    positions back (``near_keys > 0``) is far and weighs the query's ``scale``, any other 1."""
    visible = (dpos > 0) | own
    if near_keys <= 0:
        return torch.where(visible, 1.0, 0.0)
    return torch.where(visible, torch.where(dpos >= near_keys, scale, 1.0), 0.0)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor,
    normaliser: float,
) -> torch.Tensor:
    """``q [..., H, Tq, dqk]``, ``k [..., H, Tk, dqk]``, ``v [..., H, Tk, dv]``; ``index`` and
    ``weight`` ``[..., Tq, Tk]`` (shared by the heads, broadcastable; ``weight`` may be a bool);
    ``table`` the flattened bias table: ``silu(q k^T + table[index]) * weight @ v / normaliser``."""
    bias = table[index.long()].unsqueeze(-3)
    scores = F.silu(torch.matmul(q, k.transpose(-1, -2)) + bias)
    scores = scores * weight.unsqueeze(-3).to(scores.dtype)
    return torch.matmul(scores, v) / normaliser


def oracle_hstu_mha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: JaggedBatch,
    bias_table: torch.Tensor,
    params: AttentionParams,
) -> torch.Tensor:
    """``hstu_mha`` by its definition (see ``interface``): per user, every (query, key) pair's bias
    index and weight from the tokens' positions and timestamps, then ``dense_attention``. Sums in
    float32, or float64 for float64 inputs; differentiable in ``q``, ``k``, ``v`` and the table."""
    check_key_rows(batch, k, v)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if batch.k_rows is not None:  # key ``j`` of the batch is row ``k_rows[j]``
        k, v = k.index_select(0, batch.k_rows), v.index_select(0, batch.k_rows)
    table = bias_table.reshape(-1).to(dtype)
    q_offsets, k_offsets = batch.q_offsets.tolist(), batch.k_offsets.tolist()
    outs = []
    for b in range(batch.users):
        (q0, q1), (k0, k1) = q_offsets[b : b + 2], k_offsets[b : b + 2]
        q_pos = batch.q_pos[q0:q1]
        dpos = q_pos[:, None] - batch.k_pos[None, k0:k1]
        index = pair_index(
            dpos, batch.q_ts[q0:q1, None] - batch.k_ts[None, k0:k1], params.num_pos, params.num_time
        )
        # A user's queries are its last keys, in order: query ``i``'s own key is ``nk - nq + i``.
        keys = torch.arange(k1 - k0, device=dpos.device)
        own = keys[None, :] == keys[k1 - k0 - (q1 - q0) :, None]
        weight = pair_weight(dpos, own, far_scale(q_pos, params.near_keys, params.far_keys), params.near_keys)
        out = dense_attention(
            *(t.transpose(0, 1).to(dtype) for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
            index, weight, table, params.normaliser,
        )  # fmt: skip
        outs.append(out.transpose(0, 1))
    if not outs or not q.shape[0]:
        return q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    return torch.cat(outs).to(q.dtype)
