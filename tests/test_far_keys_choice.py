"""The far-key weight chosen on validation once training ends: the best weight is served when it
beats the trained one beyond the validation users' noise (the trained one otherwise, and on a
tie), the model then ranks exactly as one built at that weight (no serving state
of the old weight survives), it stays relay-exact, and ``relaygr train`` records the choice and
saves it."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from synthetic import write_csv
from test_interactions import COLS, tiny_log_rows
from test_model_relay import _config, _randomise, history

from relaygr.workers import train
from relaygr.workers.fit import FAR_KEYS_GRID, choose_far_keys
from relaygr.workers.model import HSTURanker

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Validation:
    """A stand-in for early stopping's validation: each user's rank of its target, per far weight."""

    def __init__(self, ranks: dict[float, list[float]]) -> None:
        self._ranks, self.asked = ranks, []

    def ranks(self, model: HSTURanker) -> list[np.ndarray]:
        self.asked.append(model.config.far_keys)
        return [np.array([r]) for r in self._ranks[model.config.far_keys]]


def _model() -> HSTURanker:
    return _randomise(HSTURanker(_config(near_keys=8, far_keys=3.0)), 5)


USERS = 40


def _grid_ranks(**by_weight: list[float]) -> dict[float, list[float]]:
    """Every weight of the grid and the trained 3 at rank 20 for every user, unless given."""
    ranks = {f: [20.0] * USERS for f in (3.0, *FAR_KEYS_GRID)}
    return ranks | {float(k.removeprefix("w")): v for k, v in by_weight.items()}


def test_a_weight_better_for_the_validation_users_beyond_noise_is_served() -> None:
    model = _model()
    validation = _Validation(_grid_ranks(w64=[1.0] * 30 + [20.0] * 10, w32=[2.0] * 30 + [20.0] * 10))
    choice = choose_far_keys(model, validation)
    assert sorted(validation.asked) == sorted([3.0, *FAR_KEYS_GRID])  # each weight ranked once
    assert choice.best == choice.served == 64.0 and model.config.far_keys == 64.0 and not model.training
    assert choice.gain == pytest.approx(0.75) and choice.gain_ci95[0] > 0
    assert choice.scores[64.0] > choice.scores[32.0] > choice.scores[3.0]


def test_a_best_weight_within_the_noise_leaves_the_trained_one_served() -> None:
    model = _model()
    # One user better at 64, all others alike: the best on the mean, not beyond the users' noise.
    choice = choose_far_keys(model, _Validation(_grid_ranks(w64=[1.0] + [20.0] * (USERS - 1))))
    assert choice.best == 64.0 and choice.gain > 0 and choice.gain_ci95[0] <= 0
    assert choice.served == 3.0 and model.config.far_keys == 3.0


def test_the_trained_weight_wins_a_tie() -> None:
    model = _model()
    choice = choose_far_keys(model, _Validation(_grid_ranks()))
    assert choice.best == choice.served == 3.0 and model.config.far_keys == 3.0


def test_a_model_set_to_another_weight_ranks_as_one_built_with_it() -> None:
    model = _model()
    h, cands = history(60, 1), torch.arange(1, 20)
    before, version = model.rank_full(h, cands, float(h.timestamps[-1]) + 5.0), model.model_version
    model.set_far_keys(32.0)
    built = HSTURanker(_config(near_keys=8, far_keys=32.0))
    built.load_state_dict(model.state_dict())
    built.eval()
    after = model.rank_full(h, cands, float(h.timestamps[-1]) + 5.0)
    torch.testing.assert_close(after, built.rank_full(h, cands, float(h.timestamps[-1]) + 5.0))
    assert not torch.allclose(after, before)  # the serving state of weight 3 was not reused
    assert model.model_version != version  # prefixes cached under weight 3 are not read under 32
    # Still relay-exact at the new weight: a cached prefix plus the rest is the full inference.
    prefix = model.prefill(h.slice(0, 41))
    relayed = model.rank(prefix, h.slice(41), cands, float(h.timestamps[-1]) + 5.0)
    torch.testing.assert_close(relayed, after, rtol=1e-5, atol=1e-5)


def _run(tmp_path, extra: list[str]) -> tuple[dict, HSTURanker]:
    path = write_csv(tmp_path / "log.csv", tiny_log_rows(users=12, events=14))
    out = tmp_path / "ck"
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    tiny = ["--layers", "1", "--dim", "16", "--epochs", "2", "--max-steps", "2", "--threads", "1"]
    args = parser.parse_args(["--out", str(out), "--interactions", str(path), *COLS, *tiny, *extra])
    assert train.run(args) == 0
    return json.loads((out / "metrics.json").read_text())["train"], HSTURanker.load(out)


def test_train_serves_and_saves_the_weight_validation_chose(tmp_path) -> None:
    metrics, model = _run(tmp_path, ["--near-keys", "4"])
    scores = {float(f): v for f, v in metrics["far_keys_validation_ndcg"].items()}
    assert set(scores) == set(FAR_KEYS_GRID) and metrics["far_keys"] == 128.0  # trained at 128
    best = metrics["far_keys_best_gain"]
    assert scores[best["far_keys"]] == max(scores.values())
    assert best["NDCG@10"] == pytest.approx(scores[best["far_keys"]] - scores[128.0])
    served = best["far_keys"] if best["NDCG@10_ci95"][0] > 0 else 128.0
    assert metrics["far_keys_served"] == served and model.config.far_keys == served


def test_a_weight_given_on_the_command_line_is_trained_and_served_as_is(tmp_path) -> None:
    metrics, model = _run(tmp_path, ["--near-keys", "4", "--far-keys", "6"])
    assert "far_keys_validation_ndcg" not in metrics and metrics["far_keys_served"] == 6.0
    assert model.config.far_keys == 6.0
