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

Backends (Meta's ``ops/`` layout: one entry, a PyTorch definition, tuned implementations each held
to it):

- ``oracle`` (``oracle.py``): the definition in plain, differentiable PyTorch; the training forward
  computes its attention with the same functions. A call that autograd records runs it (the only
  backend with a backward).
- ``cpu`` (``cpu.py``): PyTorch operations laid out for a CPU: a fixed handful per layer, the
  pair terms derived once per batch. What runs on a CPU, an NPU and wherever Triton does not.
- ``triton`` (``triton_hstu.py``): the fused kernel, on CUDA (or a CPU under ``TRITON_INTERPRET=1``).

``hstu_mha`` picks Triton for CUDA tensors where it imports, else ``cpu``; ``use_backend`` forces
one, and so does ``RELAYGR_ATTENTION_BACKEND`` (an operator's fallback where a kernel misbehaves).
``reference``, the CPU backend's earlier name, is still taken for it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from relaygr.workers.kernels.batch import AttentionParams, JaggedBatch
from relaygr.workers.kernels.oracle import oracle_hstu_mha

BACKENDS = ("oracle", "cpu", "triton")
ALIASES = {"reference": "cpu"}
"""Names still taken for a backend: ``reference`` was the CPU backend's."""
__all__ = [
    "ALIASES",
    "BACKENDS",
    "BACKEND_ENV",
    "AttentionParams",
    "JaggedBatch",
    "available_backends",
    "backend_for",
    "hstu_mha",
    "hstu_mha_gated",
    "use_backend",
]


BACKEND_ENV = "RELAYGR_ATTENTION_BACKEND"
"""Names the backend every call runs (``oracle``, ``cpu`` or ``triton``); unset or empty: by device."""

_forced: str | None = None


@functools.cache
def _triton_imports() -> bool:
    return importlib.util.find_spec("triton") is not None


def available_backends() -> tuple[str, ...]:
    """The implementations this machine can run."""
    return BACKENDS if _triton_imports() else BACKENDS[:2]


def _known(name: str, source: str) -> str:
    """``name`` (or an alias of one) as one of ``available_backends()``; a clear error otherwise."""
    name = ALIASES.get(name, name)
    if name not in available_backends():
        raise ValueError(
            f"{source}: attention backend {name!r} is not available here (have {available_backends()})"
        )
    return name


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force ``name`` (``oracle``, ``cpu``, ``triton``) inside the block; ``None``: choose by device."""
    global _forced
    if name is not None:
        name = _known(name, "use_backend")
    before, _forced = _forced, name
    try:
        yield
    finally:
        _forced = before


def backend_for(q: torch.Tensor, *tensors: torch.Tensor) -> str:
    """The implementation ``hstu_mha`` runs for a query tensor (and the call's other tensors):
    the one forced in code; else the oracle where autograd records the call; else the operator's
    (``RELAYGR_ATTENTION_BACKEND``); else Triton on CUDA where it imports, ``cpu`` elsewhere."""
    if _forced is not None:
        return _forced
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, *tensors)):
        return "oracle"
    if chosen := os.environ.get(BACKEND_ENV):
        return _known(chosen, BACKEND_ENV)
    return "triton" if q.is_cuda and _triton_imports() else "cpu"


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
    backend = backend_for(q, k, v, bias_table)
    if backend == "triton":
        from relaygr.workers.kernels.triton_hstu import triton_hstu_mha

        return triton_hstu_mha(q, k, v, batch, bias_table, params)
    if backend == "cpu":
        from relaygr.workers.kernels.cpu import cpu_hstu_mha

        return cpu_hstu_mha(q, k, v, batch, bias_table, params)
    return oracle_hstu_mha(q, k, v, batch, bias_table, params)


def hstu_mha_gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: JaggedBatch,
    bias_table: torch.Tensor,
    params: AttentionParams,
    norm: tuple[torch.Tensor, torch.Tensor, float],
    gate: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """An HSTU layer's attention and what follows it before the output projection:
    ``layer_norm(hstu_mha(...)) * gate`` written into ``out`` and returned. ``norm``: the layer
    norm's weight and bias (``[H, dv]``, over each row's heads) and eps; ``gate`` and ``out``:
    ``[Tq, H * dv]``, rows strided, elements not (``out`` a view of a wider buffer, as the layer's
    gated rows beside its bias column). Triton runs it as two launches; elsewhere it is
    ``hstu_mha``, ``layer_norm`` and ``mul`` (bit for bit those three). Not differentiable."""
    backend = backend_for(q, k, v, bias_table)
    if backend == "triton":
        from relaygr.workers.kernels.triton_hstu import triton_hstu_mha_gated

        return triton_hstu_mha_gated(q, k, v, batch, bias_table, params, norm, gate, out)
    attn = hstu_mha(q, k, v, batch, bias_table, params)
    a = F.layer_norm(attn, attn.shape[-2:], norm[0], norm[1], eps=norm[2])
    torch.mul(a, gate.view(a.shape), out=out.view(a.shape))
    return out
