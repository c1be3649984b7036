"""A foreign catalogue through the broker: a small log with arbitrary integer item ids, published
to the behaviours topic, trains the same model as the file holding the same events (same seed);
the model then serves it end to end, answering only with catalogue ids and counting the ids that
its vocabulary lacks."""

from __future__ import annotations

import argparse
import uuid

import pytest

from relaygr.infra.kafka import delete_topics_with_prefix, ensure_topics
from relaygr.infra.topic_reader import Start
from relaygr.schemas import BehaviorEvent, RecommendationRequest, TopicRegistry
from relaygr.tools.pipeline import Pipeline
from relaygr.tools.traffic import collect_results, publish
from relaygr.tools.train_source import read_behaviours
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.training import train
from relaygr.workers.training.interactions import Columns, build_log, read_interactions
from tests.synthetic import write_csv

pytestmark = [pytest.mark.broker, pytest.mark.slow(seconds=50)]

USERS, EVENTS = 10, 8
UNKNOWN = [7, 999_999]  # not in the catalogue: 7 would have been an ML-100K movie


TINY = ["--layers", "1", "--heads", "1", "--dim", "16", "--epochs", "1", "--max-steps", "2", "--threads", "1"]


def catalogue_rows() -> list[dict]:
    return [
        {
            "user_id": f"shopper-{u}",
            "item_id": 50_000 + 13 * ((2 * u + j) % 30),
            "timestamp": 1_650_000_000.0 + 100 * u + j,
            "rating": 1 + (u + j) % 3,
        }
        for u in range(USERS)
        for j in range(EVENTS)
    ]


def _args(out, extra: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    return parser.parse_args(["--out", str(out), *extra, *TINY])


async def test_topic_and_file_train_the_same_model_which_then_serves_the_catalogue(
    kafka_settings, tmp_path, one_torch_thread
) -> None:
    rows = catalogue_rows()
    prefix = f"vocab-{uuid.uuid4().hex[:8]}"
    settings = kafka_settings.model_copy(
        update={"topic_prefix": prefix, "home": tmp_path / "home", "partitions": 2}
    )
    reg = TopicRegistry(prefix, 2)
    await ensure_topics(reg, settings)
    try:
        behaviours = [
            BehaviorEvent(user_id=r["user_id"], item_id=r["item_id"], ts=r["timestamp"], action=r["rating"])
            for r in rows
        ]
        await publish(settings, reg, behaviours, [], settle_s=0)
        from_topic, source = await read_behaviours(settings, Start())
        from_file = build_log(read_interactions(write_csv(tmp_path / "log.csv", rows), Columns()).rows)
        assert from_topic.vocab == from_file.vocab and from_topic.bad_count == 0
        assert train.run(_args(tmp_path / "a", []), log=from_topic, source=source) == 0
        assert train.run(_args(tmp_path / "b", ["--interactions", str(tmp_path / "log.csv")])) == 0
        a, b = HSTURanker.load(tmp_path / "a"), HSTURanker.load(tmp_path / "b")
        assert a.model_version == b.model_version
        catalogue = set(a.vocab.raw_ids())
        assert catalogue == {r["item_id"] for r in rows}

        # Serve it: every history gains two ids the model has never seen.
        LatencyModel(1.0, 0.01, 0.0).save(tmp_path / "a" / "calibration.json")
        serve_prefix = f"{prefix}-serve"
        serve = settings.model_copy(update={"topic_prefix": serve_prefix})
        serve_reg = TopicRegistry(serve_prefix, 2)
        await ensure_topics(serve_reg, serve)
        env = {
            "RELAYGR_MODEL_DIR": str(tmp_path / "a"),
            "RELAYGR_CALIBRATION_FILE": str(tmp_path / "a" / "calibration.json"),
            "RELAYGR_MODE": "relay",
            "RELAYGR_BUDGET_MS": "30000",
            "RELAYGR_MAX_TASK_IDLE_MS": "60000",
        }
        extra = [
            BehaviorEvent(user_id=f"shopper-{u}", item_id=item, ts=1_660_000_000.0 + k, action=1)
            for u in range(USERS)
            for k, item in enumerate(UNKNOWN)
        ]
        requests = [
            RecommendationRequest(
                request_id=f"r-{u}", user_id=f"shopper-{u}", ts=0.0, num_candidates=12, top_k=5
            )
            for u in range(USERS)
        ]
        pipe = Pipeline(serve, ranking_workers=1, env=env)
        pipe.start()
        try:
            await pipe.wait_ready(timeout_s=240)
            sent = await publish(serve, serve_reg, behaviours + extra, requests, wait_for_ingest=True)
            results = await collect_results(serve, serve_reg, {r.request_id for r in sent}, timeout_s=240)
        finally:
            pipe.stop()
        assert len(results) == USERS
        for res in results.values():
            assert res.items and {i.item_id for i in res.items} <= catalogue
            assert res.history_len == EVENTS + len(UNKNOWN)
            assert res.unknown_history == len(UNKNOWN) and res.unknown_candidates == 0
    finally:
        await delete_topics_with_prefix(settings, prefix)
