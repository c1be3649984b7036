"""Training defaults sized from the log, the training objectives and the bounded search, on tiny data:
sizing rules and their reasons, command-line values kept, in-batch negatives, early stopping that
restores the best epoch, the search's bounded and distinct configurations and its tables, and a
sized model that is still relay-exact."""

from __future__ import annotations

import argparse
import csv
import json
import re

import numpy as np
import pytest
import torch
from synthetic import write_csv
from test_interactions import COLS, tiny_log_rows

from relaygr.workers.model.model import HSTUConfig, HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training import train
from relaygr.workers.training.fit import EarlyStopping
from relaygr.workers.training.objectives import make_batch
from relaygr.workers.training.sizing import CANDIDATE_TOKENS, MAX_WINDOW, size_training
from relaygr.workers.training.tuning import GRID, candidates

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _values(num_items: int, lengths: list[int]) -> dict:
    return {k: c.value for k, c in size_training(num_items, lengths).items()}


def test_width_and_negatives_grow_with_the_catalogue_and_a_step_costs_the_same() -> None:
    small, mid, big = _values(300, [50] * 10), _values(1682, [50] * 10), _values(200_000, [50] * 10)
    assert (
        small["dim"] <= mid["dim"] <= big["dim"] and small["negatives"] < mid["negatives"] < big["negatives"]
    )
    for v in (small, mid, big):
        assert v["dim"] & (v["dim"] - 1) == 0 and 32 <= v["dim"] <= 256 and v["heads"] == v["dim"] // 32
        assert (
            abs(v["cuts"] * (v["negatives"] + 1) - CANDIDATE_TOKENS) <= v["negatives"] + 1 or v["cuts"] == 4
        )
    assert _values(1682, [50])["dim"] == 64 and _values(1682, [50])["negatives"] == 64
    assert _values(5, [3, 4])["negatives"] == 4  # never more negatives than other items


def test_the_window_covers_the_histories_the_log_has_and_the_normaliser_follows_it() -> None:
    lengths = list(range(10, 1010, 10))  # 95th percentile 955
    v = _values(1000, lengths)
    assert v["max_len"] == 960 and v["attn_normaliser"] == 960.0
    assert _values(1000, [3, 5, 8])["max_len"] == 32
    assert _values(1000, [50_000] * 3)["max_len"] == MAX_WINDOW
    reasons = size_training(1000, lengths)
    assert "95th percentile" in reasons["max_len"].reason and "1000 items" in reasons["dim"].reason
    with pytest.raises(ValueError):
        size_training(10, [])


def _args(extra: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(["--out", "unused", *extra])


def test_command_line_values_win_and_say_so() -> None:
    hist = {str(u): Events.from_lists(list(range(1, 41)), list(range(40)), [1] * 40) for u in range(5)}
    lines: list[str] = []
    s = train.resolve_settings(_args(["--dim", "96", "--max-len", "24"]), 500, hist, log=lines.append)
    assert (s.dim, s.heads, s.max_len, s.attn_normaliser) == (96, 3, 24, 24.0)
    both = train.resolve_settings(_args(["--max-len", "48", "--attn-normaliser", "32"]), 500, hist, log=print)
    assert (both.max_len, both.attn_normaliser) == (48, 32.0)
    assert s.negatives == _values(500, [40])["negatives"]
    text = "\n".join(lines)
    assert (
        any("dim" in line and " 96 " in line and "set on the command line" in line for line in lines)
        and "2 x sqrt(items)" in text
    )


def test_in_batch_negatives_are_targets_of_the_batch() -> None:
    rng = np.random.default_rng(0)
    windows = [
        Events.from_lists([b * 10 + j + 1 for j in range(6)], list(range(6)), [1] * 6) for b in range(4)
    ]
    batch = make_batch(windows, cuts=3, negatives=8, num_items=1000, rng=rng, in_batch_share=1.0)
    targets = set(batch.candidates[..., 0][batch.weight > 0].tolist())
    assert set(batch.candidates[..., 1:].flatten().tolist()) <= targets
    uniform = make_batch(windows, cuts=3, negatives=8, num_items=1000, rng=rng, in_batch_share=0.0)
    assert not set(uniform.candidates[..., 1:].flatten().tolist()) <= targets


class ScriptedStopping(EarlyStopping):
    """Validation scores from a script instead of a ranking pass."""

    def __init__(self, script: list[float], patience: int, min_epochs: int = 1) -> None:
        super().__init__({}, {}, patience=patience, min_epochs=min_epochs)
        self._script = iter(script)

    def score(self, model) -> float:
        return next(self._script)


def test_early_stopping_stops_after_patience_and_restores_the_best_epoch() -> None:
    model = HSTURanker(HSTUConfig(num_items=10, dim=8, heads=1, attn_dim=8, linear_dim=8, layers=1))
    stop = ScriptedStopping([0.1, 0.3, 0.2, 0.25, 0.9], patience=2)
    decisions = []
    for epoch in range(4):
        with torch.no_grad():
            model.item_emb.weight.fill_(float(epoch))
        decisions.append(stop.should_stop(model))
    assert decisions == [False, False, False, True] and stop.best_epoch == 1 and stop.best == 0.3
    stop.restore_best(model)
    assert torch.all(model.item_emb.weight == 1.0)
    # Epochs before ``min_epochs`` are scored, never kept: the early peak does not count.
    late = ScriptedStopping([0.3, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], patience=2, min_epochs=5)
    assert [late.should_stop(model) for _ in range(7)] == [False] * 6 + [True] and late.best_epoch == 4


def test_the_search_is_bounded_distinct_and_starts_from_the_sized_defaults() -> None:
    base = train.resolve_settings(
        _args([]), 1682, {"u": Events.from_lists([1, 2, 3], [0, 1, 2], [1, 1, 1])}, log=lambda _: None
    )
    configs = candidates(base, 12, seed=0)
    assert configs[0] == base and len(configs) == 12
    keys = {tuple(getattr(c, k) for k in GRID) for c in configs}
    assert len(keys) == 12
    for c in configs:
        assert (
            c.attn_normaliser == c.max_len
            and c.cuts * (c.negatives + 1) <= base.cuts * (base.negatives + 1) + c.negatives + 1
        )
    assert candidates(base, 12, seed=0) == configs
    assert len(candidates(base, 10_000)) == np.prod([len(f(base)) for f in GRID.values()])


def test_tune_keeps_the_best_and_writes_its_tables(tmp_path) -> None:
    path = write_csv(tmp_path / "log.csv", tiny_log_rows(users=12, events=12))
    out = tmp_path / "ck"
    tiny = [
        "--layers",
        "1",
        "--dim",
        "16",
        "--epochs",
        "2",
        "--max-steps",
        "2",
        "--threads",
        "1",
        "--tune",
        "2",
    ]
    assert train.run(_args_for(out, ["--interactions", str(path), *COLS, *tiny])) == 0
    with (out / "tune.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and [r["kept"] for r in rows] == ["yes", ""]
    assert float(rows[0]["valid_ndcg10"]) >= float(rows[1]["valid_ndcg10"])
    assert (out / "tune.md").read_text().count("\n|") == 4  # header, rule, two rows
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train"]["dim"] == int(rows[0]["dim"])
    assert HSTURanker.load(out).config.dim == int(rows[0]["dim"])


def _args_for(out, extra: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(["--out", str(out), *extra])


def test_a_model_with_the_sized_normaliser_is_still_relay_exact() -> None:
    torch.manual_seed(0)
    cfg = HSTUConfig(
        num_items=30,
        dim=16,
        heads=2,
        attn_dim=8,
        linear_dim=8,
        attn_block=8,
        max_len=96,
        attn_normaliser=96.0,
    )
    model = ModelRunner(HSTURanker(cfg).eval())
    n = 40
    hist = Events.from_lists(
        torch.randint(1, 31, (n,)).tolist(), np.cumsum(np.arange(n) * 7.0).tolist(), [1] * n
    )
    cands = torch.arange(1, 31)
    full = model.rank_full(hist, cands, float(hist.timestamps[-1]) + 5)
    cache = model.prefill(hist.slice(0, 25))
    relay = model.rank(cache, hist.slice(25), cands, float(hist.timestamps[-1]) + 5)
    torch.testing.assert_close(relay, full, rtol=1e-5, atol=1e-5)


def test_last_cut_always_asks_for_the_item_after_the_whole_window() -> None:
    rng = np.random.default_rng(1)
    windows = [Events.from_lists(list(range(1, n + 1)), list(range(n)), [1] * n) for n in (9, 12, 20)]
    for _ in range(5):
        batch = make_batch(windows, cuts=3, negatives=4, num_items=50, rng=rng, last_cut=True)
        assert batch.cuts.max(dim=1).values.tolist() == [8, 11, 19]
        assert all(len(set(row)) == 3 for row in batch.cuts.tolist())


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("bias_lr", -1.0, "--bias-lr -1.0: must be above 0"),
        ("long_cuts", -2.0, "--long-cuts -2.0: must be 0 (off) or above"),
        ("recency_prior", -0.5, "--recency-prior -0.5: must be 0 (off) or above"),
        ("aux_negatives", -1, "--aux-negatives -1: must be 0 (off) or above"),
        ("whole_histories", -0.1, "--whole-histories -0.1: must be a probability, from 0 (off) to 1"),
        ("whole_histories", 1.5, "--whole-histories 1.5: must be a probability, from 0 (off) to 1"),
        ("whole_histories", float("nan"), "--whole-histories nan: must be a probability"),
        ("attn_normaliser", -3.0, "--attn-normaliser -3.0: must be above 0"),
        ("attn_normaliser", 0.0, "--attn-normaliser 0.0: must be above 0"),
        ("test_events", 0, "--test-events 0: must be at least 1"),
        ("valid_users", -5, "--valid-users -5: must be at least 1"),
        ("decay_epochs", 0, "--decay-epochs 0: must be at least 1"),
        ("near_keys", 65, "--near-keys 65: must be 0 or a position-bucket boundary"),
        ("near_keys", -4, "--near-keys -4: must be 0 or a position-bucket boundary"),
        ("far_keys", 0.0, "--far-keys 0.0: must be above 0"),
        ("far_keys", float("nan"), "--far-keys nan: must be above 0"),
    ],
)
def test_values_that_would_train_silently_wrong_are_refused(flag: str, value: float, message: str) -> None:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--out", "unused"])
    train.check_arguments(args)  # the defaults pass
    setattr(args, flag, value)
    with pytest.raises(SystemExit, match=re.escape(message)):
        train.check_arguments(args)
