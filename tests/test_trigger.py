"""The sequence-aware trigger and the latency model it relies on."""

from __future__ import annotations

import pytest

from relaygr.schemas import TriggerReason
from relaygr.streams.trigger import SequenceAwareTrigger, TokenBucket, TriggerConfig
from relaygr.workers.engine.latency_model import LatencyModel

LAT = LatencyModel(a=2.0, b=0.01, c=0.0)  # 1000 tokens -> 12 ms, 4000 -> 42 ms


def trig(**kw) -> SequenceAwareTrigger:
    cfg = TriggerConfig(budget_ms=40.0, theta=0.5, short_term=64, bytes_per_token=1000, **kw)
    return SequenceAwareTrigger(cfg, LAT)


def test_admits_only_at_risk_histories() -> None:
    t = trig()
    assert t.decide(0, 1000, 0.0).reason is TriggerReason.NOT_AT_RISK  # 12 ms <= 20 ms
    d = t.decide(0, 4000, 0.0)  # 42 ms > 20 ms
    assert d.admitted and d.prefix_len == 4000 - 64 and d.est_bytes == (4000 - 64) * 1000
    assert t.decide(0, 0, 0.0).reason is TriggerReason.NO_HISTORY
    assert t.counts == {"not_at_risk": 1, "admitted": 1, "no_history": 1}


def test_each_partition_is_judged_by_its_owners_latency_model() -> None:
    t = trig()
    slow = LatencyModel(a=2.0, b=0.04, c=0.0)  # 1000 tokens -> 42 ms
    t.report_latency(slow, [1])
    assert t.decide(1, 1000, 0.0).admitted  # at risk on the slow worker
    assert t.decide(0, 1000, 0.0).admitted  # unreported partitions: the latest report's model
    t.report_latency(LAT, [0])  # the fast worker reports: the slow one keeps its partition
    assert t.decide(0, 1000, 0.0).reason is TriggerReason.NOT_AT_RISK
    assert t.decide(1, 1000, 0.0).admitted
    assert t.decide(2, 1000, 0.0).reason is TriggerReason.NOT_AT_RISK  # unreported: the latest model
    t.report_latency(LAT, [1])  # partition 1 moved to the fast worker
    assert t.decide(1, 1000, 0.0).reason is TriggerReason.NOT_AT_RISK


def test_footprint_bound_per_partition_and_expiry() -> None:
    t = trig(footprint_bound_bytes=10_000_000, lease_ttl_s=5.0)
    assert t.decide(0, 4064, 0.0).admitted  # 4 MB live
    assert t.decide(0, 4064, 1.0).admitted  # 8 MB live
    assert t.decide(0, 4064, 2.0).reason is TriggerReason.FOOTPRINT_BOUND  # would be 12 MB
    assert t.decide(1, 4064, 2.0).admitted  # another partition has its own bound
    assert t.decide(0, 4064, 5.5).admitted  # the first lease expired at t=5


def test_reported_footprint_is_respected() -> None:
    t = trig(footprint_bound_bytes=10_000_000)
    t.report_footprint(3, 9_000_000)
    assert t.decide(3, 4064, 0.0).reason is TriggerReason.FOOTPRINT_BOUND


def test_footprint_counts_device_bytes_only() -> None:
    """Prefixes that were ranked and released, or spilled to host or disk, leave the device: a
    worker's report of its device bytes replaces the estimates of the admissions it has seen."""
    t = trig(footprint_bound_bytes=10_000_000, lease_ttl_s=30.0, report_grace_s=1.0)
    assert t.decide(0, 4064, 0.0).admitted
    assert t.decide(0, 4064, 1.0).admitted
    assert t.decide(0, 4064, 2.0).reason is TriggerReason.FOOTPRINT_BOUND  # 8 MB estimated
    # The worker saw both; their prefixes are off the device (host/disk tiers): 0 device bytes.
    t.report_footprint(0, 0, as_of=3.0)
    assert t.live_bytes(0, 3.0) == 0
    assert t.decide(0, 4064, 3.0).admitted
    # A report covers only admissions older than the grace: the one at 3.0 still counts at 3.5.
    t.report_footprint(0, 3_000_000, as_of=3.5)
    assert t.live_bytes(0, 3.5) == 3_000_000 + 4_000_000
    assert t.decide(0, 4064, 3.5).reason is TriggerReason.FOOTPRINT_BOUND  # 7 + 4 MB > 10 MB
    # Device bytes the worker reports do count.
    t.report_footprint(0, 9_000_000, as_of=10.0)
    assert t.decide(0, 4064, 10.0).reason is TriggerReason.FOOTPRINT_BOUND


def test_rate_bound_token_bucket() -> None:
    t = trig(prefill_rate_per_s=2.0, prefill_burst=2.0, footprint_bound_bytes=1 << 40)
    reasons = [t.decide(0, 5000, 0.0).reason for _ in range(3)]
    assert reasons == [TriggerReason.ADMITTED, TriggerReason.ADMITTED, TriggerReason.RATE_BOUND]
    assert t.decide(0, 5000, 0.5).admitted  # refilled one token in 0.5 s


def test_disabled_trigger_never_admits() -> None:
    t = trig(enabled=False)
    assert t.decide(0, 100_000, 0.0).reason is TriggerReason.DISABLED


def test_token_bucket_caps_at_burst() -> None:
    b = TokenBucket(rate=100.0, burst=3.0)
    assert b.take(0.0)
    assert sum(b.take(1000.0) for _ in range(10)) == 3


def test_latency_model_fit_and_inverse() -> None:
    true = LatencyModel(1.5, 0.004, 2e-6)
    fit = LatencyModel.fit([(n, true.predict_ms(n)) for n in (64, 256, 1024, 2048, 4096)])
    for n in (100, 3000):
        assert fit.predict_ms(n) == pytest.approx(true.predict_ms(n), rel=1e-6)
    n = fit.max_tokens_within(30.0)
    assert fit.predict_ms(n) <= 30.0 < fit.predict_ms(n + 1)
    assert LatencyModel(50.0, 0.1, 0.0).max_tokens_within(10.0) == 0


@pytest.mark.parametrize("c", [0.0, 3.7e-20, 1e-12, 1e-6])
def test_latency_model_inverts_a_nearly_linear_fit(c: float) -> None:
    # A refit on nearly linear times leaves c tiny next to b; the inverse must not cancel to 0.
    m = LatencyModel(0.5, 2.0, c)
    n = m.max_tokens_within(500.0)
    assert m.predict_ms(n) <= 500.0 < m.predict_ms(n + 1)
    k = m.tokens_within_slice(1000, 5.0, lo=1)
    assert m.predict_ms(1000 + k) - m.predict_ms(1000) <= 5.0 < m.predict_ms(1001 + k) - m.predict_ms(1000)


def test_latency_model_never_predicts_shrinking_time() -> None:
    noisy = [(64, 5.0), (256, 4.0), (1024, 9.0), (2048, 15.0)]
    m = LatencyModel.fit(noisy)
    assert min(m.coeffs()) >= 0
    assert m.predict_ms(4096) >= m.predict_ms(2048) >= m.predict_ms(64)


def test_latency_model_file_round_trip(tmp_path) -> None:
    m = LatencyModel(1.0, 0.02, 3e-6)
    m.save(tmp_path / "c.json", machine="test")
    assert LatencyModel.load(tmp_path / "c.json") == m
    with pytest.raises(ValueError):
        LatencyModel.from_coeffs([1.0, float("nan"), 0.0])


def test_pipeline_settings_defaults_follow_relaygr_home(monkeypatch, tmp_path) -> None:
    from relaygr.streams.config import PipelineSettings

    monkeypatch.delenv("RELAYGR_MODEL_DIR", raising=False)
    monkeypatch.setenv("RELAYGR_HOME", str(tmp_path))
    assert PipelineSettings().model_dir == tmp_path / "model"
    monkeypatch.setenv("RELAYGR_MODEL_DIR", str(tmp_path / "elsewhere"))
    assert PipelineSettings().model_dir == tmp_path / "elsewhere"
    assert PipelineSettings().torch_threads == 1


def test_every_lease_default_is_the_one_of_the_lease_table() -> None:
    """The wire format keeps a default of its own (the contract imports nothing of the workers):
    it agrees with the one every config reads."""
    from relaygr.schemas import PrefillSignal
    from relaygr.streams.config import PipelineSettings
    from relaygr.workers.engine.engine_config import EngineConfig
    from relaygr.workers.store.leases import DEFAULT_LEASE_TTL_S
    from relaygr.workers.store.prefix_store import PrefixStoreConfig

    defaults = {
        PrefillSignal.model_fields["lease_ttl_s"].default,
        TriggerConfig.model_fields["lease_ttl_s"].default,
        EngineConfig.model_fields["lease_ttl_s"].default,
        PrefixStoreConfig.model_fields["default_lease_ttl_s"].default,
        PipelineSettings.model_fields["lease_ttl_s"].default,
    }
    assert defaults == {DEFAULT_LEASE_TTL_S}


def test_backlog_bound_admits_fewer_under_overload_and_a_report_frees_it() -> None:
    # Each 4000-event pre-inference is predicted at 41 ms; the owner of partitions 0 and 1 may
    # hold 100 ms of them unfinished. Admissions on either of its partitions add up; another
    # worker's partition has its own backlog; the owner's report replaces the estimates.
    t = trig(backlog_bound_ms=100.0, report_grace_s=1.0)
    t.report_backlog([0, 1], 0.0, as_of=0.0)
    assert t.decide(0, 4000, 2.0).admitted
    assert t.decide(1, 4000, 2.0).admitted
    assert t.decide(0, 4000, 2.0).reason is TriggerReason.RATE_BOUND  # 3 x 41 ms > 100 ms
    assert t.backlog_ms(1) == pytest.approx(2 * LAT.predict_ms(4000 - 64))
    assert t.decide(2, 4000, 2.0).admitted  # not that worker's
    t.report_backlog([0, 1], 10.0, as_of=4.0)  # both finished; 10 ms left of another
    assert t.backlog_ms(0) == pytest.approx(10.0)
    assert t.decide(0, 4000, 4.0).admitted
    assert t.counts["rate_bound"] == 1


def test_a_slow_pace_puts_a_history_at_risk_as_the_ranking_would_truncate_it() -> None:
    # 1000 events: 12 ms by the model, under budget x theta (20 ms); the worker's full rankings
    # run 2x the model now, so its ranking would plan 24 ms and truncate: the trigger admits.
    t = trig()
    assert t.decide(0, 1000, 0.0).reason is TriggerReason.NOT_AT_RISK
    t.report_latency(LAT, [0], pace=2.0)
    assert t.decide(0, 1000, 0.0).admitted
    with pytest.raises(ValueError, match="pace"):
        t.report_latency(LAT, [0], pace=0.0)


def test_a_refit_from_short_rankings_never_makes_a_long_history_look_safe() -> None:
    # Under load a worker ranks truncated histories only; its refit (nearly flat here) would put
    # 4000 events at 3 ms. The calibration's 42 ms still counts: the request stays at risk.
    t = trig()
    t.report_latency(LatencyModel(a=2.0, b=0.0002, c=0.0), [0])
    assert t.decide(0, 4000, 0.0).admitted


def test_a_users_later_visits_join_its_admitted_pre_inference_at_no_cost() -> None:
    # A token bucket of two tokens that never refills, and a backlog bound of two pre-inferences.
    # A burst of one user's three visits (its history growing by a few events) takes one token
    # and one pre-inference of backlog: the later two join it, so a second user is still admitted.
    t = trig(prefill_rate_per_s=1e-9, prefill_burst=2.0, backlog_bound_ms=2 * 41.0 + 1, lease_ttl_s=10.0)
    first = t.decide(0, 4000, 1.0, user_id="a")
    assert first.admitted and not first.joined
    for n in (4000, 4010, 4064):
        d = t.decide(0, n, 1.05, user_id="a")
        assert d.admitted and d.joined and d.prefix_len == n - 64
    assert t.backlog_ms(0) == pytest.approx(LAT.predict_ms(4000 - 64))
    assert t.decide(0, 4000, 1.06, user_id="b").admitted
    assert t.counts["admitted"] == 5 and t.counts["joined"] == 3
    # No token left: what is not a join is refused.
    assert t.decide(0, 4000, 1.06, user_id="c").reason is TriggerReason.RATE_BOUND
    # Grown past a short-term suffix, or shorter (another window), it is another prefix.
    assert t.decide(0, 4065, 1.06, user_id="a").reason is TriggerReason.RATE_BOUND
    assert t.decide(0, 3999, 1.06, user_id="a").reason is TriggerReason.RATE_BOUND
    # Past the join window (here the backlog bound, 83 ms: the admitted work is due to be done,
    # and the user's partition may have moved since) a visit is charged again.
    assert t.decide(0, 4000, 1.1, user_id="a").reason is TriggerReason.RATE_BOUND
    # Without a user id nothing joins.
    assert t.decide(0, 4000, 1.06).reason is TriggerReason.RATE_BOUND


def test_the_join_window_is_the_lease_or_the_backlog_bound_whichever_is_shorter() -> None:
    t = trig(prefill_rate_per_s=1e-9, prefill_burst=1.0, backlog_bound_ms=1e6, lease_ttl_s=10.0)
    assert t.decide(0, 4000, 0.0, user_id="a").admitted
    assert t.decide(0, 4000, 9.5, user_id="a").joined
    # Past the lease the prefix may be gone: a visit is charged again (no token left).
    assert t.decide(0, 4000, 20.0, user_id="a").reason is TriggerReason.RATE_BOUND
