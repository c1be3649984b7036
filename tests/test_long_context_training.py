"""Training for long contexts and the evaluation that tells whether it helped, on tiny data: the
learning-rate schedule over the expected length of training, cut points weighted toward long
contexts, the recency prior of the position biases (and relay exactness with it), leave-last-K-out
targets ranked after a growing history, and paired differences between history lengths."""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from synthetic import write_csv
from test_interactions import COLS, tiny_log_rows

from relaygr.workers.model.hstu_attention import position_bucket, time_bucket
from relaygr.workers.model.model import HSTUConfig, HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.model.vocab import ItemVocab
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training import train
from relaygr.workers.training.fit import LR_FLOOR, lr_factor, recency_prior
from relaygr.workers.training.interactions import InteractionLog
from relaygr.workers.training.objectives import make_batch
from relaygr.workers.training.quality import paired_differences, rank_targets, split_leave_last_out, summarise
from relaygr.workers.training.sizing import MAX_EPOCHS, MIN_EPOCHS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _args(extra: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(["--out", "unused", *extra])


def test_the_learning_rate_reaches_its_floor_at_the_decay_span_and_stays_there() -> None:
    warm, decay = 10, 100
    rates = [lr_factor(step, warm, decay) for step in range(300)]
    assert rates[0] < rates[5] < rates[9] and max(rates) <= 1.0
    assert all(a >= b for a, b in itertools.pairwise(rates[9 : decay + 1]))
    assert rates[decay] == pytest.approx(LR_FLOOR) and rates[-1] == pytest.approx(LR_FLOOR)
    assert rates[decay // 2] == pytest.approx((1 + LR_FLOOR) / 2)  # half way down the cosine
    hist = {"u": Events.from_lists([1, 2, 3], [0, 1, 2], [1, 1, 1])}
    sized = train.resolve_settings(_args([]), 100, hist, log=lambda _: None)
    assert (sized.decay_epochs, sized.min_epochs) == (MAX_EPOCHS, MIN_EPOCHS)
    given = train.resolve_settings(_args(["--decay-epochs", "7"]), 100, hist, log=lambda _: None)
    assert (given.decay_epochs, given.min_epochs) == (7, 7)  # kept epochs start by the decay's end
    short = train.resolve_settings(_args(["--epochs", "4"]), 100, hist, log=lambda _: None)
    assert (short.decay_epochs, short.min_epochs) == (4, 4)
    asked = train.resolve_settings(
        _args(["--min-epochs", "20", "--epochs", "25"]), 100, hist, log=lambda _: None
    )
    assert (asked.decay_epochs, asked.min_epochs) == (25, 20)


def test_long_cuts_draw_more_targets_after_long_contexts() -> None:
    windows = [Events.from_lists(list(range(1, 101)), list(range(100)), [1] * 100) for _ in range(8)]

    def mean_cut(long_cuts: float) -> float:
        rng = np.random.default_rng(3)
        cuts = [
            make_batch(windows, cuts=5, negatives=2, num_items=200, rng=rng, long_cuts=long_cuts).cuts
            for _ in range(20)
        ]
        return float(torch.cat(cuts).float().mean())

    uniform, linear, square = mean_cut(0.0), mean_cut(1.0), mean_cut(2.0)
    # Expected means: 50 (uniform), 67 (c), 75 (c^2) over cuts 1..99.
    assert uniform < 58 < linear < 71 < square


def _model(seed: int = 0, **overrides) -> HSTURanker:
    torch.manual_seed(seed)
    cfg = dict(num_items=30, dim=16, heads=2, attn_dim=8, linear_dim=8, attn_block=8, max_len=64)
    return HSTURanker(HSTUConfig(**{**cfg, **overrides})).eval()


def test_the_recency_prior_discounts_distant_events_and_keeps_the_relay_exact() -> None:
    model = _model()
    recency_prior(model, 0.5)
    for layer in model.layers:
        bias = layer.pos_bias.detach()
        assert bias[0] == 0 and bias[1] == pytest.approx(-0.5)
        assert torch.all(bias[1:] <= bias[:-1])
    # The bucket of distance 100 starts at -0.5 * log2(1 + its nearest distance, 96).
    b100 = int(position_bucket(torch.tensor([100]), model.config.position_buckets))
    assert float(model.layers[0].pos_bias.detach()[b100]) == pytest.approx(-0.5 * np.log2(97))
    n = 40
    hist = Events.from_lists(
        torch.randint(1, 31, (n,)).tolist(), np.cumsum(np.arange(n) * 7.0).tolist(), [1] * n
    )
    cands, ts = torch.arange(1, 31), float(hist.timestamps[-1]) + 5
    runner = ModelRunner(model)
    relay = runner.rank(runner.prefill(hist.slice(0, 25)), hist.slice(25), cands, ts)
    torch.testing.assert_close(relay, runner.rank_full(hist, cands, ts), rtol=1e-5, atol=1e-5)
    untouched = _model()
    recency_prior(untouched, 0.0)
    assert all(torch.all(layer.pos_bias == 0) for layer in untouched.layers)


def _log_of(lengths: dict[str, int]) -> InteractionLog:
    histories = {
        u: Events.from_lists(list(range(1, n + 1)), [10.0 * i for i in range(n)], [1] * n)
        for u, n in lengths.items()
    }
    return InteractionLog(histories=histories, vocab=ItemVocab.identity_of(20), num_actions=1)


def test_leave_last_k_out_keeps_k_targets_and_one_is_leave_last_out() -> None:
    log = _log_of({"a": 10, "b": 3, "c": 1})
    hist, test = split_leave_last_out(log, 3)
    assert sorted(hist) == ["a", "b"] and "c" not in test
    assert (len(hist["a"]), test["a"].item_ids.tolist()) == (7, [8, 9, 10])
    assert (len(hist["b"]), test["b"].item_ids.tolist()) == (1, [2, 3])  # one event always stays
    hist1, test1 = split_leave_last_out(log)
    assert test1["a"].item_ids.tolist() == [10] and len(hist1["a"]) == 9


@dataclass
class _LowIdsFirst:
    """A stand-in ranker: lower item ids score higher; remembers the histories it was given."""

    config: HSTUConfig
    seen: list[tuple[int, float]]

    def rank_full(self, history: Events, candidates, request_ts: float, micro_batch: int = 0):
        self.seen.append((len(history), request_ts))
        return -candidates.double()


def test_each_target_is_ranked_after_every_event_before_it() -> None:
    hist, test = split_leave_last_out(_log_of({"a": 10}), 3)
    stub = _LowIdsFirst(HSTUConfig(num_items=20), [])
    ranks = rank_targets(stub, hist, test, lengths=[2, None], log=lambda _: None)
    # Histories of 7, 8 and 9 events (and the last 2 of each), at each target's own time.
    assert sorted(stub.seen) == sorted([(2, 70.0), (7, 70.0), (2, 80.0), (8, 80.0), (2, 90.0), (9, 90.0)])
    # Items 1..k are seen, so target k + 1 is always the best unseen item.
    assert ranks["all"][0].tolist() == [1.0, 1.0, 1.0]
    table = summarise(ranks)
    assert table["all"]["users"] == 1 and table["all"]["targets"] == 3 and table["all"]["HR@10"] == 1.0


def test_paired_differences_are_zero_for_equal_ranks_and_signed_for_better_ones() -> None:
    rng = np.random.default_rng(0)
    ranks = [np.asarray([float(r)]) for r in rng.integers(1, 30, size=200)]
    worse = [r + 20 for r in ranks]
    diff = paired_differences({"all": ranks, "16": ranks, "64": worse})
    assert diff["16"]["HR@10"] == 0 and diff["16"]["HR@10_ci95"] == [0.0, 0.0]
    assert diff["64"]["MRR"] > 0 and diff["64"]["MRR_ci95"][0] > 0 and diff["64"]["HR@10_ci95"][0] > 0


def test_metrics_keep_the_log_users_apart_from_the_users_evaluated(tmp_path) -> None:
    path = write_csv(tmp_path / "log.csv", tiny_log_rows(users=12, events=12))
    out = tmp_path / "ck"
    tiny = ["--layers", "1", "--dim", "16", "--epochs", "1", "--max-steps", "2", "--threads", "1"]
    extra = ["--eval-users", "5", "--test-events", "2", "--long-cuts", "2", "--recency-prior", "0.5"]
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--out", str(out), "--interactions", str(path), *COLS, *tiny, *extra])
    assert train.run(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["users"], metrics["users_evaluated"], metrics["targets_evaluated"]) == (12, 5, 10)
    assert metrics["test_events"] == 2 and metrics["protocol"].startswith("leave-last-2-out")
    assert set(metrics["all_minus_truncation"]) == {"16", "64", "256"}
    assert (metrics["train"]["long_cuts"], metrics["train"]["recency_prior"]) == (2.0, 0.5)


def test_the_attention_biases_can_learn_faster_than_the_other_weights() -> None:
    hist = {
        str(u): Events.from_lists(
            [(u * 7 + i) % 29 + 1 for i in range(30)], [60.0 * i for i in range(30)], [1] * 30
        )
        for u in range(8)
    }

    def moved(scale: float) -> tuple[float, float]:
        model = _model(max_len=32).train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        train.train_model(
            model, hist, epochs=1, batch_size=4, max_steps=2, bias_lr_scale=scale, log=lambda _: None
        )
        after = {n: p.detach() for n, p in model.named_parameters()}
        bias = max(float((after[n] - before[n]).abs().max()) for n in before if n.endswith("pos_bias"))
        other = float((after["item_emb.weight"] - before["item_emb.weight"]).abs().max())
        return bias, other

    slow, fast = moved(1.0), moved(20.0)
    assert fast[0] > 5 * slow[0] and fast[1] == pytest.approx(slow[1], rel=0.5)


def test_biases_past_the_longest_training_window_take_the_farthest_trained_bias() -> None:
    # Windows of 30 events, a minute apart: distances up to 29, gaps up to 29 minutes.
    hist = {
        str(u): Events.from_lists(
            [(u * 7 + i) % 29 + 1 for i in range(30)], [60.0 * i for i in range(30)], [1] * 30
        )
        for u in range(8)
    }
    model = _model(max_len=32).train()
    lines: list[str] = []
    train.train_model(model, hist, epochs=1, batch_size=4, max_steps=3, bias_lr_scale=20.0, log=lines.append)
    cfg = model.config
    far_pos = int(position_bucket(torch.tensor([29]), cfg.position_buckets))
    far_time = int(time_bucket(torch.tensor([29 * 60.0], dtype=torch.float64), cfg.time_buckets))
    assert any(f"position buckets past {far_pos} and time buckets past {far_time}" in line for line in lines)
    for layer in model.layers:
        pos, tim = layer.pos_bias.detach(), layer.time_bias.detach()
        assert float(pos[far_pos]) != 0.0 and float(tim[far_time]) != 0.0  # trained
        assert torch.all(pos[far_pos + 1 :] == pos[far_pos]) and torch.all(
            tim[far_time + 1 :] == tim[far_time]
        )
        assert not torch.all(pos[: far_pos + 1] == pos[far_pos])  # the trained ones are not flattened
    # A history far longer than any window still ranks exactly through a cached prefix.
    model.eval()
    n = 120
    long = Events.from_lists([i % 29 + 1 for i in range(n)], [600.0 * i for i in range(n)], [1] * n)
    cands, ts = torch.arange(1, 31), float(long.timestamps[-1]) + 5
    runner = ModelRunner(model)
    relay = runner.rank(runner.prefill(long.slice(0, 100)), long.slice(100), cands, ts)
    torch.testing.assert_close(relay, runner.rank_full(long, cands, ts), rtol=1e-5, atol=1e-5)


def test_whole_histories_put_long_sequences_into_training_whole_and_leave_the_rest_alone() -> None:
    from relaygr.workers.training.fit import _epoch_batches

    seqs = [
        Events.from_lists(list(range(1, n + 1)), [10.0 * i for i in range(n)], [1] * n) for n in (50, 8, 200)
    ]

    def lengths(share: float, cap: int = 8192) -> list[list[int]]:
        rng = np.random.default_rng(5)
        return [
            sorted(len(w) for b in _epoch_batches(seqs, 16, 2, rng, share, cap) for w in b) for _ in range(4)
        ]

    assert lengths(0.0) == [[8, 16, 16]] * 4  # windows only
    assert lengths(1.0) == [[8, 50, 200]] * 4  # every long history whole
    assert lengths(1.0, cap=100) == [[8, 50, 100]] * 4  # the most recent ``cap`` events
    mixed = lengths(0.5)
    assert all(epoch[0] == 8 for epoch in mixed) and len({tuple(e) for e in mixed}) > 1
    # Off, the draws are those of the windows alone: training without it is unchanged.
    a, b = np.random.default_rng(9), np.random.default_rng(9)
    assert [[w.item_ids.tolist() for w in x] for x in _epoch_batches(seqs, 16, 2, a)] == [
        [w.item_ids.tolist() for w in x] for x in _epoch_batches(seqs, 16, 2, b, 0.0, 8192)
    ]
    whole = next(
        w for x in _epoch_batches(seqs, 16, 2, np.random.default_rng(1), 1.0, 100) for w in x if len(w) == 100
    )
    assert whole.item_ids.tolist() == list(range(101, 201))


def test_evaluated_users_are_spread_over_the_log_not_its_first_ids() -> None:
    from relaygr.workers.training.quality import spread_users

    ids = [f"u{i:03d}" for i in range(100)]
    assert spread_users(ids, 4) == ["u000", "u025", "u050", "u075"]
    assert spread_users(ids[::-1], None) == ids and spread_users(ids, 500) == ids
    assert len(spread_users(ids, 30)) == 30 and spread_users(ids, 30)[-1] == "u087"


def test_validation_ranks_only_the_epochs_that_may_be_kept() -> None:
    from relaygr.workers.training.fit import EarlyStopping

    class Counting(EarlyStopping):
        ranked = 0

        def score(self, model) -> float:
            self.ranked += 1
            return [0.1, 0.3, 0.2, 0.25, 0.2, 0.1][len(self.scores)]

    stop = Counting(histories={}, targets={}, min_epochs=3, patience=2)
    model = _model()
    flags = [stop.should_stop(model) for _ in range(5)]
    # Epochs 1 and 2 are never kept, so never ranked; the best from epoch 3 on is epoch 4.
    assert stop.scores[:2] == [None, None] and stop.ranked == 3
    assert (stop.best_epoch, stop.best, flags) == (3, 0.25, [False, False, False, False, False])
    assert stop.should_stop(model) is True  # two epochs past the best
    early = Counting(histories={}, targets={}, min_epochs=10)
    for _ in range(2):
        early.should_stop(model)
    early.restore_best(model)  # ended before min_epochs: keeps its last weights, scored then
    assert (early.best_epoch, early.best, early.ranked) == (1, 0.2, 1)
