"""Training objectives of the HSTU ranker: target-aware sampled softmax at many cut points per row.

Primitives:
- ``Batch`` / ``make_batch``: a padded batch of training windows with cut points; at each cut the
  true next item and sampled negatives become candidate tokens (what ranking scores), so training
  fits the exact scoring path the worker serves. Negatives mix uniform draws, in-batch negatives
  (the targets of the batch's other cut points: popular items as often as they are consumed, the
  way eSASRec and HSTU train), optionally draws by popularity, and optionally hard negatives: the
  items the model's own next-item head ranks highest at the cut (``head_scores``), which the
  candidate path must then learn to rank below the target.
- ``batch_loss``: sampled softmax over (target, negatives) at every cut, plus an optional
  next-item loss on every history position (every position predicts the next item): a softmax over
  the whole catalogue, or, on a large one, over a pool of negatives the batch shares
  (``Batch.aux_pool``: half uniform, half by popularity), each logit corrected by its draw's
  probability so that the loss estimates the whole catalogue's softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from relaygr.workers.model.dense import train_scores
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.prefix_kv import Events


@dataclass(frozen=True)
class Batch:
    items: torch.Tensor  # [B, T]
    actions: torch.Tensor  # [B, T]
    timestamps: torch.Tensor  # [B, T] float64
    lengths: torch.Tensor  # [B]
    cuts: torch.Tensor  # [B, S]
    cut_ts: torch.Tensor  # [B, S]
    candidates: torch.Tensor  # [B, S, K]; column 0 is the true next item
    weight: torch.Tensor  # [B, S] 1 for real cut points, 0 for padding
    aux_pool: torch.Tensor | None = None  # [M] negatives of the next-item loss (None: all items)
    aux_log_q: torch.Tensor | None = None  # [M] log(M x the probability of drawing each)
    neg_log_q: torch.Tensor | None = None  # [B, S, K-1] log(K-1 x each negative's draw probability)


def make_batch(
    windows: Sequence[Events],
    cuts: int,
    negatives: int,
    num_items: int,
    rng: np.random.Generator,
    popularity: np.ndarray | None = None,
    popular_share: float = 0.0,
    in_batch_share: float = 0.0,
    last_cut: bool = False,
    long_cuts: float = 0.0,
    aux_negatives: int = 0,
    sampling_correction: bool = False,
    hard_share: float = 0.0,
    head: HeadScores | None = None,
) -> Batch:
    """Pad ``windows`` (each >= 2 events) into a batch; pick up to ``cuts`` cut points per row
    (all of them for short rows) and ``negatives`` random negatives per cut: an ``in_batch_share``
    of them are targets of the batch's cut points (any row's), a ``popular_share`` drawn by
    ``popularity`` (item probabilities, index = item id), the rest uniformly. With ``last_cut``
    every row's last event is always one of its cuts: the request that sees the whole window, as
    ranking a user's next item after the whole history does. ``long_cuts`` > 0 draws cut ``c``
    with probability proportional to ``c ** long_cuts`` (more targets after long contexts, as
    serving ranks after a whole history); 0 draws them uniformly. ``aux_negatives`` > 0 draws that
    many items as the next-item loss's shared negatives (0: the whole catalogue), from an even mix
    of the uniform distribution and ``popularity``. With ``sampling_correction`` the batch carries
    each negative's log(negatives x q), q the probability of drawing it under that mix (in-batch
    draws follow the batch's targets, so popular items are drawn often): ``batch_loss`` lowers the
    negatives' logits by it, so that the sampled softmax estimates the whole catalogue's.
    ``hard_share`` > 0 takes that share from the next-item head's top items at the cut (``head``:
    ``head_scores`` of the model trained; ``_hard_negatives``), the other shares then of the rest:
    uniform draws remain, or the items no batch draws are never pushed down. 0: as without it."""
    items, actions, ts, lengths, cut, weight = _padded_cuts(windows, cuts, rng, last_cut, long_cuts)
    B, S = cut.shape
    cut_t = torch.from_numpy(cut)
    targets = torch.gather(items, 1, cut_t)
    cut_ts = torch.gather(ts, 1, cut_t)
    neg = rng.integers(1, num_items + 1, size=(B, S, negatives))
    n_hard = min(negatives, round(negatives * hard_share))
    rest = negatives - n_hard  # the other shares are shares of what the hard ones leave
    n_in = min(rest, round(rest * in_batch_share))
    n_pop = min(rest - n_in, round(rest * popular_share)) if popularity is not None else 0
    if n_in:
        pool = targets.numpy()[weight > 0]
        neg[..., :n_in] = pool[rng.integers(0, len(pool), size=(B, S, n_in))]
    if n_pop:
        neg[..., n_in : n_in + n_pop] = rng.choice(len(popularity), size=(B, S, n_pop), p=popularity)
    hard_pool = None
    if n_hard:
        if head is None:
            raise ValueError("hard negatives need the next-item head's scores (head=)")
        logits = head(items, actions, ts, lengths, cut_t, cut_ts)
        hard, hard_pool = _hard_negatives(logits, items, lengths, cut_t, targets, n_hard, rng)
        neg[..., negatives - n_hard :] = hard
    log_q = None
    if sampling_correction and negatives:
        q = np.full(num_items + 1, (negatives - n_hard - n_in - n_pop) / negatives / num_items)
        if n_in:
            q += n_in / negatives * np.bincount(pool, minlength=num_items + 1)[: num_items + 1] / len(pool)
        if n_pop:
            q += n_pop / negatives * popularity[: num_items + 1]
        q_neg = q[neg]
        if hard_pool is not None:  # each item of a cut's pool: drawn with probability 1 / pool size
            in_pool = (neg[..., :, None] == hard_pool[..., None, :]).any(-1)
            q_neg = q_neg + in_pool * (n_hard / negatives / hard_pool.shape[-1])
        log_q = torch.from_numpy(np.log(negatives * np.maximum(q_neg, 1e-12))).float()
    neg = torch.from_numpy(neg)
    return Batch(
        items=items,
        actions=actions,
        timestamps=ts,
        lengths=lengths,
        cuts=cut_t,
        cut_ts=cut_ts,
        candidates=torch.cat([targets[..., None], neg], dim=-1),
        weight=torch.from_numpy(weight),
        neg_log_q=log_q,
        **_aux_pool(rng, num_items, aux_negatives, popularity),
    )


def _padded_cuts(
    windows: Sequence[Events], cuts: int, rng: np.random.Generator, last_cut: bool, long_cuts: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """``windows`` padded (items, actions, timestamps ``[B, T]``, lengths ``[B]``) and each row's
    cut points ``[B, S]`` with their weights (1 a real cut, 0 padding), as ``make_batch`` says."""
    B = len(windows)
    T = max(len(w) for w in windows)
    S = min(cuts, T - 1)
    items = torch.zeros(B, T, dtype=torch.int64)
    actions = torch.zeros(B, T, dtype=torch.int64)
    ts = torch.zeros(B, T, dtype=torch.float64)
    lengths = torch.tensor([len(w) for w in windows])
    cut = np.ones((B, S), dtype=np.int64)
    weight = np.zeros((B, S), dtype=np.float32)
    for b, w in enumerate(windows):
        n = len(w)
        items[b, :n], actions[b, :n], ts[b, :n] = w.item_ids, w.action_ids, w.timestamps
        if n - 1 <= S:
            chosen = np.arange(1, n)
        elif last_cut:
            chosen = np.append(np.sort(_draw_cuts(rng, n - 1, S - 1, long_cuts)), n - 1)
        else:
            chosen = np.sort(_draw_cuts(rng, n, S, long_cuts))
        cut[b, : len(chosen)] = chosen
        weight[b, : len(chosen)] = 1.0
    return items, actions, ts, lengths, cut, weight


HeadScores = Callable[..., torch.Tensor]
"""``head(items, actions, timestamps, lengths, cuts, cut_ts)``: the next-item head's logits at
every cut, ``[B, S, num_items + 1]`` (``head_scores`` with its model bound)."""
HARD_POOL = 4
"""A cut's hard negatives are drawn, without replacement, from the next-item head's top
``HARD_POOL x`` (hard negatives a cut) items there: the items the model confuses with the target,
varied from step to step rather than always the same few."""


@torch.no_grad()
def head_scores(
    model: HSTURanker,
    items: torch.Tensor,
    actions: torch.Tensor,
    timestamps: torch.Tensor,
    lengths: torch.Tensor,
    cuts: torch.Tensor,
    cut_ts: torch.Tensor,
) -> torch.Tensor:
    """The next-item head's logits at every cut, ``[B, S, num_items + 1]`` (row 0: -inf): the
    final state of the history token before the cut (position ``cut - 1`` predicts the item at
    ``cut``) dotted with the item embedding table. One forward without gradients, dropout off."""
    B, S = cuts.shape
    was_training = model.training
    model.eval()
    try:
        _, states = train_scores(
            model,
            items,
            actions,
            timestamps,
            lengths,
            cuts,
            cut_ts,
            torch.zeros(B, S, 1, dtype=torch.int64),  # one dummy candidate: only the history is read
            history_states=True,
        )
    finally:
        model.train(was_training)
    at = (cuts.to(states.device) - 1).clamp_min(0)[..., None].expand(-1, -1, states.shape[-1])
    logits = torch.gather(states, 1, at).float() @ model.item_emb.weight.float().t()
    logits[..., 0] = float("-inf")
    return logits


def _hard_negatives(
    logits: torch.Tensor,
    items: torch.Tensor,
    lengths: torch.Tensor,
    cuts: torch.Tensor,
    targets: torch.Tensor,
    count: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` hard negatives a cut (``[B, S, count]``) and the pool they were drawn from
    (``[B, S, P]``): the head's top ``P = HARD_POOL x count`` items at each cut, the target and
    the items of the history before the cut left out (ranking never scores an item the history
    read holds), then ``count`` of them without replacement."""
    logits = logits.detach().float().cpu().clone()
    B, S, N = logits.shape
    T = items.shape[1]
    # Each item's first position in its row (T where absent): seen before the cut if < cut.
    pos = torch.arange(T).expand(B, T).masked_fill(torch.arange(T)[None, :] >= lengths[:, None], T)
    first = torch.full((B, N), T, dtype=torch.int64).scatter_reduce(
        1, items.clamp(0, N - 1), pos, reduce="amin"
    )
    seen = first[:, None, :] < cuts[..., None]  # [B, S, N]
    logits = logits.masked_fill(seen, float("-inf"))
    logits.scatter_(-1, targets[..., None].clamp(0, N - 1), float("-inf"))
    size = min(HARD_POOL * count, N - 2)
    pool = torch.topk(logits, size, dim=-1).indices.numpy()  # [B, S, P]
    pick = np.argsort(rng.random((B, S, size)), axis=-1)[..., :count]
    return np.take_along_axis(pool, pick, axis=-1), pool


AUX_POPULAR_SHARE = 0.5
"""Share of the next-item loss's pool drawn by popularity: uniform draws over a large catalogue are
mostly items nobody confuses with the target, while the whole softmax's gradient is mostly the
popular ones."""


def _aux_pool(
    rng: np.random.Generator, num_items: int, size: int, popularity: np.ndarray | None
) -> dict[str, torch.Tensor]:
    """``size`` draws (with replacement) from q = mix of uniform and popularity over items
    1..num_items, and log(size x q) of each (the sampled-softmax correction)."""
    if size <= 0 or size >= num_items:
        return {}
    q = np.full(num_items, 1.0 / num_items)
    if popularity is not None and popularity[1:].sum() > 0:
        pop = popularity[1 : num_items + 1] / popularity[1 : num_items + 1].sum()
        q = (1 - AUX_POPULAR_SHARE) * q + AUX_POPULAR_SHARE * pop
    pool = rng.choice(num_items, size=size, p=q)
    return {
        "aux_pool": torch.from_numpy(pool + 1),
        "aux_log_q": torch.from_numpy(np.log(size * q[pool])).float(),
    }


def _draw_cuts(rng: np.random.Generator, stop: int, size: int, long_cuts: float) -> np.ndarray:
    """``size`` distinct cut points in ``1 .. stop - 1``, weighted by ``c ** long_cuts``."""
    points = np.arange(1, stop)
    weights = None
    if long_cuts > 0:
        weights = points.astype(np.float64) ** long_cuts
        weights /= weights.sum()
    return rng.choice(points, size=size, replace=False, p=weights)


def batch_loss(model: HSTURanker, batch: Batch, aux_weight: float = 0.0) -> torch.Tensor:
    """Sampled softmax over (true next item, negatives) at every cut point: the served scores.

    With ``aux_weight`` > 0, adds that times a next-item loss on the history tokens'
    final states (``state_t . item_embedding``, predicting event ``t + 1``): a dense, cheap
    signal for the shared embeddings and layers. The ranking score itself is only ever the
    candidate-token path above."""
    out = train_scores(
        model,
        batch.items,
        batch.actions,
        batch.timestamps,
        batch.lengths,
        batch.cuts,
        batch.cut_ts,
        batch.candidates,
        history_states=aux_weight > 0,
    )
    scores, states = out if isinstance(out, tuple) else (out, None)
    scores = scores.float()
    if batch.neg_log_q is not None:  # a draw of probability q stands for 1 / (K q) items
        scores = torch.cat([scores[..., :1], scores[..., 1:] - batch.neg_log_q.to(scores.device)], dim=-1)
    cands = batch.candidates.to(scores.device)
    # A negative that happens to be the target is not a negative.
    clash = cands[..., 1:] == cands[..., :1]
    scores = torch.cat([scores[..., :1], scores[..., 1:].masked_fill(clash, float("-inf"))], dim=-1)
    zeros = torch.zeros(scores.shape[0] * scores.shape[1], dtype=torch.int64, device=scores.device)
    ce = F.cross_entropy(scores.flatten(0, 1), zeros, reduction="none")
    w = batch.weight.to(scores.device).flatten()
    loss = (ce * w).sum() / w.sum().clamp_min(1.0)
    if states is not None:
        loss = loss + aux_weight * _next_item_loss(model, batch, states)
    return loss


def _next_item_loss(model: HSTURanker, batch: Batch, states: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each history position's next item, over the whole catalogue or over
    ``batch.aux_pool``: each position's true next item against the pool's M draws, each draw's
    logit lowered by log(M q) (the sampled-softmax correction: a draw of probability q stands for
    1 / (M q) items), the draws equal to the true item masked."""
    items = model.vocab_items(batch.items)
    nxt = items[:, 1:]
    valid = (
        torch.arange(1, items.shape[1], device=items.device) < batch.lengths.to(items.device)[:, None]
    ) & (nxt > 0)
    h = states[:, :-1][valid].float()
    target = nxt[valid]
    table = model.item_emb.weight.float()
    if batch.aux_pool is None:
        logits = h @ table.t()
        logits[:, 0] = float("-inf")  # never predict the unknown id
        return F.cross_entropy(logits, target)
    pool = batch.aux_pool.to(items.device)
    positive = (h * table[target]).sum(-1, keepdim=True)
    negative = (h @ table[pool].t() - batch.aux_log_q.to(h.device)).masked_fill(
        pool[None, :] == target[:, None], float("-inf")
    )
    logits = torch.cat([positive, negative], dim=-1)
    return F.cross_entropy(logits, torch.zeros(len(target), dtype=torch.int64, device=logits.device))
