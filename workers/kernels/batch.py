"""What a call of ``hstu_mha`` is given besides its tensors: the model's constants and the batch.

Primitives:
- ``AttentionParams``: the model's attention constants (bias table shape, normaliser, far keys).
- ``JaggedBatch``: where each user's queries and keys lie in the packed tensors of one forward,
  with their positions and timestamps, and optionally the row of each key in ``k``/``v``
  (``k_rows``: a paged pool read in place); ``JaggedBatch.build`` from per-user lengths.
- ``check_key_rows(batch, k, v)``: the key tensors against the batch (with or without a row
  index), a clear error for a mismatch.

The backends import these types from here, and the entry point (``interface``) imports the
backends: nothing imports back up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionParams:
    """The model's attention constants (the same for every layer and every call)."""

    num_pos: int
    num_time: int
    normaliser: float
    near_keys: int = 0
    far_keys: float = 128.0


@dataclass(frozen=True, eq=False)
class JaggedBatch:
    """Where each user's tokens lie in the packed tensors of one forward, layer independent.

    ``q_offsets``/``k_offsets`` ``[B + 1]`` (int64) delimit user ``b``'s queries and keys;
    ``q_pos``/``k_pos`` (int64) and ``q_ts``/``k_ts`` (float64) are per token; ``max_q``/``max_k``
    are host integers (grid sizes, padded layouts). ``scratch`` keeps what an implementation
    derives from the batch once for all layers (bias indices, masks); it never leaves the batch.

    ``k_rows`` ``[Tk]`` (int64, optional): key ``j`` of the batch is row ``k_rows[j]`` of ``k`` and
    ``v``, which may then be any ``[R, H, d]`` tensors (a paged pool's layer, read in place). With
    it, the keys may run past ``k_offsets[-1]`` (the unused tail of a static capacity, whose
    offsets are computed on the device): no user reads them, but their rows must be in range.
    ``max_k`` is then a bound on any user's key count (the capacity), not necessarily reached.
    """

    q_offsets: torch.Tensor
    k_offsets: torch.Tensor
    q_pos: torch.Tensor
    q_ts: torch.Tensor
    k_pos: torch.Tensor
    k_ts: torch.Tensor
    max_q: int
    max_k: int
    k_rows: torch.Tensor | None = None
    scratch: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def users(self) -> int:
        return int(self.q_offsets.shape[0]) - 1

    @classmethod
    def build(
        cls,
        q_lengths: list[int],
        k_lengths: list[int],
        q_pos: torch.Tensor,
        q_ts: torch.Tensor,
        k_pos: torch.Tensor,
        k_ts: torch.Tensor,
        k_rows: torch.Tensor | None = None,
    ) -> JaggedBatch:
        """A batch from per-user query and key counts (host lists) and the packed per-token
        positions and timestamps (on the device the attention runs on); ``k_rows``: each key's
        row in ``k``/``v`` (see the class)."""
        if len(q_lengths) != len(k_lengths) or not q_lengths:
            raise ValueError(f"{len(q_lengths)} query lengths for {len(k_lengths)} key lengths")
        if any(nq > nk for nq, nk in zip(q_lengths, k_lengths, strict=True)):
            raise ValueError("a user has more queries than keys: its queries' own keys must be among them")
        if int(q_pos.shape[0]) != sum(q_lengths) or int(k_pos.shape[0]) != sum(k_lengths):
            raise ValueError("positions do not match the lengths")
        device = q_pos.device
        offsets = [0, 0]
        qo, ko = [0], [0]
        for nq, nk in zip(q_lengths, k_lengths, strict=True):
            offsets[0] += nq
            offsets[1] += nk
            qo.append(offsets[0])
            ko.append(offsets[1])
        return cls(
            q_offsets=torch.tensor(qo, dtype=torch.int64, device=device),
            k_offsets=torch.tensor(ko, dtype=torch.int64, device=device),
            q_pos=q_pos.to(torch.int64),
            q_ts=q_ts.to(torch.float64),
            k_pos=k_pos.to(torch.int64),
            k_ts=k_ts.to(torch.float64),
            max_q=max(q_lengths),
            max_k=max(k_lengths),
            k_rows=k_rows,
        )


def check_key_rows(batch: JaggedBatch, k: torch.Tensor, v: torch.Tensor) -> None:
    """``k``/``v`` against ``batch``: without a row index, one row per key; with one, an int64
    ``[Tk]`` index on their device whose rows are in range. The range is read on a CPU only: on
    CUDA (and the meta device) reading it back would wait for the device, and a CUDA graph's
    capture cannot; there an index out of range reads out of bounds (the caller's contract)."""
    tokens = int(batch.k_pos.shape[0])
    rows = batch.k_rows
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"{k.shape[0]} key rows for {v.shape[0]} value rows")
    if rows is None:
        if k.shape[0] != tokens:
            raise ValueError(f"{k.shape[0]} keys for a batch of {tokens}")
        return
    if rows.dtype != torch.int64 or rows.dim() != 1:
        raise ValueError(f"k_rows must be a 1-d int64 tensor, got {rows.dtype} of shape {tuple(rows.shape)}")
    if rows.shape[0] != tokens:
        raise ValueError(f"k_rows has {rows.shape[0]} rows for a batch of {tokens} keys")
    if rows.device != k.device:
        raise ValueError(f"k_rows is on {rows.device}, the keys on {k.device}")
    if rows.device.type == "cpu" and tokens:
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= k.shape[0]:
            raise ValueError(f"k_rows reads rows {low}..{high} of a key tensor of {k.shape[0]}")
