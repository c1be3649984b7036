"""Several ranking workers on one device: each one's share of it, how `relaygr up` lays them out,
and how the capacity plan counts them."""

from __future__ import annotations

import pytest

from relaygr.streams.config import PipelineSettings
from relaygr.streams.ranking.engine_factory import device_shared
from relaygr.tools.up import ranking_layout
from relaygr.workers.engine.device_split import MIB, PREFIX_SHARE, device_memory_bytes, split_device


def test_on_a_cpu_the_workers_split_the_configured_budgets() -> None:
    share = split_device(4, cache_mb=1000.0, graph_pool_mb=200.0, total_bytes=None)
    assert (share.cache_mb, share.graph_pool_mb) == (250.0, 50.0)
    assert share.env() == {"RELAYGR_DEVICE_CACHE_MB": "250.000", "RELAYGR_GRAPH_POOL_MB": "50.000"}


def test_on_an_accelerator_each_worker_takes_its_part_of_the_device_in_the_configured_ratio() -> None:
    total = 80 * 1024 * MIB
    one, two = (split_device(n, cache_mb=3000.0, graph_pool_mb=1000.0, total_bytes=total) for n in (1, 2))
    assert one.cache_mb + one.graph_pool_mb == pytest.approx(total * PREFIX_SHARE / MIB)
    assert one.cache_mb == pytest.approx(3 * one.graph_pool_mb)
    assert two.cache_mb == pytest.approx(one.cache_mb / 2)
    assert two.graph_pool_mb == pytest.approx(one.graph_pool_mb / 2)


@pytest.mark.parametrize(
    "workers, cache, pool, total",
    [(0, 1.0, 1.0, None), (2, -1.0, 1.0, None), (2, 1.0, 0.0, None), (2, 1.0, 1.0, 0)],
)
def test_a_split_that_holds_nothing_is_refused(workers, cache, pool, total) -> None:
    with pytest.raises(ValueError):
        split_device(workers, cache, pool, total)


def test_a_cpu_has_no_device_memory_to_size_from() -> None:
    assert device_memory_bytes("cpu") is None
    assert device_memory_bytes(None) is None


def test_one_worker_keeps_its_settings_and_a_sharing_worker_takes_its_share() -> None:
    alone = PipelineSettings(device_cache_mb=800.0, graph_pool_mb=400.0)
    assert device_shared(alone, "cpu") is alone
    shared = device_shared(alone.model_copy(update={"workers_per_device": 4}), "cpu")
    assert (shared.device_cache_mb, shared.graph_pool_mb) == (200.0, 100.0)


def test_up_starts_n_workers_a_device_and_refuses_a_count_that_is_not_one_device_s() -> None:
    assert ranking_layout(None, None) == (2, {})
    assert ranking_layout(3, None) == (3, {})
    assert ranking_layout(None, 4) == (4, {"RELAYGR_WORKERS_PER_DEVICE": "4"})
    assert ranking_layout(4, 4)[0] == 4
    with pytest.raises(ValueError, match="share one device"):
        ranking_layout(8, 4)


def test_the_plan_gives_the_workers_on_a_device_its_time_together() -> None:
    import numpy as np

    from relaygr.workers.engine.capacity import ModelShape, WorkerShape, Workload, capacity_plan
    from relaygr.workers.engine.latency_model import LatencyModel
    from relaygr.workers.model.model import HSTUConfig

    shape = ModelShape.of(HSTUConfig(layers=1, heads=1, dim=16, attn_dim=8, linear_dim=8))
    latency = LatencyModel.from_coeffs([1.0, 0.05, 0.0])
    load = Workload(users=10_000, qps=400.0, budget_ms=50.0, theta=0.5, short_term=64, min_prefix=128,
                    candidates=128, hit_rate=0.9)  # fmt: skip
    lengths = np.full(100, 4096)
    plans = {
        n: capacity_plan(shape, latency, lengths, load, WorkerShape(1 << 30, 0, 0, 0.7, workers_per_device=n))
        for n in (1, 3)
    }
    assert plans[1]["devices_for_device_time"] == plans[3]["devices_for_device_time"] > 1
    assert plans[3]["workers_for_device_time"] == 3 * plans[1]["workers_for_device_time"]
    for f in plans[3]["formats"].values():
        assert f["devices"] == -(-f["workers"] // 3)
