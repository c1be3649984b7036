"""relaygr plan's arithmetic: the bytes it predicts are the bytes the prefix store accounts, its
device time follows the latency model and the paces, and the command prints one JSON line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from relaygr.workers.engine.capacity import (
    ModelShape,
    WorkerShape,
    Workload,
    capacity_plan,
    device_ms_per_request,
    lognormal_lengths,
    pace_at,
)
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.model.model import HSTUConfig, HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events
from relaygr.workers.store.kv_formats import COLD_FORMATS
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Every history is at risk: full ranking of 40+ events is predicted at 1 + 0.5·n ms > 10 ms.
LATENCY = LatencyModel(1.0, 0.5, 0.0)


def _workload(**kw) -> Workload:
    base = dict(users=1000, qps=50.0, budget_ms=20.0, theta=0.5, short_term=8, min_prefix=4, candidates=16)
    return Workload(**{**base, **kw})


def test_lognormal_lengths_have_the_given_median_and_tail() -> None:
    n = lognormal_lengths(300, 3000, cap=100_000, points=4000)
    assert np.median(n) == pytest.approx(300, rel=0.01)
    assert np.quantile(n, 0.99) == pytest.approx(3000, rel=0.03)
    assert lognormal_lengths(300, 3000, cap=1000).max() == 1000
    with pytest.raises(ValueError):
        lognormal_lengths(500, 100, cap=1000)


def test_paces_interpolate_and_stay_flat_beyond_their_points() -> None:
    table = ((1000.0, 1.0), (2000.0, 3.0))
    assert pace_at(table, np.array([500, 1500, 4000])).tolist() == [1.0, 2.0, 3.0]


def test_device_time_per_request_is_the_latency_models_arithmetic() -> None:
    served = np.array([40, 100])
    w = _workload(hit_rate=0.25, prefill_pace=((0.0, 2.0),), relay_pace=((0.0, 3.0),))
    got = device_ms_per_request(LATENCY, served, w)
    assert got["at_risk"].tolist() == [True, True]
    prefix = served - 8
    # a miss pre-infers the prefix at the prefill pace; a hit (new_events 0) nothing
    assert np.allclose(got["preinfer_ms"], 0.75 * 0.5 * prefix * 2.0)
    # the relay ranking computes the suffix and the candidates against the prefix
    assert np.allclose(got["rank_ms"], 0.5 * (8 + 16) * 3.0)
    short = device_ms_per_request(LATENCY, np.array([10]), w)  # 6 ms: not at risk, full ranking
    assert short["at_risk"].tolist() == [False] and short["rank_ms"].tolist() == [6.0]


def test_workers_cover_both_the_cache_and_the_device_time() -> None:
    shape = ModelShape(2, 2, 16, 16, torch.float32, 8192)
    lengths = np.full(100, 1000)
    worker = WorkerShape(
        device_bytes=10 << 20, host_bytes=50 << 20, disk_bytes=100 << 20, max_utilisation=0.5
    )
    plan = capacity_plan(shape, LATENCY, lengths, _workload(qps=1.0), worker)
    exact = plan["formats"]["exact"]
    per_user = -(-1000 // 32) * 32 * (2 * 2 * (16 + 16) * 4 + 8)  # whole pages of 32 tokens
    assert exact["bytes_per_cached_user"]["device"] == per_user == shape.device_bytes(1000)
    assert exact["bytes_per_cached_user"]["host"] == shape.token_bytes("exact") * 1000
    assert exact["users_per_gb"]["device"] == pytest.approx(1e9 / per_user)
    assert exact["workers_for_cache"] == math.ceil(900 / exact["cached_users_per_worker"])
    int8 = plan["formats"]["int8"]
    assert int8["workers_for_cache"] < exact["workers_for_cache"]  # a smaller cold form holds more
    # device time: 1 req/s, 10 % misses of a 992-event pre-inference + the relay ranking
    assert plan["preinfer_device_ms_per_s"] == pytest.approx(0.1 * 0.5 * 992)
    assert plan["workers_for_device_time"] == math.ceil((0.1 * 0.5 * 992 + 0.5 * 24) / 500)


@pytest.mark.parametrize("fmt", COLD_FORMATS)
def test_planned_bytes_are_what_the_store_accounts(tmp_path, fmt: str) -> None:
    torch.manual_seed(3)
    model = HSTURanker(HSTUConfig(num_items=50, layers=2, heads=2, dim=32, attn_dim=16, linear_dim=8))
    shape = ModelShape.of(model.config)
    lengths = lognormal_lengths(60, 200, cap=shape.max_seq_len, points=12)
    gen = torch.Generator().manual_seed(0)
    histories = [
        Events(
            torch.randint(1, 51, (int(n),), generator=gen),
            torch.randint(1, 6, (int(n),), generator=gen),
            torch.arange(int(n), dtype=torch.float64) * 60.0 + 1e9,
        )
        for n in lengths
    ]
    prefixes = [ModelRunner(model).prefill(h) for h in histories]
    plan = capacity_plan(shape, LATENCY, lengths, _workload(), WorkerShape(1, 1, 1), (fmt,))
    predicted = plan["formats"][fmt]["bytes_per_cached_user"]
    total = sum(p.nbytes() for p in prefixes)
    tiers = {
        "device": dict(device_budget_bytes=total, host_budget_bytes=0),
        "host": dict(device_budget_bytes=0, host_budget_bytes=total),
        "disk": dict(device_budget_bytes=0, host_budget_bytes=0, disk_path=str(tmp_path / "disk")),
    }
    for tier, budgets in tiers.items():
        cfg = PrefixStoreConfig(cold_kv_format=fmt, persist_on_close=False, **budgets)
        with PrefixStore(cfg, model.model_version) as store:
            for i, p in enumerate(prefixes):
                assert store.put(i, p) == tier
            store.flush()
            m = store.metrics()
        measured = m[f"bytes_{tier}"] / m[f"entries_{tier}"]
        if tier == "disk":  # each tensor's 64-byte alignment pad depends on its length
            tensors = 2 * shape.layers + 2 + (2 * shape.layers if fmt == "int8" else 0)
            assert abs(measured - predicted[tier]) <= 64 * tensors
        else:
            assert measured == pytest.approx(predicted[tier], rel=1e-12)


def test_plan_command_prints_one_json_line(model_dir, capsys, tmp_path) -> None:
    from relaygr.cli import main

    load = ["--users", "100000", "--qps", "200", "--history-p50", "500", "--history-p99", "5000"]
    fit_only = tmp_path / "calibration.json"  # its own: a demo may have calibrated the shared model
    LatencyModel(1.0, 0.01, 0.0).save(fit_only)
    rc = main(["plan", *load, "--model", str(model_dir), "--calibration", str(fit_only), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    formats = out["plan"]["formats"]
    assert set(formats) == set(COLD_FORMATS)
    host_x = (
        formats["exact"]["bytes_per_cached_user"]["host"] / formats["int8"]["bytes_per_cached_user"]["host"]
    )
    assert host_x > 2.5 and out["latency_model"]["paces_measured"] is False
    assert all(f["workers"] >= 1 for f in formats.values())
    with pytest.raises(SystemExit):
        main(
            [
                "plan",
                "--users",
                "1",
                "--qps",
                "1",
                "--history-p50",
                "10",
                "--history-p99",
                "5",
                "--model",
                str(model_dir),
            ]
        )
