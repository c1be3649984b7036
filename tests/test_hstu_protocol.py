"""The evaluation protocol of Meta's HSTU MovieLens figures beside ours: which items a target is
ranked against, at each history length, for the model and for popularity."""

from __future__ import annotations

from test_long_context_training import _log_of, _LowIdsFirst

from relaygr.workers.model.model import HSTUConfig
from relaygr.workers.training.quality import popularity_metrics, rank_targets, split_leave_last_out


def test_hstu_excludes_only_the_items_of_the_history_read() -> None:
    hist, test = split_leave_last_out(_log_of({"a": 10}))  # items 1..9 seen, item 10 the target
    stub = _LowIdsFirst(HSTUConfig(num_items=20), [])
    ours = rank_targets(stub, hist, test, lengths=[2, None], log=lambda _: None)
    hstu = rank_targets(stub, hist, test, lengths=[2, None], protocol="hstu", log=lambda _: None)
    # Ours: every seen item is out, whatever the model reads; the target is the best unseen item.
    assert ours["2"][0].tolist() == [1.0] and ours["all"][0].tolist() == [1.0]
    # HSTU's: reading the last 2 events (items 8, 9), items 1..7 stay candidates and rank first.
    assert hstu["2"][0].tolist() == [8.0] and hstu["all"][0].tolist() == [1.0]


def test_popularity_under_hstu_excludes_the_input_window_only() -> None:
    log = _log_of({"a": 6, "b": 6, "c": 6})  # every user: items 1..6; items 1..5 are history
    hist, test = split_leave_last_out(log)
    whole = popularity_metrics(hist, test, 20)
    window = popularity_metrics(hist, test, 20, window=2)
    # Items 1..5 are equally popular; with the whole history out, the target (6, never in a
    # history) ties with the 14 other unseen items; with only items 4 and 5 out, items 1..3 rank
    # ahead of it as well.
    assert whole["MRR"] > window["MRR"]
