"""A rolling restart whose old process dies in the middle of its hand-over, on the real broker.

One ranking worker of a two-worker deployment is replaced by a warm standby (``Pipeline.roll_worker``)
while confluent-kafka sends requests, and its old process is killed (SIGKILL) after it wrote its
positions to ``handover.json`` and before it said it answered what it held. The kill lands in that
window by construction, not by a race: ``RELAYGR_HANDOVER_STALL_S`` blocks the old process right
after it wrote ``handover.json``, and the test kills it while it is blocked (its audit trail then
says ``handed_over`` and never ``answered``).

No request is lost; a request has more than one result only where at least once allows it: it is
of the rolled worker's partitions, between the old process's last commit and its hand-over (the
range the new process says it ranked again: ``unanswered`` in ``events.jsonl``), and the new
process ranked every request of that range again. The workers commit only at the deployment's
start-up rebalance (``RELAYGR_COMMIT_INTERVAL_S``), so that range holds the requests the old process
took under load since: each one it had ranked has two results. The new process serves and joins, and the supervisor,
which had adopted the new process before the hand-over signal, counts no restart.

A second test adds another fault to the same window: the other worker stops while the old process
is blocked, so the group rebalances under the standby that serves outside it; then the old process
is killed. The same holds: none lost, duplicates only in the range ranked again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest
from aiokafka import TopicPartition
from rolling_setup import rolling_deployment, worker_events

from relaygr.infra.kafka import consumer, delete_topics_with_prefix, describe_partitions
from relaygr.infra.settings import Settings
from relaygr.schemas import RankRequest, decode
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.streams.state_lineage import deployment_dir
from relaygr.tools.long_users import long_users
from relaygr.tools.pipeline import Pipeline
from relaygr.tools.sender import BackgroundLoad
from relaygr.tools.traffic import count_results, publish
from relaygr.workers.training.movielens import load_movielens

pytest.importorskip("confluent_kafka")

pytestmark = [pytest.mark.broker, pytest.mark.slow(seconds=40)]

STALL_S = 600.0  # the old process stays blocked this long after handover.json: killed long before


async def _kill_mid_hand_over(
    files: WorkerFiles, old: subprocess.Popen, roll: asyncio.Future, timeout_s: float = 240.0
) -> tuple[dict[str, dict[int, int]], bool]:
    """Once ``old`` has written ``handover.json``, SIGKILL it (it is blocked there, by
    ``handover_stall_s``). Returns the offsets it handed over and whether it had said they were
    answered when it was killed."""
    deadline = time.monotonic() + timeout_s
    while (seen := files.read_handover()) is None or seen[1] != old.pid:
        if roll.done():
            roll.result()  # its error, if it failed
            raise AssertionError("the worker was rolled without a hand-over from its old process")
        assert time.monotonic() < deadline, f"no handover.json from pid {old.pid} within {timeout_s:.0f} s"
        await asyncio.sleep(0.01)
    answered = files.handover_answered()
    os.kill(old.pid, signal.SIGKILL)
    return seen[0], answered


async def _requests_at(settings: Settings, topic: str, ranges: dict[int, tuple[int, int]]) -> dict[str, int]:
    """request_id -> partition of the rank requests at the offsets ``ranges`` (partition ->
    [start, end)) of ``topic``."""
    found: dict[str, int] = {}
    if not ranges:
        return found
    reader = consumer(settings, group_id=None)
    await reader.start()
    try:
        todo = {TopicPartition(topic, p): (start, end) for p, (start, end) in ranges.items()}
        reader.assign(list(todo))
        for tp, (start, _) in todo.items():
            reader.seek(tp, start)
        deadline = time.monotonic() + 60
        while todo and time.monotonic() < deadline:
            for tp, msgs in (await reader.getmany(*todo, timeout_ms=200)).items():
                for m in msgs:
                    if m.offset < todo[tp][1]:
                        found[decode(RankRequest, m.value).request_id] = tp.partition
            for tp in list(todo):
                if await reader.position(tp) >= todo[tp][1]:
                    del todo[tp]
        assert not todo, f"could not read back the rank requests of {todo}"
    finally:
        await reader.stop()
    return found


async def _roll_under_load(settings: Settings, reg, pipe: Pipeline, behaviours, requests):
    """Once the deployment is up: the users' behaviours, then requests at 20/s from
    confluent-kafka, and a second later ranker-0 rolled (in a thread). Returns the load, the old
    process and the roll."""
    await pipe.wait_ready(timeout_s=240)
    # Not waited for: the ranking group commits nothing to say it applied them (a request
    # waits for its user's behaviours itself, boundedly).
    await publish(settings, reg, behaviours, [], settle_s=0)
    load = BackgroundLoad(settings, reg.name("requests"), requests, 20, client="librdkafka").start()
    await asyncio.sleep(1.0)
    old = pipe.procs["ranker-0"]
    return load, old, asyncio.ensure_future(asyncio.to_thread(pipe.roll_worker, 0))


async def _ranked_again(settings: Settings, reg, events: list[dict]) -> tuple[dict | None, dict, dict]:
    """The new process's ``unanswered`` line (None: none), the ranges it ranked again (partition
    -> [start, end)) and the requests in them (request_id -> partition)."""
    gone = next((e for e in events if e["event"] == "unanswered"), None)
    ranges = {int(p): (a, b) for p, (a, b) in gone["ranked_again"].items()} if gone else {}
    return gone, ranges, await _requests_at(settings, reg.name("rank"), ranges)


async def _copies(settings: Settings, topic: str) -> dict[str, int]:
    """request_id -> how many rank requests ``topic`` holds for it. Pre-processing forwards at least
    once: a rebalance of its own group (its table's changelog appearing in its metadata late, on
    a loaded machine) forwards its last uncommitted requests again, and each copy is a request
    the ranking worker answers. Duplicates are judged per copy."""
    reader = consumer(settings, group_id=None)
    await reader.start()
    copies: dict[str, int] = {}
    try:
        count = (await describe_partitions(settings, [topic])).get(topic, 0)
        tps = [TopicPartition(topic, p) for p in range(count)]
        assert tps, f"{topic} has no partitions"
        ends = await reader.end_offsets(tps)
        reader.assign(tps)
        await reader.seek_to_beginning(*tps)
        todo = {tp for tp in tps if ends[tp] > 0}
        deadline = time.monotonic() + 60
        while todo and time.monotonic() < deadline:
            for msgs in (await reader.getmany(*todo, timeout_ms=200)).values():
                for m in msgs:
                    rid = decode(RankRequest, m.value).request_id
                    copies[rid] = copies.get(rid, 0) + 1
            todo = {tp for tp in todo if await reader.position(tp) < ends[tp]}
        assert not todo, f"could not read back the rank requests of {todo}"
    finally:
        await reader.stop()
    return copies


def _beyond_copies(counts: dict[str, int], copies: dict[str, int], again: dict) -> dict[str, tuple[int, int]]:
    """The requests with more results than at least once allows: one a copy, and one more a copy
    for those ranked again after the old process died unanswered. request_id -> (results, copies)."""
    return {
        k: (c, copies.get(k, 1)) for k, c in counts.items() if c > copies.get(k, 1) * (2 if k in again else 1)
    }


async def test_old_process_killed_mid_hand_over_under_load(kafka_settings, tmp_path, model_dir) -> None:
    settings, reg, env = await rolling_deployment(
        kafka_settings,
        tmp_path,
        model_dir,
        "rollkill",
        handover_stall_s=STALL_S,
        # No commit while the test runs (none but at the start's rebalance): every request the old
        # process took under load is after its last commit, so the range it leaves unanswered is
        # known (and not empty: the requests it ranked, each of which then has two results).
        commit_interval_s=3600.0,
    )
    behaviours, requests = long_users(load_movielens("ml-100k"), 8, 60, tag="roll")
    folder = deployment_dir(settings, "workers") / "ranker-0"
    pipe = Pipeline(settings, ranking_workers=2, env=env)
    pipe.start()
    try:
        load, old, roll = await _roll_under_load(settings, reg, pipe, behaviours, requests)
        handed, answered_at_kill = await _kill_mid_hand_over(WorkerFiles(folder), old, roll)
        took = await roll
        await asyncio.sleep(2.0)
        sent = await asyncio.to_thread(load.stop)
        new_pid = pipe.procs["ranker-0"].pid
        results, counts = await count_results(settings, reg, {r.request_id for r in sent}, timeout_s=120)
        # The supervisor adopted the standby before the hand-over signal: the killed process was no
        # longer ranker-0's, so its death is not a crash of the stage and nothing is restarted.
        assert pipe.restarts["ranker-0"] == 0, "the old process's death was counted as a crash of ranker-0"
        pipe.check()
        events = worker_events(folder)
        gone, ranges, again = await _ranked_again(settings, reg, events)
        copies = await _copies(settings, reg.name("rank"))
    finally:
        pipe.stop()
        await delete_topics_with_prefix(settings, settings.topic_prefix)
    kinds = [e["event"] for e in events]
    # The kill landed in the window: positions written, nothing answered (else this test proves nothing).
    assert not answered_at_kill and "handed_over" in kinds and "answered" not in kinds, kinds
    assert old.returncode == -signal.SIGKILL, old.returncode
    # The new process saw the old one gone unanswered, and said what it ranks again.
    assert gone is not None, "the new process never noticed that the old one died unanswered"
    rolled = set(handed[reg.name("rank")])
    assert set(ranges) <= rolled and all(a < b <= handed[reg.name("rank")][p] for p, (a, b) in ranges.items())
    # No request lost.
    assert set(results) == {r.request_id for r in sent}, "lost results"
    # Duplicates only where at least once allows them: requests the new process ranked again
    # (and, per copy, requests pre-processing forwarded twice).
    assert not _beyond_copies(counts, copies, again), _beyond_copies(counts, copies, again)
    duplicated = {k for k, c in counts.items() if c > copies.get(k, 1)}
    partitions = {e["request_id"]: e["partition"] for e in events if e["event"] == "result"}
    assert all(partitions.get(k) in rolled for k in duplicated), "a duplicate from another worker's partition"
    # Every request of the range the new process did rank again (its results after its note); so
    # each one the old process had ranked (its results before its hand-over) has two results.
    after_gone = {e["request_id"] for e in events[events.index(gone) :] if e["event"] == "result"}
    assert set(again) <= after_gone, set(again) - after_gone
    handed_at = kinds.index("handed_over")
    old_ranked = {e["request_id"] for e in events[:handed_at] if e["event"] == "result"} & set(again)
    assert old_ranked & set(counts), "the old process ranked no request under load after its last commit"
    assert old_ranked & set(counts) <= duplicated, (old_ranked & set(counts)) - duplicated
    # The new process serves and joins.
    assert new_pid != old.pid and set(took) == {"warm", "serving", "joined", "old_exit"}
    assert {"standby_ready", "handed_over", "took_over", "unanswered", "joined"} <= set(kinds)
    assert kinds.index("handed_over") < kinds.index("unanswered") < kinds.index("joined")
    assert "result" in kinds[kinds.index("took_over") :], "the new process ranked nothing"
    # Its state generation is the current one.
    assert WorkerFiles(folder).state_dir().name.startswith("gen-")


async def _until_event(folder, kind: str, after: str | None = None, timeout_s: float = 120.0) -> None:
    """Until the worker's audit trail has a line ``kind`` (after the first ``after`` line)."""
    deadline = time.monotonic() + timeout_s
    while True:
        kinds = [e["event"] for e in worker_events(folder)] if (folder / "events.jsonl").exists() else []
        start = kinds.index(after) if after in kinds else (None if after else 0)
        if start is not None and kind in kinds[start:]:
            return
        assert time.monotonic() < deadline, (
            f"no {kind!r} in {folder.name}'s audit trail within {timeout_s:.0f} s"
        )
        await asyncio.sleep(0.05)


@pytest.mark.slow(seconds=70)
async def test_a_rebalance_during_the_hand_over_then_the_old_process_killed(
    kafka_settings, tmp_path, model_dir
) -> None:
    """Two faults in one hand-over. While the old process blocks after writing ``handover.json``
    (the standby serves its partitions outside the group and has joined it), the other worker
    stops: its session runs out and the group rebalances under the standby. Then the old process
    is killed before it answered. The standby commits nothing of the revoked partitions before it
    knows what the old process left unanswered (it ranks those again first), switches to the
    group with every partition, and no request is lost; a request has two results only where the
    old process ranked it and the standby ranked it again."""
    settings, reg, env = await rolling_deployment(
        kafka_settings, tmp_path, model_dir, "rolldouble", handover_stall_s=STALL_S
    )
    behaviours, requests = long_users(load_movielens("ml-100k"), 8, 60, tag="rolldouble")
    folder = deployment_dir(settings, "workers") / "ranker-0"
    pipe = Pipeline(settings, ranking_workers=2, env=env)
    pipe.start()
    try:
        load, old, roll = await _roll_under_load(settings, reg, pipe, behaviours, requests)
        # The standby took over and joined (its first assignment), while the old process blocks.
        await _until_event(folder, "assigned", after="took_over", timeout_s=240)
        handover = WorkerFiles(folder).read_handover()
        assert old.poll() is None and handover is not None and not WorkerFiles(folder).handover_answered()
        pipe.stop_worker(1)  # its partitions move once its session times out: a rebalance
        await _until_event(folder, "revoked_during_hand_over", after="took_over")
        os.kill(old.pid, signal.SIGKILL)
        took = await roll
        await asyncio.sleep(2.0)
        sent = await asyncio.to_thread(load.stop)
        results, counts = await count_results(settings, reg, {r.request_id for r in sent}, timeout_s=120)
        assert pipe.restarts["ranker-0"] == 0
        events = worker_events(folder)
        gone, ranges, again = await _ranked_again(settings, reg, events)
        copies = await _copies(settings, reg.name("rank"))
    finally:
        pipe.stop()
        await delete_topics_with_prefix(settings, settings.topic_prefix)
    kinds = [e["event"] for e in events]
    assert "answered" not in kinds and old.returncode == -signal.SIGKILL, kinds
    # The rebalance came during the hand-over, and before the standby said what it ranks again.
    assert kinds.index("took_over") < kinds.index("revoked_during_hand_over") < kinds.index("unanswered")
    assert set(took) == {"warm", "serving", "joined", "old_exit"}
    (joined,) = [e for e in events if e["event"] == "joined"]
    assert joined["partitions"] == [0, 1, 2, 3], joined  # its own and the stopped worker's
    # What it ranked again lies before the hand-over's offsets, in the partitions handed over.
    handed = handover[0][reg.name("rank")]
    assert gone is not None and all(a < b <= handed[p] for p, (a, b) in ranges.items()), (gone, handed)
    # No request lost; duplicates only where at least once allows them.
    assert set(results) == {r.request_id for r in sent}, "lost results"
    assert not _beyond_copies(counts, copies, again), _beyond_copies(counts, copies, again)
