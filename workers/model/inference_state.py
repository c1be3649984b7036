"""What one inference call works on, apart from the calls themselves (``inference``).

Primitives:
- ``Context``: the keys and values the next tokens attend to, as segments of consecutive
  positions from 0 (a cached prefix, then the tokens being computed), per layer.
- ``Pending``: a segment being computed: its events (vocabulary ids), key/value buffers and the
  plan cache its query chunks share.
- ``Serving``: what the serving paths derive from the weights (wide bias tables, the fused
  functions' weights, shapes, the far-key settings); ``serving_state(model, cached)`` builds it,
  or returns ``cached`` while no parameter has changed (its storage or version), so a ranking
  does not rebuild it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from relaygr.workers.model.fused_scoring import layer_weights
from relaygr.workers.model.hstu_attention import Segment, wide_far_index

if TYPE_CHECKING:
    from relaygr.workers.model.model import HSTURanker


@dataclass
class Context:
    """Keys/values the next tokens attend to: segments of consecutive positions from 0."""

    segments: list[Segment] = field(default_factory=list)
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)  # [layer][segment]

    @property
    def length(self) -> int:
        return self.segments[-1].stop if self.segments else 0


@dataclass
class Pending:
    """A segment being computed: its events (vocabulary ids), K/V buffers and index cache."""

    start: int
    items: torch.Tensor
    actions: torch.Tensor
    timestamps: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer
    plan_cache: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Serving:
    """What the serving paths derive from the weights, built once per set of weights."""

    key: tuple
    tables: list[torch.Tensor]  # per layer: wide_bias_table
    weights: list[torch.Tensor]  # the fused functions' layer weights
    dims: tuple[int, int, int]
    consts: tuple[float, float, float]
    far: tuple[int, int, float]  # first far index of the tables, near keys (0: none), far keys
    cand_action: torch.Tensor  # the candidate action's embedding
    embeddings: list[torch.Tensor]  # item and action tables, final norm weight and bias


def serving_state(model: HSTURanker, cached: Serving | None) -> Serving:
    """``model``'s ``Serving``: ``cached`` if it was built from these very weights, else a new one."""
    key = tuple((p.data_ptr(), p._version) for p in model._params)
    if cached is not None and cached.key == key:
        return cached
    cfg, first = model.config, model.layers[0]
    with torch.inference_mode():
        return Serving(
            key=key,
            tables=[layer.wide_bias_table() for layer in model.layers],
            weights=[w.detach() for layer in model.layers for w in layer_weights(layer)],
            dims=(cfg.heads, cfg.attn_dim, cfg.linear_dim),
            consts=(first.scale, cfg.attn_normaliser, first.norm.eps),
            far=(
                wide_far_index(cfg.near_keys, cfg.position_buckets) if cfg.near_keys else 0,
                cfg.near_keys,
                cfg.far_keys,
            ),
            cand_action=model.action_emb.weight[model.candidate_action].detach(),
            embeddings=[
                model.item_emb.weight.detach(),
                model.action_emb.weight.detach(),
                model.final_norm.weight.detach(),
                model.final_norm.bias.detach(),
            ],
        )
