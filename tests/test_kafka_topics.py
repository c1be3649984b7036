"""Against the real broker: every schema round-trips with aiokafka; topic creation is idempotent."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiokafka import errors

from relaygr.infra.kafka import TopicError, consumer, describe_partitions, ensure_topics, producer
from relaygr.infra.roundtrip import roundtrip
from relaygr.schemas import TopicRegistry, decode, encode
from relaygr.schemas.examples import examples

pytestmark = pytest.mark.broker


async def test_every_schema_round_trips_through_the_broker(kafka_settings, registry) -> None:
    by_type = {spec.event_type: spec for spec in registry}
    prod = producer(kafka_settings)
    await prod.start()
    try:
        sent = {}
        for ev in examples():
            spec = by_type[type(ev)]
            md = await prod.send_and_wait(spec.name, encode(ev), key=ev.key())
            sent[spec.name] = (ev, md.partition)
    finally:
        await prod.stop()
    cons = consumer(kafka_settings, *registry.names, group_id=None)
    await cons.start()
    got = {}
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while len(got) < len(sent) and loop.time() < deadline:
            for tp, msgs in (await cons.getmany(timeout_ms=500)).items():
                for m in msgs:
                    got[tp.topic] = m
    finally:
        await cons.stop()
    assert set(got) == set(sent)
    for name, (ev, partition) in sent.items():
        m = got[name]
        assert m.key == ev.key()
        assert m.partition == partition
        assert decode(type(ev), m.value) == ev


async def test_same_user_lands_on_same_partition_number_across_topics(kafka_settings, registry) -> None:
    """The affinity-aware router: key user_id + equal partition counts = same partition number."""
    ex = {type(e).__name__: e for e in examples()}
    prod = producer(kafka_settings)
    await prod.start()
    try:
        parts = {}
        for user in ["1", "2", "42", "943", "user-x"]:
            b = ex["BehaviorEvent"].model_copy(update={"user_id": user})
            r = ex["RankRequest"].model_copy(update={"user_id": user})
            p = ex["PrefillSignal"].model_copy(update={"user_id": user})
            got = {
                (await prod.send_and_wait(registry.name(role), encode(e), key=e.key())).partition
                for role, e in (("behaviors", b), ("rank", r), ("prefill", p))
            }
            assert len(got) == 1, f"user {user} spread over partitions {got}"
            parts[user] = got.pop()
        assert len(set(parts.values())) > 1  # keys really spread over partitions
    finally:
        await prod.stop()


async def test_topic_creation_is_idempotent_with_right_partitions(kafka_settings, registry) -> None:
    again = await ensure_topics(registry, kafka_settings)
    assert set(again.values()) == {"exists"}
    counts = await describe_partitions(kafka_settings, registry.names)
    assert counts == {s.name: s.partitions for s in registry}


async def test_partition_mismatch_is_refused(kafka_settings, registry) -> None:
    other = TopicRegistry(registry.prefix, partitions=registry.partitions + 2)
    with pytest.raises(TopicError, match="partitions"):
        await ensure_topics(other, kafka_settings)


async def test_roundtrip_command_core(kafka_settings) -> None:
    rows = await roundtrip(kafka_settings)
    assert len(rows) == len(examples())


def test_offset_lookups_retried_on_a_new_partition_are_not_logged_as_errors(caplog) -> None:
    """aiokafka logs "Failed fetch offsets" at ERROR and retries; on a partition whose leader is not
    ready yet that is no failure, so it is demoted to DEBUG. Other failures stay errors."""
    fetcher = logging.getLogger("aiokafka.consumer.fetcher")
    caplog.set_level(logging.WARNING)
    fetcher.error("Failed fetch offsets from %s: %s", 1, errors.NotLeaderForPartitionError())
    fetcher.error("Failed fetch offsets from %s: %s", 1, errors.LeaderNotAvailableError())
    assert not caplog.records
    fetcher.error("Failed fetch offsets from %s: %s", 1, errors.KafkaTimeoutError())
    fetcher.error("Fetch to node %s failed: %s", 1, errors.NotLeaderForPartitionError())
    assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    fetcher.error("Failed fetch offsets from %s: %s", 1, errors.NotLeaderForPartitionError())
    assert [r.levelname for r in caplog.records] == ["DEBUG"]


def test_produce_requests_retried_on_a_new_partition_are_not_logged_as_warnings(caplog) -> None:
    """The same for aiokafka's producer, which logs the error's class with the partition."""
    sender = logging.getLogger("aiokafka.producer.sender")
    caplog.set_level(logging.WARNING)
    msg = "Got error produce response on topic-partition %s, retrying. Error: %s"
    sender.warning(msg, ("t", 2), errors.NotLeaderForPartitionError)
    sender.warning(msg, ("t", 2), errors.LeaderNotAvailableError)
    assert not caplog.records
    sender.warning(msg, ("t", 2), errors.KafkaTimeoutError)
    sender.warning("Got error produce response: %s", errors.NotLeaderForPartitionError())
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.WARNING]
