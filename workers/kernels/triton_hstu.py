"""The Triton forward kernel of ``hstu_mha`` (CUDA; CPU under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import torch

from relaygr.workers.kernels.interface import AttentionParams, JaggedBatch


def triton_hstu_mha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: JaggedBatch,
    bias_table: torch.Tensor,
    params: AttentionParams,
) -> torch.Tensor:
    raise NotImplementedError("the Triton HSTU kernel is not built yet")
