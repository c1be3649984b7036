"""A ranking worker's hand-over files and state generations (no broker): the folder itself is the
state of a worker that never rolled; a standby gets the next generation; promoting it makes it
the one a restart opens, and the stale ones (the old layout included) are deleted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relaygr.streams.ranking.worker_files import WorkerFiles


def test_generations(tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path / "ranker-0")
    assert files.state_dir() == files.folder
    (files.folder / "history").mkdir(parents=True)
    (files.folder / "events.jsonl").write_text("{}\n")
    first = files.new_generation()
    assert first.name == "gen-1" and files.state_dir() == files.folder  # not current yet
    files.promote(first)
    assert files.state_dir() == first
    second = files.new_generation()
    assert second.name == "gen-2"
    files.promote(second)
    removed = files.remove_stale_generations()
    assert set(removed) == {first, files.folder / "history"}
    assert second.exists() and (files.folder / "events.jsonl").exists()  # the audit trail stays


def test_hand_over_files(tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path)
    assert files.read_assignment() is None and files.read_handover() is None and files.read_standby() is None
    files.write_assignment([3, 1, 1])
    assert files.read_assignment() == [1, 3]
    files.write_handover({"p.rank-requests": {1: 40, 3: 7}}, pid=123)
    assert files.read_handover() == ({"p.rank-requests": {1: 40, 3: 7}}, 123)
    assert not files.handover_answered()
    files.write_handover({"p.rank-requests": {1: 40, 3: 7}}, pid=123, answered=True)
    assert files.handover_answered() and files.read_handover() == ({"p.rank-requests": {1: 40, 3: 7}}, 123)
    files.clear_handover()
    assert files.read_handover() is None and not files.handover_answered()
    files.write_standby("ready", 9)
    assert files.read_standby() == ("ready", 9)
    with pytest.raises(ValueError, match="unknown standby state"):
        files.write_standby("asleep", 9)
    assert files.read_latency_samples() == []
    files.write_latency_samples([(512, 7.5), (2048, 35.25)])
    assert files.read_latency_samples() == [(512, 7.5), (2048, 35.25)]
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary name, renamed


_STAND_ASIDE = """
import json, os, sys, threading
from relaygr.infra.settings import Settings
from relaygr.streams.ranking.standby import stand_aside
before = threading.Event(); done = threading.Event(); seen = {}
def early():
    before.set(); done.wait()
t = threading.Thread(target=early); t.start(); before.wait()
level = stand_aside(Settings(home=sys.argv[1], topic_prefix="p"), "ranker-0")
def late():
    seen["late"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
seen["early"] = os.getpriority(os.PRIO_PROCESS, t.native_id)
l = threading.Thread(target=late); l.start(); l.join(); done.set(); t.join()
print(json.dumps({"level": level, "main": os.getpriority(os.PRIO_PROCESS, 0), **seen}))
"""


def test_a_standby_stands_aside_at_the_lowest_priority(tmp_path: Path) -> None:
    """Every thread of a standby, and those it starts later, at nice 19; it serves at the level of
    the active process it replaces (named in ``assignment.json``) once it takes over."""
    import os
    import subprocess
    import sys

    from relaygr.streams.ranking.standby import STANDBY_NICE
    from relaygr.workers.engine.cores import may_renice_to

    active = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.setpriority(os.PRIO_PROCESS, active.pid, 3)
        folder = tmp_path / "workers" / "p" / "ranker-0"
        folder.mkdir(parents=True)
        (folder / "assignment.json").write_text(json.dumps({"partitions": [0], "pid": active.pid}))
        out = subprocess.run(
            [sys.executable, "-c", _STAND_ASIDE, str(tmp_path)], capture_output=True, text=True, check=True
        )
    finally:
        active.kill()
        active.wait()
    seen = json.loads(out.stdout)
    if not may_renice_to(3):  # it could not come back: it stays where it is
        assert seen["level"] is None and seen["main"] == os.getpriority(os.PRIO_PROCESS, 0)
        return
    assert seen["level"] == 3
    assert seen["main"] == seen["early"] == seen["late"] == STANDBY_NICE


def test_a_standbys_pre_inferences_are_not_counted_twice(tmp_path: Path) -> None:
    from relaygr.tools.report.inputs import prefill_statuses

    folder = tmp_path / "ranker-0"
    folder.mkdir()
    lines = [
        {"event": "prefill", "request_id": "a", "status": "computed", "standby": True},
        {"event": "prefill", "request_id": "a", "status": "device"},
        {"event": "prefill", "request_id": "b", "status": "computed"},
    ]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert prefill_statuses(tmp_path) == ["device", "computed"]


def test_spilled_file_is_for_one_standby(tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path)
    assert files.read_spilled(42) is None
    files.write_spilled(42, {"folder": "/x/prefix-store", "model_version": "m1", "prefixes": 3, "bytes": 900})
    got = files.read_spilled(42)
    assert got is not None and got["folder"] == "/x/prefix-store" and got["prefixes"] == 3
    assert got["pid"] > 0 and got["t"] > 0
    assert files.read_spilled(43) is None  # written for another standby: not this one's
    files.clear_spilled()
    assert files.read_spilled(42) is None
