"""The rolling-restart scenario's figures: timeouts and window P99 count from the steady level on, the
warm-up (cold caches by design) is reported apart and never dropped, and each restart gets the
figures of its span (standby start to a window after its hand-over)."""

from __future__ import annotations

import argparse

from relaygr.schemas import RankedResult
from relaygr.tools.experiment.scenarios.rolling_restart import (
    handover_ms,
    restart_row,
    standby_warm_up,
    tail_figures,
    timeline_figures,
)

T0 = 1_000.0
BUDGET_MS = 50.0


def _result(t_s: float, ranking_ms: float, path: str = "relay") -> RankedResult:
    return RankedResult(
        request_id=f"r-{t_s:g}",
        user_id="u",
        ts=T0 + t_s,
        items=[],
        path=path,
        latency_ms=ranking_ms,
        breakdown_ms={"ranking": ranking_ms},
    )


def _args(**over: float) -> argparse.Namespace:
    return argparse.Namespace(**{"window_s": 5.0, "warmup_s": 10.0, "steady_s": 10.0, "plot": None, **over})


def test_warmup_is_reported_apart_from_the_measured_run() -> None:
    results = [
        _result(1.0, 80.0, "full"),  # cold caches: the warm-up's
        _result(2.0, 20.0),
        _result(12.0, 20.0),
        _result(16.0, 30.0),
        _result(31.0, 60.0),  # at a restart
        _result(38.0, 10.0),
    ]
    restarts = [{"worker": "ranker-0", "at_s": 30.0, "warm_s": 3.0}]
    f = timeline_figures(results, restarts, T0, BUDGET_MS, _args())
    assert f["timeouts"] == 1 and f["ranking_max_ms"] == 60.0
    assert f["warmup"]["timeouts"] == 1 and f["warmup"]["requests"] == 2
    assert f["warmup"]["relay_share"] == 0.5 and f["warmup"]["window_p99_ms"] == [80.0, 80.0]
    assert f["window_p99_ms"] == [10.0, 60.0] and f["windows_over_budget"] == 1
    assert [w["phase"] for w in f["windows"]] == ["warm-up", "measured", "measured", "measured", "measured"]
    assert sum(w["n"] for w in f["windows"]) == len(results)  # nothing dropped
    (rs,) = f["restarts"]
    assert rs["timeouts"] == 1 and rs["ranking_p99_ms"] == 60.0
    assert rs["relay_back_s"] == 0.0 and f["steady_relay_share"] == 1.0


def test_a_restart_span_starts_with_its_standby() -> None:
    """A ranking slowed while the standby warmed up counts for that restart."""
    results = [_result(26.0, 70.0), _result(29.0, 10.0), _result(36.0, 10.0)]
    restarts = [{"worker": "ranker-1", "at_s": 30.0, "warm_s": 5.0}]
    (rs,) = timeline_figures(results, restarts, T0, BUDGET_MS, _args())["restarts"]
    assert rs["timeouts"] == 1


def test_tail_figures_of_nothing() -> None:
    f = tail_figures([], BUDGET_MS)
    assert f["requests"] == 0 and f["timeouts"] == 0 and f["relay_share"] == 0


def test_a_restart_reports_its_standby_warm_up_from_the_audit_trail() -> None:
    last = {
        "spilled_for_standby": {"prefixes": 12, "seconds": 0.03},
        "standby_adopted": {"adopted": 9, "refused": 2, "bytes": 4096, "seconds": 0.01, "standby": True},
        "standby_ready": {"seconds": 1.5},
        "handed_over": {"t": 100.0, "ms": 1.0},
        "took_over": {"t": 100.002},
    }
    got = standby_warm_up(last)
    assert (got["spilled"], got["adopted"], got["refused"], got["adopted_bytes"]) == (12, 9, 2, 4096)
    assert got["standby_ready_s"] == 1.5 and got["adopt_why"] is None
    assert handover_ms(last)["signal_to_serving_ms"] == 3.0
    # A standby that adopted none says why; a trail without a standby reports nothing.
    assert standby_warm_up({"standby_adopted": {"adopted": 0, "why": "no_disk_tier"}})["adopt_why"] == (
        "no_disk_tier"
    )
    assert standby_warm_up({})["adopted"] is None and handover_ms({}) == {}
    row = restart_row({"worker": "ranker-0", "warm_s": 3.0, **got})
    assert "adopted 9 prefixes of 12 (refused 2" in row
