"""Report figures on tiny hand-computed result sets: percentiles, SLO compliance, quality, cache, paths."""

from __future__ import annotations

import json
import math

import pytest

from relaygr.schemas import RankedResult, ScoredItem
from relaygr.tools.report.command import write_run_report
from relaygr.tools.report.figures import (
    admission,
    by_history_len,
    headline,
    hit_rates,
    path_mix,
    percentile,
    quality,
    slo_figures,
    stage_latencies,
    summarize,
    windows,
)


def res(
    i: int,
    ranking: float,
    *,
    path: str = "relay",
    history: int = 100,
    used: int | None = None,
    tier: str | None = None,
    items: list[int] | None = None,
    label: int | None = None,
    ts: float | None = None,
    e2e: float | None = None,
) -> RankedResult:
    return RankedResult(
        request_id=f"r{i}",
        user_id=f"u{i % 3}",
        ts=1000.0 + i if ts is None else ts,
        items=[ScoredItem(item_id=x, score=float(-k)) for k, x in enumerate(items or [1, 2, 3])],
        path=path,
        latency_ms=ranking + 40.0 if e2e is None else e2e,
        breakdown_ms={"ranking": ranking, "hop_rank": 1.0, "compute": max(0.0, ranking - 2.0)},
        history_len=history,
        used_len=history if used is None else used,
        prefix_tier=tier,
        label_item_id=label,
    )


def test_nearest_rank_percentiles() -> None:
    xs = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(xs, 50) == 50.0
    assert percentile(xs, 90) == 90.0
    assert percentile(xs, 99) == 99.0
    assert percentile(xs, 99.9) == 100.0
    ten = [5.0 * k for k in range(1, 11)]  # 5..50
    assert [percentile(ten, q) for q in (50, 90, 99, 99.9)] == [25.0, 45.0, 50.0, 50.0]
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))
    assert percentile([1.0, math.inf], 50) == 1.0 and percentile([1.0, math.inf], 99) == math.inf


def test_stage_latencies_cover_end_to_end_and_every_stage() -> None:
    rs = [res(i, 5.0 * (i + 1)) for i in range(10)]  # ranking 5..50, e2e 45..90
    lat = stage_latencies(rs)
    assert lat["ranking"]["p50"] == 25.0 and lat["ranking"]["p90"] == 45.0 and lat["ranking"]["p99"] == 50.0
    assert lat["end_to_end"]["p50"] == 65.0 and lat["end_to_end"]["p99.9"] == 90.0
    assert lat["hop_rank"]["p99"] == 1.0 and lat["compute"]["p50"] == 23.0
    assert lat["ranking"]["n"] == 10 and lat["ranking"]["mean"] == pytest.approx(27.5)
    assert "retrieval" not in lat  # only stages that appear


def test_slo_compliance_counts_late_truncated_timed_out_and_missing() -> None:
    rs = [res(i, 5.0 * (i + 1)) for i in range(10)]  # 5..50 ms; B = 40 -> 8 within latency
    rs[2] = res(2, 15.0, path="full_truncated", used=60)  # within B but truncated
    rs[3] = res(3, 20.0, path="timeout", used=0)  # timed out
    s = slo_figures(rs, 40.0, expected=11, duration_s=2.0)
    assert s["requests"] == 11 and s["results"] == 10 and s["missing"] == 1
    assert s["within_latency"] == 8
    assert s["truncated"] == 2  # the timeout used nothing either
    assert s["timeouts"] == 1
    assert s["compliant"] == 6  # 8 within B, minus the truncated one, minus the timeout
    assert s["compliance"] == pytest.approx(6 / 11)
    assert s["slo_throughput_qps"] == pytest.approx(3.0) and s["throughput_qps"] == pytest.approx(5.5)
    assert s["slo_p99_ms"] == math.inf and s["holds_slo"] is False
    allowed = slo_figures(rs, 40.0, allow_truncated=True)
    assert allowed["compliant"] == 7  # truncation tolerated, the timeout still not


def test_holding_the_slo_means_99_percent_within_bound() -> None:
    ok = [res(i, 10.0) for i in range(99)]
    one_late = slo_figures([*ok, res(99, 80.0)], 40.0)
    assert one_late["holds_slo"] is True and one_late["slo_p99_ms"] == 10.0
    two_late = slo_figures([*ok[:98], res(98, 80.0), res(99, 80.0)], 40.0)
    assert two_late["holds_slo"] is False and two_late["slo_p99_ms"] == math.inf
    missing = slo_figures(ok[:98], 40.0, expected=100)  # two results never came
    assert missing["holds_slo"] is False and missing["compliance"] == pytest.approx(0.98)
    # Duration from the send times: 100 requests 1 s apart -> 100 s (99 gaps stretched by 100/99).
    spread = slo_figures([res(i, 10.0, ts=2000.0 + i) for i in range(100)], 40.0)
    assert spread["duration_s"] == pytest.approx(100.0) and spread["slo_throughput_qps"] == pytest.approx(1.0)


def test_hr_and_ndcg_at_10() -> None:
    top = list(range(100, 110))
    rs = [
        res(0, 1.0, items=top, label=100),  # rank 1: hit, gain 1
        res(1, 1.0, items=top, label=102),  # rank 3: hit, gain 1/log2(4) = 0.5
        res(2, 1.0, items=top, label=555),  # not ranked: miss
        res(3, 1.0, items=top, label=None),  # no ground truth: not counted
        res(4, 1.0, items=[*top, 777], label=777),  # 11th: outside the top 10
    ]
    q = quality(rs)
    assert q["labelled"] == 4
    assert q["hr@10"] == pytest.approx(2 / 4)
    assert q["ndcg@10"] == pytest.approx((1.0 + 0.5) / 4)
    # Labels from the trace take precedence over the results' own.
    q2 = quality(rs, labels={"r2": 109, "r3": 101})
    assert q2["labelled"] == 5
    assert q2["hr@10"] == pytest.approx(4 / 5)
    assert q2["ndcg@10"] == pytest.approx((1.0 + 0.5 + 1 / math.log2(11) + 1 / math.log2(3)) / 5)


def test_hit_rates_per_tier_and_prefill_outcomes() -> None:
    rs = [
        res(0, 1.0, tier="device"),
        res(1, 1.0, tier="device"),
        res(2, 1.0, tier="host"),
        res(3, 1.0, tier="miss", path="full"),
        res(4, 1.0, tier=None, path="cold_start", history=0),  # no lookup: not counted
    ]
    h = hit_rates(rs, ["device", "extended", "computed", "refused:footprint_bound", "disk"])
    assert h["rank_lookup"]["n"] == 4
    assert h["rank_lookup"]["device"] == 0.5 and h["rank_lookup"]["host"] == 0.25
    assert h["rank_lookup"]["miss"] == 0.25 and h["rank_lookup"]["hit"] == 0.75
    assert h["rank_lookup"]["disk"] == 0.0
    assert h["prefill"]["n"] == 5 and h["prefill"]["hit"] == pytest.approx(3 / 5)
    assert h["prefill"]["refused"] == pytest.approx(1 / 5) and h["prefill"]["computed"] == pytest.approx(
        1 / 5
    )
    assert hit_rates([res(0, 1.0, path="baseline")]) == {}


def test_path_mix_admission_and_bins() -> None:
    rs = [res(0, 1.0), res(1, 1.0), res(2, 1.0, path="full"), res(3, 1.0, path="full_truncated", used=10)]
    mix = path_mix(rs)
    assert mix == {
        "full": {"count": 1, "share": 0.25},
        "full_truncated": {"count": 1, "share": 0.25},
        "relay": {"count": 2, "share": 0.5},
    }
    assert admission(10, 4) == {"admitted": 4, "admission_rate": 0.4}
    assert admission(10, None)["admission_rate"] is None
    # 12 requests in 0..11 s: windows of 5 s hold 5, 5 and 2 requests.
    w = windows([res(i, float(i), ts=100.0 + i) for i in range(12)], 5.0)
    assert [(q, n) for q, _, n in w] == [(1.0, 5), (1.0, 5), (0.4, 2)]
    assert [p for _, p, _ in w] == [4.0, 9.0, 11.0]
    b = by_history_len([res(i, float(i), history=h) for i, h in enumerate([100, 120, 127, 128, 300, 300])], 1)
    assert b == [(64, 2.0, 3), (128, 3.0, 1), (256, 5.0, 2)]


def test_run_report_writes_json_markdown_and_plots(tmp_path) -> None:
    rs = [
        res(i, 5.0 + i, tier="device" if i % 2 else "host", label=1 if i % 3 else 9, history=50 + 20 * i)
        for i in range(30)
    ]
    s = summarize(rs, slo_ms=30.0, admitted=20, prefill_statuses=["device"] * 10 + ["computed"] * 10)
    doc = write_run_report(tmp_path, rs, s, slo_ms=30.0, inputs={"results": "t.results"})
    for name in ("latency_cdf.png", "p99_vs_qps.png", "p99_vs_seq_len.png", "hit_rates.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
    assert doc["plots"] == ["latency_cdf.png", "p99_vs_qps.png", "p99_vs_seq_len.png", "hit_rates.png"]
    back = json.loads((tmp_path / "report.json").read_text())
    assert back["summary"]["slo"]["compliant"] == 26  # 5..29 ms: 26 at or under 30
    assert back["summary"]["trigger"]["admission_rate"] == pytest.approx(20 / 30)
    md = (tmp_path / "report.md").read_text()
    assert "P99.9" in md and "SLO-compliant throughput" in md and "![hit_rates.png](hit_rates.png)" in md
    h = headline(s)
    assert h["hr@10"] == pytest.approx(20 / 30) and h["paths"] == {"relay": 30}
    json.dumps(h)  # finite or None only


def test_prefill_outcomes_keeps_the_last_outcome_of_each_request(tmp_path):
    from relaygr.tools.report.inputs import prefill_outcomes, prefill_statuses

    worker = tmp_path / "dep" / "ranker-0"
    worker.mkdir(parents=True)
    lines = [
        {"event": "prefill", "request_id": "a", "status": "abandoned"},
        {"event": "result", "request_id": "a", "path": "full_truncated"},
        {"event": "prefill", "request_id": "b", "status": "computed"},
        {"event": "prefill", "request_id": "a", "status": "device"},
        {"event": "prefill", "request_id": "c", "status": "abandoned"},
    ]
    (worker / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines) + "{torn")
    assert prefill_outcomes(tmp_path, {"a", "b", "d"}) == {"a": "device", "b": "computed"}
    assert sorted(prefill_statuses(tmp_path, {"a", "c"})) == ["abandoned", "abandoned", "device"]


def test_pre_inference_counts_sum_the_workers_reports() -> None:
    from relaygr.schemas import WorkerStats
    from relaygr.tools.report.inputs import pre_inference_counts

    a = WorkerStats(
        worker_id="w0",
        ts=1.0,
        prefill_counts={"admitted": 5, "finished": 4, "late": 2, "dropped:backlog": 1},
        device_share={"rank_s": 3.0, "prefill_s": 1.0},
    )
    b = WorkerStats(
        worker_id="w1",
        ts=1.0,
        prefill_counts={"admitted": 3, "finished": 1, "cached": 2},
        device_share={"rank_s": 1.0, "prefill_s": 1.0},
    )
    got = pre_inference_counts({"w0": a, "w1": b})
    assert got["admitted"] == 8 and got["finished"] == 5 and got["cached"] == 2
    assert got["dropped"] == 1 and got["dropped:backlog"] == 1 and got["late"] == 2
    assert got["prefill_device_share"] == pytest.approx(2 / 6, abs=1e-4)
    assert pre_inference_counts([])["prefill_device_share"] == 0.0
