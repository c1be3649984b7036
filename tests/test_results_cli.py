"""`relaygr results get|tail` against the real broker, and the results topic's table settings."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from relaygr import results_cli
from relaygr.cli import main
from relaygr.infra.kafka import admin, producer
from relaygr.schemas import RankedResult, RankPath, ScoredItem, decode, encode

pytestmark = pytest.mark.broker

# Record timestamps in the recent past: the broker refuses ones far from its clock.
T0_MS = int(time.time() * 1000) - 60_000


@pytest.fixture
def settings(kafka_settings, registry, monkeypatch):
    mine = kafka_settings.model_copy(update={"topic_prefix": registry.prefix})
    monkeypatch.setattr(results_cli, "get_settings", lambda: mine)
    return mine


def result(request_id: str, worker_id: str) -> RankedResult:
    return RankedResult(
        request_id=request_id,
        user_id="42",
        ts=T0_MS / 1000,
        items=[ScoredItem(item_id=i, score=1.0 / (i + 1)) for i in range(7)],
        path=RankPath.RELAY,
        latency_ms=12.5,
        worker_id=worker_id,
    )


async def publish(settings, registry, results: list[RankedResult], first_ms: int | None = None) -> None:
    """Results with timestamps one second apart, in list order (from ``first_ms``, else now)."""
    first_ms = int(time.time() * 1000) if first_ms is None else first_ms
    prod = producer(settings)
    await prod.start()
    try:
        for i, r in enumerate(results):
            await prod.send_and_wait(
                registry.name("results"), encode(r), key=r.key(), timestamp_ms=first_ms + 1000 * i
            )
    finally:
        await prod.stop()


@pytest.fixture
def published(settings, registry) -> None:
    # req-a is answered twice (at-least-once): the table keeps the second answer.
    rs = [result("req-a", "copy-0"), result("req-b", "w1"), result("req-a", "copy-1")]
    asyncio.run(publish(settings, registry, rs, first_ms=T0_MS))


def test_get_prints_the_last_result_of_a_request(published, capsys) -> None:
    assert main(["results", "get", "req-a"]) == 0
    got = decode(RankedResult, capsys.readouterr().out.encode())
    assert got == result("req-a", "copy-1")


def test_get_of_an_unknown_request_exits_1(published, capsys) -> None:
    assert main(["results", "get", "req-none"]) == 1
    assert "no result for request 'req-none'" in capsys.readouterr().err


def test_tail_prints_the_latest_results_oldest_first(published, capsys) -> None:
    assert main(["results", "tail", "-n", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert "  req-b  user=42  relay  12.5 ms  w1  [0:1.000 1:0.500 2:0.333 3:0.250 4:0.200 (+2)]" in lines[0]
    assert "  req-a  " in lines[1] and "copy-1" in lines[1]

    assert main(["results", "tail", "--from", "earliest", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["request_id"], r["worker_id"]) for r in rows] == [
        ("req-a", "copy-0"),
        ("req-b", "w1"),
        ("req-a", "copy-1"),
    ]


async def test_tail_follow_prints_new_results(settings, registry, capsys) -> None:
    follow = asyncio.create_task(results_cli.tail(settings, last=10, start=None, follow=True, as_json=True))
    try:
        out = ""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        # Published until seen: the tail may not have found the end of the topic yet.
        while "req-new" not in out and loop.time() < deadline:
            await publish(settings, registry, [result("req-new", "w2")])
            await asyncio.sleep(0.3)
            out += capsys.readouterr().out
        assert decode(RankedResult, out.splitlines()[0].encode()).request_id == "req-new"
    finally:
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)


async def test_the_results_topic_is_a_table_with_time_retention(kafka_settings, registry) -> None:
    client = admin(kafka_settings)
    await client.start()
    try:
        [resp] = await client.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, registry.name("results"))]
        )
    finally:
        await client.close()
    [(_, _, _, _, entries)] = resp.resources
    configs = {entry[0]: entry[1] for entry in entries}
    assert configs["cleanup.policy"] == "compact,delete"
    assert int(configs["retention.ms"]) == 7 * 24 * 3600 * 1000
