"""What the Triton kernel reads of a batch besides its own tensors, derived once per batch (kept in
``batch.scratch``, so every layer of a forward reuses it) on the batch's device, with no host sync.

Primitives:
- ``causal_limits(batch)``: per user, whether its keys may be cut at a query block's last own key
  (the causal skip).
- ``position_frames(batch)``: each token's position relative to its user's smallest, in int32, and
  per user whether they span at most ``POSITION_SPAN`` (2^30): the kernel then derives every pair's
  gap in int32; a user that spans more is read in int64.
"""

from __future__ import annotations

import torch

from relaygr.workers.kernels.batch import JaggedBatch
from relaygr.workers.kernels.buckets import POSITION_CLAMP

POSITION_SPAN = POSITION_CLAMP  # ``position_bucket`` clamps position gaps here before the int32 cast


def causal_limits(batch: JaggedBatch) -> torch.Tensor:
    """``[B]`` int32, once per batch: 1 where a user's key positions never decrease and each query
    sits at or before its own key's position, so every key after a query's own key is hidden from
    it (``pos_j >= pos_i``) and the kernel may stop there; 0 where the kernel reads all the keys."""
    key = ("triton", "causal_limits")
    if key in batch.scratch:
        return batch.scratch[key]
    users = batch.users
    device = batch.k_pos.device
    k_pos, q_pos = batch.k_pos, batch.q_pos
    total_k, total_q = int(k_pos.shape[0]), int(q_pos.shape[0])
    bad = torch.zeros(users + 1, dtype=torch.int32, device=device)  # the last: keys of no user
    q_user, k_user = _token_users(batch)
    if total_k > 1:
        drops = (k_pos[1:] < k_pos[:-1]) & (k_user[1:] == k_user[:-1])
        bad.index_add_(0, k_user[1:], drops.to(torch.int32))
    if total_q:
        own = batch.k_offsets[q_user + 1] - batch.q_offsets[q_user + 1] + torch.arange(total_q, device=device)
        bad.index_add_(0, q_user, (q_pos > k_pos[own]).to(torch.int32))
    limits = (bad[:users] == 0).to(torch.int32)
    batch.scratch[key] = limits
    return limits


def _token_users(batch: JaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's and each key's user (``[Tq]``, ``[Tk]``), once per batch; a key past the last
    user's (``k_rows``' unused tail) is user ``B``, which no program reads."""
    key = ("triton", "token_users")
    if key not in batch.scratch:
        batch.scratch[key] = tuple(
            torch.searchsorted(offsets[1:], torch.arange(int(pos.shape[0]), device=pos.device), right=True)
            for offsets, pos in ((batch.q_offsets, batch.q_pos), (batch.k_offsets, batch.k_pos))
        )
    return batch.scratch[key]


def position_frames(batch: JaggedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Once per batch, on the device (no host sync): ``[Tq]`` and ``[Tk]`` int32 positions relative
    to their user's smallest, and ``[B]`` int32 1 where the user's positions span at most 2^30 (so
    a pair's gap is an int32 difference), 0 where they do not (that user's relative positions are 0
    and the kernel reads the int64 ones)."""
    key = ("triton", "position_frames")
    if key in batch.scratch:
        return batch.scratch[key]
    limit = torch.iinfo(torch.int64)
    users = batch.users
    q_user, k_user = _token_users(batch)
    low = batch.k_pos.new_full((users + 1,), limit.max)  # the last: keys of no user
    low = low.scatter_reduce_(0, k_user, batch.k_pos, "amin").scatter_reduce_(0, q_user, batch.q_pos, "amin")
    high = batch.k_pos.new_full((users + 1,), limit.min)
    high = high.scatter_reduce_(0, k_user, batch.k_pos, "amax").scatter_reduce_(
        0, q_user, batch.q_pos, "amax"
    )
    # high - low <= 2^30 without overflow (an empty user has high < low: it fits).
    fits = high <= low.clamp(max=limit.max - POSITION_SPAN) + POSITION_SPAN

    def relative(pos: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        return torch.where(fits[owner], pos - low[owner], 0).to(torch.int32)

    frames = (relative(batch.q_pos, q_user), relative(batch.k_pos, k_user), fits[:users].to(torch.int32))
    batch.scratch[key] = frames
    return frames
