"""The training loop of the HSTU ranker, with early stopping on a validation split.

Primitives:
- ``Objective``: what a step optimises (cut points, negatives and their mix, auxiliary weight);
  ``hard_negatives``: the share of each cut's negatives taken from the next-item head's top items
  (one forward of the batch's histories without gradients a step).
- ``EarlyStopping``: after each epoch from ``min_epochs`` on, NDCG@10 of the validation target (the
  event before each user's test event) ranked against the whole catalogue through ``rank_full``;
  keeps the best weights, says when ``patience`` epochs have not improved on them, and restores
  them at the end. Earlier epochs are never kept, so they are not ranked (on a 14,190-item
  catalogue ranking is most of an epoch's time): while the learning rate is high validation swings
  from epoch to epoch (on ML-100K a peak at epoch 8 of 11 was kept and scored HR@10 0.064 on the
  test targets, against 0.106 after 24 epochs).
- ``recency_prior``: a starting point for the position biases that discounts old events.
- ``FarBiases``: the farthest position and time buckets training has reached; the buckets beyond
  them take the farthest one's bias, so serving a history longer than any training window never
  meets a bias training left at its starting value.
- ``lr_factor``: the learning-rate schedule (warm-up, cosine decay to a floor over the expected
  length of training, then the floor).
- ``train_model``: AdamW over shuffled, length-bucketed batches of random windows of at most
  ``config.max_len`` events; progress to the log; returns the mean loss of each epoch.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from relaygr.workers.model.hstu_attention import position_bucket, time_bucket
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training.budget import BATCH_TOKENS, Deadline, batch_shapes
from relaygr.workers.training.objectives import batch_loss, head_scores, make_batch
from relaygr.workers.training.quality import _log, evaluate, fmt_secs, spread_users

VALIDATION_USERS = 1024
"""Users ranked after each epoch (evenly spread): enough to tell a better epoch (with 256, one
user's hit moved validation NDCG@10 by about 0.002, the size of an epoch's gain), few enough to stay
cheap."""


@dataclass(frozen=True)
class Objective:
    cuts: int = 16
    negatives: int = 31
    popular_share: float = 0.5
    in_batch_share: float = 0.0
    aux_weight: float = 1.0
    last_cut: bool = False
    long_cuts: float = 0.0
    aux_negatives: int = 0
    sampling_correction: bool = False
    hard_negatives: float = 0.0


@dataclass
class EarlyStopping:
    """Validation NDCG@10 after each epoch; the best weights are kept and restored."""

    histories: dict[str, Events]
    targets: dict[str, Events]
    patience: int = 3
    min_epochs: int = 5
    users: int = VALIDATION_USERS
    scores: list[float | None] = field(default_factory=list)  # None: an epoch before min_epochs
    best_epoch: int = -1
    _best_state: dict | None = None

    def __post_init__(self) -> None:
        # An evenly spread, fixed subset: the same users every epoch.
        self._users = spread_users(list(self.targets), self.users)

    def score(self, model: HSTURanker) -> float:
        model.eval()
        hist = {u: self.histories[u] for u in self._users}
        got = evaluate(model, hist, self.targets, lengths=[None], dense=True, log=lambda _: None)
        model.train()
        return float(got["all"]["NDCG@10"])

    def should_stop(self, model: HSTURanker) -> bool:
        """Score this epoch (from ``min_epochs`` on: an earlier one is never kept, so it is not
        ranked, which on a large catalogue is most of an epoch's time); keep its weights if best;
        ``True`` once patience has run out."""
        epoch = len(self.scores)
        if epoch + 1 < self.min_epochs:
            self.scores.append(None)
            return False
        self.scores.append(self.score(model))
        if self.best_epoch < 0 or self.scores[-1] > self.scores[self.best_epoch]:
            self.best_epoch = epoch
            self._best_state = copy.deepcopy(model.state_dict())
        return epoch - self.best_epoch >= self.patience

    def restore_best(self, model: HSTURanker) -> None:
        """Load the kept weights; training that ended before ``min_epochs`` keeps its last ones
        (scored now)."""
        if self._best_state is not None:
            model.load_state_dict(self._best_state)
        elif self.scores:
            self.best_epoch = len(self.scores) - 1
            if self.scores[-1] is None:
                self.scores[-1] = self.score(model)
                model.eval()

    @property
    def best(self) -> float:
        return self.scores[self.best_epoch] if self.scores else float("nan")


def recency_prior(model: HSTURanker, slope: float) -> None:
    """Start every layer's position bias at ``-slope * log2(1 + d)`` for the shortest distance
    ``d`` of its bucket: old events start out discounted (as ALiBi's linear biases do) and
    training moves the biases from there. A function of the pair's positions only, so a cached
    prefix stays exact."""
    if slope == 0:
        return
    num_pos = model.config.position_buckets
    dist = torch.arange(1 << 17)
    buckets = position_bucket(dist, num_pos).long()
    nearest = torch.full((num_pos,), float(dist[-1])).scatter_reduce(0, buckets, dist.float(), reduce="amin")
    with torch.no_grad():
        for layer in model.layers:
            layer.pos_bias.copy_(-slope * torch.log2(1 + nearest))


@dataclass
class FarBiases:
    """The farthest position and time buckets any training window has reached so far.

    Training windows hold at most ``max_len`` events, but serving reads whole histories: a pair
    of events farther apart than any window was never trained on, and its bucket's bias would keep
    its starting value (0: no discount at all, while the trained far buckets learned one). After
    every step the buckets beyond the farthest reached ones take its bias, so the biases stay
    flat past what the data showed. The tie is on parameters only: ``position_bucket`` and
    ``time_bucket`` are unchanged, and so is relay-exactness."""

    position: int = 0
    time: int = 0

    def reach(self, rows: list[Events], num_pos: int, num_time: int) -> None:
        """Extend the reach to the widest pair of events in ``rows`` (windows, oldest first)."""
        distance = max(len(w) for w in rows) - 1
        gap = max(float(w.timestamps[-1] - w.timestamps[0]) for w in rows)
        self.position = max(self.position, int(position_bucket(torch.tensor([distance]), num_pos)))
        self.time = max(self.time, int(time_bucket(torch.tensor([gap], dtype=torch.float64), num_time)))

    def tie(self, model: HSTURanker) -> None:
        with torch.no_grad():
            for layer in model.layers:
                layer.pos_bias[self.position + 1 :] = layer.pos_bias[self.position]
                layer.time_bias[self.time + 1 :] = layer.time_bias[self.time]


def _popularity(model: HSTURanker, seqs: list[Events]) -> np.ndarray:
    counts = np.zeros(model.config.num_items + 1)
    for s in seqs:
        np.add.at(counts, model.vocab_items(s.item_ids).cpu().numpy(), 1)
    counts[0] = 0
    return counts / max(1.0, counts.sum())


def _epoch_batches(
    seqs: list[Events],
    max_len: int,
    batch_size: int,
    rng: np.random.Generator,
    whole_share: float = 0.0,
    whole_cap: int = 8192,
    batch_tokens: int = BATCH_TOKENS,
) -> list[list[Events]]:
    """One random window of at most ``max_len`` events per sequence, grouped by length into steps
    of at most ``batch_size`` rows and ``batch_tokens`` tokens (``budget.batch_shapes``). With
    ``whole_share``, a sequence longer than that is read whole (its last ``whole_cap`` events) with
    that probability, so training meets the lengths serving reads."""
    windows = []
    for s in seqs:
        if whole_share > 0 and len(s) > max_len and rng.random() < whole_share:
            windows.append(s.slice(max(0, len(s) - whole_cap), len(s)))
            continue
        start = int(rng.integers(0, len(s) - max_len + 1)) if len(s) > max_len else 0
        windows.append(s.slice(start, start + max_len))
    order = np.argsort([len(w) + rng.random() for w in windows])  # length buckets, random ties
    ordered = [windows[i] for i in order]
    lengths = [len(w) for w in ordered]
    batches, start = [], 0
    for rows, _ in batch_shapes(lengths, max(lengths, default=1), batch_size, batch_tokens):
        batches.append(ordered[start : start + rows])
        start += rows
    rng.shuffle(batches)
    return batches


def _batch(rows: list[Events], obj: Objective, model: HSTURanker, rng: np.random.Generator, popularity):
    return make_batch(
        rows,
        obj.cuts,
        obj.negatives,
        model.config.num_items,
        rng,
        popularity=popularity,
        popular_share=obj.popular_share,
        in_batch_share=obj.in_batch_share,
        last_cut=obj.last_cut,
        long_cuts=obj.long_cuts,
        aux_negatives=obj.aux_negatives,
        sampling_correction=obj.sampling_correction,
        hard_share=obj.hard_negatives,
        head=functools.partial(head_scores, model) if obj.hard_negatives > 0 else None,
    )


BIAS_LR_SCALE = 10.0
"""How much faster than the other weights the attention's position and time biases learn, by
default (``relaygr train --bias-lr``): on ML-100K, with the other settings alike, it narrowed the
gap between the whole history and its last 16 events (HR@10, whole minus last 16, paired: -0.015
at 1x, +0.000 at 10x)."""
LONG_CUTS = 1.0
"""How strongly a row's cut points lean toward long contexts by default (``relaygr train
--long-cuts``: cut ``c`` drawn with probability ~ ``c ** LONG_CUTS``). Serving ranks after a whole
history, and a pointwise attention sum over a long one mixes in every old event unless the biases
learned to discount them: on ML-100K (seeds 0 and 1) the whole history's HR@10 went from 0.126 and
0.113 at 0 to 0.135 and 0.160 at 1, and from behind the last 16 events to ahead of them."""
LR_FLOOR = 0.05
"""The learning rate after its decay, as a share of the peak."""


def lr_factor(step: int, warmup: int, decay_steps: int) -> float:
    """Share of the peak learning rate at ``step``: linear warm-up, then a cosine decay that
    reaches ``LR_FLOOR`` after ``decay_steps`` and stays there (training may run past it until
    early stopping ends it)."""
    done = min(1.0, step / max(1, decay_steps))
    cosine = LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * done))
    return min(1.0, (step + 1) / warmup) * cosine


def _optimiser(
    model: HSTURanker, lr: float, decay_steps: int, steps_per_epoch: int, bias_lr_scale: float = 1.0
):
    """AdamW with a short warm-up, then the decay of ``lr_factor`` over ``decay_steps``. The
    relative position and time biases learn ``bias_lr_scale`` times faster: Adam moves a weight
    by about the learning rate a step, so at the base rate a few hundred steps cannot take a bias
    far enough to discount old events."""
    biases = [p for n, p in model.named_parameters() if n.endswith(("pos_bias", "time_bias"))]
    ids = {id(p) for p in biases}
    groups = [
        {"params": [p for p in model.parameters() if id(p) not in ids]},
        {"params": biases, "lr": lr * bias_lr_scale},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, min(decay_steps // 20, 2 * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, warmup, decay_steps))
    return opt, sched


def _epoch_line(
    epoch: int,
    epochs: int,
    loss: float,
    stopping: EarlyStopping | None,
    step: int,
    total: int,
    t0: float,
    cpu0: float,
) -> str:
    val = ""
    if stopping is not None:
        last = stopping.scores[-1]
        val = (
            f"  valid NDCG@10 {last:.4f}"
            if last is not None
            else f"  (validation from epoch {stopping.min_epochs})"
        )
    elapsed = time.perf_counter() - t0
    return (
        f"epoch {epoch}/{epochs}  loss {loss:.4f}{val}  steps {step}/{total}  "
        f"elapsed {fmt_secs(elapsed)} (cpu {fmt_secs(time.process_time() - cpu0)})  "
        f"eta at most {fmt_secs(elapsed / step * (total - step))}"
    )


@dataclass
class _Loop:
    """What the steps of ``train_model`` share."""

    model: HSTURanker
    obj: Objective
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    rng: np.random.Generator
    popularity: np.ndarray
    far: FarBiases
    step: int = 0

    def run_step(self, rows: list[Events]) -> float:
        cfg = self.model.config
        self.far.reach(rows, cfg.position_buckets, cfg.time_buckets)
        loss = batch_loss(
            self.model, _batch(rows, self.obj, self.model, self.rng, self.popularity), self.obj.aux_weight
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.far.tie(self.model)
        self.step += 1
        return float(loss.detach())


def _late_line(steps: int, deadline: Deadline | None) -> str:
    if deadline is not None and deadline.stopped:
        return f"{deadline.stopped} after {steps} steps: training stops"
    return f"time budget reached after {steps} steps: training stops (--time-budget)"


def train_model(
    model: HSTURanker,
    sequences: dict[str, Events],
    *,
    epochs: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    objective: Objective | None = None,
    seed: int = 0,
    max_steps: int | None = None,
    stopping: EarlyStopping | None = None,
    decay_epochs: int | None = None,
    bias_lr_scale: float = 1.0,
    whole_share: float = 0.0,
    batch_tokens: int = BATCH_TOKENS,
    deadline: Deadline | None = None,
    log: Callable[[str], None] = _log,
    **objective_fields,
) -> list[float]:
    """Train in place; returns the mean loss of each epoch. ``objective_fields`` (``cuts``,
    ``negatives``, ...) set an ``Objective`` when none is given. With ``stopping``, training ends
    when validation stops improving and the best epoch's weights are restored. The learning rate
    decays over ``decay_epochs`` (default: all ``epochs``), the attention biases' at
    ``bias_lr_scale`` times the rate. A step reads at most ``batch_size`` rows and ``batch_tokens``
    tokens. Once ``deadline`` has passed no step or validation starts: training stops there and
    keeps the best weights validated so far (its last ones when none was)."""
    obj = objective or Objective(**objective_fields)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    random.seed(seed)
    seqs = [s for s in sequences.values() if len(s) >= 2]
    cfg = model.config
    steps_per_epoch = len(batch_shapes([len(s) for s in seqs], cfg.max_len, batch_size, batch_tokens))
    total = steps_per_epoch * epochs if max_steps is None else min(max_steps, steps_per_epoch * epochs)
    decay = total if decay_epochs is None else min(total, steps_per_epoch * decay_epochs)
    opt, sched = _optimiser(model, lr, decay, steps_per_epoch, bias_lr_scale)
    loop = _Loop(model, obj, opt, sched, rng, _popularity(model, seqs), FarBiases())
    losses: list[float] = []
    t0, cpu0 = time.perf_counter(), time.process_time()
    late = False
    for epoch in range(epochs):
        model.train()
        ep_loss, ep_n = 0.0, 0
        for rows in _epoch_batches(
            seqs, cfg.max_len, batch_size, rng, whole_share, cfg.max_seq_len, batch_tokens
        ):
            late = deadline is not None and deadline.passed()
            if late or (max_steps is not None and loop.step >= max_steps):
                break
            ep_loss += loop.run_step(rows)
            ep_n += 1
        if ep_n == 0:
            if late:
                log(_late_line(loop.step, deadline))
            break
        losses.append(ep_loss / ep_n)
        late = late or (deadline is not None and deadline.passed())
        stop = stopping is not None and not late and stopping.should_stop(model)
        if late and stopping is not None and len(stopping.scores) < len(losses):
            stopping.scores.append(None)  # the epoch the budget cut: not validated
        log(_epoch_line(epoch + 1, epochs, losses[-1], stopping, loop.step, total, t0, cpu0))
        if late:
            log(_late_line(loop.step, deadline))
            break
        if stop:
            log(f"early stop: best validation NDCG@10 {stopping.best:.4f} at epoch {stopping.best_epoch + 1}")
            break
    if stopping is not None:
        stopping.restore_best(model)
    log(
        f"attention biases: position buckets past {loop.far.position} and time buckets past "
        f"{loop.far.time} (no training window reached them) take the farthest reached one's bias"
    )
    model.eval()
    model.refresh_version()
    return losses
