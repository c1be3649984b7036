"""What a training run will cost on this machine, timed on the real model and log before it starts.

Probes are timed in CPU seconds of this process (``time.process_time``): on a shared machine a
probe's wall time swings with what else runs, its CPU time does not. The share of the wall time
the process got the CPU for during the probes turns them into an estimate of wall time.

Primitives:
- ``measure_costs(model, objective, train, valid_users, eval_users, ...)`` -> ``budget.RunCosts``:
  two training steps (forward and backward, no update) of the shortest and the longest batch an
  epoch holds give the ``StepCost``; two rankings of the whole catalogue (after a short and after
  the longest history, through the dense path validation and evaluation take) give the
  ``RankCost``; from them, every step of an epoch, a validation and
  the final evaluation are predicted. The model's weights are left as they were, and training
  seeds its own random streams, so a probed run trains the same model as an unprobed one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from relaygr.workers.model.dense import dense_rank_full
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training.budget import BATCH_TOKENS, Clock, RankCost, RunCosts, StepCost, batch_shapes
from relaygr.workers.training.fit import Objective
from relaygr.workers.training.objectives import batch_loss, head_scores, make_batch

PROBE_EVENTS = 1024
"""Longest history a ranking probe reads (the cost model extends it to longer ones)."""


REPEATS = 2
"""Timings of each probe; the fastest counts (the first run of a shape pays one-off allocations,
and a shared machine only ever adds time)."""


def _timed(fn, clock: Clock, repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def _step_seconds(model: HSTURanker, obj: Objective, rows: list[Events], clock: Clock) -> float:
    """One forward and backward pass of a batch of ``rows``; the gradients are dropped."""
    rng = np.random.default_rng(0)
    batch = make_batch(
        rows,
        obj.cuts,
        obj.negatives,
        model.config.num_items,
        rng,
        in_batch_share=obj.in_batch_share,
        long_cuts=obj.long_cuts,
        aux_negatives=obj.aux_negatives,
        sampling_correction=obj.sampling_correction,
    )
    hard = obj.hard_negatives > 0  # the head's forward of the batch's histories, every step

    def step() -> None:
        if hard:
            head_scores(
                model, batch.items, batch.actions, batch.timestamps, batch.lengths, batch.cuts, batch.cut_ts
            )
        batch_loss(model, batch, obj.aux_weight).backward()
        model.zero_grad(set_to_none=True)

    model.train()
    try:
        return _timed(step, clock)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def step_cost(
    model: HSTURanker,
    obj: Objective,
    sequences: Sequence[Events],
    batch_size: int,
    batch_tokens: int = BATCH_TOKENS,
    clock: Clock = time.process_time,
) -> tuple[StepCost, list[tuple[int, int]]]:
    """The step cost model and the shapes of an epoch's steps."""
    max_len = model.config.max_len
    seqs = sorted((s for s in sequences if len(s) >= 2), key=len)
    shapes = batch_shapes([len(s) for s in seqs], max_len, batch_size, batch_tokens)
    (r1, _), (r2, _) = shapes[0], shapes[-1]
    short = [s.slice(max(0, len(s) - max_len)) for s in seqs[:r1]]
    long = [s.slice(max(0, len(s) - max_len)) for s in seqs[len(seqs) - r2 :]]
    t1 = _step_seconds(model, obj, short, clock)
    t2 = _step_seconds(model, obj, long, clock)
    w1, w2 = max(len(s) for s in short), max(len(s) for s in long)
    return StepCost.fit((r1, w1, t1), (r2, w2, t2)), shapes


def rank_cost(
    model: HSTURanker, longest: Events, clock: Clock = time.process_time, dense: bool = False
) -> RankCost:
    """The ranking cost model, from the whole catalogue ranked after 16 events and after
    ``longest`` (its last ``PROBE_EVENTS``), through ``rank_full`` or (``dense``) the dense path
    validation takes."""
    items = torch.arange(1, model.config.num_items + 1)
    long = longest.slice(max(0, len(longest) - PROBE_EVENTS))
    short = long.slice(max(0, len(long) - 16))
    ts = float(long.timestamps[-1])

    runner = ModelRunner(model)  # as validation and evaluation serve it

    def rank(h: Events) -> None:
        (dense_rank_full(model, h, items, ts) if dense else runner.rank_full(h, items, ts))

    with torch.no_grad():
        t1 = _timed(lambda: rank(short), clock)
        t2 = _timed(lambda: rank(long), clock)
    return RankCost.fit((len(short), len(items), t1), (len(long), len(items), t2))


def _unseen(num_items: int, history: Events) -> int:
    return num_items - len(np.unique(history.item_ids.numpy()))


def measure_costs(
    model: HSTURanker,
    obj: Objective,
    train: dict[str, Events],
    valid_histories: Sequence[Events],
    eval_histories: Sequence[Events],
    eval_lengths: Sequence[int | None],
    *,
    batch_size: int,
    batch_tokens: int = BATCH_TOKENS,
    clock: Clock = time.process_time,
    wall: Clock = time.perf_counter,
    spent: float = 0.0,
) -> RunCosts:
    """CPU seconds of an epoch, a validation (``valid_histories`` each ranked whole against the
    catalogue) and the final evaluation (``eval_histories`` at every length), on this machine; and
    the share of wall time this process gets the CPU for, measured over the probes."""
    t0, w0 = clock(), wall()
    steps, shapes = step_cost(model, obj, list(train.values()), batch_size, batch_tokens, clock)
    epoch = sum(steps(rows, window) for rows, window in shapes)
    longest = max([*valid_histories, *eval_histories], key=len)
    ranks = rank_cost(model, longest, clock, dense=True)
    n = model.config.num_items
    validation = sum(ranks(len(h), _unseen(n, h)) for h in valid_histories)
    evaluation = sum(
        ranks(len(h) if k is None else min(k, len(h)), _unseen(n, h))
        for h in eval_histories
        for k in eval_lengths
    )
    cpu, elapsed = clock() - t0, wall() - w0
    return RunCosts(
        epoch=epoch,
        validation=validation,
        evaluation=evaluation,
        spent=spent + elapsed,
        steps=len(shapes),
        share=cpu / elapsed if elapsed > 0 and cpu > 0 else 1.0,
    )
