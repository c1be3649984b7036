"""HSTU attention kernels behind one entry point.

The model calls ``hstu_mha`` and never sees which implementation ran: the oracle (``oracle``, the
definition, differentiable), the CPU backend (``cpu``) or the Triton kernel (``triton_hstu``). This
package imports nothing of the project but itself (an import contract checks it).

Primitives:
- ``JaggedBatch``: the layer-independent description of one forward over several users: where
  each user's queries and keys lie in the packed tensors, their positions and timestamps.
- ``hstu_mha(q, k, v, batch, bias_table, params)``: pointwise HSTU attention over that batch;
  ``hstu_mha_gated(..., norm, gate, out)``: with what follows it in a layer (a norm over the heads,
  the gate), one pass on Triton.
- ``AttentionParams``: the model's constants (bias table shape, normaliser, far keys).
- ``position_bucket``, ``time_bucket``: the bias buckets, exact integer functions of float32 bits.
- ``available_backends()``, ``use_backend(name)``: which implementations this machine has, and
  forcing one (tests, benchmarks).
- ``dense_attention``, ``pair_index``, ``pair_weight``, ``far_scale``: the oracle's arithmetic and
  pair terms, which the training forward calls too.
"""

from relaygr.workers.kernels.buckets import EXACT_POSITIONS, SELF_BIAS_INDEX, position_bucket, time_bucket
from relaygr.workers.kernels.interface import (
    AttentionParams,
    JaggedBatch,
    available_backends,
    hstu_mha,
    hstu_mha_gated,
    use_backend,
)
from relaygr.workers.kernels.oracle import dense_attention, far_scale, pair_index, pair_weight

__all__ = [
    "EXACT_POSITIONS",
    "SELF_BIAS_INDEX",
    "AttentionParams",
    "JaggedBatch",
    "available_backends",
    "dense_attention",
    "far_scale",
    "hstu_mha",
    "hstu_mha_gated",
    "pair_index",
    "pair_weight",
    "position_bucket",
    "time_bucket",
    "use_backend",
]
