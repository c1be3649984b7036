"""The steady-load scenario's figures: visits numbered from the request ids, relay share and reasons by
visit, pre-inference outcomes grouped by what became of the work, and bad --rates refused."""

from __future__ import annotations

from collections import Counter

import pytest

from relaygr.schemas import RankedResult, RecommendationRequest
from relaygr.tools.experiment.scenarios.steady_load import (
    parse_rates,
    side_by_side,
    stage_figures,
    visit_figures,
    visit_of,
    visit_plan,
)


def _request(rid: str, ts: float = 100.0) -> RecommendationRequest:
    return RecommendationRequest(request_id=rid, user_id=rid.split("-v")[0], ts=ts, num_candidates=8)


def _result(rid: str, path: str, ranking_ms: float, reason: str | None = None) -> RankedResult:
    return RankedResult(
        request_id=rid,
        user_id="u",
        ts=100.0,
        items=[],
        path=path,
        latency_ms=ranking_ms,
        breakdown_ms={"ranking": ranking_ms},
        path_reason=reason,
    )


def test_visit_plan_goes_round_robin_over_the_users() -> None:
    plan = visit_plan([_request("a"), _request("b")], 3, "t")
    assert [r.request_id for r in plan] == ["t-a-v1", "t-b-v1", "t-a-v2", "t-b-v2", "t-a-v3", "t-b-v3"]
    assert [visit_of(r.request_id) for r in plan] == [1, 1, 2, 2, 3, 3]


def test_figures_by_visit_and_pre_inference_outcome() -> None:
    sent = [_request(f"t-u{i}-v{k}") for k in (1, 2) for i in range(2)]
    results = {
        "t-u0-v1": _result("t-u0-v1", "full_truncated", 40.0, "prefill_not_ready"),
        "t-u1-v1": _result("t-u1-v1", "timeout", 70.0, "deadline_passed"),
        "t-u0-v2": _result("t-u0-v2", "relay", 10.0),
        # t-u1-v2 lost
    }
    prefills = {
        "t-u0-v1": {"status": "computed", "t": 102.0},
        "t-u1-v1": {"status": "abandoned", "t": 101.0},
        "t-u0-v2": {"status": "device", "t": 103.0},
    }
    admitted = {"t-u0-v1", "t-u1-v1", "t-u0-v2", "t-u1-v2"}
    got = visit_figures(sent, results, Counter({"t-u0-v2": 2}), admitted, prefills, budget_ms=50.0)
    assert got["lost"] == 1 and got["duplicated"] == 1
    assert got["relay_by_visit"]["1"] == {
        "n": 2,
        "relay": 0,
        "off_relay": {"prefill_not_ready": 1, "deadline_passed": 1},
    }
    assert got["relay_by_visit"]["2"] == {"n": 1, "relay": 1, "off_relay": {}}
    assert (got["returning_on_relay"], got["returning"]) == (1, 1)
    assert got["prefill"] | {"finished_per_s": None} == {
        "admitted": 4,
        "finished": 1,
        "cached": 1,
        "dropped": 1,
        "refused": 0,
        "no_outcome": 1,
        "finished_per_s": None,
    }
    assert got["prefill"]["finished_per_s"] == 0.5  # one in the 2 s from the first send
    assert got["timeouts"] == 1 and got["over_budget"] == 1
    line = side_by_side([{"rate": "10", "policy": "converge", **got}])
    assert line["side_by_side"]["10"]["converge"]["returning_on_relay"] == "1/1"


def test_stage_figures_give_the_deadline_window_and_the_rankings_device_time() -> None:
    # Two requests sent at t=100 s: the later one's rank request is produced 30 ms after it was
    # sent (its upstream stages), so the last deadline is 30 + 50 ms after the first send.
    sent = [_request("t-a-v1"), _request("t-b-v1")]
    a, b = _result("t-a-v1", "relay", 20.0), _result("t-b-v1", "full", 60.0)
    a = a.model_copy(update={"breakdown_ms": {"hop_requests": 5.0, "retrieval": 5.0, "compute": 8.0}})
    upstream = {"hop_requests": 10.0, "retrieval": 10.0, "hop_retrieved": 9.0, "preprocess": 1.0}
    b = b.model_copy(update={"breakdown_ms": upstream | {"device_queue": 20.0, "compute": 32.0}})
    got = stage_figures(sent, {"t-a-v1": a, "t-b-v1": b}, budget_ms=50.0)
    assert got["deadline_window_ms"] == pytest.approx(80.0)
    assert got["ranking_compute_ms"] == pytest.approx(40.0)
    assert got["stages_ms"]["compute"]["p90"] >= got["stages_ms"]["compute"]["p50"] >= 8.0
    assert stage_figures(sent, {}, 50.0)["ranking_compute_ms"] == 0.0


def test_rates_are_positive_numbers_or_burst() -> None:
    assert parse_rates("10, burst,2.5") == [10.0, None, 2.5]
    for bad in ("0", "-1", "fast", "nan"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)
