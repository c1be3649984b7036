"""The one interface of HSTU attention: a jagged batch, the model's constants, and ``hstu_mha``.

What it computes, for query token ``i`` and key token ``j`` of the same user::

    out_i = (1 / N) * sum_j  visible(i, j) * far(i, j) * silu(q_i . k_j + bias[index(i, j)]) * v_j

- ``visible(i, j)``: ``pos_j < pos_i``, or ``j`` is ``i``'s own key. History tokens are causal;
  a candidate sits at the position after the history and sees every history key and itself, never
  another candidate (candidates share their position, so ``pos_j < pos_i`` leaves them out).
- ``index(i, j) = position_bucket(pos_i - pos_j) * num_time + time_bucket(ts_i - ts_j)``, into
  the layer's flattened ``[num_pos * num_time]`` bias table (shared by the heads).
- ``far(i, j)``: with ``near_keys > 0``, a key at least ``near_keys`` positions before its query is
  far and weighs ``min(1, far_keys / (pos_i - near_keys + 1))``; every other pair weighs 1.
- ``N``: the model's fixed normaliser; ``q`` arrives already scaled by ``1 / sqrt(d)``.

Layout: ``q [Tq, H, dqk]``, ``k [Tk, H, dqk]``, ``v [Tk, H, dv]``, the users' tokens packed one
after another (``JaggedBatch`` offsets). Each user's queries are the last keys of that user, in the
same order (the new tokens' keys are appended after the cached prefix), which is how a query finds
its own key. Positions are absolute within the user's history; timestamps are seconds (float64).

Backends: ``reference`` (PyTorch; CPU, NPU, and the oracle) and ``triton`` (CUDA, or CPU under
``TRITON_INTERPRET=1``). ``hstu_mha`` picks Triton for CUDA tensors where it imports, else the
reference; ``use_backend`` forces one, and so does ``RELAYGR_ATTENTION_BACKEND`` (an operator's
fallback where a kernel misbehaves).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

BACKENDS = ("reference", "triton")


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
    """

    q_offsets: torch.Tensor
    k_offsets: torch.Tensor
    q_pos: torch.Tensor
    q_ts: torch.Tensor
    k_pos: torch.Tensor
    k_ts: torch.Tensor
    max_q: int
    max_k: int
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
    ) -> JaggedBatch:
        """A batch from per-user query and key counts (host lists) and the packed per-token
        positions and timestamps (on the device the attention runs on)."""
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
        )


BACKEND_ENV = "RELAYGR_ATTENTION_BACKEND"
"""Names the backend every call runs (``reference`` or ``triton``); unset or empty: by device."""

_forced: str | None = None


@functools.cache
def _triton_imports() -> bool:
    return importlib.util.find_spec("triton") is not None


def available_backends() -> tuple[str, ...]:
    """The implementations this machine can run."""
    return BACKENDS if _triton_imports() else ("reference",)


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force ``name`` (``reference``, ``triton``) inside the block; ``None``: choose by device."""
    global _forced
    if name is not None and name not in available_backends():
        raise ValueError(f"attention backend {name!r} is not available here (have {available_backends()})")
    before, _forced = _forced, name
    try:
        yield
    finally:
        _forced = before


def backend_for(q: torch.Tensor) -> str:
    """The implementation ``hstu_mha`` runs for a query tensor."""
    if _forced is not None:
        return _forced
    if chosen := os.environ.get(BACKEND_ENV):
        if chosen not in available_backends():
            raise ValueError(f"{BACKEND_ENV}={chosen!r}: not one of {available_backends()}")
        return chosen
    return "triton" if q.is_cuda and _triton_imports() else "reference"


def hstu_mha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: JaggedBatch,
    bias_table: torch.Tensor,
    params: AttentionParams,
) -> torch.Tensor:
    """HSTU attention of ``q [Tq, H, dqk]`` over ``k [Tk, H, dqk]``, ``v [Tk, H, dv]``: ``[Tq, H, dv]``
    in ``q``'s dtype (sums in float32)."""
    if backend_for(q) == "triton":
        from relaygr.workers.kernels.triton_hstu import triton_hstu_mha

        return triton_hstu_mha(q, k, v, batch, bias_table, params)
    from relaygr.workers.kernels.reference import reference_hstu_mha

    return reference_hstu_mha(q, k, v, batch, bias_table, params)
