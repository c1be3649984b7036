"""Faults on a local 3-broker cluster (replication factor 3, min.insync.replicas 2): a broker
crashing during a replay and coming back, and a ranking worker joining and leaving under load.

The cluster is started once for the module (three small-heap JVMs from the same jars as the single
broker) and stopped at its end through the CLI, which also reports the crashed node and revives
it; each test runs a deployment of its own (topic prefix, state) under `relaygr up`'s supervisor.
Assertions are counts: every request answered, one answer per request id when the results are read
as a table, each worker's history equal to what was produced, paths that follow where the prefixes
live. Times (failover, catch-up, a history rebuilt) are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_checks import histories_by_user, read_results, worker_history

from relaygr.infra.kafka import admin, delete_topics_with_prefix, ensure_topics, partition_for, producer
from relaygr.infra.local import broker
from relaygr.infra.settings import Settings
from relaygr.infra.stop_guard import process_alive
from relaygr.schemas import RecommendationRequest, TopicRegistry, encode
from relaygr.tools.barriers import wait_groups_caught_up
from relaygr.tools.pipeline import Pipeline
from relaygr.tools.traffic import collect_results, leave_last_out, publish
from relaygr.workers.training.movielens import load_movielens

pytestmark = [pytest.mark.broker, pytest.mark.slow]
PARTITIONS = 4


@dataclass(frozen=True)
class Cluster:
    nodes: Settings  # where the cluster is recorded (for kill_node / start_node)
    client: Settings  # the clients' settings: bootstrap = every node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    nodes = Settings(home=tmp_path_factory.mktemp("cluster-home"), broker_heap="384m", bootstrap=None)
    state = broker.start(nodes, quiet=True, brokers=3)
    try:
        yield Cluster(nodes, nodes.model_copy(update={"bootstrap": state.bootstrap}))
    finally:
        broker.stop(nodes)


@pytest.fixture(scope="module")
def ml():
    return load_movielens("ml-100k")


def env(model_dir: Path, **extra: str) -> dict[str, str]:
    return {
        "RELAYGR_MODEL_DIR": str(model_dir),
        "RELAYGR_CALIBRATION_FILE": str(model_dir / "calibration.json"),
        # Long enough that a request waiting out a broker's failover is still ranked, not timed out,
        # with every history "at risk" all the same (budget × θ = 30 µs).
        "RELAYGR_BUDGET_MS": "30000",
        "RELAYGR_THETA": "0.000001",
        "RELAYGR_SHORT_TERM": "8",
        **extra,
    }


async def deployment(c: Cluster, tmp_path: Path) -> tuple[Settings, TopicRegistry]:
    prefix = f"cl-{uuid.uuid4().hex[:8]}"
    s = c.client.model_copy(
        update={"topic_prefix": prefix, "home": tmp_path / "home", "partitions": PARTITIONS}
    )
    reg = TopicRegistry(prefix, PARTITIONS)
    await ensure_topics(reg, s)
    return s, reg


async def replica_sets(s: Settings, prefix: str) -> dict[tuple[str, int], tuple[list[int], list[int]]]:
    """(replicas, in-sync replicas) of every partition of every topic starting with ``prefix``."""
    client = admin(s)
    await client.start()
    try:
        names = [t for t in await client.list_topics() if t.startswith(prefix)]
        return {
            (t["topic"], p["partition"]): (list(p["replicas"]), list(p["isr"]))
            for t in await client.describe_topics(names)
            for p in t["partitions"]
        }
    finally:
        await client.close()


async def leader(s: Settings, topic: str, partition: int) -> int:
    client = admin(s)
    await client.start()
    try:
        [t] = await client.describe_topics([topic])
        return next(p["leader"] for p in t["partitions"] if p["partition"] == partition)
    finally:
        await client.close()


def ids(requests: list[RecommendationRequest]) -> set[str]:
    return {r.request_id for r in requests}


def _cli(args: list[str], home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RELAYGR_HOME": str(home), "RELAYGR_BROKER_HEAP": "384m"}
    env.pop("RELAYGR_BOOTSTRAP", None)
    return subprocess.run(
        [sys.executable, "-m", "relaygr.cli", *args], capture_output=True, text=True, env=env, timeout=240
    )


@pytest.mark.slow(seconds=300)  # the cluster's start (three brokers) included
async def test_broker_crash_during_a_replay_loses_nothing(cluster, tmp_path, model_dir, ml) -> None:
    s, reg = await deployment(cluster, tmp_path)
    first_users, later_users = range(1, 101), range(101, 161)
    behaviours, requests = leave_last_out(ml, first_users, num_candidates=32)
    later_behaviours, later_requests = leave_last_out(ml, later_users, num_candidates=32)
    produced = histories_by_user(behaviours + later_behaviours)
    pipe = Pipeline(s, ranking_workers=2, env=env(model_dir))
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        # Every topic of the deployment, the faust stages' changelogs included, has 3 replicas.
        layout = await replica_sets(s, s.topic_prefix)
        assert layout and all(len(replicas) == 3 for replicas, _ in layout.values()), layout
        await publish(s, reg, behaviours, [], wait_for_ingest=True)
        victim = await leader(s, reg.name("results"), 0)
        sending = asyncio.create_task(publish(s, reg, [], requests, qps=20, settle_s=0.0))
        await asyncio.sleep(1.5)  # requests are flowing
        t_kill = time.monotonic()
        await asyncio.to_thread(broker.kill_node, cluster.nodes, victim)  # SIGKILL: a crash
        # Behaviours keep coming while the node is down; none may be lost.
        await publish(s, reg, later_behaviours, [], settle_s=0.0)
        sent = await sending
        # Answered while the node is still down: the cascade carried on by itself.
        during = await collect_results(s, reg, ids(sent), timeout_s=180)
        answered_down_s = time.monotonic() - t_kill
        assert set(during) == ids(sent), f"{len(ids(sent) - set(during))} requests unanswered"
        # Still down, and `broker status` says so, node by node.
        degraded = await asyncio.to_thread(_cli, ["broker", "status"], cluster.nodes.home)
        assert degraded.returncode == 1 and degraded.stdout.startswith("degraded"), degraded.stdout
        assert f"node {victim} down" in degraded.stdout
        assert degraded.stdout.count(" up bootstrap=") == 2

        # `broker start` brings the node back; its replicas catch up with the leaders.
        t_back = time.monotonic()
        revived = await asyncio.to_thread(_cli, ["broker", "start", "--brokers", "3"], cluster.nodes.home)
        assert revived.returncode == 0, revived.stderr
        assert revived.stdout.strip() == f"bootstrap={cluster.client.bootstrap}"  # the same nodes
        caught_up = await _until_in_sync(s, s.topic_prefix, victim)
        status = await asyncio.to_thread(_cli, ["broker", "status"], cluster.nodes.home)
        assert status.returncode == 0 and status.stdout.startswith("up") and "nodes=3" in status.stdout
        assert [ln.split()[:3] for ln in status.stdout.splitlines()[1:]] == [
            ["node", str(i), "up"] for i in (1, 2, 3)
        ]
        caught_up_s = time.monotonic() - t_back
        await wait_groups_caught_up(s, reg)
        sent += await publish(s, reg, [], later_requests, qps=20, settle_s=0.0)
        results = await collect_results(s, reg, ids(sent), timeout_s=180)
        table, copies = await read_results(s, reg)
        pipe.check()
        restarts = dict(pipe.restarts)
    finally:
        pipe.stop()
    try:
        assert caught_up, "the restarted node's replicas did not rejoin the ISR"
        assert set(results) == ids(sent)
        answered = {rid: r for rid, r in table.items() if rid in ids(sent)}
        assert set(answered) == ids(sent) and len(answered) == len(sent)  # one per request id
        # No behaviour lost or applied twice: each ranked history is exactly what was produced,
        # and so is the history table of the worker that ranked it.
        cut = {r.request_id: r.model_ts for r in sent}
        for r in answered.values():
            seen = [e for e in produced[r.user_id] if e[2] < cut[r.request_id]]  # a ranking sees the past
            assert r.history_complete and r.history_len == len(seen), r.request_id
            assert worker_history(s.home, s.topic_prefix, r.worker_id, r.user_id) == produced[r.user_id]
        redelivered = sum(n - 1 for rid, n in copies.items() if rid in answered)
        print(
            f"\nbroker {victim} of 3 killed (SIGKILL) mid-replay: sent {len(sent)}, answered "
            f"{len(answered)}, lost 0, result records beyond one per request {redelivered}, "
            f"behaviours {sum(map(len, produced.values()))} all in the histories; stage restarts "
            f"{restarts or 'none'}; requests sent before the crash answered {answered_down_s:.1f} s after "
            f"it with the node still down; the node back in sync {caught_up_s:.1f} s after its restart"
        )
    finally:
        await delete_topics_with_prefix(s, s.topic_prefix)


async def _until_in_sync(s: Settings, prefix: str, node_id: int, timeout_s: float = 180.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        layout = await replica_sets(s, prefix)
        if all(node_id in isr for replicas, isr in layout.values() if node_id in replicas):
            return True
        await asyncio.sleep(0.5)
    return False


@pytest.mark.slow(seconds=95)
async def test_a_worker_joins_and_leaves_under_load(cluster, tmp_path, model_dir, ml) -> None:
    """Two ranking workers, then a third on a host of its own (its own RELAYGR_HOME), then the two.
    The trigger's token bucket admits its burst of 50 pre-inferences and then (about) none: the
    first round's 40 requests leave a cached prefix on their workers, and afterwards a relay path
    can only come from a prefix cached by an earlier ranking on the same worker."""
    s, reg = await deployment(cluster, tmp_path)
    long_users = [u for u in sorted(ml.histories) if len(ml.histories[u]) >= 80]
    cached_users, load_users = long_users[:40], long_users[40:80]
    behaviours, first = leave_last_out(ml, cached_users, num_candidates=32)
    load_behaviours, load_template = leave_last_out(ml, load_users, num_candidates=32)
    produced = histories_by_user(behaviours + load_behaviours)
    joined_home = tmp_path / "host-2"
    pipe = Pipeline(s, ranking_workers=2, env=env(model_dir, RELAYGR_PREFILL_RATE_PER_S="0.001"))
    pipe.start()
    load_sent: list[RecommendationRequest] = []
    stop_load = asyncio.Event()
    try:
        await pipe.wait_ready(timeout_s=240)
        await publish(s, reg, behaviours + load_behaviours, [], wait_for_ingest=True)
        # Round 1: each cached user's prefix is pre-inferred and ranked on its partition's worker.
        sent1 = await publish(s, reg, [], first, qps=10, settle_s=0.0)
        round1 = await collect_results(s, reg, ids(sent1), timeout_s=180)
        assert set(round1) == ids(sent1)
        assert all(r.path.value.startswith("relay") for r in round1.values()), _paths(round1)
        owner = {r.user_id: r.worker_id for r in round1.values()}

        # Load throughout the join and the leave: the other users' requests, again and again.
        loading = asyncio.create_task(_load(s, reg, load_template, load_sent, stop_load, qps=4.0))
        await _until(lambda: len(load_sent) >= 20, "the first load requests sent")
        load_early = await collect_results(s, reg, ids(load_sent[:20]), timeout_s=180)
        assert len(load_early) == 20  # they took the bucket's last tokens

        # A third worker joins, with state of its own: it rebuilds its partitions' histories.
        pipe.start_worker(2, home=joined_home)
        notes = await _caught_up_notes(joined_home, s.topic_prefix, "ranker-2")
        moved = {n["partition"] for n in notes}
        sent3 = await publish(s, reg, [], _again(first, "r3"), qps=10, settle_s=0.0)
        round3 = await collect_results(s, reg, ids(sent3), timeout_s=180)

        # The third worker leaves (a static member: its partitions move after the session timeout).
        pipe.stop_worker(2)
        sent5 = await publish(s, reg, [], _again(first, "r5"), qps=10, settle_s=0.0)
        round5 = await collect_results(s, reg, ids(sent5), timeout_s=180)
        stop_load.set()
        await loading
        load_results = await collect_results(s, reg, ids(load_sent), timeout_s=180)
        table, _ = await read_results(s, reg)
        pipe.check()
        restarts = dict(pipe.restarts)
    finally:
        stop_load.set()
        pipe.stop()
    try:
        assert moved, "the joining worker got no partition"
        assert set(round3) == ids(sent3) and set(round5) == ids(sent5), "a request was lost or stuck"
        assert set(load_results) == ids(load_sent), "a request under load was lost or stuck"
        for rid in ids(sent1) | ids(sent3) | ids(sent5) | ids(load_sent):
            assert rid in table
        # Round 3: users of the moved partitions are ranked by the new worker, in full (their
        # prefix lives on the old owner); the others stay and rank against their cached prefix.
        moved_users = {u for u in owner if partition_for(u.encode(), PARTITIONS) in moved}
        cut3 = {r.request_id: r.model_ts for r in sent3}
        assert moved_users and moved_users != set(owner)
        for r in round3.values():
            if r.user_id in moved_users:
                assert r.worker_id == "ranker-2" and r.path.value == "full", r
                assert r.prefix_worker_id is None and r.prefix_len == 0
            else:
                assert r.worker_id == owner[r.user_id] and r.path.value.startswith("relay"), r
                assert r.prefix_worker_id == r.worker_id
            # The joining worker's rebuilt histories are complete (a ranking sees the events before it).
            seen = [e for e in produced[r.user_id] if e[2] < cut3[r.request_id]]
            assert r.history_complete and r.history_len == len(seen), r.request_id
        # Round 5: after the leave, every partition is back on its first owner.
        assert {r.user_id: r.worker_id for r in round5.values()} == owner
        # Everywhere: a cached prefix is only ever used on the worker that computed it.
        for r in [*round1.values(), *round3.values(), *round5.values(), *load_results.values()]:
            if r.path.value.startswith("relay"):
                assert r.prefix_worker_id == r.worker_id, r
        # The rebuilt partitions hold every event produced for them, and the joined worker's table
        # is what was produced, user by user.
        for n in notes:
            users = [u for u in produced if partition_for(u.encode(), PARTITIONS) == n["partition"]]
            assert n["events"] == sum(len(produced[u]) for u in users), n
            for u in users:
                assert worker_history(joined_home, s.topic_prefix, "ranker-2", u) == produced[u]
        rebuilt = ", ".join(
            f"partition {n['partition']}: {n['events']} events ({n['records']} records) in {n['seconds']:.2f} s"
            for n in notes
        )
        print(
            f"\nranker-2 joined and left under load: rounds of {len(sent1)} requests before, during and "
            f"after; {len(load_sent)} load requests, all answered; moved partitions {sorted(moved)} "
            f"({len(moved_users)} users ranked in full on the new owner); rebuilt {rebuilt}; "
            f"stage restarts {restarts or 'none'}"
        )
    finally:
        await delete_topics_with_prefix(s, s.topic_prefix)


@pytest.mark.slow(seconds=20)
def test_stop_ends_every_node_and_removes_the_data(cluster) -> None:
    """Last in the module: the fixture's own stop then finds nothing left to do."""
    state = broker.read_state(cluster.nodes)
    assert state is not None
    mismatch = _cli(["broker", "start"], cluster.nodes.home)  # one node asked for, three running
    assert mismatch.returncode == 1 and "3 node(s) is already running" in mismatch.stderr
    stopped = _cli(["broker", "stop"], cluster.nodes.home)
    assert stopped.returncode == 0
    assert not any(broker.port_open(n.port) for n in state.nodes)
    assert not any(process_alive(n.pid) for n in state.nodes)  # gone (or a zombie of this process)
    for n in state.nodes:
        broker._reap(n.pid)
    assert not Path(state.data_dir).exists() and broker.read_state(cluster.nodes) is None


def _paths(results) -> dict[str, int]:
    return dict(Counter(r.path.value for r in results.values()))


def _again(requests: list[RecommendationRequest], tag: str) -> list[RecommendationRequest]:
    """The same users' requests once more, under new request ids."""
    return [r.model_copy(update={"request_id": f"{r.request_id}-{tag}"}) for r in requests]


async def _load(
    s: Settings,
    reg: TopicRegistry,
    template: list[RecommendationRequest],
    sent: list[RecommendationRequest],
    stop: asyncio.Event,
    *,
    qps: float,
) -> None:
    """Send the template's requests round after round, at ``qps``, until ``stop`` is set."""
    prod = producer(s, linger_ms=0)
    await prod.start()
    try:
        i = 0
        while not stop.is_set():
            r = template[i % len(template)]
            r = r.model_copy(update={"request_id": f"{r.request_id}-load{i}", "ts": time.time()})
            await prod.send_and_wait(reg.name("requests"), encode(r), key=r.key())
            sent.append(r)
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1 / qps)
    finally:
        await prod.stop()


async def _until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        await asyncio.sleep(0.1)


async def _caught_up_notes(home: Path, prefix: str, worker: str, timeout_s: float = 240.0) -> list[dict]:
    """The worker's ``history_caught_up`` notes, once it has one for every behaviours partition
    of its latest assignment (from its own event log)."""
    log = home / "workers" / prefix / worker / "events.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists():
            notes = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
            assigned = [n["partitions"] for n in notes if n.get("event") == "assigned"]
            caught = {n["partition"]: n for n in notes if n.get("event") == "history_caught_up"}
            if assigned and assigned[-1] and set(assigned[-1]) <= set(caught):
                return [caught[p] for p in assigned[-1]]
        await asyncio.sleep(0.2)
    raise AssertionError(f"{worker} did not rebuild its histories within {timeout_s:.0f} s")
