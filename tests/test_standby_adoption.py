"""The warm-up of a standby from its predecessor's cache (no broker): the active process, seeing a
standby warm up, writes its memory tiers' prefixes to its disk tier and says so in ``spilled.json``
(at once, and again when the standby, caught up, removes that file); the standby adopts those
valid for its own histories, and on any trouble (no disk tier, nothing in time, a folder it cannot
read) adopts none and says why, never failing."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_prefix_store import prefix_for

from relaygr.streams.ranking import standby_warmup as warmup_module
from relaygr.streams.ranking.standby_warmup import StandbyWarmUp, spill_for_standby
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.workers.prefix_kv import Events
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

VERSION = "m1"


def _history(n: int, shift: int = 0) -> Events:
    return Events.from_lists([1 + (i + shift) % 30 for i in range(n)], [1000.0 + 7 * i for i in range(n)])


def _store(disk: Path | None) -> PrefixStore:
    config = PrefixStoreConfig(disk_path=None if disk is None else str(disk), persist_on_close=False)
    return PrefixStore(config, VERSION)


def _worker(folder: Path, store: PrefixStore | None, histories: dict[str, Events], wait_s: float):
    noted: list[dict] = []
    w = SimpleNamespace(
        worker_id="ranker-0",
        files=WorkerFiles(folder),
        state_dir=folder / "gen-2",
        engine=SimpleNamespace(store=store, model=SimpleNamespace(model_version=VERSION)),
        pipeline=SimpleNamespace(standby_adopt_wait_s=wait_s),
        handler=SimpleNamespace(
            served_history=lambda user, before: SimpleNamespace(events=histories.get(user, Events.empty()))
        ),
        noted=noted,
    )
    w.note = lambda **fields: noted.append(fields)
    return w


@contextlib.asynccontextmanager
async def _active_timer(w, standby_pid: int):
    """The active process's timer running, a standby ``standby_pid`` warming up."""
    w.files.write_standby("warming", standby_pid)
    task = asyncio.create_task(spill_for_standby(w.files, w.engine, w.note, lambda: True, w.worker_id))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _spilled(files: WorkerFiles, standby_pid: int) -> dict:
    for _ in range(200):
        if (spilled := files.read_spilled(standby_pid)) is not None:
            return spilled
        await asyncio.sleep(0.05)
    raise AssertionError("nothing spilled")


def _standby(w, pid: int) -> StandbyWarmUp:
    """A standby's warm-up over the stand-in worker ``w``'s parts, as the process ``pid``."""
    return StandbyWarmUp(
        worker_id=w.worker_id,
        settings=None,  # type: ignore[arg-type]
        pipeline=w.pipeline,
        files=w.files,
        generation=w.state_dir,
        engine=w.engine,
        handler=w.handler,
        partitions=None,  # type: ignore[arg-type]
        intake=None,  # type: ignore[arg-type]
        note=w.note,
        pid=pid,
    )


@pytest.fixture
def fast_poll(monkeypatch) -> None:
    monkeypatch.setattr(warmup_module, "SPILL_POLL_S", 0.05)


async def test_the_active_process_spills_for_a_warming_standby_and_the_standby_adopts(
    tmp_path, fast_poll
) -> None:
    histories = {"u1": _history(30), "u2": _history(20, shift=3)}
    old = _store(tmp_path / "gen-1" / "prefix-store")
    new = _store(None)
    try:
        for user, h in histories.items():
            old.put(user, prefix_for(h, len(h) - 4, mv=VERSION))  # in memory only: the disk tier lacks them
        assert old.where("u1") == "device"
        active = _worker(tmp_path, old, histories, 1.0)
        async with _active_timer(active, standby_pid=4242):
            spilled = await _spilled(active.files, 4242)  # at once, as the standby starts
            assert spilled["prefixes"] == 2 and spilled["written"] == 2 and spilled["bytes"] > 0
            assert spilled["folder"] == str(tmp_path / "gen-1" / "prefix-store")
            assert old.where("u1") == "device"  # nothing left memory
            await asyncio.sleep(0.3)  # several turns of the timer: the file is there, no new one
            assert [e["event"] for e in active.noted] == ["spilled_for_standby"]
            old.put(
                "u3", prefix_for(_history(12, shift=1), 8, mv=VERSION)
            )  # computed while the standby catches up

            # The standby, caught up, asks for what came since. Its history of u2 changed: u1
            # adopted, u2 refused, u3 (computed after the first spill) adopted too.
            grown = {"u1": _history(34), "u2": _history(20, shift=5), "u3": _history(12, shift=1)}
            standby = _worker(tmp_path, new, grown, 5.0)
            await _standby(standby, 4242).adopt()
        assert [e["event"] for e in active.noted] == ["spilled_for_standby"] * 2
        assert active.noted[1]["written"] == 1 and active.noted[1]["prefixes"] == 3
        (line,) = standby.noted
        assert line["event"] == "standby_adopted" and line["spilled"] == 3
        assert (line["adopted"], line["refused_history"], line["refused"]) == (2, 1, 1)
        assert new.where("u1") == "device" and new.where("u2") is None and new.where("u3") == "device"
        assert new.cached_length("u1", grown["u1"]) == 26  # extended by the pre-inference later
        assert not (standby.state_dir / "adopting").exists()  # the view's files are removed
    finally:
        new.close()
        old.close()


async def _adopt_with(w, pid: int = 7) -> dict:
    await _standby(w, pid).adopt()
    (line,) = w.noted
    assert line["event"] == "standby_adopted" and line["adopted"] == 0
    return line


async def test_a_standby_adopts_none_and_says_why(tmp_path, fast_poll) -> None:
    store = _store(None)
    disk_store = _store(tmp_path / "d" / "gen-1" / "prefix-store")
    try:
        # The active process has no disk tier: it says so, and the standby recomputes.
        active = _worker(tmp_path / "a", store, {}, 1.0)
        async with _active_timer(active, standby_pid=7):
            assert (await _adopt_with(_worker(tmp_path / "a", store, {}, 5.0)))["why"] == "no_disk_tier"
        assert active.noted[-1]["folder"] is None
        # Nothing written for it in time (an earlier standby's file is not its own).
        folder = tmp_path / "b"
        WorkerFiles(folder).write_spilled(6, {"folder": str(folder), "model_version": VERSION})
        line = await _adopt_with(_worker(folder, store, {}, 0.1))
        assert line["why"] == "not_spilled_in_time"
        # A folder it cannot read (here: its own folder for the view cannot be made): logged,
        # none adopted, the standby goes on.
        folder = tmp_path / "d"
        async with _active_timer(_worker(folder, disk_store, {}, 1.0), standby_pid=7):
            standby = _worker(folder, store, {}, 5.0)
            (folder / "not-a-folder").write_text("")
            standby.state_dir = folder / "not-a-folder"
            assert (await _adopt_with(standby))["why"].startswith("error:")
        # Adoption off, or a worker without a store (baseline).
        assert (await _adopt_with(_worker(folder, store, {}, 0.0)))["why"] == "off"
        assert (await _adopt_with(_worker(folder, None, {}, 1.0)))["why"] == "off"
    finally:
        disk_store.close()
        store.close()
