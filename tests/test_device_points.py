"""The device check's pipeline points: requests from the stopping rule, lengths and rates from a
calibration, points dropped to fit the time, and the report's sentence when a side never held."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relaygr.device import points as dp
from relaygr.device.report import never_held
from relaygr.tools.experiment.stopping import StopRule, miss_rate_upper_bound
from relaygr.workers.engine.latency_model import LatencyModel

# An accelerator where a ranking costs a launch-bound 4 ms plus a little per event.
FAST = LatencyModel(4.0, 0.002, 1e-8)
# A device slower than the budget even at the shortest history.
SLOW = LatencyModel(80.0, 0.5, 0.0)


def test_each_point_sends_the_fewest_requests_with_which_no_miss_holds() -> None:
    plan = dp.size_points(FAST, 50.0, 32768)
    n = plan.requests
    assert n == 299  # "300 at 1 %"
    assert miss_rate_upper_bound(n, 0) <= 0.01 < miss_rate_upper_bound(n - 1, 0)
    rule = StopRule(cap=n)
    assert rule.decide(n, 0) == "holds" and rule.decide(n, 1) == "fails"
    # 60 requests, as the first run sent, could never hold.
    assert StopRule(cap=60).decide(60, 0) == "fails"
    args = dp.experiment_args(plan)
    assert args[args.index("--max-requests") + 1] == "299"


def test_lengths_run_from_where_full_ranking_is_comfortable_to_the_serving_cap() -> None:
    plan = dp.size_points(FAST, 50.0, 32768)
    lo, hi = plan.lengths[0], plan.lengths[-1]
    assert hi == 32768 and len(plan.lengths) == dp.LENGTHS
    assert FAST.predict_ms(lo) <= dp.COMFORT_FRACTION * 50.0
    assert all(x % 64 == 0 for x in plan.lengths) and plan.lengths == sorted(set(plan.lengths))
    # The baseline's point keeps the device at most BASELINE_UTILISATION busy at the seq-len rate.
    assert plan.seq_len_qps * FAST.predict_ms(lo) / 1000 <= dp.BASELINE_UTILISATION + 1e-9


def test_rates_run_from_a_few_per_second_to_where_relay_saturates_the_device() -> None:
    plan = dp.size_points(FAST, 50.0, 32768)
    assert plan.history <= 32768 // 2 and FAST.predict_ms(plan.history) <= dp.COMFORT_FRACTION * 50.0
    assert plan.rates[0] * FAST.predict_ms(plan.history) / 1000 <= dp.BASELINE_UTILISATION + 1e-9
    assert plan.rates[-1] == dp.MAX_QPS  # relay at this device would saturate far above what stages carry
    # A device whose relay ranking takes 25 ms saturates at 40/s: the rates stop there.
    slower = LatencyModel(2.0, 0.004, 1e-7)
    capped = dp.size_points(slower, 50.0, 8192, relay_pace=((0.0, 60.0),))
    relay_ms = capped.predicted_relay_ms[str(capped.history)]
    assert capped.rates[-1] == pytest.approx(1000 / relay_ms, abs=0.1)


def test_points_are_dropped_middle_first_until_sending_fits() -> None:
    every = dp.size_points(FAST, 50.0, 32768)
    fit = dp.size_points(FAST, 50.0, 32768, seconds=every.seconds - 1)
    assert fit.seconds <= every.seconds - 1 and fit.dropped
    assert fit.rates[0] == every.rates[0] and fit.rates[-1] == every.rates[-1]
    assert fit.lengths[0] == every.lengths[0] and fit.lengths[-1] == every.lengths[-1]
    # Never fewer than two of each: both ratios need a low and a high point.
    tight = dp.size_points(FAST, 50.0, 32768, seconds=1.0)
    assert len(tight.rates) == 2 and len(tight.lengths) == 2


def test_a_device_slower_than_the_budget_still_gets_points_and_says_so() -> None:
    plan = dp.size_points(SLOW, 50.0, 8192)
    assert plan.lengths[0] == dp.MIN_LENGTH and plan.rates[0] == dp.MIN_QPS
    assert plan.predicted_full_ms[str(plan.lengths[0])] > 50.0


def test_geometric_spacing_is_on_the_grid_without_repeats() -> None:
    assert dp.geometric(256, 32768, 3, 64) == [256, 2880, 32768]
    assert dp.geometric(512, 512, 3, 64) == [512]
    assert dp.geometric(10.0, 120.0, 3, 0.1) == pytest.approx([10.0, 34.6, 120.0])


def _experiment(kind: str, relay, baseline, points) -> dict:
    ratio = relay / baseline if relay and baseline else None
    return {"experiment": kind, "slo_ms": 50, "ratio": ratio, "relay_max": relay, "baseline_max": baseline,
            "points": points}  # fmt: skip


def test_the_report_says_which_side_never_held_and_why() -> None:
    plan = {
        "history": 4096,
        "predicted_full_ms": {"256": 12.0, "4096": 60.0},
        "predicted_relay_ms": {"256": 1.0},
    }
    pts = [
        {"x": 1024, "mode": "baseline", "n": 100, "k": 40, "p99_ms": 95.0, "holds": False},
        {"x": 256, "mode": "baseline", "n": 100, "k": 9, "p99_ms": 71.0, "holds": False},
        {"x": 256, "mode": "relay", "n": 299, "k": 0, "p99_ms": 20.0, "holds": True},
    ]
    text = never_held(_experiment("seq-len", 1024, None, pts), plan)
    assert text.startswith("seq-len: no ratio, the baseline never held: at its easiest point (256 events)")
    assert "9 of 100 requests over B = 50 ms" in text and "predicted at 12.0 ms" in text
    assert "queueing and the pipeline's stages" in text and "relay never held" not in text
    # Throughput: full ranking predicted over B at the history: the device is too slow for it.
    pts = [{"x": 5.0, "mode": "baseline", "n": 100, "k": 100, "p99_ms": 400.0, "holds": False}]
    text = never_held(_experiment("throughput", 40.0, None, pts), plan)
    assert "(5.0/s)" in text and "predicted at 60.0 ms" in text and "too slow for it" in text
    # Neither side ran: said so; a defined ratio needs no sentence.
    assert "the relay never ran a point" in never_held(_experiment("seq-len", None, None, []), None)
    assert never_held(_experiment("seq-len", 4096, 1024, pts), plan) == ""


def test_plan_prints_the_xl_presets_bytes_per_user_without_a_model() -> None:
    cmd = [sys.executable, "-m", "relaygr.cli", "plan", "--users", "1000", "--qps", "10", "--history-p50", "2000",
           "--history-p99", "8192", "--preset", "xl", "--format", "bf16", "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)["bytes_per_cached_user"]
    assert out["shape"]["layers"] == 24 and out["lengths"] == {"p50": 2000, "p99": 8192, "cap": 8192}
    at_cap = out["formats"]["bf16"]["cap"]
    # Keys and values of 24 layers, 8 heads of 128, 8,192 events, 2 bytes each (and a few bytes of
    # position and time per event).
    kv = 2 * 24 * 8 * 128 * 8192 * 2
    assert all(kv <= at_cap[tier] <= kv + 16 * 8192 for tier in ("device", "host"))
    assert at_cap["disk"] > at_cap["host"]
    bad = subprocess.run([*cmd[:-5], "--preset", "huge"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "no model preset 'huge'" in bad.stderr


def test_the_device_tier_holds_every_user_of_the_window_at_the_longest_length() -> None:
    # 7 users, 16 KiB an event (large, float32), an H200's 141 GB: the tier is 30 % of it.
    store = dp.size_store(141 * 10**9, 16 * 1024, 7, 32768)
    assert store.device_tier_mb == store.footprint_mb == round(0.3 * 141 * 10**9 / (1 << 20))
    assert store.longest == 32768
    assert store.env() == {
        "RELAYGR_DEVICE_CACHE_MB": f"{store.device_tier_mb:.0f}",
        "RELAYGR_FOOTPRINT_BOUND_MB": f"{store.footprint_mb:.0f}",
    }
    # A 16 GB card: 7 users' prefixes fit up to 4.8 GB / 7 / 16 KiB = 41,9xx events, on the grid.
    small = dp.size_store(16 * 10**9, 16 * 1024, 7, 65536)
    assert small.longest % 64 == 0 and small.longest * 7 * 16 * 1024 <= 0.3 * 16 * 10**9
    assert (small.longest + 64) * 7 * 16 * 1024 > 0.3 * 16 * 10**9
    # Never below the shortest length the sizing tries.
    assert dp.size_store(10**6, 16 * 1024, 7, 32768).longest == dp.MIN_LENGTH


def test_the_experiments_window_is_a_few_users_sessions() -> None:
    # Why the device tier must hold every user: 299 requests of the window are 7 users coming back.
    assert dp.window_users(299) == 7
    assert dp.window_users(100) <= dp.window_users(299)


def test_the_points_fit_what_the_steps_deadline_leaves() -> None:
    assert dp.sending_seconds(135.0, 45.0, 1000.0, None) == 135.0
    assert dp.sending_seconds(float("inf"), 45.0, 1000.0, "1300") == 255.0
    assert dp.sending_seconds(135.0, 45.0, 1000.0, "1300") == 135.0
    assert dp.sending_seconds(135.0, 45.0, 1000.0, "1010") == 0.0
