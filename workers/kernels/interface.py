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
With a row index (``JaggedBatch.k_rows``), ``k``/``v`` are any ``[R, H, d]`` tensors (a paged pool's
layer, read in place) and key ``j`` of the batch is their row ``k_rows[j]``.

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

import torch

from relaygr.workers.kernels.batch import AttentionParams, JaggedBatch

BACKENDS = ("reference", "triton")
__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "AttentionParams",
    "JaggedBatch",
    "available_backends",
    "backend_for",
    "hstu_mha",
    "use_backend",
]


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
