"""Hard negatives for the candidate path: a share of each cut's negatives drawn from the items the
model's own next-item head ranks highest there (never the target, never an item the history before
the cut holds); at share 0 the batch is exactly the one drawn without them. And the next-item head's
ranks, the trainer's diagnostic beside the served quality table."""

from __future__ import annotations

import argparse
import functools

import numpy as np
import pytest
import torch
from synthetic import history, tiny_model

from relaygr.workers.model.dense import train_scores
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training import train
from relaygr.workers.training.fit import train_model
from relaygr.workers.training.objectives import HARD_POOL, batch_loss, head_scores, make_batch
from relaygr.workers.training.quality import _candidates, _rank_of_target, head_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ITEMS = 500
WINDOWS = [history(n, seed=n) for n in (12, 30, 47)]


def _batch(seed: int = 0, **kwargs):
    return make_batch(WINDOWS, 4, 16, ITEMS, np.random.default_rng(seed), in_batch_share=0.5, **kwargs)


def _by_id(items, actions, timestamps, lengths, cuts, cut_ts) -> torch.Tensor:
    """A fake head: every cut ranks the items by id, the highest first."""
    B, S = cuts.shape
    logits = torch.arange(ITEMS + 1, dtype=torch.float32).expand(B, S, ITEMS + 1).clone()
    logits[..., 0] = float("-inf")
    return logits


def test_share_zero_draws_exactly_the_batch_drawn_without_the_option() -> None:
    before = _batch(sampling_correction=True)
    off = _batch(sampling_correction=True, hard_share=0.0, head=_by_id)
    for name in ("items", "cuts", "cut_ts", "candidates", "weight", "neg_log_q"):
        assert torch.equal(getattr(off, name), getattr(before, name)), name


def test_hard_negatives_are_the_heads_top_items_never_the_target_nor_the_history() -> None:
    plain = _batch()
    hard = _batch(hard_share=0.5, head=_by_id)
    count = 8  # half of 16
    neg = hard.candidates[..., 1:]
    # The cuts are the ones drawn without hard negatives; the other shares are shares of the 8
    # negatives the hard ones leave: 4 in-batch (targets of the batch), 4 uniform (the draws of a
    # batch without in-batch negatives), so that every item can still be drawn.
    assert torch.equal(hard.cuts, plain.cuts)
    targets = set(plain.candidates[..., 0][plain.weight > 0].tolist())
    assert set(neg[..., :4][hard.weight > 0].flatten().tolist()) <= targets
    uniform = make_batch(WINDOWS, 4, 16, ITEMS, np.random.default_rng(0))
    assert torch.equal(neg[..., 4:8], uniform.candidates[..., 5:9])
    for b, w in enumerate(WINDOWS):
        for s in range(hard.cuts.shape[1]):
            if not hard.weight[b, s]:
                continue
            c = int(hard.cuts[b, s])
            target = int(w.item_ids[c])
            excluded = {target, *w.item_ids[:c].tolist()}
            top = [i for i in range(ITEMS, 0, -1) if i not in excluded][: HARD_POOL * count]
            drawn = neg[b, s, -count:].tolist()
            assert len(set(drawn)) == count  # without replacement
            assert set(drawn) <= set(top)
            assert target not in drawn and not set(drawn) & set(w.item_ids[:c].tolist())
    with pytest.raises(ValueError, match="head"):
        _batch(hard_share=0.5)


def test_the_head_scores_are_the_state_before_each_cut_dotted_with_the_item_table() -> None:
    model = tiny_model(0).train()
    batch = _batch()
    got = head_scores(
        model, batch.items, batch.actions, batch.timestamps, batch.lengths, batch.cuts, batch.cut_ts
    )
    assert model.training  # restored
    model.eval()
    with torch.no_grad():
        _, states = train_scores(
            model,
            batch.items,
            batch.actions,
            batch.timestamps,
            batch.lengths,
            batch.cuts,
            batch.cut_ts,
            batch.candidates,
            history_states=True,
        )
    b, s = 2, 1
    want = model.item_emb.weight @ states[b, int(batch.cuts[b, s]) - 1]
    assert got.shape == (3, batch.cuts.shape[1], ITEMS + 1) and got[b, s, 0] == float("-inf")
    torch.testing.assert_close(got[b, s, 1:], want[1:], rtol=1e-4, atol=1e-4)
    # The model's own hard negatives: the top of these logits, and the loss is finite.
    hard = _batch(hard_share=0.25, head=functools.partial(head_scores, model), sampling_correction=True)
    top = torch.topk(got[b, s], 40).indices.tolist()
    assert len(set(hard.candidates[b, s, -4:].tolist()) & set(top)) >= 3
    assert torch.isfinite(batch_loss(model.train(), hard, 1.0))


def test_training_with_hard_negatives_runs_and_the_option_reaches_the_objective() -> None:
    model = tiny_model(1)
    seqs = {str(i): history(40, seed=100 + i) for i in range(8)}
    losses = train_model(
        model, seqs, epochs=1, max_steps=2, cuts=4, negatives=16, hard_negatives=0.5, log=lambda _: None
    )
    assert len(losses) == 1 and np.isfinite(losses[0])
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    hist = {"u": Events.from_lists([1, 2, 3], [0, 1, 2], [1, 1, 1])}
    args = parser.parse_args(["--out", "unused", "--hard-negatives", "0.25"])
    assert train.resolve_settings(args, 100, hist, log=lambda _: None).objective.hard_negatives == 0.25
    assert parser.parse_args(["--out", "unused"]).hard_negatives == 0.0
    with pytest.raises(SystemExit, match="hard-negatives"):
        train.check_arguments(parser.parse_args(["--out", "unused", "--hard-negatives", "1.5"]))


def test_head_ranks_rank_the_target_by_the_last_state_among_the_protocols_candidates() -> None:
    model = tiny_model(2).eval()
    hist = {str(i): history(30 + i, seed=200 + i) for i in range(3)}
    test = {u: Events.from_lists([7 + int(u)], [1], [float(h.timestamps[-1]) + 60]) for u, h in hist.items()}
    ranks = head_ranks(model, hist, test, lengths=[10, None], protocol="hstu")
    assert set(ranks) == {"10", "all"} and all(len(v) == 3 for v in ranks.values())
    u, h = "1", hist["1"]
    for key, read in (("all", h), ("10", h.slice(len(h) - 10))):
        with torch.no_grad():
            _, states = train_scores(
                model,
                read.item_ids[None],
                read.action_ids[None],
                read.timestamps[None],
                torch.tensor([len(read)]),
                torch.tensor([[len(read)]]),
                torch.tensor([[float(test[u].timestamps[0])]], dtype=torch.float64),
                torch.zeros(1, 1, 1, dtype=torch.int64),
                history_states=True,
            )
        scores = (model.item_emb.weight @ states[0, -1]).detach().numpy()
        cands, tpos = _candidates(ITEMS, read, 8)
        assert ranks[key][1][0] == _rank_of_target(scores[cands.numpy()], tpos)
