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
- ``far_index(near_keys, num_pos, columns)``: the first bias index of a far pair;
  ``is_bucket_boundary``: whether ``near_keys`` is one (a model's far keys must be).
- From the attention's oracle (``kernels.oracle``), the one place its arithmetic is written:
  ``pair_index(dpos, dt, ...)`` (a pair's index into a layer's flattened bias table),
  ``far_scale(q_pos, near_keys, far_keys)`` (each query's factor ``[nq, 1]``),
  ``pair_weight(dpos, own, scale, near_keys)`` (each pair's visibility times far factor) and
  ``dense_attention`` (the differentiable dense form training uses, every pair's bias and weight
  materialised). Serving calls ``kernels.hstu_mha``, whose backends are held to the same oracle.
"""

from __future__ import annotations

import torch

from relaygr.workers.kernels import (
    EXACT_POSITIONS,
    SELF_BIAS_INDEX,
    dense_attention,
    far_scale,
    pair_index,
    pair_weight,
    position_bucket,
    time_bucket,
)

__all__ = [
    "EXACT_POSITIONS",
    "SELF_BIAS_INDEX",
    "dense_attention",
    "far_index",
    "far_scale",
    "is_bucket_boundary",
    "pair_index",
    "pair_weight",
    "position_bucket",
    "time_bucket",
]


def far_index(near_keys: int, num_pos: int, columns: int) -> int:
    """First bias index of a far pair (``near_keys`` > 0, a position-bucket boundary) in a table of
    ``columns`` entries per position bucket: that of the first far bucket with time column 0."""
    return int(position_bucket(torch.tensor([near_keys]), num_pos)[0]) * columns


def is_bucket_boundary(n: int, num_pos: int) -> bool:
    """Whether position differences ``>= n`` are exactly the buckets from ``bucket(n)`` on."""
    below, at = position_bucket(torch.tensor([n - 1, n]), 1 << 30).tolist()
    return n >= 1 and at > below and at < num_pos
