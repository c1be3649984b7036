"""The relative-bias buckets of a token pair, as exact integer functions of float32 bit patterns.

Primitives:
- ``position_bucket(dpos, num_buckets)``: bucket of a position difference ``i - j`` (exact below
  ``EXACT_POSITIONS``, then four buckets per doubling; negative differences are bucket 0).
- ``time_bucket(dt, num_buckets)``: bucket of a time gap in seconds (two buckets per doubling, gaps
  under 1.5 s, negative ones included, are bucket 0).
- ``SELF_BIAS_INDEX``: the bias index of a token with itself.

Both read the exponent and leading mantissa bits of a float32, so every implementation (PyTorch,
Triton) computes the same bucket for the same pair, whatever its blocking or device.
"""

from __future__ import annotations

import torch

SELF_BIAS_INDEX = 0
"""Bias index of a token with itself: position bucket 0 and time bucket 0."""
EXACT_POSITIONS = 16
"""Position differences below this get a bucket of their own; beyond, four buckets per doubling."""
F32_EXP_BIAS = 127
POSITION_CLAMP = 1 << 30
"""Position differences are clamped here before their int32 cast (every bucket count in use
saturates far below it: 64 buckets at 57,344)."""


def position_bucket(dpos: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket (int32) of position differences ``i - j``; negative differences map to bucket 0."""
    d = dpos.clamp(0, POSITION_CLAMP).to(torch.int32)
    # For d >= 16: 16 + 4 * (floor(log2 d) - 4) + (two mantissa bits after the leading one).
    log_part = (d.to(torch.float32).view(torch.int32) >> 21) - (((F32_EXP_BIAS + 4) << 2) - EXACT_POSITIONS)
    return torch.where(d < EXACT_POSITIONS, d, log_part).clamp_(0, num_buckets - 1)


def time_bucket(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket (int32) of time gaps in seconds: ``floor(log2 gap)`` doubled, plus one if the gap is
    at least 1.5 times that power of two. Gaps under 1.5 s (negative ones included) are bucket 0."""
    g = dt.to(torch.float32).clamp(min=1.0)
    return ((g.view(torch.int32) >> 22) - (F32_EXP_BIAS << 1)).clamp_(0, num_buckets - 1)
