"""Producers that are not ours, against the real broker and a pipeline with two ranking workers.

Behaviours and requests come from confluent-kafka (librdkafka) with its default settings — its
partitioner hashes keys with CRC32, not the murmur2 of the cascade — and from a producer that
writes each record to a random partition. Histories are real MovieLens users' (tens to hundreds
of events, sent as one burst), with item ids the model has never seen appended. Every request of
a user with history is ranked with all of it, relay rankings use the prefix their own worker
pre-inferred, and a request produced right after its behaviours (no pause) still sees them all.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from pathlib import Path

import pytest

from relaygr.infra.kafka import delete_topics_with_prefix, ensure_topics
from relaygr.schemas import TopicRegistry
from relaygr.tools.barriers import wait_groups_caught_up
from relaygr.tools.pipeline import Pipeline
from relaygr.tools.traffic import collect_results
from relaygr.workers.training.movielens import load_movielens

confluent_kafka = pytest.importorskip("confluent_kafka")

pytestmark = [pytest.mark.broker, pytest.mark.slow(seconds=40)]

UNSEEN_ITEMS = 5  # item ids far beyond the catalogue, appended to every history


@pytest.fixture(scope="module")
def movielens():
    return load_movielens("ml-100k")


@pytest.fixture(scope="module")
async def deployment(kafka_settings, tmp_path_factory, model_dir):
    prefix = f"foreign-{uuid.uuid4().hex[:8]}"
    settings = kafka_settings.model_copy(
        update={"topic_prefix": prefix, "home": tmp_path_factory.mktemp("home-foreign"), "partitions": 4}
    )
    reg = TopicRegistry(prefix, 4)
    await ensure_topics(reg, settings)
    env = {
        "RELAYGR_MODEL_DIR": str(model_dir),
        "RELAYGR_CALIBRATION_FILE": str(model_dir / "calibration.json"),
        "RELAYGR_MODE": "relay",
        "RELAYGR_BUDGET_MS": "30000",  # no deadline pressure: this is about which events are seen
        "RELAYGR_MAX_TASK_IDLE_MS": "60000",  # alignment is tested by counts, never by a clock
        "RELAYGR_THETA": "0.000001",  # every user with history is at risk: exercise the relay path
        "RELAYGR_SHORT_TERM": "8",
    }
    pipe = Pipeline(settings, ranking_workers=2, env=env, metrics=True)
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        yield settings, reg, pipe
    finally:
        pipe.stop()
        await delete_topics_with_prefix(settings, prefix)


def _producer(settings):
    # librdkafka with its defaults: only where the broker is.
    return confluent_kafka.Producer({"bootstrap.servers": settings.bootstrap})


def _behaviours(ml, users: list[int], tag: str) -> dict[str, list[dict]]:
    """Per user id: a real history plus UNSEEN_ITEMS events with ids the model has never seen."""
    out = {}
    for u in users:
        h = ml.histories[u]
        uid = f"{tag}-{u}"
        evs = [
            {"user_id": uid, "item_id": int(i), "ts": float(t), "action": int(a)}
            for i, a, t in zip(h.item_ids.tolist(), h.action_ids.tolist(), h.timestamps.tolist(), strict=True)
        ]
        last = evs[-1]["ts"]
        evs += [
            {"user_id": uid, "item_id": 900_000_000 + 7 * k + u, "ts": last + 1 + k, "action": 1}
            for k in range(UNSEEN_ITEMS)
        ]
        out[uid] = evs
    return out


def _request(uid: str) -> tuple[str, bytes]:
    rid = f"{uid}-{uuid.uuid4().hex[:6]}"
    body = {"request_id": rid, "user_id": uid, "ts": time.time(), "num_candidates": 32, "top_k": 10}
    return rid, json.dumps(body).encode()


def _produce(prod, topic: str, key: str, value: bytes, partition: int | None) -> None:
    kw = {} if partition is None else {"partition": partition}
    while True:
        try:
            prod.produce(topic, value=value, key=key.encode(), **kw)
            return
        except BufferError:  # librdkafka's local queue is full: let it drain
            prod.poll(0.05)


def _send(
    settings, reg, histories, *, random_partitions: bool, requests_right_after: bool = False, before=None
):
    """Produce every history as one burst (interleaved across users, as a live stream would be),
    after the histories ``before`` (a backlog of other users); returns the producer and the
    partition chooser."""
    rng = random.Random(5)
    prod = _producer(settings)
    part = (lambda: rng.randrange(reg.partitions)) if random_partitions else (lambda: None)
    for evs in (before or {}).values():
        for ev in evs:
            _produce(prod, reg.name("behaviors"), ev["user_id"], json.dumps(ev).encode(), part())
    streams = [list(evs) for evs in histories.values()]
    while any(streams):
        for s in streams:
            for ev in s[:7]:
                _produce(prod, reg.name("behaviors"), ev["user_id"], json.dumps(ev).encode(), part())
            del s[:7]
    if not requests_right_after:
        assert prod.flush(60) == 0
    return prod, part


def _request_all(prod, reg, histories, part) -> dict[str, str]:
    sent = {}
    for uid in histories:
        rid, body = _request(uid)
        _produce(prod, reg.name("requests"), uid, body, part())
        sent[rid] = uid
    assert prod.flush(60) == 0
    return sent


def _prefill_workers(settings) -> dict[str, str]:
    out = {}
    for f in Path(settings.home, "workers").glob("*/events.jsonl"):
        for line in f.read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "prefill":
                out[e["request_id"]] = e["worker_id"]
    return out


async def _ranked_with_whole_histories(settings, reg, histories, sent) -> dict:
    results = await collect_results(settings, reg, set(sent), timeout_s=240)
    assert set(results) == set(sent)
    for rid, uid in sent.items():
        res = results[rid]
        assert res.user_id == uid
        assert res.history_len == len(histories[uid]), (uid, res.history_len, len(histories[uid]), res.path)
        assert res.history_complete
    return results


def _relay_on_its_own_worker(settings, results) -> None:
    relay = [r for r in results.values() if r.path.value.startswith("relay")]
    assert len(relay) >= len(results) // 2, sorted(r.path.value for r in results.values())
    prefill_by = _prefill_workers(settings)
    for res in relay:
        assert res.prefix_worker_id == res.worker_id
        if res.request_id in prefill_by:
            assert prefill_by[res.request_id] == res.worker_id
    assert len({r.worker_id for r in results.values()}) == 2


async def test_librdkafka_default_partitioner(deployment, movielens) -> None:
    settings, reg, pipe = deployment
    histories = _behaviours(movielens, list(range(1, 21)), "crc")
    prod, part = _send(settings, reg, histories, random_partitions=False)
    await wait_groups_caught_up(settings, reg)
    sent = _request_all(prod, reg, histories, part)
    results = await _ranked_with_whole_histories(settings, reg, histories, sent)
    _relay_on_its_own_worker(settings, results)
    # CRC32 put some users elsewhere than the cascade's partitioner would: counted, and harmless.
    misrouted = pipe.scrape("ingress-behaviors")
    assert misrouted.value("relaygr_ingress_misrouted_total", topic=reg.name("behaviors")) > 0


async def test_random_partitions(deployment, movielens) -> None:
    settings, reg, _ = deployment
    histories = _behaviours(movielens, list(range(21, 41)), "rnd")
    prod, part = _send(settings, reg, histories, random_partitions=True)
    await wait_groups_caught_up(settings, reg)
    sent = _request_all(prod, reg, histories, part)
    results = await _ranked_with_whole_histories(settings, reg, histories, sent)
    _relay_on_its_own_worker(settings, results)


# Whether the requests may wait out the backlog depends on how fast the cascade drains it within
# their deadline: the stages must have the CPU to themselves.
@pytest.mark.alone
async def test_request_right_after_its_behaviours_sees_them_all(deployment, movielens) -> None:
    settings, reg, pipe = deployment
    histories = _behaviours(movielens, list(range(41, 61)), "now")
    backlog = _behaviours(movielens, list(range(61, 400)), "backlog")  # ~35k events of other users
    # No flush, no pause: the requests follow the behaviours in the same producer's queue, on
    # random partitions, behind a backlog, so they race the burst through the cascade (and win
    # it: the ingress forwards requests at once, behaviours in turn).
    prod, part = _send(
        settings, reg, histories, random_partitions=True, requests_right_after=True, before=backlog
    )
    sent = _request_all(prod, reg, histories, part)
    await _ranked_with_whole_histories(settings, reg, histories, sent)
    metrics = {name: pipe.scrape(name) for name in ("ranker-0", "ranker-1")}
    assert all(m.value("relaygr_rank_history_incomplete_total") == 0 for m in metrics.values())
    # The backlog measured the ingress's forward rate, and its progress records told the workers
    # (a request behind a backlog too long for its deadline would not wait for it).
    assert pipe.scrape("ingress-behaviors").value("relaygr_ingress_forward_rate") > 0
    assert all(m.value("relaygr_rank_ingress_forward_rate") > 0 for m in metrics.values())
