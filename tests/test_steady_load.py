"""Returning users reach the relay path: admitted pre-inference is finished, not dropped.

A real broker, two ranking workers, eight users with a few hundred behaviours each and three
visits each, all from confluent-kafka with its default settings (a producer that is not ours:
librdkafka's CRC32 partitioner). The first visits come as one burst, so that pre-inference backs
up; the second and third come once the first visits are answered and their pre-inferences have
ended. Counts only: every request answered once, no admitted pre-inference dropped, every
returning visit served from the prefix a previous visit computed (on the relay path, under a
budget no ranking misses; from the signal's cache hit, under a budget every request misses, so
that each first visit's pre-inference is late), and the workers' reports (worker-stats topic)
say what was admitted and finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import pytest

from relaygr.infra.kafka import delete_topics_with_prefix, ensure_topics
from relaygr.schemas import TopicRegistry
from relaygr.tools.experiment.scenarios.steady_load import await_prefills, visit_figures, visit_of, visit_plan
from relaygr.tools.long_users import long_users
from relaygr.tools.pipeline import Pipeline
from relaygr.tools.report.inputs import pre_inference_counts, read_admitted_ids, read_worker_stats
from relaygr.tools.sender import send_paced
from relaygr.tools.traffic import count_results, publish
from relaygr.workers.training.movielens import load_movielens

pytest.importorskip("confluent_kafka")

pytestmark = [pytest.mark.broker, pytest.mark.slow(seconds=75)]

USERS, EVENTS, VISITS = 8, 300, 3
LATE_EVENTS = 1500  # the histories whose pre-inference is made late


# Budgets: one no ranking can miss (paths are decided by the cache alone), and one every request
# misses (each ranking goes ahead without its pre-inference, which is then late).
GENEROUS_MS, MISSED_MS = "30000", "0.001"


@contextlib.asynccontextmanager
async def _deployment(kafka_settings, home: Path, model_dir: Path, budget_ms: str):
    prefix = f"steady-{uuid.uuid4().hex[:8]}"
    settings = kafka_settings.model_copy(update={"topic_prefix": prefix, "home": home, "partitions": 4})
    reg = TopicRegistry(prefix, 4)
    await ensure_topics(reg, settings)
    env = {
        "RELAYGR_MODEL_DIR": str(model_dir),
        "RELAYGR_CALIBRATION_FILE": str(model_dir / "calibration.json"),
        "RELAYGR_MODE": "relay",
        "RELAYGR_BUDGET_MS": budget_ms,
        "RELAYGR_MAX_TASK_IDLE_MS": "60000",  # alignment is tested by counts, never by a clock
        "RELAYGR_THETA": "0.000001",  # every user with history is at risk: each visit is admitted
        "RELAYGR_STATS_INTERVAL_S": "0.5",
        "RELAYGR_TOO_LONG_WINDOW_FACTOR": "0",  # a missed budget is no reason to refuse here
    }
    if budget_ms == MISSED_MS:  # pre-inference in many small chunks: it is still running when
        env |= {"RELAYGR_PREFILL_CHUNK": "16", "RELAYGR_DEVICE_SLICE_MS": "0"}  # its ranking comes
    pipe = Pipeline(settings, ranking_workers=2, env=env, metrics=True)
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        yield settings, reg
    finally:
        pipe.stop()
        await delete_topics_with_prefix(settings, prefix)


@pytest.fixture(scope="module")
async def generous(kafka_settings, tmp_path_factory, model_dir):
    home = tmp_path_factory.mktemp("home-steady")
    async with _deployment(kafka_settings, home, model_dir, GENEROUS_MS) as dep:
        yield dep


@pytest.fixture(scope="module")
async def missed(kafka_settings, tmp_path_factory, model_dir):
    home = tmp_path_factory.mktemp("home-late")
    async with _deployment(kafka_settings, home, model_dir, MISSED_MS) as dep:
        yield dep


async def _visits(settings, reg, plan, qps):
    sent = await asyncio.to_thread(send_paced, settings, reg.name("requests"), plan, qps, "librdkafka")
    ids = {r.request_id for r in sent}
    results, counts = await count_results(settings, reg, ids, timeout_s=240.0)
    admitted = await read_admitted_ids(settings, reg.name("prefill"), ids, progress=False)
    prefills = await await_prefills(Path(settings.home), admitted, timeout_s=240.0)
    return sent, results, counts, admitted, prefills


async def _reports_covering(settings, reg, finished: int, timeout_s: float = 60.0) -> dict[str, float]:
    """The workers' summed pre-inference counts, once their reports cover ``finished`` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pre_inference_counts(await read_worker_stats(settings, reg.name("worker_stats")))
        if got["finished"] + got["cached"] >= finished or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.5)


async def test_returning_visits_are_served_from_the_prefix_a_previous_visit_computed(generous) -> None:
    settings, reg = generous
    behaviours, requests = long_users(load_movielens("ml-100k"), USERS, EVENTS, tag="roll")
    await publish(settings, reg, behaviours, [], wait_for_ingest=True, settle_s=0)
    plan = visit_plan(requests, VISITS, "steady")
    first = [r for r in plan if visit_of(r.request_id) == 1]
    later = [r for r in plan if visit_of(r.request_id) > 1]

    # First visits as one burst: their pre-inferences queue behind the rankings.
    sent1, res1, counts1, admitted1, prefills1 = await _visits(settings, reg, first, None)
    one = visit_figures(sent1, res1, counts1, admitted1, prefills1, float(GENEROUS_MS))
    assert one["lost"] == 0 and one["duplicated"] == 0
    assert one["prefill"]["admitted"] == USERS
    assert one["prefill"]["dropped"] == 0 and one["prefill"]["no_outcome"] == 0, prefills1
    assert one["prefill"]["finished"] == USERS  # each user's prefix computed once

    # The second and third visits together: each finds its user's prefix cached.
    sent2, res2, counts2, admitted2, prefills2 = await _visits(settings, reg, later, 8.0)
    two = visit_figures(sent2, res2, counts2, admitted2, prefills2, float(GENEROUS_MS))
    assert two["lost"] == 0 and two["duplicated"] == 0
    assert two["returning_on_relay"] == len(later), two["relay_by_visit"]
    for r in res2.values():
        assert r.prefix_tier in ("device", "host", "disk"), (r.request_id, r.path, r.prefix_tier)
        assert r.prefix_len >= EVENTS - 64
    assert two["prefill"]["finished"] == 0  # nothing computed twice
    assert two["prefill"]["dropped"] == 0

    reports = await _reports_covering(settings, reg, USERS + len(admitted2))
    assert reports["dropped"] == 0
    assert reports["finished"] == USERS
    assert reports["admitted"] == reports["finished"] + reports["cached"]
    assert 0 < reports["prefill_device_share"] < 1


async def test_a_burst_of_every_visit_computes_each_prefix_once_and_ranks_every_visit_on_relay(
    generous,
) -> None:
    # Every visit of fresh users at once, as one burst: a user's later visits come while its first
    # visit's pre-inference is still queued. They are admitted too (joining it, at no cost in the
    # trigger's bounds), their signals join that computation in the worker's store, and every
    # visit ranks against the one prefix (under a budget no ranking misses).
    settings, reg = generous
    behaviours, requests = long_users(load_movielens("ml-100k"), 2 * USERS, EVENTS, tag="roll")
    fresh = {r.user_id for r in requests[USERS:]}
    behaviours = [
        b.model_copy(update={"user_id": f"{b.user_id}-b"}) for b in behaviours if b.user_id in fresh
    ]
    requests = [
        r.model_copy(update={"user_id": f"{r.user_id}-b", "request_id": f"{r.request_id}-b"})
        for r in requests[USERS:]
    ]
    await publish(settings, reg, behaviours, [], wait_for_ingest=True, settle_s=0)
    plan = visit_plan(requests, VISITS, "burst")
    sent, res, counts, admitted, prefills = await _visits(settings, reg, plan, None)
    got = visit_figures(sent, res, counts, admitted, prefills, float(GENEROUS_MS))
    assert got["lost"] == 0 and got["duplicated"] == 0
    assert got["timeouts"] == 0
    assert got["prefill"]["admitted"] == len(plan)  # the later visits joined, none refused
    assert got["prefill"]["finished"] == USERS, prefills  # each user's prefix computed once
    assert got["prefill"]["dropped"] == 0 and got["prefill"]["no_outcome"] == 0
    assert got["returning_on_relay"] == got["returning"] == (VISITS - 1) * USERS, got["relay_by_visit"]
    for r in res.values():
        assert r.prefix_len >= EVENTS - 64, (r.request_id, r.path, r.prefix_len)


async def test_a_pre_inference_its_ranking_went_ahead_without_finishes_for_the_next_visits(missed) -> None:
    # Every request misses its deadline, so no ranking waits for its pre-inference: the first
    # visits' pre-inferences are late while several are queued (the shedding policy,
    # RELAYGR_ABANDON_BACKLOG=0, drops them there and fails this test). They finish, and the next
    # visits' signals find every prefix cached.
    settings, reg = missed
    behaviours, requests = long_users(load_movielens("ml-100k"), USERS, LATE_EVENTS, tag="roll")
    await publish(settings, reg, behaviours, [], wait_for_ingest=True, settle_s=0)
    plan = visit_plan(requests, VISITS, "late")
    first = [r for r in plan if visit_of(r.request_id) == 1]
    sent1, res1, counts1, admitted1, prefills1 = await _visits(settings, reg, first, None)
    one = visit_figures(sent1, res1, counts1, admitted1, prefills1, float(MISSED_MS))
    assert one["lost"] == 0 and one["duplicated"] == 0
    assert one["timeouts"] == USERS  # answered past their deadline, none ranked
    assert one["prefill"]["admitted"] == USERS and one["prefill"]["no_outcome"] == 0
    assert one["prefill"]["dropped"] == 0, prefills1
    assert one["prefill"]["finished"] == USERS

    later = [r for r in plan if visit_of(r.request_id) > 1]
    sent2, res2, counts2, admitted2, prefills2 = await _visits(settings, reg, later, None)
    two = visit_figures(sent2, res2, counts2, admitted2, prefills2, float(MISSED_MS))
    assert two["lost"] == 0 and two["duplicated"] == 0
    assert two["prefill"]["finished"] == 0 and two["prefill"]["dropped"] == 0
    assert two["prefill"]["cached"] == len(admitted2) == len(later)

    reports = await _reports_covering(settings, reg, USERS + len(admitted2))
    assert reports["dropped"] == 0 and reports["finished"] == USERS
