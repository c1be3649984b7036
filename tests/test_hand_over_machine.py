"""The hand-over state machine (``streams.ranking.hand_over.HandOver``), one test per transition of
its table, no broker: the consumers are stand-ins over an in-memory log (offsets per partition,
committed offsets); the worker's partitions (``Partitions``), its intake (``Intake``), the rebalance
listener (``RankRebalance``) and the hand-over files (``WorkerFiles``) are the real ones. The
faults: the old process exits without handing over, exits before answering what it held (its
requests after its last commit ranked again), and a second fault during a hand-over (a rebalance
while the standby serves outside the group, or while the old process drains)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition

from relaygr.infra.settings import Settings
from relaygr.schemas import TopicRegistry
from relaygr.streams.ranking import hand_over as hand_over_module
from relaygr.streams.ranking import intake as intake_module
from relaygr.streams.ranking.hand_over import HandOver, IllegalTransition, State
from relaygr.streams.ranking.history_applier import BehaviourApplier
from relaygr.streams.ranking.intake import Intake
from relaygr.streams.ranking.partitions import Partitions
from relaygr.streams.ranking.worker_files import WorkerFiles

REG = TopicRegistry("p", 2)
BEH, SIG, RANK = REG.name("routed_behaviors"), REG.name("prefill"), REG.name("rank")


def _tp(topic: str, p: int) -> TopicPartition:
    return TopicPartition(topic, p)


def _all(*partitions: int) -> set[TopicPartition]:
    return {TopicPartition(t, p) for t in (BEH, SIG, RANK) for p in partitions}


class Log:
    """The broker as the stand-in consumers see it: each partition's end offset, the group's
    committed offsets, the log's start, and every commit in order."""

    def __init__(self) -> None:
        self.ends: dict[TopicPartition, int] = {}
        self.committed: dict[TopicPartition, int] = {}
        self.start = 0
        self.commits: list[dict[TopicPartition, int]] = []
        self.group_assignment: set[TopicPartition] = set()


class Consumer:
    """An aiokafka consumer over ``Log``: a group member's (``group_id``) or one outside."""

    def __init__(self, log: Log, group_id: str | None) -> None:
        self.log, self.group_id = log, group_id
        self.assigned: set[TopicPartition] = set()
        self.at: dict[TopicPartition, int] = {}
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.listener = None
        self.stopped = False

    def subscribe(self, topics: list[str], listener) -> None:
        self.listener = listener

    async def start(self) -> None:
        if self.listener is not None:  # the first rebalance: nothing revoked, then the assignment
            await self.listener.on_partitions_revoked(set())
            self.assigned = set(self.log.group_assignment)
            await self.listener.on_partitions_assigned(set(self.assigned))

    async def stop(self) -> None:
        self.stopped = True

    def assign(self, tps) -> None:
        self.assigned = set(tps)

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def seek(self, tp: TopicPartition, at: int) -> None:
        self.seeks.append((tp, at))
        self.at[tp] = at

    async def seek_to_end(self, tp: TopicPartition) -> None:
        self.at[tp] = self.log.ends.get(tp, 0)

    async def seek_to_beginning(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self.at[tp] = self.log.start

    async def position(self, tp: TopicPartition) -> int:
        return self.at.get(tp, self.log.committed.get(tp, self.log.start))

    async def getmany(
        self, *tps: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict:
        out = {}
        for tp in tps or self.assigned:
            start, end = await self.position(tp), self.log.ends.get(tp, 0)
            if start < end:
                out[tp] = [SimpleNamespace(offset=o) for o in range(start, end)]
                self.at[tp] = end
        return out

    async def end_offsets(self, tps) -> dict:
        return {tp: self.log.ends.get(tp, 0) for tp in tps}

    async def committed(self, tp: TopicPartition) -> int | None:
        return self.log.committed.get(tp)

    async def beginning_offsets(self, tps) -> dict:
        return {tp: self.log.start for tp in tps}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0, 1}

    async def commit(self, offsets: dict) -> None:
        assert self.group_id is not None, "a commit outside the group"
        self.log.committed.update(offsets)
        self.log.commits.append(dict(offsets))

    def pause(self, *tps) -> None: ...

    def resume(self, *tps) -> None: ...


class Dispatch:
    """The Kafka shell as the machine sees it: what it took (started, not yet finished)."""

    def __init__(self, partitions: Partitions) -> None:
        self.partitions = partitions
        self.taken: list[tuple[str, int, int]] = []
        self.prefills_cancelled = 0
        self.acks = False  # True: each result is acknowledged as soon as it is taken

    def take(self, tp: TopicPartition, m) -> None:
        self.partitions.start(tp, m.offset)
        self.taken.append((tp.topic, tp.partition, m.offset))
        if self.acks:
            self.partitions.done(tp, m.offset)

    def finish(self) -> None:
        """Every request taken has its result."""
        for topic, p, offset in self.taken:
            self.partitions.done(TopicPartition(topic, p), offset)

    async def cancel_prefills(self) -> None:
        self.prefills_cancelled += 1


class Lineage:
    async def verify(self, topic: str, partitions) -> dict:
        return {}

    async def watch(self, consumer, topic: str) -> None: ...

    async def close(self) -> None: ...


class Incarnations:
    async def stale(self, group: str, tps) -> set:
        return set()

    def stamp(self, offsets: dict) -> dict:
        return offsets


class Rig(SimpleNamespace):
    machine: HandOver
    partitions: Partitions
    intake: Intake
    files: WorkerFiles
    dispatch: Dispatch
    log: Log
    notes: list[dict]
    made: list[Consumer]

    def events(self) -> list[str]:
        return [n["event"] for n in self.notes]


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def build(*, standby: bool) -> Rig:
        log, made, notes, paced, inherited = Log(), [], [], [], []

        def new_consumer(settings, group_id=None, **kw) -> Consumer:
            made.append(Consumer(log, group_id))
            return made[-1]

        monkeypatch.setattr(intake_module, "new_consumer", new_consumer)
        monkeypatch.setattr(hand_over_module, "new_consumer", new_consumer)
        history = SimpleNamespace(next_offset=lambda p: 100 + p)  # the history table's own offsets
        alignment = SimpleNamespace(forgot=[], fetched=lambda p, records: None, notify=lambda: None)
        alignment.forget = alignment.forgot.append
        engine = SimpleNamespace(
            store=None,
            latency_samples=lambda: [(64, 5.0)],
            scheduler=SimpleNamespace(pace=paced.append),
            inherit_latency_samples=inherited.append,
        )
        applier = BehaviourApplier(
            history, alignment, engine, lambda m: m, lambda m, r: None, lambda **f: None
        )  # type: ignore[arg-type]
        partitions = Partitions(REG, history, alignment, applier, Lineage())  # type: ignore[arg-type]
        # The fake consumers fetch by themselves (no librdkafka behind them).
        settings = Settings(home=tmp_path, topic_prefix="p", partitions=2, fetch_client="aiokafka")
        intake = Intake(settings, REG, "ranker-0", Incarnations())  # type: ignore[arg-type]
        files = WorkerFiles(tmp_path / "ranker-0")
        dispatch = Dispatch(partitions)
        machine = HandOver(
            standby=standby,
            worker_id="ranker-0",
            settings=settings,
            pipeline=SimpleNamespace(handover_stall_s=0.0),  # type: ignore[arg-type]
            files=files,
            generation=files.folder / "gen-2",
            partitions=partitions,
            intake=intake,
            dispatch=dispatch,
            engine=engine,  # type: ignore[arg-type]
            note=lambda **fields: notes.append(fields),
        )
        return Rig(
            machine=machine, partitions=partitions, intake=intake, files=files, dispatch=dispatch,
            log=log, notes=notes, made=made, paced=paced, inherited=inherited, alignment=alignment,
        )  # fmt: skip

    return build


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drains and waits that give up at once (the faults where they never end)."""
    monkeypatch.setattr(hand_over_module, "DRAIN_S", 0.05)
    monkeypatch.setattr(hand_over_module, "REVOKE_DRAIN_S", 0.05)
    monkeypatch.setattr(hand_over_module, "SETTLE_WAIT_S", 0.2)


def _gone_pid() -> int:
    """The pid of a process that has exited."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


async def _serving(rig, assignment: set[TopicPartition]) -> Rig:
    """An active worker, a member of the group with ``assignment``."""
    r = rig(standby=False)
    r.log.group_assignment = assignment
    await r.intake.start_group(r.machine)
    return r


async def _standing_by(rig, partitions: list[int]) -> Rig:
    """A standby reading ``partitions`` outside the group, its histories caught up."""
    r = rig(standby=True)
    r.machine.warm()
    await r.intake.start_outside()
    await r.machine.stand_by(partitions)
    return r


async def _outside(rig, partitions: list[int], handed: dict[int, int], old_pid: int | None, **kw) -> Rig:
    """A standby that took over ``partitions`` at ``handed`` (request partition -> offset) from
    ``old_pid`` and joined the group (not yet switched)."""
    r = await _standing_by(rig, partitions)
    for p, end in kw.get("kept", {}).items():  # requests fetched while it stood by
        r.log.ends[_tp(RANK, p)] = end
    await _fetch_into_kept(r)
    r.machine.warmed()
    r.machine.ready(1.0)
    offsets = {RANK: handed, SIG: dict.fromkeys(handed, 0)} if old_pid is not None else {}
    await r.machine.take_over(offsets, old_pid)
    r.log.group_assignment = _all(*partitions)
    r.machine.joined(await r.intake.join(r.machine))
    return r


async def _fetch_into_kept(r: Rig) -> None:
    """One fetch of the loop: requests of kept partitions are kept."""
    for tp, msgs in (await r.intake.consumer.getmany()).items():
        assert r.partitions.keep(tp, msgs) or r.partitions.holds(tp) or tp.topic == BEH


# ---------------------------------------------------------------------- the standby side


async def test_warm_clears_an_earlier_hand_over_and_says_warming(rig) -> None:
    r = rig(standby=True)
    r.files.write_handover({RANK: {0: 5}}, 1)
    r.files.write_spilled(7, {"folder": None})
    r.machine.warm()
    assert r.machine.state is State.WARMING and r.machine.standing_by and not r.machine.in_group
    assert r.files.read_handover() is None and r.files.read_spilled(7) is None
    assert r.files.read_standby() == ("warming", os.getpid())


async def test_stand_by_reads_outside_the_group_with_signals_held_and_requests_kept(rig) -> None:
    r = await _standing_by(rig, [0, 1])
    consumer = r.intake.consumer
    assert consumer.group_id is None and consumer.assignment() == _all(0, 1)
    assert (_tp(BEH, 1), 101) in consumer.seeks  # behaviours from the history table's own offsets
    assert r.partitions.assigned == _all(0, 1) and r.machine.outside == [0, 1]
    assert r.partitions.holds(_tp(SIG, 0)) and not r.partitions.holds(_tp(RANK, 0))
    assert r.partitions.keep(_tp(RANK, 0), [SimpleNamespace(offset=9)])  # kept, not ranked
    assert r.partitions.ready([0, 1])  # (the stand-in logs are empty: caught up at once)


async def test_warmed_fetches_the_signals(rig) -> None:
    r = await _standing_by(rig, [0])
    r.machine.warmed()
    assert not r.partitions.holds(_tp(SIG, 0)) and r.machine.state is State.WARMING


async def test_ready(rig) -> None:
    r = await _standing_by(rig, [0])
    r.machine.warmed()
    r.machine.ready(2.5)
    assert r.machine.state is State.READY and r.files.read_standby() == ("ready", os.getpid())
    assert r.notes[-1] == {"event": "standby_ready", "partitions": [0], "seconds": 2.5}


@pytest.mark.parametrize(
    ("kept", "offset", "taken", "seek"),
    [
        ((10, 14), 12, [12, 13], None),  # the kept ones from the offset on, at once
        ((10, 12), 12, [], None),  # the old process had taken every kept one
        ((20, 22), 12, [], 12),  # 12..19 came before it kept any: fetched again from 12
        ((0, 0), 12, [], 12),  # none kept
    ],
)
async def test_take_over_ranks_the_kept_requests_from_the_hand_over(rig, kept, offset, taken, seek) -> None:
    r = await _standing_by(rig, [0])
    r.partitions.keep(_tp(RANK, 0), [SimpleNamespace(offset=o) for o in range(*kept)])
    r.machine.warmed()
    r.machine.ready(1.0)
    r.files.write_latency_samples([(128, 9.0)])
    await r.machine.take_over({RANK: {0: offset}, SIG: {0: 4}}, old_pid=os.getpid())
    assert [o for _, _, o in r.dispatch.taken] == taken
    assert ((_tp(RANK, 0), seek) in r.intake.consumer.seeks) == (seek is not None)
    assert r.machine.state is State.SERVING_OUTSIDE and not r.machine.standing_by
    assert r.files.read_standby() == ("serving", os.getpid()) and r.events()[-1] == "took_over"
    assert r.paced == [0] and r.inherited == [[(128, 9.0)]]  # the predecessor's timings
    assert not r.partitions.holds(_tp(SIG, 0)) and not r.partitions.keep(_tp(RANK, 0), [])


async def test_take_over_of_partitions_the_group_moved_reads_them_first(rig) -> None:
    r = await _standing_by(rig, [0])
    r.machine.warmed()
    r.machine.ready(1.0)
    await r.machine.take_over({RANK: {1: 30}, SIG: {1: 8}}, old_pid=os.getpid())
    consumer = r.intake.consumer
    assert consumer.assignment() == _all(1) and r.partitions.assigned == _all(1)
    assert {(_tp(RANK, 1), 30), (_tp(SIG, 1), 8), (_tp(BEH, 1), 101)} <= set(consumer.seeks)
    assert r.machine.outside == [1] and r.machine.state is State.SERVING_OUTSIDE


async def test_take_over_after_the_old_process_exited_without_handing_over(rig) -> None:
    """The fault: no hand-over. Nothing is ranked outside the group; the switch needs no answer,
    and the group's committed offsets say where to go on."""
    r = await _outside(rig, [0], handed={}, old_pid=None)
    assert r.partitions.assigned == set() and r.dispatch.taken == []
    r.log.committed[_tp(RANK, 0)] = 17
    await r.machine.between_fetches()
    assert r.machine.state is State.JOINED and r.intake.consumer.group_id is not None
    assert "unanswered" not in r.events()


async def test_joined_waits_for_the_old_processs_answer_between_fetches(rig) -> None:
    r = await _outside(rig, [0], handed={0: 12}, old_pid=os.getpid(), kept={0: 12})  # alive: this process
    await r.machine.between_fetches()
    assert r.machine.state is State.SERVING_OUTSIDE and r.intake.consumer.group_id is None
    assert r.log.commits == []  # nothing committed before the old process answered


async def test_switch_once_the_old_process_answered(rig) -> None:
    r = await _outside(rig, [0], handed={0: 12}, old_pid=os.getpid(), kept={0: 12})
    r.log.ends[_tp(RANK, 0)] = 15  # came since: fetched by the manual consumer at the switch
    r.files.write_handover({RANK: {0: 12}}, os.getpid(), answered=True)
    manual = r.intake.consumer
    await r.machine.between_fetches()
    group = r.intake.consumer
    assert r.machine.state is State.JOINED and group.group_id is not None
    assert [o for _, _, o in r.dispatch.taken] == [12, 13, 14]  # handled here, not fetched again
    assert (_tp(RANK, 0), 15) in group.seeks and (_tp(BEH, 0), 100) in group.seeks
    assert r.partitions.assigned == _all(0) and r.machine.in_group
    assert r.files.state_dir() == r.files.folder / "gen-2" and r.files.read_handover() is None
    assert r.files.read_standby() == ("joined", os.getpid()) and r.events()[-1] == "joined"
    r.dispatch.finish()
    assert (await r.machine.commit())[_tp(RANK, 0)] == 15
    await r.machine.close()
    assert manual.stopped
    r.machine.ask()  # joined, it hands over as any member does
    assert r.machine.state is State.HANDING_OVER


async def test_an_old_process_gone_before_answering_has_its_requests_ranked_again(rig) -> None:
    """The fault: it handed over, then died before answering. The requests after its last commit
    (all of a partition it never committed, from the log's start) are ranked again before the
    switch, and the audit trail says which first."""
    gone = _gone_pid()
    r = await _outside(rig, [0, 1], handed={0: 50, 1: 70}, old_pid=gone, kept={0: 50, 1: 70})
    r.log.start = 3
    r.log.committed[_tp(RANK, 0)] = 40
    await r.machine.between_fetches()
    assert r.machine.state is State.JOINED
    unanswered = next(n for n in r.notes if n["event"] == "unanswered")
    assert unanswered == {"event": "unanswered", "pid": gone, "ranked_again": {0: (40, 50), 1: (3, 70)}}
    again = [(p, o) for _, p, o in r.dispatch.taken]
    assert again == [(0, o) for o in range(40, 50)] + [(1, o) for o in range(3, 70)]
    assert r.events().index("unanswered") < r.events().index("joined")


# ---------------------------------------------------------------------- the active side


async def test_ask_hands_over_only_from_the_group(rig) -> None:
    r = await _serving(rig, _all(0))
    r.machine.ask()
    assert r.machine.state is State.HANDING_OVER and r.machine.asked > 0 and not r.machine.serving_in_group()
    s = await _standing_by(rig, [0])
    s.machine.ask()  # a standby told to hand over stops: it has nothing to hand over
    assert s.machine.state is State.WARMING and s.machine.asked > 0


async def test_hand_over_writes_the_positions_drains_commits_and_answers(rig) -> None:
    r = await _serving(rig, _all(0))
    r.log.ends.update({_tp(RANK, 0): 8, _tp(SIG, 0): 5})
    for tp, msgs in (await r.intake.consumer.getmany()).items():
        for m in msgs:
            r.dispatch.take(tp, m)
    r.machine.ask()
    r.dispatch.finish()
    await r.machine.hand_over()
    assert r.files.read_handover() == ({RANK: {0: 8}, SIG: {0: 5}}, os.getpid())
    assert r.files.handover_answered() and r.machine.state is State.ANSWERED
    assert r.dispatch.prefills_cancelled == 1 and r.files.read_latency_samples() == [(64, 5.0)]
    assert r.log.committed[_tp(RANK, 0)] == 8 and r.log.committed[_tp(BEH, 0)] == 100
    assert r.events() == ["assigned", "handed_over", "answered"]


async def test_hand_over_whose_requests_are_not_finished_in_time_does_not_answer(rig, quick) -> None:
    """The fault: the drain runs out. It exits without saying answered (the successor ranks its
    requests after its last commit again)."""
    r = await _serving(rig, _all(0))
    r.log.ends[_tp(RANK, 0)] = 3
    for tp, msgs in (await r.intake.consumer.getmany()).items():
        for m in msgs:
            r.dispatch.take(tp, m)
    r.machine.ask()
    await r.machine.hand_over()
    assert r.files.read_handover() is not None and not r.files.handover_answered()
    assert r.machine.state is State.HANDING_OVER and "answered" not in r.events()


# ---------------------------------------------------------------------- rebalances


async def test_assigned_while_serving(rig) -> None:
    r = await _serving(rig, _all(0, 1))
    group = r.intake.consumer
    assert r.partitions.assigned == _all(0, 1) and r.files.read_assignment() == [0, 1]
    assert {(_tp(BEH, 0), 100), (_tp(BEH, 1), 101)} <= set(group.seeks)  # the history table's offsets
    assert r.notes == [{"event": "assigned", "partitions": [0, 1]}]


async def test_the_periodic_commit_skips_offsets_already_committed_until_the_group_moves(rig) -> None:
    """An idle worker's commit every ``commit_interval_s`` was a broker round trip each time; it is
    made when the offsets moved, and always once after an assignment or a revocation (another
    member may have committed meanwhile)."""
    r = await _serving(rig, _all(0, 1))
    r.dispatch.take(_tp(RANK, 0), SimpleNamespace(offset=4))
    r.dispatch.finish()
    first = await r.machine.commit(if_changed=True)
    assert first[_tp(RANK, 0)] == 5 and len(r.log.commits) == 1
    assert await r.machine.commit(if_changed=True) == {} and len(r.log.commits) == 1
    r.dispatch.take(_tp(RANK, 0), SimpleNamespace(offset=5))
    r.dispatch.finish()
    assert (await r.machine.commit(if_changed=True))[_tp(RANK, 0)] == 6 and len(r.log.commits) == 2
    assert (await r.machine.commit())[_tp(RANK, 0)] == 6 and len(r.log.commits) == 3  # when asked
    await r.machine.assigned(_all(0, 1), r.intake.consumer)
    assert (await r.machine.commit(if_changed=True))[_tp(RANK, 0)] == 6 and len(r.log.commits) == 4


async def test_revoked_while_serving_drains_commits_and_forgets(rig) -> None:
    r = await _serving(rig, _all(0, 1))
    r.dispatch.take(_tp(RANK, 1), SimpleNamespace(offset=6))
    r.dispatch.finish()
    forgot = len(r.alignment.forgot)
    await r.machine.revoked(_all(1), r.intake.consumer)
    assert r.log.commits == [{_tp(RANK, 1): 7}]
    assert r.partitions.assigned == _all(0) and r.files.read_assignment() == [0]
    assert r.partitions.pending() == 0 and r.partitions.committable() == {}
    assert r.alignment.forgot[forgot:] == [1]  # its behaviours fetched ahead no longer stand


async def test_revoked_while_handing_over_keeps_what_it_handed_over(rig, quick) -> None:
    """A second fault: a rebalance while the old process drains. Its requests in flight stay its
    own, so it does not say answered before they are; once they are, it does."""
    r = await _serving(rig, _all(0))
    r.dispatch.take(_tp(RANK, 0), SimpleNamespace(offset=4))
    r.machine.ask()
    await r.machine.revoked(_all(0), r.intake.consumer)
    assert r.partitions.assigned == _all(0) and r.partitions.pending() == 1
    await r.machine.hand_over()
    assert not r.files.handover_answered() and r.machine.state is State.HANDING_OVER
    s = await _serving(rig, _all(0))
    s.dispatch.take(_tp(RANK, 0), SimpleNamespace(offset=4))
    s.machine.ask()
    await s.machine.revoked(_all(0), s.intake.consumer)
    s.dispatch.finish()
    await s.machine.hand_over()
    assert s.files.handover_answered() and s.machine.state is State.ANSWERED


async def test_assigned_while_handing_over_takes_nothing(rig) -> None:
    r = await _serving(rig, _all(0))
    r.machine.ask()
    await r.machine.assigned(_all(1), r.intake.consumer)
    assert r.partitions.assigned == _all(0)


async def test_assigned_while_serving_outside_keeps_what_it_serves(rig) -> None:
    """The join's assignment: the partitions served outside go on as they are (their fetched
    behaviours stay known to the alignment); only the others are read from the switch on."""
    r = await _outside(rig, [0], handed={0: 12}, old_pid=os.getpid(), kept={0: 12})
    forgot = list(r.alignment.forgot)
    group = r.made[-1]
    group.assigned = _all(0, 1)
    await r.machine.assigned(_all(0, 1), group)  # the group gave it partition 1 too
    assert r.alignment.forgot == [*forgot, 1] and r.partitions.assigned == _all(0)
    r.files.write_handover({RANK: {0: 12}}, os.getpid(), answered=True)
    await r.machine.between_fetches()
    assert r.partitions.assigned == _all(0, 1) and r.machine.state is State.JOINED


async def test_a_rebalance_while_serving_outside_commits_only_once_the_old_process_answered(
    rig, quick
) -> None:
    """A second fault: the group moves a partition while the standby serves it outside the group
    and the old process still drains. Nothing is taken of it any more, nothing committed while
    the old process has not answered (a commit past the hand-over would hide its unanswered
    requests), and the switch waits for the group's next assignment."""
    r = await _outside(rig, [0, 1], handed={0: 12, 1: 20}, old_pid=os.getpid(), kept={0: 12, 1: 20})
    group = r.made[-1]
    await r.machine.revoked(_all(1), group)  # the old process never answers within the wait
    assert r.log.commits == [] and r.partitions.holds(_tp(RANK, 1)) and r.partitions.assigned == _all(0)
    assert r.notes[-1] == {"event": "revoked_during_hand_over", "partitions": [1]}
    r.files.write_handover({RANK: {0: 12, 1: 20}}, os.getpid(), answered=True)
    await r.machine.between_fetches()
    assert r.machine.state is State.SERVING_OUTSIDE  # the group has not assigned again yet
    group.assigned = _all(0)
    await r.machine.assigned(_all(0), group)
    await r.machine.between_fetches()
    assert r.machine.state is State.JOINED and r.partitions.assigned == _all(0)
    assert _tp(RANK, 1) not in {tp for tp, _ in group.seeks}  # its next owner reads it from the commit


async def test_a_rebalance_after_the_old_process_died_unanswered_loses_nothing(rig, quick) -> None:
    """Both faults: the old process died before answering, and the group moves a partition
    before the standby switched. The revoked partition's unanswered requests are ranked again
    here first, and only then committed, with what the standby ranked since, so that its next
    owner starts after them: none lost, none ranked by both. The old process is settled once."""
    r = await _outside(rig, [0, 1], handed={0: 12, 1: 20}, old_pid=_gone_pid(), kept={0: 12, 1: 20})
    r.dispatch.acks = True
    r.log.committed.update({_tp(RANK, 0): 12, _tp(RANK, 1): 15})  # the old process's last commits
    r.log.ends[_tp(RANK, 1)] = 22  # two more, ranked by the standby from the hand-over on
    for tp, msgs in (await r.intake.consumer.getmany(_tp(RANK, 1))).items():
        for m in msgs:
            r.dispatch.take(tp, m)
    group = r.made[-1]
    await r.machine.revoked(_all(1), group)
    assert [o for _, p, o in r.dispatch.taken if p == 1] == [20, 21, 15, 16, 17, 18, 19]
    assert r.log.commits == [{_tp(RANK, 1): 22, _tp(SIG, 1): 0}]
    assert r.partitions.assigned == _all(0) and r.events().count("unanswered") == 1
    group.assigned = _all(0)
    await r.machine.assigned(_all(0), group)
    await r.machine.between_fetches()
    assert r.machine.state is State.JOINED and r.events().count("unanswered") == 1


async def test_a_rebalance_commits_no_request_ranked_again_before_its_result(rig, quick) -> None:
    """As above, but the requests ranked again have no result when the drain gives up: the
    commit stops at the first of them (the next owner ranks them: at least once)."""
    r = await _outside(rig, [0, 1], handed={0: 12, 1: 20}, old_pid=_gone_pid(), kept={0: 12, 1: 20})
    r.log.committed.update({_tp(RANK, 0): 12, _tp(RANK, 1): 15})
    await r.machine.revoked(_all(1), r.made[-1])
    assert r.log.commits == [{_tp(RANK, 1): 15, _tp(SIG, 1): 0}]


async def test_requests_of_a_partition_the_group_moved_are_ranked_again_by_its_next_owner_only(
    rig, quick
) -> None:
    """The group moved a partition while the old process still drained (nothing committed for
    it: its next owner reads it from the old process's commit); the old process then died
    unanswered. Only the partitions still this worker's are ranked again here."""
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        r = await _outside(rig, [0, 1], handed={0: 12, 1: 20}, old_pid=old.pid, kept={0: 12, 1: 20})
        r.log.committed.update({_tp(RANK, 0): 10, _tp(RANK, 1): 15})
        group = r.made[-1]
        await r.machine.revoked(_all(1), group)
        assert r.log.commits == [] and r.partitions.assigned == _all(0)
    finally:
        old.kill()
        old.wait()
    group.assigned = _all(0)
    await r.machine.assigned(_all(0), group)
    await r.machine.between_fetches()
    assert r.machine.state is State.JOINED
    unanswered = next(n for n in r.notes if n["event"] == "unanswered")
    assert unanswered["ranked_again"] == {0: (10, 12)}
    assert [(p, o) for _, p, o in r.dispatch.taken] == [(0, 10), (0, 11)]


# ---------------------------------------------------------------------- guards


async def test_a_transition_from_the_wrong_state_is_refused(rig) -> None:
    r = await _serving(rig, _all(0))
    with pytest.raises(IllegalTransition, match="ready in state serving"):
        r.machine.ready(1.0)
    with pytest.raises(IllegalTransition, match="hand_over in state serving"):
        await r.machine.hand_over()
    s = await _standing_by(rig, [0])
    with pytest.raises(IllegalTransition, match="take_over in state warming"):
        await s.machine.take_over({}, None)
