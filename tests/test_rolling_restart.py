"""A rolling restart under load on the real broker: one ranking worker of a two-worker deployment is
replaced by a warm standby (``Pipeline.roll_worker``) while confluent-kafka sends requests.
Every request is answered exactly once (every result on the topic is counted), and the new
process serves: its results follow its take-over in the worker's audit trail, and the supervisor
watches it as the worker. Before it is ready, the standby adopts the prefixes the old process
wrote to its disk tier for it."""

from __future__ import annotations

import asyncio

import pytest
from rolling_setup import rolling_deployment, worker_events

from relaygr.infra.kafka import delete_topics_with_prefix
from relaygr.schemas import RecommendationRequest
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.streams.state_lineage import deployment_dir
from relaygr.tools.long_users import long_users
from relaygr.tools.pipeline import Pipeline
from relaygr.tools.sender import BackgroundLoad
from relaygr.tools.traffic import count_results, publish
from relaygr.workers.training.movielens import load_movielens

pytest.importorskip("confluent_kafka")

pytestmark = [pytest.mark.broker, pytest.mark.slow(seconds=40)]


async def test_roll_one_worker_under_load(kafka_settings, tmp_path, model_dir) -> None:
    settings, reg, env = await rolling_deployment(kafka_settings, tmp_path, model_dir, "roll")
    ml = load_movielens("ml-100k")
    behaviours, requests = long_users(ml, 8, 60, tag="roll")
    pipe = Pipeline(settings, ranking_workers=2, env=env)
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        await publish(settings, reg, behaviours, [], wait_for_ingest=True, settle_s=0)
        load = BackgroundLoad(settings, reg.name("requests"), requests, 10, client="librdkafka").start()
        await asyncio.sleep(1.0)
        old_pid = pipe.procs["ranker-0"].pid
        took = await asyncio.to_thread(pipe.roll_worker, 0)
        await asyncio.sleep(2.0)
        sent = await asyncio.to_thread(load.stop)
        new_pid = pipe.procs["ranker-0"].pid
        results, counts = await count_results(settings, reg, {r.request_id for r in sent}, timeout_s=120)
        assert pipe.restarts["ranker-0"] == 0  # handed over, not restarted
        pipe.check()
    finally:
        pipe.stop()
        await delete_topics_with_prefix(settings, settings.topic_prefix)
    assert isinstance(sent[0], RecommendationRequest)
    assert set(results) == {r.request_id for r in sent}, "lost results"
    assert all(c == 1 for c in counts.values()), {k: c for k, c in counts.items() if c > 1}
    assert new_pid != old_pid and set(took) == {"warm", "serving", "joined", "old_exit"}
    folder = deployment_dir(settings, "workers") / "ranker-0"
    events = worker_events(folder)
    kinds = [e["event"] for e in events]
    assert {"standby_ready", "handed_over", "answered", "took_over", "joined"} <= set(kinds)
    # The new process commits (joins) only once the old one has answered what it held.
    assert kinds.index("answered") < kinds.index("joined")
    # The standby's lines say so until it serves (its pre-inferences are not counted twice).
    assert all(e.get("standby") for e in events if e["event"] == "standby_ready")
    assert not any(e.get("standby") for e in events if e["event"] in ("result", "took_over", "joined"))
    after = kinds[kinds.index("took_over") :]
    assert "result" in after, "the new process ranked nothing"
    # Its state generation is the current one; the old one is gone once the old process exited.
    assert WorkerFiles(folder).state_dir().name.startswith("gen-")
    # The old process left its full-ranking timings for the new one's latency model.
    assert (folder / "latency_samples.json").exists()
    # The old process wrote its prefixes to its disk tier for the standby, which adopted those of
    # its users (long histories, served before the roll: their prefixes were cached) before it
    # was ready, refusing none (no history changed), and was ready after that.
    spilled = [e for e in events if e["event"] == "spilled_for_standby"]
    assert spilled and spilled[-1]["folder"] and spilled[-1]["prefixes"] > 0
    assert not any(e.get("standby") for e in spilled)
    adopted = [e for e in events if e["event"] == "standby_adopted"]
    assert len(adopted) == 1 and adopted[0]["standby"], adopted
    assert adopted[0]["adopted"] > 0 and adopted[0]["refused"] == 0, adopted
    assert adopted[0]["bytes"] > 0
    assert kinds.index("spilled_for_standby") < kinds.index("standby_adopted") < kinds.index("standby_ready")
