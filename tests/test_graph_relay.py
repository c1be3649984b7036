"""Bucketed relay rankings that read the cached prefixes in place from the pages (``graph_relay``,
``graph_runner``, ``kv_pages``): the same scores and grown prefixes as the eager relay path and as
full ranking, padding included; each prefix read where it lies, its grown events written after it;
the buckets' rows taken and given back; and the captured forward's guarantees (the same buffers
every run, no transfer, an operation count independent of the prefix length), checked on the CPU
twin."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_model_relay import NUM_ITEMS, history  # histories with unknown ids, 40 items

from relaygr.bench.launches import count_graphed, on_meta
from relaygr.workers.model.graph_relay import GraphRelay
from relaygr.workers.model.graph_runner import (
    INDEX_BYTES_PER_KEY,
    BucketRunner,
    RelayBucket,
    bucket_for,
    grid_buckets,
)
from relaygr.workers.model.inference import UserRanking
from relaygr.workers.model.model import HSTUConfig, HSTURanker
from relaygr.workers.model.presets import preset
from relaygr.workers.model.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RTOL32 = ATOL32 = 1e-5
BLOCK = 8  # tokens a page
POOL = 2048  # the buckets' prefix capacity; the largest bucket of these tests takes 8 x (64 + 32) rows
PAGES = 4 * POOL  # tokens of the runners' pages: the prefixes and the buckets' rows


def _model(dtype: torch.dtype, seed: int) -> ModelRunner:
    cfg = HSTUConfig(
        num_items=NUM_ITEMS, layers=2, heads=2, dim=16, attn_dim=8, linear_dim=8, attn_block=8,
        candidate_batch=4, dropout=0.0, near_keys=8, far_keys=3.0,
    )  # fmt: skip
    model = HSTURanker(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model = model.to(dtype)
    model.refresh_version()
    return ModelRunner(model.eval(), pool_tokens=PAGES, page_tokens=BLOCK)


@functools.cache
def model32() -> ModelRunner:
    return _model(torch.float32, 1)


@functools.cache
def model64() -> ModelRunner:
    return _model(torch.float64, 2)


def _requests(model: ModelRunner, shapes: list[tuple[int, int, int]], seed: int) -> list[UserRanking]:
    """One request per ``(history, cached, candidates)``; ``cached`` 0: no prefix."""
    out = []
    for i, (n, cached, c) in enumerate(shapes):
        h = history(n, seed + i)
        prefix = model.prefill(h.slice(0, cached)) if cached else None
        cands = torch.randint(-1, NUM_ITEMS + 3, (c,), generator=torch.Generator().manual_seed(seed + 99 + i))
        out.append(UserRanking(prefix, h, cands, float(h.timestamps[-1]) + 30.0 + i))
    return out


def _graphed(model: ModelRunner, requests: list[UserRanking], **kw) -> tuple[list, GraphRelay]:
    relay = model.use_graph_relay(True, prefix_tokens=kw.pop("prefix_tokens", POOL), **kw)
    try:
        return model.rank_users(requests), relay
    finally:
        model.use_graph_relay(False)


def _assert_same(graphed: list, requests: list[UserRanking], model: ModelRunner, rtol: float) -> None:
    eager = model.rank_users(requests)
    for (scores, grow), (e_scores, e_grow), r in zip(graphed, eager, requests, strict=True):
        full = model.rank_full(r.history, r.candidates, r.request_ts)
        assert scores.shape == (len(r.candidates),)
        torch.testing.assert_close(scores, e_scores, rtol=rtol, atol=rtol)
        torch.testing.assert_close(scores, full, rtol=rtol, atol=rtol)
        got, want = grow().dense(), e_grow().dense()
        assert got.length == want.length == len(r.history) and got.fingerprint == want.fingerprint
        for a, b in zip(got.keys + got.values, want.keys + want.values, strict=True):
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)


def test_users_of_different_prefix_lengths_in_one_padded_bucket_score_as_eager_and_full() -> None:
    # Three users (a padded fourth), prefixes of 0, 13 and 61 events (partly filled blocks), 2 to 11
    # new events, 1 to 9 candidates: every kind of padding the bucket has.
    for model, tol in ((model32(), RTOL32), (model64(), 1e-12)):
        requests = _requests(model, [(15, 13, 9), (72, 61, 4), (2, 0, 1)], seed=5)
        graphed, relay = _graphed(model, requests)
        assert relay.counters()["graphed_rankings"] == 1 and relay.counters()["fallbacks"] == 0
        assert list(relay.runners) == [RelayBucket(4, 16, 32)]
        (runner,) = relay.runners.values()
        assert runner.slots == POOL and runner.capacity == 4 * (POOL + 16 + 32)  # one capacity for all
        _assert_same(graphed, requests, model, tol)


@given(
    users=st.lists(
        st.tuples(st.integers(1, 50), st.floats(0, 1), st.integers(0, 12)), min_size=1, max_size=5
    ),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=25, deadline=None)
def test_any_users_in_a_bucket_score_as_the_eager_path(users, seed) -> None:
    model = model32()
    shapes = [(n, int(split * n), c) for n, split, c in users]
    requests = _requests(model, shapes, seed)
    graphed, relay = _graphed(model, requests)
    assert relay.counters()["graphed_rankings"] == 1
    _assert_same(graphed, requests, model, RTOL32)


def test_one_bucket_serves_other_users_on_the_same_buffers() -> None:
    """The runner's buffers keep their addresses from one call to the next (what a replayed graph
    reads and writes), the second call's users score right, not as the first call's, and each
    user's keys are its prefix's own rows in the pages: read where they lie, nothing copied."""
    model = model32()
    relay = model.use_graph_relay(True, prefix_tokens=POOL)
    try:
        first = _requests(model, [(30, 25, 5), (20, 10, 7)], seed=1)
        model.rank_users(first)
        (runner,) = relay.runners.values()
        before = [t.data_ptr() for t in runner.static_buffers()]
        second = _requests(model, [(36, 31, 6), (9, 3, 2)], seed=2)  # the same bucket
        graphed = model.rank_users(second)
        assert list(relay.runners.values()) == [runner]
        assert [t.data_ptr() for t in runner.static_buffers()] == before
        copied = model.pages.counters()["rows_copied"]
        again = model.rank_users(first)
        rows = runner.k_rows.numpy()
        assert rows[:25].tolist() == first[0].prefix.pages.rows().tolist()  # its prefix, in place
        at = 25 + 16 + 32  # after the first user: its prefix and its rows (16 events, 32 candidates)
        assert rows[at : at + 10].tolist() == first[1].prefix.pages.rows().tolist()
        # Ranked (and grown) a second time, each prefix's half-filled last page is copied before
        # the new events are written after it (the first growth wrote there): no other row is.
        assert model.pages.counters()["rows_copied"] - copied == 25 % BLOCK + 10 % BLOCK
    finally:
        model.use_graph_relay(False)
    _assert_same(graphed, second, model, RTOL32)
    _assert_same(again, first, model, RTOL32)


def test_rank_uses_the_bucket_and_rank_full_stays_eager() -> None:
    model = model32()
    (r,) = _requests(model, [(50, 40, 6)], seed=3)
    eager = model.rank(r.prefix, r.history.slice(40), r.candidates, r.request_ts)
    relay = model.use_graph_relay(True, prefix_tokens=POOL)
    try:
        graphed = model.rank(r.prefix, r.history.slice(40), r.candidates, r.request_ts)
        model.rank_full(r.history, r.candidates, r.request_ts)
        assert relay.counters()["graphed_rankings"] == 1
    finally:
        model.use_graph_relay(False)
    torch.testing.assert_close(graphed, eager, rtol=RTOL32, atol=ATOL32)


def test_what_fits_no_bucket_or_no_prefix_capacity_runs_the_eager_path() -> None:
    model = model32()
    too_many_events = _requests(model, [(300, 10, 3)], seed=4)  # 290 new events: over every bucket
    too_long_prefix = _requests(model, [(80, 70, 3)], seed=5)  # 70 cached: over a 64-token capacity
    (dense,) = _requests(model, [(30, 20, 3)], seed=6)
    dense_prefix = UserRanking(dense.prefix.dense(), dense.history, dense.candidates, dense.request_ts)
    for requests in (too_many_events, too_long_prefix, [dense_prefix]):  # a prefix outside the pages too
        graphed, relay = _graphed(model, requests, prefix_tokens=64)
        assert relay.counters()["fallbacks"] == 1 and relay.counters()["graphed_rankings"] == 0
        _assert_same(graphed, requests, model, RTOL32)


def test_new_weights_build_new_runners() -> None:
    model = _model(torch.float32, 7)
    requests = _requests(model, [(20, 12, 4)], seed=6)
    relay = model.use_graph_relay(True, prefix_tokens=POOL)
    try:
        model.rank_users(requests)
        (old,) = relay.runners.values()
        with torch.no_grad():
            model.model.final_norm.weight.mul_(2.0)
        model.rank_users(requests)
        (new,) = relay.runners.values()
        assert new is not old and new.sv is not old.sv
    finally:
        model.use_graph_relay(False)


def test_the_bucket_grids() -> None:
    assert bucket_for(3, 64, 100) == RelayBucket(4, 64, 128)
    assert bucket_for(1, 1, 1) == RelayBucket(1, 16, 32)
    assert bucket_for(17, 1, 1) is None
    assert bucket_for(1, 257, 1) is None
    assert bucket_for(1, 1, 513) is None
    assert len(grid_buckets()) == 5 * 4 * 4
    assert bucket_for(8, 128, 256) == RelayBucket(8, 128, 256)  # the anchor shape, unpadded
    some = grid_buckets(2, 20, 100)
    assert set(some) == {RelayBucket(u, s, c) for u in (1, 2) for s in (16, 64) for c in (32, 128)}
    assert [b.rows for b in some] == sorted(b.rows for b in some)
    with pytest.raises(ValueError, match="past the bucket grids"):
        grid_buckets(1, 1000, 1)


def test_a_ranking_replays_a_graph_only_where_capture_is_on_and_a_bucket_and_its_capacity_hold_it() -> None:
    graphs = GraphRelay(model32(), capture=False, prefix_tokens=POOL)
    assert not graphs.replays(16, 32, 100)  # eager buckets (a CPU): slicing still applies
    graphs.capture = True  # as on CUDA (no capture happens here)
    assert graphs.replays(16, 32, 100) and graphs.replays(16, 32, POOL)
    assert not graphs.replays(16, 32, POOL + 1)  # over the buckets' prefix capacity
    graphs.close()
    small = GraphRelay(model32(), capture=False, prefix_tokens=99)
    small.capture = True
    assert small.replays(16, 32, 104) and not small.replays(16, 32, 105)  # 99 tokens: 13 pages of 8
    small.close()
    assert not graphs.replays(1000, 32, 100)  # past the suffix grid
    graphs.graph_error = "RuntimeError: capture failed"
    assert not graphs.replays(16, 32, 100)  # captures failed: the buckets run eagerly


def test_capture_needs_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        GraphRelay(model32(), capture=True)
    assert model32().use_graph_relay() is None  # default: on for CUDA only


# ------------------------------------------------------------------------------ the buckets' rows
def test_a_dropped_bucket_gives_its_rows_back() -> None:
    model = model32()
    relay = GraphRelay(model, max_buckets=1, prefix_tokens=PAGES)  # no rows beyond: each bucket its own
    model.graph_relay = relay
    try:
        free = model.pages.free_pages
        model.rank_users(_requests(model, [(20, 12, 4)], seed=1))
        model.rank_users(_requests(model, [(20, 12, 40)], seed=1))  # another bucket: the first goes
        assert len(relay.runners) == 1
        assert relay.rows_reserved() == 16 + 128 and model.pages.free_pages == free - (16 + 128) // BLOCK
    finally:
        model.use_graph_relay(False)
    assert model.pages.free_pages == free  # closed: the buckets' rows are back


# ------------------------------------------------------------------------ what a CUDA graph captures
@functools.cache
def _meta(name: str) -> HSTURanker:
    torch.manual_seed(0)
    return on_meta(HSTURanker(preset(name).config(dropout=0.0)).eval())


@pytest.mark.parametrize("name", ["small", "large"])
def test_the_bucketed_forward_has_no_transfer_and_a_count_independent_of_the_prefix(name: str) -> None:
    """On the meta device nothing has a value, so a forward that ran has read nothing back to the
    host (no ``item``, ``tolist`` or ``cpu``); its count is the same at 1k, 8k and 32k events."""
    model = _meta(name)
    counts = []
    for n in (1024, 8192, 32768):
        counter = count_graphed(model, n, 64, 128, users=2)
        assert counter.transfers == 0
        counts.append(counter.total)
    assert len(set(counts)) == 1, counts


# ------------------------------------------------------------------------------ the Triton kernel
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_bucketed_forward_with_the_triton_kernel_scores_as_the_reference(device: str) -> None:
    """``graph_parity.py`` in a subprocess: Triton's interpreter on a CPU (``TRITON_INTERPRET``
    must be set before Triton is imported); on CUDA the captured graph's replay."""
    pytest.importorskip("triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    here = Path(__file__).parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(here), os.environ.get("PYTHONPATH")) if p),
    }
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run(
        [sys.executable, str(here / "graph_parity.py"), device],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["graphed_rankings"] == 1 and report["graph_error"] is None, report
    assert report["captured"] == (device == "cuda")
    assert report["scale"] > 0.1 and report["worst"] <= 1e-5 * report["scale"], report


# ------------------------------------------------------------------------------------ the engine
async def test_a_relay_engine_with_cuda_graphs_ranks_waiting_users_through_a_bucket() -> None:
    """``EngineConfig.cuda_graphs`` on (a CPU: the eager twin): the engine's batched relay rankings
    go through one bucket and score, and grow the stored prefixes, as the eager engine does."""
    from store_probe import resident_prefix
    from synthetic import tiny_model
    from test_relay_batching import engine, prefill_all, rank_while_busy, users

    model, jobs = ModelRunner(tiny_model(3)), users()
    eager = engine(model, batch_tokens=4096)  # cuda_graphs unset: off on a CPU
    assert eager.runner.graph_relay is None
    await prefill_all(eager, jobs)
    want = await rank_while_busy(eager, jobs)
    graphed = engine(model, batch_tokens=4096, cuda_graphs=True, graph_pool_mb=4)
    relay = graphed.runner.graph_relay
    assert relay is not None and not relay.capture
    await prefill_all(graphed, jobs)
    got = await rank_while_busy(graphed, jobs)
    assert relay.counters()["graphed_rankings"] == 1 and relay.counters()["fallbacks"] == 0
    for (uid, h, n, _), res, ref in zip(jobs, got, want, strict=True):
        assert res.path == ref.path == "relay" and res.prefix_len == n
        torch.testing.assert_close(res.scores, ref.scores, rtol=RTOL32, atol=ATOL32)
        mine, theirs = resident_prefix(graphed.store, uid).dense(), resident_prefix(eager.store, uid).dense()
        assert mine.length == theirs.length == len(h)
        for a, b in zip(mine.keys + mine.values, theirs.keys + theirs.values, strict=True):
            torch.testing.assert_close(a, b, rtol=RTOL32, atol=ATOL32)
    for e in (eager, graphed):
        e.scheduler.close()


# ------------------------------------------------------------------------- a capture that fails
def test_a_failed_capture_is_reported_once_and_every_bucket_runs_eagerly(monkeypatch, caplog) -> None:
    model = model32()
    relay = GraphRelay(model, prefix_tokens=POOL)
    relay.capture = True  # as on CUDA; the capture itself fails as a broken one would

    def broken(self, pool=None) -> None:
        self.forward()  # half way: a warm-up ran
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(BucketRunner, "capture", broken)
    model.graph_relay = relay
    try:
        with caplog.at_level(logging.WARNING, logger="relaygr.workers.model.graph_relay"):
            first = _requests(model, [(20, 12, 4), (30, 5, 9)], seed=8)
            other = _requests(model, [(90, 10, 3)], seed=9)  # another bucket: no second capture
            got_first, got_other = model.rank_users(first), model.rank_users(other)
    finally:
        model.use_graph_relay(False)
    assert relay.graph_error == "RuntimeError: operation not permitted when stream is capturing"
    assert not relay.capture and all(r.graph is None for r in relay.runners.values())
    assert len(relay.runners) == 2 and relay.counters()["graphed_rankings"] == 2
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    _assert_same(got_first, first, model, RTOL32)
    _assert_same(got_other, other, model, RTOL32)


def test_bench_model_reports_a_graph_failure_and_keeps_its_eager_columns(monkeypatch) -> None:
    import argparse

    from relaygr.bench.model import graphed_columns

    model = _model(torch.float32, 3)
    (r,) = _requests(model, [(40, 30, 5)], seed=1)
    eager = model.rank(r.prefix, r.history.slice(30), r.candidates, r.request_ts)
    args = argparse.Namespace(repeats=2)
    ok = graphed_columns(model, (r.prefix, r.history.slice(30), r.candidates, r.request_ts), eager, args)
    assert ok["graph_error"] is None and ok["graphed_rankings"] == 3 and ok["relay_graphed_ms_p50"] > 0
    assert ok["graphed_max_abs_diff"] <= 1e-5 and model.graph_relay is None

    def broken(*a, **kw):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(model, "use_graph_relay", broken)
    bad = graphed_columns(model, (r.prefix, r.history.slice(30), r.candidates, r.request_ts), eager, args)
    assert bad["graph_error"] == "RuntimeError: CUDA error: out of memory"
    assert bad["relay_graphed_ms_p50"] is None and model.graph_relay is None


# ------------------------------------------------------------------------------------ the warm-up
def test_warm_up_builds_every_bucket_before_traffic_and_a_ranking_builds_none() -> None:
    model = model32()
    relay = model.use_graph_relay(True, prefix_tokens=2 * POOL)  # the rest of the pages: every bucket's rows
    try:
        report = relay.warm_up(users=2, suffix=20, candidates=100)
        wanted = grid_buckets(2, 20, 100)
        assert list(relay.runners) == wanted and report["buckets"] == len(wanted) == 8
        assert report["left_to_demand"] == 0 and report["seconds"] > 0
        assert report["index_bytes"] == sum(
            b.users * (2 * POOL + b.suffix + b.candidates) for b in wanted
        ) * (INDEX_BYTES_PER_KEY)
        assert report["rows_reserved"] == relay.rows_reserved() > 0
        built = dict(relay.runners)
        requests = _requests(model, [(30, 25, 5), (20, 3, 90)], seed=4)  # bucket (2, 64, 128)
        graphed = model.rank_users(requests)
        assert dict(relay.runners) == built and relay.counters()["graphed_rankings"] == 1
        assert relay.counters()["warm_up"] == report
    finally:
        model.use_graph_relay(False)
    _assert_same(graphed, requests, model, RTOL32)


def test_warm_up_leaves_half_the_pages_to_prefixes() -> None:
    relay = GraphRelay(model32(), prefix_tokens=PAGES)
    report = relay.warm_up()
    assert 0 < report["buckets"] < len(grid_buckets()) and report["left_to_demand"] > 0
    assert report["buckets"] + report["left_to_demand"] == len(grid_buckets())
    assert relay.rows_reserved() <= PAGES // 2
    assert relay.max_buckets >= report["buckets"] == len(relay.runners)
    relay.close()


def test_the_engine_warm_up_builds_the_buckets() -> None:
    from relaygr.workers.engine.calibration import warm_up_work

    model = model32()
    relay = model.use_graph_relay(True, prefix_tokens=POOL)
    try:
        warm_up_work(model, 40, 8, rounds=1, chunk=16)()
        assert relay.warmed is not None and len(relay.runners) == relay.warmed["buckets"] > 0
    finally:
        model.use_graph_relay(False)


# ------------------------------------------------------------------- the shared rows of new tokens
def test_buckets_share_one_reservation_for_their_new_tokens_and_score_right_in_turn() -> None:
    """With rows to spare, every bucket writes its new tokens to one shared run of rows:
    alternating buckets (a second bucket overwrites what the first wrote) still score as the eager
    path and full ranking, and the pages hold that one run of rows only."""
    model = model32()
    shared = POOL - 256  # at most the grid's largest bucket's rows (12,288): here what is allowed
    relay = model.use_graph_relay(True, prefix_tokens=256, rows_tokens=shared)
    try:
        report = relay.warm_up(users=4, suffix=20, candidates=100)
        assert report["left_to_demand"] == 0 and report["rows_reserved"] == shared
        assert all(r.own_run is None for r in relay.runners.values())
        one = _requests(model, [(40, 31, 7)], seed=11)
        three = _requests(model, [(15, 13, 90), (72, 61, 4), (9, 0, 3)], seed=12)
        runs = [(requests, model.rank_users(requests)) for requests in (one, three, one, three)]
        assert relay.counters()["graphed_rankings"] == 4 and relay.counters()["fallbacks"] == 0
        assert relay.rows_reserved() == shared
    finally:
        model.use_graph_relay(False)
    for requests, graphed in runs:
        _assert_same(graphed, requests, model, RTOL32)


def test_a_prefix_capacity_that_fills_the_pages_leaves_no_shared_rows() -> None:
    relay = GraphRelay(model32())  # max_seq_len >= the pages
    assert relay.new_rows is None and relay.rows_reserved() == 0


def test_bench_model_batched_graphed_users_score_as_each_alone_and_a_failure_is_reported(monkeypatch) -> None:
    import argparse

    from relaygr.bench.model import batched_graphed_columns

    model = _model(torch.float32, 4)
    requests = _requests(model, [(40, 32, 5), (35, 32, 9), (50, 32, 2)], seed=6)
    alone = [model.rank_and_extend(r.prefix, r.history, r.candidates, r.request_ts)[0] for r in requests]

    def batched() -> list[torch.Tensor]:
        return [scores for scores, _ in model.rank_users(requests)]

    args = argparse.Namespace(repeats=2)
    ok = batched_graphed_columns(model, batched, alone, 32, args)
    assert ok["graph_error"] is None and ok["batched_graphed_rankings"] == 3  # the capture + 2 timed
    assert ok["batched_graphed_max_abs_diff"] <= 1e-5 and model.graph_relay is None
    assert ok["device_rankings_per_s"] == pytest.approx(
        1000 / ok["batched_graphed_ms_per_request_p50"], rel=0.01
    )

    def broken(*a, **kw):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(model, "use_graph_relay", broken)
    bad = batched_graphed_columns(model, batched, alone, 32, args)
    assert bad["graph_error"] == "RuntimeError: CUDA error: out of memory"
    assert bad["device_rankings_per_s"] is None and model.graph_relay is None
