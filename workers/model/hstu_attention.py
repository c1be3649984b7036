"""HSTU pointwise attention with relative position/time bias: its definition and the dense form training uses.

Attention of query token ``i`` over key token ``j`` (HSTU style, no softmax)::

    out_i = (1 / N) * sum_j  visible(i, j) * silu(q_i . k_j + bias[bucket(i, j)]) * v_j

with ``N`` a fixed normaliser (never the sequence length) and ``bias`` one learned value per
(position bucket, time bucket) pair, shared by the heads. Buckets come only from the absolute
positions and timestamps of the two tokens, so a token's attention never depends on how long the
sequence is or on where it was cut: that is what makes a cached prefix exact.

Far keys (optional, ``near_keys > 0``): a key at least ``near_keys`` positions before its query is
far, and the far keys' terms are multiplied by ``min(1, far_keys / n_far(i))``, with ``n_far(i) =
i - near_keys + 1`` the far keys query ``i`` sees (positions count from 0). The recent keys are read
one by one; the older ones weigh at most ``far_keys`` keys' worth together, however many there
are, so a long history adds a summary of old taste instead of swamping the recent events. The
factor depends only on the query's position, so a cached prefix stays exact. ``near_keys`` is a
position-bucket boundary, so "far" is a threshold on a pair's bias index.

Primitives:
- ``position_bucket(dpos)``, ``time_bucket(dt)``, ``SELF_BIAS_INDEX``: the bias buckets
  (``kernels.buckets``, exact integer functions of float32 bit patterns).
- ``pair_index(dpos, dt, ...)``: combined bucket index into a layer's flattened bias table.
- ``far_index(near_keys, num_pos, columns)``: the first bias index of a far pair;
  ``is_bucket_boundary``: whether ``near_keys`` is one; ``far_scale(q_pos, near_keys, far_keys)``:
  each query's factor ``[nq, 1]``; ``far_weights(index, scale, first)``: the factor of each pair.
- ``dense_attention``: the differentiable dense form training uses; every pair's bias and
  visibility materialised. Serving calls ``kernels.hstu_mha``, which computes the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from relaygr.workers.kernels.buckets import EXACT_POSITIONS, SELF_BIAS_INDEX, position_bucket, time_bucket

__all__ = [
    "EXACT_POSITIONS",
    "SELF_BIAS_INDEX",
    "dense_attention",
    "far_index",
    "far_scale",
    "far_weights",
    "is_bucket_boundary",
    "pair_index",
    "position_bucket",
    "time_bucket",
]


def pair_index(dpos: torch.Tensor, dt: torch.Tensor, num_pos: int, num_time: int) -> torch.Tensor:
    """Index (int32) into a flattened ``[num_pos, num_time]`` bias table for each token pair."""
    return position_bucket(dpos, num_pos) * num_time + time_bucket(dt, num_time)


def far_index(near_keys: int, num_pos: int, columns: int) -> int:
    """First bias index of a far pair (``near_keys`` > 0, a position-bucket boundary) in a table of
    ``columns`` entries per position bucket: that of the first far bucket with time column 0."""
    return int(position_bucket(torch.tensor([near_keys]), num_pos)[0]) * columns


def is_bucket_boundary(n: int, num_pos: int) -> bool:
    """Whether position differences ``>= n`` are exactly the buckets from ``bucket(n)`` on."""
    below, at = position_bucket(torch.tensor([n - 1, n]), 1 << 30).tolist()
    return n >= 1 and at > below and at < num_pos


def far_scale(q_pos: torch.Tensor, near_keys: int, far_keys: float) -> torch.Tensor:
    """Factor ``[nq, 1]`` (float32) of the far keys of queries at positions ``q_pos [nq]``:
    ``min(1, far_keys / (q_pos - near_keys + 1))`` (1 while a query sees no more than ``far_keys``)."""
    count = (q_pos - near_keys + 1).clamp(min=1).to(torch.float32)
    return (far_keys / count).clamp(max=1.0).reshape(-1, 1)


def far_weights(index: torch.Tensor, scale: torch.Tensor, first: int) -> torch.Tensor:
    """Factor of each pair: ``scale`` (broadcast over the keys) where ``index >= first``, else 1."""
    return torch.where(index >= first, scale, torch.ones_like(scale))


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    visible: torch.Tensor,
    table: torch.Tensor,
    normaliser: float,
) -> torch.Tensor:
    """Reference attention: ``q [..., H, Tq, dqk]``, ``k [..., H, Tk, dqk]``, ``v [..., H, Tk, dv]``;
    ``index [..., Tq, Tk]`` the pairs' bias indices (``pair_index`` of their position differences
    and time gaps), ``visible [..., Tq, Tk]`` (bool, or each pair's factor: 0 for a hidden one),
    both shared by the heads and broadcastable;
    ``table`` the flattened bias table. Differentiable: the training path and the test oracle."""
    bias = table[index.long()].unsqueeze(-3)
    scores = F.silu(torch.matmul(q, k.transpose(-1, -2)) + bias)
    scores = scores * visible.unsqueeze(-3).to(scores.dtype)
    return torch.matmul(scores, v) / normaliser
