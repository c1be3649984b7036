"""What the serving forward derives from the weights, built once per set of weights.

Primitives:
- ``LayerWeights``: one layer's tensors in the form the forward reads them: the U/Q/K/V projection
  doubled for one ``glu`` (``glu([a, b]) = a * sigmoid(b)``: with ``a`` the projection, its query
  rows scaled by ``1 / sqrt(d)``, and ``b`` the projection, that is SiLU with the query scale in one
  operation), the output projection with its bias as one more input row (so that the residual
  add, the projection and its bias are one ``addmm`` over the gated output and a column of ones),
  the norms, and the flattened bias table.
- ``Serving``: those of every layer, the item and action embeddings as one table (a token's
  embedding is one ``embedding_bag`` sum), the item embeddings and final norm the scores read, the
  attention constants (``kernels.AttentionParams``) and the shapes; ``serving_state(modules,
  params, cached)`` builds it, or returns ``cached`` while no parameter of ``params`` has changed
  (its storage or version), so that a ranking does not rebuild it.

It reads the modules through ``RankerModules`` (what ``HSTURanker`` has), and imports nothing of
the model module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from relaygr.workers.kernels import AttentionParams


class RankerModules(Protocol):
    """The parts of the ranker the serving state reads."""

    layers: nn.ModuleList
    item_emb: nn.Embedding
    action_emb: nn.Embedding
    final_norm: nn.LayerNorm
    config: object


@dataclass(frozen=True)
class LayerWeights:
    """One layer, as the serving forward reads it."""

    norm: tuple[torch.Tensor, torch.Tensor, float]  # weight, bias, eps
    proj_weight: torch.Tensor  # [2 * out, dim]: scaled projection, then the projection
    proj_bias: torch.Tensor  # [2 * out]
    attn_norm: tuple[torch.Tensor, torch.Tensor, float]  # weight, bias (as [H, dv]), eps
    out_weight: torch.Tensor  # [H * dv + 1, dim]: the output projection transposed, then its bias
    bias_table: torch.Tensor  # [num_pos * num_time]


@dataclass(frozen=True)
class Serving:
    """What the serving forward derives from the weights."""

    key: tuple
    layers: list[LayerWeights]
    tokens: torch.Tensor  # item embeddings, then action embeddings: a token is one row of each
    items: torch.Tensor  # item embeddings (a candidate's score is a dot product with its row)
    final_norm: tuple[torch.Tensor, torch.Tensor, float]  # weight, bias, eps
    params: AttentionParams
    splits: tuple[int, int, int, int]  # u, q, k, v columns of the projection


def _layer_weights(layer: nn.Module, heads: int) -> LayerWeights:
    hv, hq = layer.splits[0], layer.splits[1]
    weight, bias = layer.uqkv.weight.detach(), layer.uqkv.bias.detach()
    scale = torch.ones(weight.shape[0], dtype=weight.dtype, device=weight.device)
    scale[hv : hv + hq] = layer.scale
    out = layer.out.weight.detach()
    return LayerWeights(
        norm=(layer.norm.weight.detach(), layer.norm.bias.detach(), layer.norm.eps),
        proj_weight=torch.cat([weight * scale[:, None], weight]),
        proj_bias=torch.cat([bias * scale, bias]),
        attn_norm=(
            layer.attn_norm.weight.detach().view(heads, -1),
            layer.attn_norm.bias.detach().view(heads, -1),
            layer.attn_norm.eps,
        ),
        out_weight=torch.cat([out.t(), layer.out.bias.detach()[None, :]]).contiguous(),
        bias_table=layer.bias_table().detach().contiguous(),
    )


def serving_state(modules: RankerModules, params: list[nn.Parameter], cached: Serving | None) -> Serving:
    """``modules``' ``Serving``: ``cached`` if it was built from these very weights (``params``,
    every parameter of ``modules``), else a new one."""
    key = tuple((p.data_ptr(), p._version) for p in params)
    if cached is not None and cached.key == key:
        return cached
    cfg = modules.config
    first = modules.layers[0]
    with torch.inference_mode():
        return Serving(
            key=key,
            layers=[_layer_weights(layer, cfg.heads) for layer in modules.layers],
            tokens=torch.cat([modules.item_emb.weight.detach(), modules.action_emb.weight.detach()]),
            items=modules.item_emb.weight.detach(),
            final_norm=(
                modules.final_norm.weight.detach(),
                modules.final_norm.bias.detach(),
                modules.final_norm.eps,
            ),
            params=AttentionParams(
                num_pos=cfg.position_buckets,
                num_time=cfg.time_buckets,
                normaliser=cfg.attn_normaliser,
                near_keys=cfg.near_keys,
                far_keys=cfg.far_keys,
            ),
            splits=tuple(first.splits),
        )
