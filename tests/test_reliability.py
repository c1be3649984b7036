"""Faults against the real broker: a ranking worker killed with SIGKILL, a broker restart, workers
joining and leaving, overload. In every case each request gets a result; nothing is lost."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from pathlib import Path

import pytest
from fault_checks import read_results

from relaygr.infra.kafka import delete_topics_with_prefix, ensure_topics
from relaygr.infra.local import broker
from relaygr.infra.settings import Settings
from relaygr.schemas import TopicRegistry
from relaygr.tools.pipeline import Pipeline
from relaygr.tools.traffic import collect_results, leave_last_out, publish
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.training.movielens import load_movielens

pytestmark = [pytest.mark.broker, pytest.mark.slow]


@pytest.fixture(scope="module")
def ml():
    return load_movielens("ml-100k")


def env(model_dir: Path, **extra: str) -> dict[str, str]:
    return {
        "RELAYGR_MODEL_DIR": str(model_dir),
        "RELAYGR_CALIBRATION_FILE": str(model_dir / "calibration.json"),
        "RELAYGR_BUDGET_MS": "5000",
        "RELAYGR_THETA": "0.0001",
        "RELAYGR_SHORT_TERM": "8",
        **extra,
    }


async def deployment(settings: Settings, tmp_path: Path) -> tuple[Settings, TopicRegistry]:
    prefix = f"rel-{uuid.uuid4().hex[:8]}"
    s = settings.model_copy(update={"topic_prefix": prefix, "home": tmp_path / "home", "partitions": 4})
    reg = TopicRegistry(prefix, 4)
    await ensure_topics(reg, s)
    return s, reg


@pytest.mark.slow(seconds=65)
async def test_sigkill_of_a_ranking_worker_loses_nothing(kafka_settings, tmp_path, model_dir, ml) -> None:
    """`relaygr up`'s supervisor restarts a ranking worker killed with SIGKILL mid-replay; every
    request is answered, and the results read as a table hold one answer per request."""
    s, reg = await deployment(kafka_settings, tmp_path)
    behaviours, requests = leave_last_out(ml, range(1, 161), num_candidates=32)
    pipe = Pipeline(s, ranking_workers=2, env=env(model_dir))
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        await publish(s, reg, behaviours, [])
        sending = asyncio.create_task(publish(s, reg, [], requests, qps=25, settle_s=0.0))
        await asyncio.sleep(2.5)  # requests are flowing
        killed = pipe.crash("ranker-0")  # SIGKILL behind the supervisor's back: no drain, no commit
        sent = await sending
        results = await collect_results(s, reg, {r.request_id for r in sent}, timeout_s=180)
        table, copies = await read_results(s, reg)
        pipe.check()  # one restart is no crash loop: the deployment kept running
        restarted = pipe.procs["ranker-0"].pid
        restarts = dict(pipe.restarts)
    finally:
        pipe.stop()
        await delete_topics_with_prefix(s, s.topic_prefix)
    assert restarts == {"ranker-0": 1} and restarted != killed  # restarted once, by the supervisor
    sent_ids = {r.request_id for r in sent}
    missing = sent_ids - set(results)
    assert not missing, f"{len(missing)} requests without a result"
    assert len(results) == len(sent)
    answered = {rid: r for rid, r in table.items() if rid in sent_ids}
    assert set(answered) == sent_ids  # one answer per request id, none missing
    redelivered = sum(n - 1 for rid, n in copies.items() if rid in sent_ids)
    print(
        f"\nSIGKILL of ranker-0 under `relaygr up`: sent {len(sent)}, answered {len(answered)}, "
        f"restarts {restarts}, result records beyond one per request (at least once) {redelivered}"
    )


@pytest.mark.slow(seconds=45)
async def test_a_pipeline_stopped_past_its_sessions_serves_again_once_resumed(
    kafka_settings, tmp_path, model_dir, ml
) -> None:
    """An experiment stops the pipeline of the mode it does not measure (SIGSTOP): its consumers
    leave their groups meanwhile. Resumed, every stage rejoins and ranks again; none exits."""
    s, reg = await deployment(kafka_settings, tmp_path)
    behaviours, requests = leave_last_out(ml, range(1, 41), num_candidates=32)
    pipe = Pipeline(s, ranking_workers=1, env=env(model_dir))
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        await publish(s, reg, behaviours, requests[:20], qps=20)  # offsets to commit on resume
        pipe.pause()
        await asyncio.sleep(15)  # past the 10 s session timeout of the stages' consumers
        pipe.resume()
        await pipe.wait_ready(timeout_s=240)
        sent = await publish(s, reg, [], requests[20:], qps=20)
        results = await collect_results(s, reg, {r.request_id for r in sent}, timeout_s=120)
        await asyncio.sleep(3)  # a crash on a failed commit would come now
        pipe.check()
    finally:
        pipe.stop()
        await delete_topics_with_prefix(s, s.topic_prefix)
    assert len(results) == len(sent)


@pytest.mark.slow(seconds=100)
async def test_broker_restart_mid_run_loses_nothing(kafka_settings, tmp_path, model_dir, ml) -> None:
    own = Settings(home=tmp_path / "broker-home")  # a broker of this test's own, to restart
    state = broker.start(own, quiet=True)
    try:
        base = own.model_copy(update={"bootstrap": state.bootstrap})
        s, reg = await deployment(base, tmp_path)
        behaviours, requests = leave_last_out(ml, range(1, 81), num_candidates=32)
        half = len(requests) // 2
        pipe = Pipeline(s, ranking_workers=1, env=env(model_dir))
        pipe.start()
        try:
            await pipe.wait_ready(timeout_s=240)
            first = await publish(s, reg, behaviours, requests[:half], qps=20)
            await asyncio.to_thread(broker.restart, own, down_s=3.0)
            second = await publish(s, reg, [], requests[half:], qps=20, settle_s=0.0)
            sent = first + second
            results = await collect_results(s, reg, {r.request_id for r in sent}, timeout_s=180)
            pipe.check()
            restarts = dict(pipe.restarts)
        finally:
            pipe.stop()
        assert set(results) == {r.request_id for r in sent}
        assert not restarts  # no stage died: they reconnected by themselves
    finally:
        broker.stop(own)


@pytest.mark.alone
async def test_rebalance_join_and_leave_falls_back_cleanly(kafka_settings, tmp_path, model_dir, ml) -> None:
    s, reg = await deployment(kafka_settings, tmp_path)
    behaviours, requests = leave_last_out(ml, range(1, 201), num_candidates=32)
    pipe = Pipeline(s, ranking_workers=1, env=env(model_dir, RELAYGR_BUDGET_MS="2000"))
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        await publish(s, reg, behaviours, [])
        # Requests flow (20/s) through the whole membership change, however long a worker takes
        # to start here: each phase ends on an event, not on a clock.
        stop_sending = asyncio.Event()
        sending = asyncio.create_task(_send_until(s, reg, requests, stop_sending))
        await _results_by(s, "ranker-0", at_least=5)
        pipe.start_worker(1)  # joins: half of the partitions move to it
        await _results_by(s, "ranker-1", at_least=5, timeout_s=300)
        pipe.stop_worker(0)  # leaves cleanly: everything moves to worker 1
        await asyncio.sleep(2.0)  # a few more requests after it left
        stop_sending.set()
        sent = await sending
        results = await collect_results(s, reg, {r.request_id for r in sent}, timeout_s=180)
        pipe.check()
    finally:
        pipe.stop()
        await delete_topics_with_prefix(s, s.topic_prefix)
    assert set(results) == {r.request_id for r in sent}, "a request was stuck or lost"
    workers = Counter(r.worker_id for r in results.values())
    assert set(workers) == {"ranker-0", "ranker-1"}
    for r in results.values():
        # A prefix is only ever used on the worker that computed it; otherwise the path says full.
        if r.path.value.startswith("relay"):
            assert r.prefix_worker_id == r.worker_id
        else:
            assert r.path.value in {"full", "full_truncated", "cold_start", "timeout"}
    # Requests that wait in Kafka while their partition moves may miss the 2 s budget: how many
    # depends on how long the rebalance takes here. What must hold is that a miss is explicit:
    # a request is ranked within its budget or answered as a timeout, never ranked late.
    paths = Counter(r.path.value for r in results.values())
    within = sum(r.breakdown_ms["ranking"] <= 2000 for r in results.values()) / len(results)
    explicit = paths["timeout"] / len(results)
    print(f"\nSLO compliance during the rebalance: {within:.1%} of {len(results)}; paths {paths}")
    assert within + explicit >= 0.95, (within, paths)


@pytest.mark.alone
async def test_overload_sheds_prefill_truncates_and_times_out(
    kafka_settings, tmp_path, model_dir, ml
) -> None:
    """3x more requests than the deadline lets the worker serve: bounded queue, explicit timeouts."""
    s, reg = await deployment(kafka_settings, tmp_path)
    behaviours, requests = leave_last_out(ml, range(1, 241), target_len=600, num_candidates=64)
    extra = {
        "RELAYGR_BUDGET_MS": "40",
        "RELAYGR_MAX_INFLIGHT": "4",
        "RELAYGR_PREFILL_RATE_PER_S": "5",
        # A latency model saying long histories are slow: ranking must truncate to meet 40 ms.
        "RELAYGR_CALIBRATION_FILE": str(_slow_calibration(tmp_path)),
    }
    pipe = Pipeline(s, ranking_workers=1, env=env(model_dir, **extra), metrics=True)
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        # The overload is the requests' alone: they go out once every stage has the behaviours.
        sent = await publish(s, reg, behaviours, requests, qps=240, wait_for_ingest=True)
        results = await collect_results(s, reg, {r.request_id for r in sent}, timeout_s=180)
        m_ret, m_rank = pipe.scrape("retrieval"), pipe.scrape("ranker-0")
        pipe.check()
    finally:
        pipe.stop()
        await delete_topics_with_prefix(s, s.topic_prefix)
    assert set(results) == {r.request_id for r in sent}  # answered, if only with a timeout
    paths = Counter(r.path.value for r in results.values())
    # How many requests time out depends on how fast this machine ranks and hops; what each path
    # means does not. A timeout came after its deadline and still lists the candidates; a full
    # ranking says whether it was cut to the budget (the slow latency model makes 600 events
    # too many for 40 ms; truncation itself is tested on the engine).
    budget_ms = 40.0
    for r in results.values():
        if r.path.value == "timeout":
            assert len(r.items) > 0  # candidates in retrieval order rather than silence
            assert r.breakdown_ms["ranking"] >= budget_ms - 1.0, r.breakdown_ms
        elif r.path.value.startswith("full"):
            assert (r.path.value == "full_truncated") == (r.used_len < r.history_len), r
    # Overload, measured: when ranking every request takes the device longer than the requests
    # took to arrive (plus the budget), deadlines must pass, and those requests time out.
    ranked = [r for r in results.values() if r.path.value != "timeout"]
    if ranked:
        device_ms = sum(r.breakdown_ms.get("compute", 0.0) for r in ranked) / len(ranked) * len(results)
        arrival_ms = (max(r.ts for r in sent) - min(r.ts for r in sent)) * 1000 + budget_ms
        if device_ms > 2 * arrival_ms:
            assert paths["timeout"] > 0, (paths, device_ms, arrival_ms)
    assert m_ret.value("relaygr_trigger_decisions_total", reason="rate_bound") > 0  # pre-inference shed first
    assert m_rank.value("relaygr_rank_inflight_peak") <= 4 + 1  # the bounded queue (+1 dead-letter slot)
    # Every timeout result is counted (a request redelivered after a rebalance under this load is
    # answered, and counted, again; the results topic keeps one answer per request).
    assert m_rank.value("relaygr_rank_results_total", path="timeout") >= paths["timeout"]


async def _send_until(s: Settings, reg, requests: list, stop: asyncio.Event) -> list:
    """Publish ``requests`` at 20/s, round after round (fresh request ids), until ``stop``."""
    sent: list = []
    rounds = 0
    while not stop.is_set():
        batch = [r.model_copy(update={"request_id": f"{r.request_id}-r{rounds}"}) for r in requests[:20]]
        requests = requests[20:] + requests[:20]
        sent += await publish(s, reg, [], batch, qps=20, settle_s=0.0)
        rounds += 1
    return sent


async def _results_by(s: Settings, worker: str, at_least: int, timeout_s: float = 120.0) -> None:
    """Wait until ``worker`` has published ``at_least`` results (from its own event log)."""
    log = Path(s.home) / "workers" / s.topic_prefix / worker / "events.jsonl"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if log.exists() and log.read_text().count('"event": "result"') >= at_least:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{worker} published fewer than {at_least} results in {timeout_s:.0f} s")


def _slow_calibration(tmp_path: Path) -> Path:
    p = tmp_path / "slow.json"
    LatencyModel(2.0, 0.1, 0.0).save(p)  # 600 tokens -> 62 ms > 40 ms budget
    return p
