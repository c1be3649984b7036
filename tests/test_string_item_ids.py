"""String item ids end to end: a generated shop log with ids like "sku-00017", written as CSV and
as Parquet, trains a tiny ranker through `relaygr train --interactions` (evaluated, its vocabulary
in the checkpoint), and the pipeline serves that model on the real broker to a producer that is
not ours (confluent-kafka, librdkafka defaults) sending string ids, some of which the model has
never seen.

Both formats give the same log, so with the same seed they give the same checkpoint (asserted:
vocabulary and every weight), and one deployment serving it serves both. The results name items
by catalogue strings, echo the labels as sent, and count the never-seen ids of each served history
(``unknown_history``, and ``relaygr_rank_unknown_items_total``); a behaviour or a request with an
invalid item id goes to the dead-letter topic with its reason while the stages keep serving.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path

import pytest
import torch
from synthetic import write_csv, write_parquet

from relaygr.cli import main
from relaygr.infra.kafka import delete_topics_with_prefix, ensure_topics
from relaygr.schemas import DeadLetter, RankedResult, TopicRegistry, decode
from relaygr.tools.pipeline import Pipeline
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.model.model import HSTURanker

confluent_kafka = pytest.importorskip("confluent_kafka")

pytestmark = [pytest.mark.broker]

CATALOGUE = [f"sku-{i:05d}" for i in range(40)]
TINY = ["--layers", "1", "--heads", "1", "--dim", "16", "--epochs", "1", "--max-steps", "2", "--threads", "1"]
COLS = ["--user-col", "uid", "--item-col", "sku", "--time-col", "when", "--action-col", "kind"]
T0 = 1_600_000_000


def shop_log(users: int = 16, events: int = 12) -> list[dict]:
    """Each user walks through a stretch of the catalogue."""
    return [
        {
            "uid": f"user-{u}",
            "sku": CATALOGUE[(5 * u + 3 * j) % len(CATALOGUE)],
            "when": T0 + 100 * u + j,
            "kind": 1 + j % 3,
        }
        for u in range(users)
        for j in range(events)
    ]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The log trained once per format with `relaygr train --interactions`."""
    root = tmp_path_factory.mktemp("string-ids")
    rows = shop_log()
    out = {}
    for fmt, write in (("csv", write_csv), ("parquet", write_parquet)):
        log = write(root / f"shop.{fmt}", rows)
        ck = root / f"model-{fmt}"
        assert main(["train", "--interactions", str(log), "--out", str(ck), *COLS, *TINY]) == 0
        LatencyModel(1.0, 0.01, 0.0).save(ck / "calibration.json")  # workers skip calibration
        out[fmt] = ck
    return out


def test_both_formats_train_evaluate_and_give_the_same_checkpoint(checkpoints) -> None:
    models = {fmt: HSTURanker.load(ck) for fmt, ck in checkpoints.items()}
    for fmt, ck in checkpoints.items():
        metrics = json.loads((ck / "metrics.json").read_text())
        assert metrics["items"] == len(CATALOGUE) and metrics["users"] == 16 and metrics["bad_rows"] == 0
        assert metrics["by_history_length"], fmt  # evaluated
        assert models[fmt].vocab.raw_ids() == CATALOGUE
    a, b = (m.state_dict() for m in models.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
async def deployment(kafka_settings, tmp_path_factory, checkpoints):
    prefix = f"strids-{uuid.uuid4().hex[:8]}"
    settings = kafka_settings.model_copy(
        update={"topic_prefix": prefix, "home": tmp_path_factory.mktemp("home-strids"), "partitions": 2}
    )
    reg = TopicRegistry(prefix, 2)
    await ensure_topics(reg, settings)
    model = checkpoints["parquet"]  # the CSV one is the same checkpoint (the test above)
    env = {
        "RELAYGR_MODEL_DIR": str(model),
        "RELAYGR_CALIBRATION_FILE": str(model / "calibration.json"),
        "RELAYGR_BUDGET_MS": "30000",  # no deadline pressure: this is about which ids are seen
        "RELAYGR_MAX_TASK_IDLE_MS": "60000",  # histories complete by counts, never by a clock
    }
    pipe = Pipeline(settings, ranking_workers=1, env=env, metrics=True)
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        yield settings, reg, pipe
    finally:
        pipe.stop()
        await delete_topics_with_prefix(settings, prefix)


def _produce(prod, topic: str, key: str, doc: dict) -> None:
    while True:
        try:
            prod.produce(topic, value=json.dumps(doc).encode(), key=key.encode())
            return
        except BufferError:  # librdkafka's local queue is full: let it drain
            prod.poll(0.05)


def _consume(settings, topic: str, done, timeout_s: float = 240.0) -> list:
    """Messages of ``topic`` from its start until ``done(messages)`` (a bound, not a measurement)."""
    cons = confluent_kafka.Consumer(
        {
            "bootstrap.servers": settings.bootstrap,
            "group.id": f"t-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
        }
    )
    cons.subscribe([topic])
    got: list = []
    try:
        deadline = time.monotonic() + timeout_s
        while not done(got) and time.monotonic() < deadline:
            m = cons.poll(0.5)
            if m is not None and m.error() is None:
                got.append(m)
    finally:
        cons.close()
    return got


async def test_string_ids_are_served_and_unknown_ones_counted(deployment) -> None:
    settings, reg, pipe = deployment
    prod = confluent_kafka.Producer({"bootstrap.servers": settings.bootstrap})
    # Invalid ids first: dead-lettered with their reason, and nothing after them is held up.
    now = time.time()
    bad_behaviour = {"user_id": "shopper-bad", "item_id": "", "ts": now - 10}
    bad_request = {"request_id": "bad-label", "user_id": "shopper-bad", "ts": now, "label_item_id": 3.5}
    _produce(prod, reg.name("behaviors"), "shopper-bad", bad_behaviour)
    _produce(prod, reg.name("requests"), "shopper-bad", bad_request)
    # Shoppers: catalogue items, then 0..3 ids the model has never seen (one user has only those).
    histories: dict[str, list[str]] = {}
    for s in range(6):
        known = [CATALOGUE[(7 * s + j) % len(CATALOGUE)] for j in range(0 if s == 5 else 6 + s)]
        unseen = [f"sku-new-{s}-{j}" for j in range(s % 4)] + (["sku-new-only"] if s == 5 else [])
        histories[f"shopper-{s}"] = known + unseen
    for uid, items in histories.items():
        for j, item in enumerate(items):
            _produce(
                prod, reg.name("behaviors"), uid, {"user_id": uid, "item_id": item, "ts": T0 + j, "action": 1}
            )
    assert prod.flush(60) == 0
    labels = {uid: (CATALOGUE[3] if i % 2 else f"sku-never-{i}") for i, uid in enumerate(histories)}
    sent = {}
    for uid in histories:
        rid = f"{uid}-{uuid.uuid4().hex[:6]}"
        req = {"request_id": rid, "user_id": uid, "ts": time.time(), "num_candidates": 16, "top_k": 5}
        _produce(prod, reg.name("requests"), uid, {**req, "label_item_id": labels[uid]})
        sent[rid] = uid
    assert prod.flush(60) == 0

    def answered(msgs) -> bool:
        return set(sent) <= {decode(RankedResult, m.value()).request_id for m in msgs}

    results = {}
    for m in _consume(settings, reg.name("results"), answered):
        r = decode(RankedResult, m.value())
        if r.request_id in sent:
            results[r.request_id] = r
    assert set(results) == set(sent)
    for rid, r in results.items():
        uid = sent[rid]
        items = histories[uid]
        unseen = [i for i in items if i not in CATALOGUE]
        assert r.user_id == uid and r.history_complete
        assert r.history_len == len(items)
        assert r.unknown_history == len(unseen), (uid, r.unknown_history, unseen)
        assert r.unknown_candidates == 0  # retrieval answers from the catalogue
        assert r.items and all(isinstance(it.item_id, str) and it.item_id in CATALOGUE for it in r.items)
        assert r.label_item_id == labels[uid]
    # The worker counted the same never-seen ids as the results did (probes have no history).
    worker = pipe.scrape("ranker-0")
    counted = worker.by_label("relaygr_rank_unknown_items_total", "where")
    unseen_sent = sum(len([i for i in items if i not in CATALOGUE]) for items in histories.values())
    assert counted.get("history", 0.0) == sum(r.unknown_history for r in results.values()) == unseen_sent > 0
    assert counted.get("candidate", 0.0) == 0.0

    def both_dead(msgs) -> bool:
        sources = {decode(DeadLetter, m.value()).source_topic for m in msgs}
        return {reg.name("behaviors"), reg.name("requests")} <= sources

    letters = [decode(DeadLetter, m.value()) for m in _consume(settings, reg.name("dead_letters"), both_dead)]
    by_source = {dl.source_topic: dl for dl in letters}
    assert len(letters) == 2 and set(by_source) == {reg.name("behaviors"), reg.name("requests")}
    beh, req = by_source[reg.name("behaviors")], by_source[reg.name("requests")]
    assert "field 'item_id'" in beh.reason and "got ''" in beh.reason
    assert "field 'label_item_id'" in req.reason and "got 3.5" in req.reason
    assert json.loads(base64.b64decode(beh.value_b64)) == bad_behaviour
    assert json.loads(base64.b64decode(req.value_b64)) == bad_request
    pipe.check()  # every stage still running
