"""The dense path of the HSTU ranker: what training differentiates, and the oracle of serving.

Primitives:
- ``train_scores(model, items, actions, timestamps, lengths, cuts, cut_ts, candidates)``:
  differentiable candidate scores at many cut points of a padded batch, with the attention's
  oracle (``kernels.oracle``: ``pair_index`` and ``pair_weight`` for every pair, then
  ``dense_attention``), the same functions ``kernels.hstu_mha``'s oracle backend runs and every
  serving backend is held to; tests hold training and serving equal.
- ``dense_rank_full(model, history, candidates, request_ts)``: ``rank_full`` computed this way (one
  row, one cut): the oracle the serving paths are tested against.
"""

from __future__ import annotations

import torch

from relaygr.workers.model.hstu_attention import (
    SELF_BIAS_INDEX,
    dense_attention,
    far_scale,
    pair_index,
    pair_weight,
)
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.prefix_kv import Events


def train_scores(
    model: HSTURanker,
    items: torch.Tensor,
    actions: torch.Tensor,
    timestamps: torch.Tensor,
    lengths: torch.Tensor,
    cuts: torch.Tensor,
    cut_ts: torch.Tensor,
    candidates: torch.Tensor,
    *,
    history_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable candidate scores on a padded batch, with the dense reference attention.

    ``items``/``actions`` ``[B, T]`` raw ids, ``timestamps [B, T]`` float64, ``lengths [B]``
    valid events per row. For each cut point ``cuts[b, s]`` (``1..lengths[b]``), the
    candidates ``candidates[b, s, :]`` are scored as at a request at time ``cut_ts[b, s]``
    after history ``events[b, :cut]``: exactly what ``rank_full`` computes, batched.
    Returns ``[B, S, K]``; with ``history_states`` also the final normalised hidden states of
    the history tokens ``[B, T, dim]`` (for an auxiliary next-item loss; serving never needs
    them, so there the last layer computes only keys and values of history tokens).
    """
    cfg = model.config
    dev = model.device
    B, T = items.shape
    _, S, K = candidates.shape
    pos = torch.arange(T, device=dev)
    ts = timestamps.to(dev, torch.float64)
    valid = pos[None, :] < lengths.to(dev)[:, None]  # [B, T]
    cuts = cuts.to(dev)
    cut_ts = cut_ts.to(dev, torch.float64)
    np_, nt, near = cfg.position_buckets, cfg.time_buckets, cfg.near_keys
    # Bias indices and weights (visibility and far factor), shared by layers and heads (a cut's K
    # candidates share them): the oracle's pair terms. History tokens see themselves (own key).
    hist_d = pos[:, None] - pos[None, :]
    hist_index = pair_index(hist_d, ts[:, :, None] - ts[:, None, :], np_, nt)
    hist_own = torch.eye(T, dtype=torch.bool, device=dev)
    hist_vis = (
        pair_weight(hist_d, hist_own, far_scale(pos, near, cfg.far_keys), near)[None] * valid[:, None, :]
    )
    cand_d = cuts[..., None] - pos  # [B, S, T]; a candidate's own key is its own term below
    cand_index = pair_index(cand_d, cut_ts[..., None] - ts[:, None, :], np_, nt)
    cand_scale = far_scale(cuts.reshape(-1), near, cfg.far_keys).view(B, S, 1)
    cand_vis = pair_weight(cand_d, torch.zeros((), dtype=torch.bool, device=dev), cand_scale, near)
    cand_vis = cand_vis * valid[:, None, :]
    cand_index, cand_vis = cand_index.unsqueeze(-2), cand_vis.unsqueeze(-2)  # [B, S, 1, T]
    own_index = torch.full((1, 1), SELF_BIAS_INDEX, device=dev)
    own_weight = torch.ones((1, 1), device=dev)
    cand_ids = model.vocab_items(candidates.reshape(B, S * K))
    x = model.emb_drop(
        model.item_emb(model.vocab_items(items)) + model.action_emb(model.vocab_actions(actions))
    )
    e = model.item_emb(cand_ids)  # [B, S*K, dim]
    xc = xc0 = model.emb_drop(e + model.action_emb.weight[model.candidate_action])
    last = len(model.layers) - 1
    for li, layer in enumerate(model.layers):
        table = layer.bias_table()
        u, q, k, v = layer.project(x)  # [B, H, T, d]
        uc, qc, kc, vc = layer.project(xc)  # [B, H, S*K, d]
        H = q.shape[1]
        qs = qc.unflatten(2, (S, K)).transpose(1, 2)  # [B, S, H, K, d]
        ac = dense_attention(qs, k[:, None], v[:, None], cand_index, cand_vis, table, 1.0)
        ac = ac.transpose(1, 2).reshape(B, H, S * K, -1)
        # Each candidate's own key: one query against one key, the same arithmetic.
        own = dense_attention(*(t.unsqueeze(-2) for t in (qc, kc, vc)), own_index, own_weight, table, 1.0)
        own = own.squeeze(-2)
        xc_next = layer.finish(xc, uc, (ac + own) / cfg.attn_normaliser)
        if li < last or history_states:
            a = dense_attention(q, k, v, hist_index, hist_vis, table, cfg.attn_normaliser)
            x = layer.finish(x, u, a)
        xc = xc_next
    scores = (model.final_norm(xc - xc0) * e).sum(-1).view(B, S, K)
    return (scores, model.final_norm(x)) if history_states else scores


@torch.no_grad()
def dense_rank_full(
    model: HSTURanker, history: Events, candidates: torch.Tensor, request_ts: float
) -> torch.Tensor:
    """``rank_full`` computed by the dense training path (one row, one cut): the oracle the
    serving path is tested against."""
    was_training = model.training
    model.eval()
    try:
        n = len(history)
        cands = torch.as_tensor(candidates).reshape(1, 1, -1)
        scores = train_scores(
            model,
            history.item_ids[None],
            history.action_ids[None],
            history.timestamps[None],
            torch.tensor([n]),
            torch.tensor([[n]]),
            torch.tensor([[float(request_ts)]], dtype=torch.float64),
            cands,
        )
    finally:
        model.train(was_training)
    return scores.reshape(-1).float().cpu()
