"""The time plan of ``relaygr train``, on injected clocks (nothing here depends on the machine's
speed): steps bounded by a token budget, cost models fitted to probes, the epochs that fit a
budget, and training that stops at its deadline keeping the best validated weights."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from test_training_sizing import ScriptedStopping

from relaygr.workers.model.model import HSTUConfig, HSTURanker
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training import train
from relaygr.workers.training.budget import (
    PLAN_SHARE,
    Deadline,
    RankCost,
    RunCosts,
    StepCost,
    batch_shapes,
    default_budget,
    plan_time,
)
from relaygr.workers.training.fit import Objective, train_model
from relaygr.workers.training.probe import measure_costs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class TickClock:
    """Each reading is one tick later than the one before."""

    def __init__(self, tick: float = 1.0) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _histories(users: int, length: int, items: int = 30, seed: int = 0) -> dict[str, Events]:
    rng = np.random.default_rng(seed)
    return {
        str(u): Events.from_lists(
            rng.integers(1, items + 1, size=length).tolist(), list(range(length)), [1] * length
        )
        for u in range(users)
    }


def _tiny(items: int = 30, max_len: int = 16) -> HSTURanker:
    torch.manual_seed(0)
    cfg = HSTUConfig(num_items=items, dim=8, heads=1, attn_dim=8, linear_dim=8, layers=1, max_len=max_len)
    return HSTURanker(cfg)


def test_a_step_holds_at_most_its_rows_and_tokens_whatever_the_history_lengths() -> None:
    lengths = [5] * 40 + [300] * 7 + [5000] * 3
    shapes = batch_shapes(lengths, max_len=1024, batch_size=32, batch_tokens=4096)
    assert sum(r for r, _ in shapes) == len(lengths)
    assert all(r <= 32 and (r == 1 or r * w <= 4096) for r, w in shapes)
    assert max(w for _, w in shapes) == 1024  # windows are cut at max_len
    assert [w for _, w in shapes] == sorted(w for _, w in shapes)  # shortest first
    # ML-100K's shape (windows up to 320, 32 rows): the token budget never binds, steps are as before.
    ml100k = batch_shapes([320] * 70 + [40] * 30, max_len=320, batch_size=32, batch_tokens=32 * 320)
    assert [r for r, _ in ml100k] == [32, 32, 32, 4]


def test_cost_models_fit_two_probes_exactly() -> None:
    truth = StepCost(per_token=2e-4, per_pair=3e-7)
    fitted = StepCost.fit((32, 40, truth(32, 40)), (8, 1024, truth(8, 1024)))
    assert fitted.per_token == pytest.approx(2e-4) and fitted.per_pair == pytest.approx(3e-7)
    rank = RankCost(fixed=0.01, per_pair=5e-8)
    got = RankCost.fit((16, 1000, rank(16, 1000)), (2048, 1000, rank(2048, 1000)))
    assert got(500, 3000) == pytest.approx(rank(500, 3000))
    # Equal windows cannot tell tokens from pairs: one term carries the time, never a negative one.
    same = StepCost.fit((32, 64, 1.0), (16, 64, 0.5))
    assert same.per_token >= 0 and same.per_pair >= 0 and same(32, 64) == pytest.approx(1.0)


def test_the_cap_is_kept_when_it_fits_and_the_decay_follows_the_epochs_that_fit_when_not() -> None:
    costs = RunCosts(epoch=10.0, validation=5.0, evaluation=50.0, spent=20.0, steps=30)
    roomy = plan_time(costs, 3600, epochs=30, decay_epochs=30, min_epochs=16)
    assert (roomy.epochs, roomy.decay_epochs, roomy.min_epochs, roomy.binds) == (30, 30, 16, False)
    assert roomy.estimate == pytest.approx(20 + 30 * 10 + 15 * 5 + 50)
    tight = plan_time(costs, 300, epochs=30, decay_epochs=30, min_epochs=16)
    assert tight.binds and tight.epochs == tight.decay_epochs < 30 and tight.min_epochs <= tight.epochs
    assert (
        tight.estimate
        <= PLAN_SHARE * 300
        < plan_time(costs, 300 * 2, epochs=30, decay_epochs=30, min_epochs=16).estimate
    )
    assert tight.training_deadline == 300 - 50  # the final evaluation's reserve
    assert any("the budget binds" in line for line in tight.lines)
    # Epochs asked for are kept: the budget only stops them, and says so.
    asked = plan_time(costs, 300, epochs=30, decay_epochs=30, min_epochs=16, epochs_given=True)
    assert asked.epochs == 30 and not asked.binds and any("stops training" in line for line in asked.lines)
    # Half a core: every CPU second takes two.
    slow = plan_time(
        RunCosts(10.0, 5.0, 50.0, 20.0, 30, share=0.5), 3600, epochs=30, decay_epochs=30, min_epochs=16
    )
    assert slow.estimate == pytest.approx(20 + 2 * (30 * 10 + 15 * 5 + 50))
    # --max-steps: the estimate counts only the steps that run.
    short = plan_time(costs, 3600, epochs=30, decay_epochs=30, min_epochs=1, max_steps=15)
    assert short.estimate == pytest.approx(20 + 5 + 5 + 50)


def test_the_final_evaluations_reserve_never_leaves_training_no_step() -> None:
    """Probes on a loaded machine once predicted a final evaluation longer than the whole budget:
    the training deadline fell before the start, and the run wrote a model of no step."""
    costs = RunCosts(epoch=60.0, validation=300.0, evaluation=1200.0, spent=20.0, steps=30, share=0.98)
    plan = plan_time(costs, 600, epochs=30, decay_epochs=30, min_epochs=16)
    assert plan.epochs == 1 and plan.min_epochs == 1
    assert plan.training_deadline >= 20 + (60 + 300) / 0.98  # the first epoch and its validation
    assert any("one epoch is trained anyway" in line for line in plan.lines)
    roomy = plan_time(costs, 36000, epochs=30, decay_epochs=30, min_epochs=16)
    assert roomy.training_deadline == pytest.approx(36000 - 1200 / 0.98)  # the reserve, as before
    assert not any("anyway" in line for line in roomy.lines)


def test_the_default_budget_grows_with_the_log() -> None:
    assert default_budget(100_000) == 600 and default_budget(1_000_000) == 6000 and default_budget(500) == 600


def test_training_stops_at_its_deadline_and_keeps_the_best_validated_weights() -> None:
    model = _tiny()
    hist = _histories(8, 12)
    clock = TickClock()
    # Two steps an epoch (4 rows each), each step and each epoch's end read the clock once: the
    # deadline at tick 8 lets two epochs run whole and cuts the third after its first step.
    stopping = ScriptedStopping([0.5, 0.2, 0.9], patience=10)
    lines: list[str] = []
    kept: list[torch.Tensor] = []
    real_should_stop = stopping.should_stop

    def remember(m):
        kept.append(m.item_emb.weight.detach().clone())
        return real_should_stop(m)

    stopping.should_stop = remember
    losses = train_model(
        model,
        hist,
        epochs=10,
        batch_size=4,
        objective=Objective(cuts=2, negatives=4),
        stopping=stopping,
        deadline=Deadline(8.0, clock),
        log=lines.append,
    )
    assert len(losses) == 3 and stopping.scores == [0.5, 0.2, None]
    assert stopping.best_epoch == 0 and torch.equal(model.item_emb.weight, kept[0])
    assert any("time budget reached after 5 steps" in line for line in lines)


def test_a_signal_ends_training_as_the_budget_does_and_a_second_one_at_once() -> None:
    """SIGTERM (a service manager, ``timeout``) brings the deadline forward: the step under way
    ends, training stops there keeping the best validated weights (then saved and evaluated); a
    second SIGTERM stops the process. ``run`` gives the caller's handlers back."""
    import os
    import signal

    deadline = Deadline(1e9, TickClock())
    before = signal.getsignal(signal.SIGTERM)
    try:
        train.stop_on_signals(deadline)
        assert not deadline.passed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert deadline.stopped == "SIGTERM" and deadline.passed() and deadline.left() == 0.0
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, before)

    # Training cut by it logs why, as the budget's cut does.
    model, lines = _tiny(), []
    stopped_now = Deadline(1e9, TickClock())
    stopped_now.stop("SIGTERM")
    losses = train_model(
        model,
        _histories(8, 12),
        epochs=3,
        batch_size=4,
        objective=Objective(cuts=2, negatives=4),
        deadline=stopped_now,
        log=lines.append,
    )
    assert losses == [] and any("SIGTERM after 0 steps: training stops" in line for line in lines)


def test_run_gives_the_callers_signal_handlers_back(monkeypatch) -> None:
    import signal

    def a_run(*_args) -> int:
        train.stop_on_signals(Deadline(1e9, TickClock()))
        assert signal.getsignal(signal.SIGTERM) is not before
        return 0

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(train, "_run", a_run)
    assert train.run(argparse.Namespace()) == 0
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_probed_run_trains_the_same_model_as_an_unprobed_one() -> None:
    hist = _histories(12, 20, seed=1)
    obj = Objective(cuts=2, negatives=4)
    plain, probed = _tiny(), _tiny()
    costs = measure_costs(
        probed,
        obj,
        hist,
        list(hist.values())[:4],
        list(hist.values()),
        [4, None],
        batch_size=4,
        clock=TickClock(),
    )
    assert (
        costs.epoch > 0 and costs.validation > 0 and costs.evaluation > costs.validation and costs.steps == 3
    )
    for m in (plain, probed):
        train_model(m, hist, epochs=1, batch_size=4, objective=obj, log=lambda _: None)
    assert plain.model_version == probed.model_version


def test_relaygr_train_prints_its_estimate_and_records_the_plan(tmp_path, capsys) -> None:
    from synthetic import write_csv
    from test_interactions import COLS, tiny_log_rows

    path = tmp_path / "log.csv"
    write_csv(path, tiny_log_rows())
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    tiny = ["--layers", "1", "--heads", "1", "--dim", "16", "--max-steps", "2", "--threads", "1"]
    args = parser.parse_args(
        ["--interactions", str(path), "--out", str(tmp_path / "m"), *COLS, *tiny, "--time-budget", "900"]
    )
    assert train.run(args) == 0
    err = capsys.readouterr().err
    assert "time: about" in err and "budget 15.0 min" in err
    plan = json.loads((tmp_path / "m" / "metrics.json").read_text())["time_plan"]
    assert plan["budget_seconds"] == 900 and 0 < plan["estimate_seconds"] <= 900
