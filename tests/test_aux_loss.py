"""The next-item loss on a large catalogue: a pool of uniform negatives the batch shares instead of
the whole catalogue, corrected so that it estimates the whole catalogue's softmax."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from synthetic import history, tiny_model

from relaygr.workers.fit import train_model
from relaygr.workers.objectives import batch_loss, make_batch
from relaygr.workers.sizing import AUX_FULL_ITEMS, AUX_NEGATIVES, size_training


def _batch(aux_negatives: int, seed: int = 0):
    windows = [history(n, seed=n) for n in (12, 30, 47)]
    return make_batch(windows, 4, 8, 500, np.random.default_rng(seed), aux_negatives=aux_negatives)


def test_the_pool_is_distinct_uniform_items_and_draws_nothing_when_off() -> None:
    batch = _batch(64)
    pool = batch.aux_pool.tolist()
    assert len(pool) == len(set(pool)) == 64 and min(pool) >= 1 and max(pool) <= 500
    off = _batch(0)
    assert off.aux_pool is None
    # Off, the batch is what it was before the pool existed: the random stream is untouched.
    assert torch.equal(off.candidates, batch.candidates) and torch.equal(off.cuts, batch.cuts)
    assert _batch(500).aux_pool is None  # a pool of the whole catalogue is the whole catalogue


def test_a_pool_of_every_item_gives_the_whole_catalogue_softmax() -> None:
    model = tiny_model(0).train(False)
    full = _batch(0)
    every = dataclasses.replace(full, aux_pool=torch.arange(1, 501))
    cut_loss = batch_loss(model, full, 0.0)
    with torch.no_grad():
        whole = batch_loss(model, full, 1.0) - cut_loss
        pooled = batch_loss(model, every, 1.0) - cut_loss
    assert whole.item() > 0 and pooled.item() == pytest.approx(whole.item(), rel=1e-5)


def test_the_corrected_pool_estimates_the_whole_softmax() -> None:
    model = tiny_model(1).train(False)
    full = _batch(0)
    with torch.no_grad():
        cut_loss = batch_loss(model, full, 0.0)
        whole = (batch_loss(model, full, 1.0) - cut_loss).item()
        rng = np.random.default_rng(3)
        sampled = [
            (batch_loss(model, dataclasses.replace(full, aux_pool=pool), 1.0) - cut_loss).item()
            for pool in (torch.from_numpy(rng.choice(500, 250, replace=False) + 1) for _ in range(20))
        ]
        uncorrected_gap = np.log(500 / 250)
    # Without the log(N / M) correction every sampled loss would sit about log 2 below.
    assert abs(np.mean(sampled) - whole) < 0.1 * uncorrected_gap


def test_training_with_a_pool_learns() -> None:
    model = tiny_model(2)
    seqs = {str(u): history(40, seed=u) for u in range(16)}
    losses = train_model(
        model, seqs, epochs=4, batch_size=8, cuts=4, negatives=8, aux_negatives=32, log=lambda _: None
    )
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_the_sizing_scores_small_catalogues_whole_and_samples_large_ones() -> None:
    small = size_training(AUX_FULL_ITEMS, [50, 60])["aux_negatives"]
    large = size_training(AUX_FULL_ITEMS + 1, [50, 60])["aux_negatives"]
    assert small.value == 0 and "scores all of them" in small.reason
    assert large.value == AUX_NEGATIVES and f"{AUX_NEGATIVES} uniform draws" in large.reason
