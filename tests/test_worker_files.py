"""A ranking worker's hand-over files and state generations (no broker): the folder itself is the
state of a worker that never rolled; a standby gets the next generation; promoting it makes it
the one a restart opens, and the stale ones (the old layout included) are deleted."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaygr.streams.worker_files import WorkerFiles


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
    files.clear_handover()
    assert files.read_handover() is None
    files.write_standby("ready", 9)
    assert files.read_standby() == ("ready", 9)
    with pytest.raises(ValueError, match="unknown standby state"):
        files.write_standby("asleep", 9)
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary name, renamed
