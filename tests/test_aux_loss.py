"""The next-item loss on a large catalogue: a pool of negatives the batch shares (half uniform, half
by popularity) instead of the whole catalogue, corrected so that it estimates the whole
catalogue's softmax."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from synthetic import history, tiny_model

from relaygr.workers.training.fit import train_model
from relaygr.workers.training.objectives import _aux_pool, batch_loss, make_batch
from relaygr.workers.training.sizing import AUX_FULL_ITEMS, AUX_NEGATIVES, size_training

POPULARITY = np.r_[0.0, np.linspace(1, 50, 500)] / np.linspace(1, 50, 500).sum()


def _batch(aux_negatives: int, seed: int = 0, popularity=None):
    windows = [history(n, seed=n) for n in (12, 30, 47)]
    rng = np.random.default_rng(seed)
    return make_batch(windows, 4, 8, 500, rng, popularity=popularity, aux_negatives=aux_negatives)


def test_the_pool_mixes_uniform_and_popular_items_and_draws_nothing_when_off() -> None:
    batch = _batch(64)
    pool = batch.aux_pool.tolist()
    assert len(pool) == 64 and min(pool) >= 1 and max(pool) <= 500
    assert torch.allclose(batch.aux_log_q, torch.full((64,), float(np.log(64 / 500))))
    mixed = _batch(4000 // 10, popularity=POPULARITY)
    q = 0.5 / 500 + 0.5 * POPULARITY[mixed.aux_pool.numpy()]
    assert torch.allclose(mixed.aux_log_q, torch.from_numpy(np.log(400 * q)).float())
    assert mixed.aux_pool.float().mean() > 250 + 20  # popular (high) ids drawn more often
    off = _batch(0)
    assert off.aux_pool is None
    # Off, the batch is what it was before the pool existed: the random stream is untouched.
    assert torch.equal(off.candidates, batch.candidates) and torch.equal(off.cuts, batch.cuts)
    assert _batch(500).aux_pool is None  # a pool of the whole catalogue is the whole catalogue


def test_a_pool_of_every_item_gives_the_whole_catalogue_softmax() -> None:
    model = tiny_model(0).train(False)
    full = _batch(0)
    every = dataclasses.replace(full, aux_pool=torch.arange(1, 501), aux_log_q=torch.zeros(500))
    cut_loss = batch_loss(model, full, 0.0)
    with torch.no_grad():
        whole = batch_loss(model, full, 1.0) - cut_loss
        pooled = batch_loss(model, every, 1.0) - cut_loss
    assert whole.item() > 0 and pooled.item() == pytest.approx(whole.item(), rel=1e-5)


@pytest.mark.parametrize("popularity", [None, POPULARITY])
def test_the_corrected_pool_estimates_the_whole_softmax(popularity) -> None:
    model = tiny_model(1).train(False)
    full = _batch(0)
    rng = np.random.default_rng(3)
    with torch.no_grad():
        cut_loss = batch_loss(model, full, 0.0)
        whole = (batch_loss(model, full, 1.0) - cut_loss).item()
        sampled = [
            (
                batch_loss(model, dataclasses.replace(full, **_aux_pool(rng, 500, 250, popularity)), 1.0)
                - cut_loss
            )
            for _ in range(20)
        ]
        uncorrected = dataclasses.replace(full, **_aux_pool(rng, 500, 250, popularity))
        uncorrected = dataclasses.replace(uncorrected, aux_log_q=torch.zeros(250))
        off = (batch_loss(model, uncorrected, 1.0) - cut_loss).item()
    # The correction brings the pool's loss to the whole softmax's; without it, about log 2 apart.
    assert abs(float(np.mean(sampled)) - whole) < 0.1 * abs(off - whole)


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
    assert large.value == AUX_NEGATIVES and f"{AUX_NEGATIVES} draws a step" in large.reason
