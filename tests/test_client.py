"""The client against the real broker: a round trip, a timeout, a duplicate result ignored.

The ranking stage is played by ``answer_requests``: it reads the request topic and writes a
``RankedResult`` for each request to the results topic, the way a ranking worker does (key
request_id), once or more than once (at-least-once delivery). One slow test runs the real stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest

from relaygr.client import ClientError, RelayClient, RequestTimeout
from relaygr.infra.kafka import consumer, delete_topics_with_prefix, ensure_topics, producer
from relaygr.schemas import (
    BehaviorEvent,
    RankedResult,
    RankPath,
    RecommendationRequest,
    ScoredItem,
    TopicRegistry,
    decode,
    encode,
)
from relaygr.tools.pipeline import Pipeline

pytestmark = pytest.mark.broker


@pytest.fixture
def settings(kafka_settings, registry):
    return kafka_settings.model_copy(update={"topic_prefix": registry.prefix})


async def answer_requests(settings, reg: TopicRegistry, *, copies: int = 1) -> None:
    """Play the ranking stage until cancelled: ``copies`` results per request, told apart by
    their worker_id (``copy-0``, ``copy-1``, ...), with the request's top_k items."""
    requests = consumer(settings, reg.name("requests"), group_id=None)
    results = producer(settings)
    await requests.start()
    await results.start()
    try:
        while True:
            for msgs in (await requests.getmany(timeout_ms=200)).values():
                for m in msgs:
                    req = decode(RecommendationRequest, m.value)
                    assert m.key == req.user_id.encode(), "requests are keyed by user_id"
                    items = [ScoredItem(item_id=i, score=float(-i)) for i in range(req.top_k)]
                    for copy in range(copies):
                        res = RankedResult(
                            request_id=req.request_id,
                            user_id=req.user_id,
                            ts=req.ts,
                            items=items,
                            path=RankPath.FULL,
                            latency_ms=1.0,
                            worker_id=f"copy-{copy}",
                        )
                        await results.send_and_wait(reg.name("results"), encode(res), key=res.key())
    finally:
        await results.stop()
        await requests.stop()


@contextlib.asynccontextmanager
async def ranking_stage(settings, reg: TopicRegistry, *, copies: int = 1):
    task = asyncio.create_task(answer_requests(settings, reg, copies=copies))
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_round_trip_publishes_keyed_behaviours_and_returns_the_result(settings, registry) -> None:
    before = time.time()
    behaviours = [BehaviorEvent(user_id="196", item_id=i, ts=before - 60 + i, action=4) for i in (242, 302)]
    async with RelayClient(settings) as client, ranking_stage(settings, registry):
        assert await client.publish_behaviors(behaviours) == 2
        with pytest.raises(TypeError, match="BehaviorEvent objects, got dict"):
            await client.publish_behaviors([{"user_id": "196", "item_id": 1, "ts": before}])
        result = await client.request("196", top_k=3, request_id="req-round-trip")
        assert (result.request_id, result.user_id, result.worker_id) == ("req-round-trip", "196", "copy-0")
        assert [s.item_id for s in result.items] == [0, 1, 2]
        # The same result on the stream, from a start time before it was produced.
        async with contextlib.aclosing(client.results(start=before)) as stream:
            assert await anext(stream) == result

    cons = consumer(settings, registry.name("behaviors"), group_id=None)
    await cons.start()
    try:
        got = []
        while len(got) < 2:
            for msgs in (await cons.getmany(timeout_ms=500)).values():
                got += [(m.key, decode(BehaviorEvent, m.value)) for m in msgs]
    finally:
        await cons.stop()
    assert got == [(b"196", b) for b in behaviours]


async def test_a_request_without_result_times_out_naming_the_request(settings) -> None:
    async with RelayClient(settings) as client:
        with pytest.raises(RequestTimeout, match="'req-unanswered'") as timeout:
            await client.request("196", request_id="req-unanswered", timeout_s=0.5)
    assert timeout.value.request_id == "req-unanswered"
    assert "user '196'" in str(timeout.value)


async def test_a_duplicate_result_is_ignored_and_the_table_keeps_the_last(settings, registry) -> None:
    async with RelayClient(settings) as client, ranking_stage(settings, registry, copies=2):
        first = await client.request("7", top_k=1, request_id="req-twice")
        assert first.worker_id == "copy-0"
        # The second copy arrives after the answer: counted, and nothing else happens.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while client.duplicate_results < 1 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert client.duplicate_results == 1
        with pytest.raises(ClientError, match="already answered"):
            await client.request("7", request_id="req-twice")
        # The client keeps serving.
        assert (await client.request("8", request_id="req-next")).request_id == "req-next"
        # Read as a table, the topic holds the last result per request; the stream yields each id once.
        assert (await client.lookup("req-twice")).worker_id == "copy-1"
        streamed = [r async for r in client.results("earliest", follow=False)]
    assert sorted(r.request_id for r in streamed) == ["req-next", "req-twice"]


async def test_missing_topics_and_a_closed_client_are_clear_errors(kafka_settings) -> None:
    nowhere = kafka_settings.model_copy(update={"topic_prefix": "no-such-deployment"})
    with pytest.raises(ClientError, match=r"topic no-such-deployment\.results does not exist"):
        async with RelayClient(nowhere):
            pass
    with pytest.raises(ClientError, match="not started"):
        await RelayClient(kafka_settings).publish_behaviors([])


@pytest.mark.slow(seconds=25)
async def test_round_trip_through_the_pipeline(kafka_settings, tmp_path, model_dir) -> None:
    """The client against the real stages: retrieval, pre-processing and one ranking worker."""
    prefix = f"client-{uuid.uuid4().hex[:8]}"
    settings = kafka_settings.model_copy(update={"topic_prefix": prefix, "home": tmp_path, "partitions": 2})
    await ensure_topics(TopicRegistry(prefix, 2), settings)
    env = {
        "RELAYGR_MODEL_DIR": str(model_dir),
        "RELAYGR_CALIBRATION_FILE": str(model_dir / "calibration.json"),
        "RELAYGR_BUDGET_MS": "30000",  # no deadline misses on a loaded machine
    }
    pipe = Pipeline(settings, ranking_workers=1, env=env)
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        async with RelayClient(settings, request_timeout_s=120) as client:
            now = time.time()
            await client.publish_behaviors(
                BehaviorEvent(user_id="u1", item_id=i, ts=now - 60 + i, action=4) for i in range(1, 21)
            )
            result = await client.request("u1", top_k=5, num_candidates=32, request_id="req-pipeline")
        pipe.check()
    finally:
        pipe.stop()
        await delete_topics_with_prefix(settings, prefix)
    assert (result.request_id, result.user_id, len(result.items)) == ("req-pipeline", "u1", 5)
    assert result.path != RankPath.TIMEOUT
