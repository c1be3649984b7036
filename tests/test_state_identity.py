"""Local state follows the cluster: a wiped broker, a recreated topic or a new topic prefix never
stops a stage, and no history or prefix from the old topics is used.

Unit tests compare recorded and current lineage with stub identities; the broker tests use real
topic ids; the pipeline test runs the whole cascade through a topic wipe under running stages, a
wiped broker (a new cluster id) and a new prefix, all under one RELAYGR_HOME.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
from aiokafka import TopicPartition
from aiokafka.protocol.admin import DescribeGroupsRequest_v2
from aiokafka.protocol.api import Request
from store_probe import is_leased

from relaygr.infra.cluster_identity import ClusterFacts, ClusterProbe, ProbeError, TopicFacts
from relaygr.infra.kafka import (
    admin,
    consumer,
    delete_topics_with_prefix,
    describe_partitions,
    ensure_topics,
    producer,
)
from relaygr.infra.local import broker
from relaygr.infra.settings import Settings, kafka_client_kwargs
from relaygr.schemas import BehaviorEvent, RetrievedRequest, TopicRegistry, decode, encode
from relaygr.streams.history import HistoryTable
from relaygr.streams.state_lineage import (
    DISCARDED,
    HistoryLineage,
    Lineage,
    LineageBook,
    PartitionState,
    Reason,
    deployment_dir,
    judge,
)
from relaygr.tools.pipeline import Pipeline, Scrape
from relaygr.tools.traffic import collect_results, history_of, leave_last_out, publish
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig
from relaygr.workers.training.movielens import load_movielens

HERE = Lineage("cluster-a", "p.behaviors", "id-1")


def ev(user: str, item: int, ts: float = 1.0) -> BehaviorEvent:
    return BehaviorEvent(user_id=user, item_id=item, ts=ts, action=1)


# ---------------------------------------------------------------------------------- comparison


@pytest.mark.parametrize(
    ("recorded", "state", "end", "expected"),
    [
        (HERE, PartitionState(True, 9), 10, None),  # up to the log end: kept
        (None, PartitionState(False), 0, None),  # nothing there: nothing to discard
        (HERE, PartitionState(True, None), 0, None),  # no offset recorded: nothing beyond the end
        (None, PartitionState(True, 3), 10, Reason.UNRECORDED),
        (Lineage("cluster-b", "p.behaviors", "id-1"), PartitionState(True, 3), 10, Reason.CLUSTER_CHANGED),
        (Lineage("cluster-a", "p.routed", "id-1"), PartitionState(True, 3), 10, Reason.SOURCE_CHANGED),
        (Lineage("cluster-a", "p.behaviors", "id-0"), PartitionState(True, 3), 10, Reason.TOPIC_RECREATED),
        (HERE, PartitionState(True, 3), -1 + 1, Reason.OFFSET_BEYOND_END),  # the wiped broker: 3 > -1
        (HERE, PartitionState(True, 10), 10, Reason.OFFSET_BEYOND_END),
        (Lineage(None, "p.behaviors", None), PartitionState(True, 3), 10, None),  # unknown ids: no mismatch
    ],
)
def test_judge_names_each_mismatch(recorded, state, end, expected) -> None:
    verdict = judge(recorded, HERE, state, end)
    assert (verdict[0] if verdict else None) == expected
    if verdict:
        assert verdict[1]  # a sentence for the log line


def test_lineage_book_survives_a_reopen(tmp_path) -> None:
    book = LineageBook(tmp_path / "lineage.json")
    assert book.get("history", 0) is None
    book.put("history", 0, HERE)
    book.save()
    again = LineageBook(tmp_path / "lineage.json")
    assert again.get("history", 0) == HERE and again.get("history", 1) is None
    (tmp_path / "lineage.json").write_text("{not json")
    assert LineageBook(tmp_path / "lineage.json").get("history", 0) is None  # unreadable: unrecorded


def test_state_folders_are_per_prefix(tmp_path) -> None:
    a = Settings(home=tmp_path, topic_prefix="a")
    b = Settings(home=tmp_path, topic_prefix="b")
    assert deployment_dir(a, "workers") != deployment_dir(b, "workers")
    assert deployment_dir(a, "stages").parent == tmp_path / "stages"
    dots = deployment_dir(Settings(home=tmp_path, topic_prefix=".."), "workers")
    assert dots.parent == tmp_path / "workers"  # never outside HOME


# ---------------------------------------------------------------------------------- history


def test_discarding_a_partition_keeps_the_others(tmp_path) -> None:
    t = HistoryTable(tmp_path / "h")
    t.append_many(0, [(0, ev("a", 1)), (1, ev("b", 2)), (2, ev("a", 3))])
    t.append_many(1, [(0, ev("c", 4)), (1, ev("c", 5))])
    assert len(t.get("a")) == 2  # cached in memory too
    assert sorted(t.partition_users(0)) == ["a", "b"] and t.partition_users(1) == ["c"]
    assert t.discard_partition(0) == 3
    assert len(t.get("a")) == 0 and len(t.get("b")) == 0 and t.next_offset(0) == 0
    assert t.get("c").item_ids.tolist() == [4, 5] and t.next_offset(1) == 2
    assert t.partition_users(0) == []
    t.append_many(0, [(0, ev("a", 9))])  # rebuilt from offset 0 of the new topic
    t.close()
    t = HistoryTable(tmp_path / "h")
    assert t.get("a").item_ids.tolist() == [9] and t.partition_users(0) == ["a"]
    t.close()


def _prefix(h: Events) -> PrefixKV:
    n = len(h)
    return PrefixKV(
        keys=[torch.zeros(1, n, 2)],
        values=[torch.zeros(1, n, 2)],
        positions=torch.arange(n, dtype=torch.int64),
        timestamps=h.timestamps.clone(),
        length=n,
        fingerprint=history_fingerprint(h, n),
        model_version="m",
    )


def test_forgotten_prefixes_are_gone_from_every_tier(tmp_path) -> None:
    cfg = PrefixStoreConfig(
        device_budget_bytes=1 << 20, host_budget_bytes=1 << 20, disk_path=str(tmp_path / "kv")
    )
    h = Events.from_lists([1, 2, 3], [1.0, 2.0, 3.0], [0, 0, 0])
    store = PrefixStore(cfg, "m")
    store.put("a", _prefix(h))
    store.put("b", _prefix(h))
    store.lease("a", 30.0)
    store.close()  # both persisted to disk
    store = PrefixStore(cfg, "m")
    store.put("a", _prefix(h))  # in memory and on disk
    assert store.forget(["a", "nobody"]) == 1
    assert store.where("a") is None and store.where("b") == "disk" and not is_leased(store, "a")
    store.close()
    store = PrefixStore(cfg, "m")
    assert store.where("a") is None and store.where("b") == "disk"
    store.close()


class StubProbe:
    """A cluster whose id, topic id and end offsets a test sets."""

    def __init__(self, topic: str) -> None:
        self.topic, self.cluster_id, self.topic_id, self.end = topic, "cluster-a", "id-1", 100

    async def facts(self, topics) -> ClusterFacts:
        return ClusterFacts(
            self.cluster_id, {self.topic: TopicFacts(self.topic, self.topic_id, {0: 1, 1: 1})}
        )

    async def end_offsets(self, facts, partitions) -> dict[tuple[str, int], int]:
        return {tp: self.end for tp in partitions}

    async def close(self) -> None:
        pass


def _discards(stage: str, reason: Reason) -> float:
    return DISCARDED.labels(stage, reason.value)._value.get()


async def test_a_different_cluster_discards_history_and_its_prefixes(tmp_path) -> None:
    cfg = PrefixStoreConfig(disk_path=str(tmp_path / "kv"))
    store = PrefixStore(cfg, "m")
    history = HistoryTable(tmp_path / "h")
    probe = StubProbe("p.behaviors")
    lineage = HistoryLineage("stub", Settings(home=tmp_path), tmp_path, history, store, probe=probe)
    assert await lineage.verify("p.behaviors", [0, 1]) == {}  # empty: recorded as cluster-a
    history.append_many(0, [(0, ev("a", 1)), (1, ev("a", 2))])
    history.append_many(1, [(0, ev("b", 3))])
    store.put("a", _prefix(history.get("a")))
    assert await lineage.verify("p.behaviors", [0, 1]) == {}  # still the same cluster and topic

    probe.end = 1  # partition 0 applied offset 1, which the topic no longer has
    assert await lineage.verify("p.behaviors", [0, 1]) == {0: Reason.OFFSET_BEYOND_END}
    assert len(history.get("a")) == 0 and store.where("a") is None and len(history.get("b")) == 1

    before = _discards("stub", Reason.CLUSTER_CHANGED)
    probe.cluster_id, probe.end = "cluster-b", 100
    assert await lineage.verify("p.behaviors", [0, 1]) == {1: Reason.CLUSTER_CHANGED}  # 0 is empty
    assert len(history.get("b")) == 0
    assert _discards("stub", Reason.CLUSTER_CHANGED) == before + 1
    assert LineageBook(tmp_path / "lineage.json").get("history", 1).cluster_id == "cluster-b"
    await lineage.close()
    store.close()
    history.close()


class StubConsumer:
    def __init__(self, *tps) -> None:
        self.tps, self.seeks = set(tps), []

    def assignment(self):
        return self.tps

    def seek(self, tp, offset: int) -> None:
        self.seeks.append((tp, offset))


async def test_the_watch_rereads_a_partition_whose_topic_was_recreated_without_a_rebalance(tmp_path) -> None:
    from aiokafka import TopicPartition

    history = HistoryTable(tmp_path / "h")
    probe = StubProbe("p.behaviors")
    lineage = HistoryLineage("stub", Settings(home=tmp_path), tmp_path, history, None, probe=probe)
    await lineage.verify("p.behaviors", [0])
    history.append_many(0, [(0, ev("a", 1)), (1, ev("a", 2))])
    tp = TopicPartition("p.behaviors", 0)
    cons = StubConsumer(tp, TopicPartition("p.requests", 0))
    watching = asyncio.create_task(lineage.watch(cons, "p.behaviors", interval_s=0.01))
    try:
        probe.topic_id = "id-2"  # same name, same partitions: no rebalance would tell the worker
        for _ in range(500):
            if cons.seeks:
                break
            await asyncio.sleep(0.01)
    finally:
        watching.cancel()
    assert cons.seeks[0] == (tp, 0) and len(history.get("a")) == 0
    await lineage.close()
    history.close()


# ---------------------------------------------------------------------------------- real broker


@pytest.mark.broker
async def test_a_topic_recreated_under_a_history_is_noticed_by_its_id(kafka_settings, tmp_path) -> None:
    prefix = f"sid-{uuid.uuid4().hex[:8]}"
    s = kafka_settings.model_copy(update={"topic_prefix": prefix, "partitions": 2})
    reg = TopicRegistry(prefix, 2)
    topic = reg.name("behaviors")
    history = HistoryTable(tmp_path / "h")
    lineage = HistoryLineage("broker-test", s, tmp_path, history, None)
    try:
        await ensure_topics(reg, s)
        await _produce(s, topic, [ev("a", i) for i in range(3)], partition=0)
        assert await lineage.verify(topic, [0, 1]) == {}
        history.append_many(0, [(i, ev("a", i)) for i in range(3)])
        assert await lineage.verify(topic, [0, 1]) == {}

        await delete_topics_with_prefix(s, prefix)
        await _recreate(s, reg)
        await _produce(s, topic, [ev("z", i) for i in range(5)], partition=0)  # more than before
        assert await lineage.verify(topic, [0, 1]) == {0: Reason.TOPIC_RECREATED}
        assert len(history.get("a")) == 0 and history.next_offset(0) == 0
        assert await lineage.verify(topic, [0, 1]) == {}  # recorded: the new topic is the source now
    finally:
        await lineage.close()
        history.close()
        await delete_topics_with_prefix(s, prefix)


@pytest.mark.broker
async def test_a_commit_of_the_old_topic_landing_on_the_new_one_is_not_resumed_from(kafka_settings) -> None:
    """A faust stage's commit retried across a topic's deletion and creation lands on the new
    topic with the old topic's offset. Its stamp names the old topic id: on assignment, the
    stage's consumer reads that partition from the start instead, and keeps a commit of its own."""
    from types import SimpleNamespace

    from aiokafka.structs import OffsetAndMetadata

    from relaygr.infra.incarnations import Incarnations
    from relaygr.streams.table_lineage import _IncarnationCheckedThread

    prefix = f"sid-{uuid.uuid4().hex[:8]}"
    s = kafka_settings.model_copy(update={"topic_prefix": prefix, "partitions": 2})
    reg = TopicRegistry(prefix, 2)
    topic, group = reg.name("routed_requests"), f"{prefix}-retrieval"
    tps = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
    old = Incarnations(s)
    try:
        await ensure_topics(reg, s)
        await _produce(s, topic, [ev("a", i) for i in range(6)], partition=0)
        old_ids = await old.learn([topic])
        await delete_topics_with_prefix(s, prefix)
        await _recreate(s, reg)
        await _produce(s, topic, [ev("z", i) for i in range(4)], partition=0)
        await _produce(s, topic, [ev("z", i) for i in range(4)], partition=1)
        # The retried commit lands (offset 6 of the old topic), and one of the new topic's own.
        await _commit_as(s, group, {tps[0]: OffsetAndMetadata(6, old.stamp({tps[0]: 6})[tps[0]].metadata)})
        new = Incarnations(s)
        await new.learn([topic])
        await _commit_as(s, group, new.stamp({tps[1]: 3}))
        await new.close()
        assert old_ids[topic] != new.ids[topic]

        cons = consumer(s, group_id=group)
        await cons.start()
        try:
            cons.assign(tps)
            thread = _IncarnationCheckedThread.__new__(_IncarnationCheckedThread)
            thread.app = SimpleNamespace(
                conf=SimpleNamespace(id=group), relaygr_settings=s, relaygr_stage="t"
            )
            thread._ensure_consumer = lambda: cons
            resumed = await thread._seek_checked()
            assert resumed[tps[0]] is None and resumed[tps[1]] == 3
            assert await cons.position(tps[0]) == 0 and await cons.position(tps[1]) == 3
            # What the thread commits from now on names the new topic.
            assert thread._checker().stamp({tps[0]: 1})[tps[0]].metadata.endswith(new.ids[topic])
            await thread._checker().close()
        finally:
            await cons.stop()
    finally:
        await old.close()
        await delete_topics_with_prefix(s, prefix)


async def _commit_as(s: Settings, group: str, offsets: dict) -> None:
    cons = consumer(s, group_id=group)
    await cons.start()
    try:
        cons.assign(list(offsets))
        await cons.commit(offsets)
    finally:
        await cons.stop()


@pytest.mark.broker
async def test_the_probe_reads_cluster_and_topic_ids(kafka_settings) -> None:
    prefix = f"sid-{uuid.uuid4().hex[:8]}"
    reg = TopicRegistry(prefix, 2)
    probe = ClusterProbe(kafka_settings)
    try:
        await ensure_topics(reg, kafka_settings)
        facts = await probe.facts([reg.name("requests"), f"{prefix}.no-such-topic"])
        _, state = broker.status(kafka_settings)
        if state is not None and not kafka_settings.bootstrap:
            assert facts.cluster_id == state.cluster_id
        t = facts.topics[reg.name("requests")]
        assert t.topic_id and set(t.leaders) == {0, 1} and f"{prefix}.no-such-topic" not in facts.topics
        ends: dict = {}
        for _ in range(100):  # a new partition's leader may not answer ListOffsets at once
            try:
                ends = await probe.end_offsets(facts, [(reg.name("requests"), 0)])
                break
            except ProbeError:
                await asyncio.sleep(0.1)
        assert ends == {(reg.name("requests"), 0): 0}
    finally:
        await probe.close()
        await delete_topics_with_prefix(kafka_settings, prefix)


async def _produce(s: Settings, topic: str, events: list[BehaviorEvent], partition: int) -> None:
    prod = producer(s)
    await prod.start()
    try:
        for e in events:
            await prod.send_and_wait(topic, encode(e), key=e.key(), partition=partition)
    finally:
        await prod.stop()


async def _recreate(
    s: Settings, reg: TopicRegistry, others: dict[str, int] | None = None, *, deleted: list[str] | None = None
) -> None:
    """Create the registry's topics again, and ``others`` (name -> partitions: the stages'
    changelogs and faust's own topic), once the broker has finished deleting them (``deleted``:
    the ones that were deleted, all of the registry's by default)."""
    gone = set(deleted if deleted is not None else reg.names)
    client = admin(s)
    await client.start()
    try:  # deletion is asynchronous: until it is done, "create" would find the old topics
        for _ in range(300):
            if not gone & set(await client.list_topics()):
                break
            await asyncio.sleep(0.1)
    finally:
        await client.close()
    for _ in range(150):
        try:
            await ensure_topics(reg, s)
            await _create(s, others or {})
            return
        except Exception:  # still being deleted
            await asyncio.sleep(0.2)
    raise AssertionError("the topics could not be created again")


async def _create(s: Settings, topics: dict[str, int]) -> None:
    from aiokafka.admin import NewTopic

    client = admin(s)
    await client.start()
    try:
        have = set(await client.list_topics())
        missing = [
            NewTopic(n, p, 1, topic_configs={"cleanup.policy": "compact"} if n.endswith("-changelog") else {})
            for n, p in topics.items()
            if n not in have
        ]
        if missing:
            resp = await client.create_topics(missing)
            failed = [(t, code) for t, code, *_ in resp.topic_errors if code not in (0, 36)]
            if failed:
                raise RuntimeError(f"creating {failed} failed")
    finally:
        await client.close()


# ---------------------------------------------------------------------------------- the pipeline


@pytest.fixture(scope="module")
def ml():
    return load_movielens("ml-100k")


def _env(model_dir: Path) -> dict[str, str]:
    return {
        "RELAYGR_MODEL_DIR": str(model_dir),
        "RELAYGR_CALIBRATION_FILE": str(model_dir / "calibration.json"),
        "RELAYGR_BUDGET_MS": "30000",  # no timeouts on a loaded machine: the paths say what was used
        "RELAYGR_SHORT_TERM": "2",
        "RELAYGR_METADATA_MAX_AGE_MS": "2000",  # running stages see recreated topics within seconds
    }


@pytest.mark.broker
@pytest.mark.slow(seconds=420)
async def test_recreated_topics_a_wiped_broker_and_a_new_prefix_under_one_home(
    tmp_path, model_dir, ml
) -> None:
    own = Settings(home=tmp_path / "broker-home")  # a broker of this test's own, to wipe
    home = tmp_path / "home"
    first, second = f"sid-{uuid.uuid4().hex[:8]}", f"sid-{uuid.uuid4().hex[:8]}"
    reg = TopicRegistry(first, 4)
    state = broker.start(own, quiet=True)
    try:
        s = own.model_copy(
            update={"bootstrap": state.bootstrap, "topic_prefix": first, "home": home, "partitions": 4}
        )
        await ensure_topics(reg, s)
        with Pipeline(s, ranking_workers=1, env=_env(model_dir), metrics=True) as pipe:
            await pipe.wait_ready(timeout_s=240)
            await _ranked_with(s, reg, ml, "before", histories=range(1, 13), max_len=6, requests=range(1, 13))
            # Every topic of the deployment, changelogs included, deleted and created again under
            # the running stages: users 1..6 now have no history anywhere, 7..12 a new one.
            await _delete_and_recreate(s, reg)
            await pipe.wait_ready(timeout_s=180)
            # A stage notices a recreated topic at its next assignment or check (seconds later):
            # the new traffic goes out once each has, so what is asserted is the state it rebuilt.
            await _until_discarded(pipe, ("retrieval", "preprocess", "ranker-0"), "topic_recreated")
            await _ranked_with(
                s, reg, ml, "recreated", histories=range(7, 19), max_len=4, requests=range(1, 19)
            )
            pipe.check()
            discarded = {name: _discard_counts(pipe.scrape(name)) for name in ("retrieval", "ranker-0")}
        assert discarded["retrieval"]["topic_recreated"] > 0, discarded
        assert discarded["ranker-0"]["topic_recreated"] > 0, discarded

        # The broker wiped (`broker stop` removes its data): a new cluster id behind a new port,
        # the same RELAYGR_HOME. Its state was built in the old cluster: no stage may stop on it.
        broker.stop(own)
        state = broker.start(own, quiet=True)
        s = s.model_copy(update={"bootstrap": state.bootstrap})
        await ensure_topics(reg, s)
        with Pipeline(s, ranking_workers=1, env=_env(model_dir), metrics=True) as pipe:
            await pipe.wait_ready(timeout_s=240)
            await _ranked_with(s, reg, ml, "wiped", histories=range(13, 25), max_len=3, requests=range(7, 25))
            pipe.check()
            discarded = {
                name: _discard_counts(pipe.scrape(name)) for name in ("retrieval", "preprocess", "ranker-0")
            }
        for name, reasons in discarded.items():
            assert reasons["cluster_changed"] > 0, (name, reasons)

        # A second deployment (another prefix) under the same RELAYGR_HOME: state of its own.
        s2 = s.model_copy(update={"topic_prefix": second})
        reg2 = TopicRegistry(second, 4)
        await ensure_topics(reg2, s2)
        with Pipeline(s2, ranking_workers=1, env=_env(model_dir)) as pipe:
            await pipe.wait_ready(timeout_s=240)
            await _ranked_with(
                s2, reg2, ml, "other-prefix", histories=range(19, 31), max_len=5, requests=range(13, 31)
            )
            pipe.check()
        for kind in ("stages", "workers"):
            assert {p.name for p in (home / kind).iterdir()} == {first, second}
    finally:
        broker.stop(own)


@pytest.mark.broker
async def test_a_recreated_public_behaviours_topic_is_new_history_not_copies(
    tmp_path, model_dir, ml, kafka_settings
) -> None:
    """Only the public behaviours topic deleted and created again under running stages (the
    routed topics and the state stay): its offsets start at 0 again, and the same events published
    to it again are new events, not copies forwarded twice."""
    prefix = f"sid-{uuid.uuid4().hex[:8]}"
    s = kafka_settings.model_copy(update={"topic_prefix": prefix, "home": tmp_path / "home", "partitions": 2})
    reg = TopicRegistry(prefix, 2)
    users = range(1, 7)
    behaviours, reqs = leave_last_out(ml, users, max_len=5, num_candidates=16)
    per_user = {r.user_id: len(history_of(behaviours, r.user_id, r.model_ts)) for r in reqs}
    try:
        await ensure_topics(reg, s)
        with Pipeline(s, ranking_workers=1, env=_env(model_dir)) as pipe:
            await pipe.wait_ready(timeout_s=240)
            for round_, (tag, times) in enumerate((("first", 1), ("again", 2))):
                if round_:
                    await delete_topics_with_prefix(s, reg.name("behaviors"))
                    await _recreate(s, reg, deleted=[reg.name("behaviors")])
                    # The same events again: until the ingress has noticed the new topic (a
                    # rebalance, or its watch), its old positions equal the new end offsets and
                    # its lag reads 0. Noticed = its commits name the new topic id.
                    await _until_committed_from(s, f"{prefix}-ingress-behaviors", reg.name("behaviors"))
                tagged = [r.model_copy(update={"request_id": f"{tag}-{r.user_id}"}) for r in reqs]
                sent = await publish(s, reg, behaviours, tagged, qps=20, wait_for_ingest=True)
                ids = {r.request_id for r in sent}
                results = await collect_results(s, reg, ids, timeout_s=120)
                assert set(results) == ids, await _how_far(s, reg, ids - set(results))
                retrieved = await _retrieved_history_lengths(s, reg, ids)
                for r in sent:
                    want = times * per_user[r.user_id]
                    got = (results[r.request_id].history_len, retrieved[r.request_id])
                    assert got == (want, want), (tag, r.user_id, got, want)
            pipe.check()
    finally:
        await delete_topics_with_prefix(s, prefix)


async def _until_committed_from(s: Settings, group: str, topic: str, timeout_s: float = 60) -> None:
    """Until every partition's committed offset of ``group`` names ``topic``'s current id."""
    from relaygr.infra.incarnations import Incarnations

    inc = Incarnations(s)
    client = admin(s)
    await client.start()
    try:
        current = (await inc.learn([topic]))[topic]
        tps = [TopicPartition(topic, q) for q in range((await describe_partitions(s, [topic]))[topic])]
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            got = await client.list_consumer_group_offsets(group, partitions=tps)
            if all(tp in got and got[tp].metadata.endswith(current) for tp in tps):
                return
            await asyncio.sleep(0.2)
        raise AssertionError(f"{group} did not commit offsets of the new {topic} in {timeout_s:.0f} s")
    finally:
        await client.close()
        await inc.close()


async def _ranked_with(
    s: Settings, reg: TopicRegistry, ml, tag: str, *, histories: range, max_len: int, requests: range
) -> None:
    """Publish the ``max_len`` most recent behaviours of the ``histories`` users, then a request
    of each ``requests`` user; every request must be ranked with exactly the behaviours published
    here before it (a user without any is a cold start), by retrieval and the ranking worker."""
    behaviours, _ = leave_last_out(ml, histories, max_len=max_len, num_candidates=16)
    _, reqs = leave_last_out(ml, requests, num_candidates=16)
    reqs = [r.model_copy(update={"request_id": f"{tag}-{r.user_id}"}) for r in reqs]
    sent = await publish(s, reg, behaviours, reqs, qps=20, wait_for_ingest=True)
    ids = {r.request_id for r in sent}
    results = await collect_results(s, reg, ids, timeout_s=120)
    if set(results) != ids:
        missing = ids - set(results)
        where = await _how_far(s, reg, missing)
        raise AssertionError(f"{tag}: {len(missing)} requests without a result; last seen: {where}")
    retrieved = await _retrieved_history_lengths(s, reg, ids)
    for r in sent:
        want, got = len(history_of(behaviours, r.user_id, r.model_ts)), results[r.request_id]
        assert got.history_len == want and retrieved[r.request_id] == want, (
            f"{tag}: user {r.user_id} ranked with {got.history_len} events and retrieved with "
            f"{retrieved[r.request_id]}, {want} were published since its topics were created"
        )
        assert (got.path.value == "cold_start") == (want == 0), (tag, r.user_id, got.path)


async def _how_far(s: Settings, reg: TopicRegistry, ids: set[str]) -> dict[str, str]:
    """For each request id, the last topic of the cascade it reached (with partition and offset),
    so that a lost request says which stage lost it."""
    import json

    hops = ("requests", "routed_requests", "retrieved", "rank", "results")
    seen: dict[str, str] = {i: "nowhere" for i in ids}
    counts = await describe_partitions(s, [reg.name(role) for role in hops])
    for role in hops:
        cons = consumer(s, group_id=None)
        await cons.start()
        try:
            tps = [TopicPartition(reg.name(role), q) for q in range(counts.get(reg.name(role), 0))]
            cons.assign(tps)
            await cons.seek_to_beginning(*tps)
            ends = await cons.end_offsets(tps)
            deadline = asyncio.get_running_loop().time() + 20
            while asyncio.get_running_loop().time() < deadline and any(
                [await cons.position(tp) < end for tp, end in ends.items()]
            ):
                for msgs in (await cons.getmany(timeout_ms=200)).values():
                    for m in msgs:
                        rid = json.loads(m.value).get("request_id")
                        if rid in seen:
                            seen[rid] = f"{role}[{m.partition}]@{m.offset}"
        finally:
            await cons.stop()
    return seen


async def _retrieved_history_lengths(s: Settings, reg: TopicRegistry, ids: set[str]) -> dict[str, int]:
    cons = consumer(s, reg.name("retrieved"), group_id=None)
    await cons.start()
    out: dict[str, int] = {}
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while not ids <= out.keys() and asyncio.get_running_loop().time() < deadline:
            for msgs in (await cons.getmany(timeout_ms=200)).values():
                for m in msgs:
                    r = decode(RetrievedRequest, m.value)
                    if r.request_id in ids:
                        out[r.request_id] = r.history_len
    finally:
        await cons.stop()
    return out


async def _delete_and_recreate(s: Settings, reg: TopicRegistry) -> None:
    """Delete every topic of the deployment (the stages' changelogs and faust's own included),
    wait until no stage is assigned any of them, then create them all again, empty."""
    client = admin(s)
    await client.start()
    try:
        names = [t for t in await client.list_topics() if t.startswith(reg.prefix)]
    finally:
        await client.close()
    partitions = await describe_partitions(s, names)
    await delete_topics_with_prefix(s, reg.prefix)
    groups = [f"{reg.prefix}-{g}" for g in ("retrieval", "preprocess", "ranking")]
    await _wait_unassigned(s, groups, set(names))
    await _recreate(s, reg, {n: p for n, p in partitions.items() if n not in reg.names})


async def _wait_unassigned(s: Settings, groups: list[str], topics: set[str], timeout_s: float = 60) -> None:
    """Until every member of ``groups`` has been assigned none of ``topics`` (the stages have
    seen them go: their return is then a new assignment, not a silent change under them)."""
    from aiokafka.client import AIOKafkaClient
    from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment

    from relaygr.infra.local.broker import resolve_bootstrap

    finder = admin(s)
    client = AIOKafkaClient(bootstrap_servers=resolve_bootstrap(s), **kafka_client_kwargs(s))
    await finder.start()
    await client.bootstrap()
    try:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            still: set[str] = set()
            for group in groups:
                node = await finder.find_coordinator(group)
                for g in (await client.send(node, _DescribeGroups([group]))).to_object()["groups"]:
                    if g["state"] != "Stable":
                        still.add(g["group"])
                    for m in g["members"]:
                        if m["member_assignment"]:
                            a = ConsumerProtocolMemberAssignment.decode(m["member_assignment"])
                            still |= {t for t, _ in a.assignment} & topics
            if not still:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"still assigned after {timeout_s:.0f} s: {still}")
            await asyncio.sleep(0.5)
    finally:
        await client.close()
        await finder.close()


class _DescribeGroups(Request[DescribeGroupsRequest_v2]):
    """DescribeGroups at v2: aiokafka pairs its v3 request with the v2 response layout."""

    API_KEY = 15

    def __init__(self, groups: list[str]) -> None:
        self._groups = groups

    def build(self, request_struct_class: type[DescribeGroupsRequest_v2]) -> DescribeGroupsRequest_v2:
        return request_struct_class(self._groups)


async def _until_discarded(pipe, stages, reason: str, timeout_s: float = 180.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    waiting = set(stages)
    while waiting and loop.time() < deadline:
        waiting = {name for name in waiting if not _discard_counts(pipe.scrape(name))[reason]}
        await asyncio.sleep(0.5)
    assert not waiting, f"{sorted(waiting)} did not notice ({reason}) in {timeout_s:.0f} s"


def _discard_counts(metrics: Scrape) -> Counter[str]:
    by_reason = metrics.by_label("relaygr_state_discarded_total", "reason")
    return Counter({reason: int(n) for reason, n in by_reason.items()})
