"""A successor's read-only view of its predecessor's disk tier (``tiers.DiskSnapshot``, a RocksDB
read-only instance on real rocksdict) and the adoption of its prefixes (``prefix_adoption``):
only entries of the same model version whose fingerprint matches the successor's own history are
adopted, and a ranking from an adopted prefix equals one from a computed prefix."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_model_relay import NUM_ITEMS, _config

from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events, history_fingerprint
from relaygr.workers.store.prefix_adoption import adopt_prefixes
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig
from relaygr.workers.store.tiers import DiskSnapshot, DiskTier

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOB = 64 << 10  # above the folder's min blob size: the value lives in a blob file


def _model() -> HSTURanker:
    model = HSTURanker(_config())
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.refresh_version()
    return model.eval()


def _history(n: int, seed: int) -> Events:
    gen = torch.Generator().manual_seed(seed)
    return Events(
        item_ids=torch.randint(1, NUM_ITEMS, (n,), generator=gen),
        action_ids=torch.randint(0, 4, (n,), generator=gen),
        timestamps=8.8e8 + torch.cumsum(torch.randint(1, 100, (n,), generator=gen).double(), 0),
    )


def _store(model: HSTURanker, disk: Path | None, version: str | None = None) -> PrefixStore:
    config = PrefixStoreConfig(disk_path=None if disk is None else str(disk), persist_on_close=False)
    return PrefixStore(config, version or model.model_version)


def test_the_view_opens_a_folder_held_open_and_sees_what_was_written_before_it_caught_up(tmp_path) -> None:
    disk = DiskTier(tmp_path / "old", 1 << 30)
    try:
        disk.write(("a", "m1"), b"x" * BLOB, 5, b"fp-a")
        view = DiskSnapshot(tmp_path / "old", tmp_path / "new" / "reader")  # the primary still open
        try:
            assert set(view.index()) == {("a", "m1")}
            disk.write(("b", "m1"), b"y" * BLOB, 7, b"fp-b")
            disk.flush()  # a new blob file: the view sees it only after catching up
            assert set(view.index()) == {("a", "m1")}
            view.catch_up()
            index = view.index()
            assert set(index) == {("a", "m1"), ("b", "m1")}
            assert index[("b", "m1")].length == 7 and index[("b", "m1")].fingerprint == b"fp-b"
            assert bytes(view.read(("b", "m1"), index[("b", "m1")]) or b"") == b"y" * BLOB
            assert bytes(view.read(("a", "m1"), index[("a", "m1")]) or b"") == b"x" * BLOB
            disk.write(("a", "m1"), b"z" * BLOB, 5, b"fp-a")  # rewritten: another sequence number
            view.catch_up()
            assert view.read(("a", "m1"), index[("a", "m1")]) is None
        finally:
            view.close()
    finally:
        disk.close()
    with pytest.raises(FileNotFoundError):
        DiskSnapshot(tmp_path / "nowhere", tmp_path / "reader")


def _predecessor(tmp_path: Path, model: HSTURanker, histories: dict[str, Events]) -> PrefixStore:
    """A store with a disk tier holding a computed prefix of each history (all but its last 4)."""
    old = _store(model, tmp_path / "old")
    for user, h in histories.items():
        old.put(user, ModelRunner(model).prefill(h.slice(0, len(h) - 4)))
    report = old.persist()
    assert report["prefixes"] == len(histories) and report["written"] == len(histories)
    return old


def test_adopted_prefixes_rank_exactly_as_computed_ones(tmp_path) -> None:
    model = _model()
    histories = {"u1": _history(40, 1), "u2": _history(25, 2)}
    old = _predecessor(tmp_path, model, histories)  # still open: the view is a secondary
    new = _store(model, None)
    try:
        with DiskSnapshot(tmp_path / "old", tmp_path / "new" / "reader") as view:
            got = adopt_prefixes(view, new, histories.get)
        assert (got.adopted, got.refused, got.skipped_users) == (2, 0, 0)
        assert got.bytes > 0
        cands = torch.arange(1, 9)
        for user, h in histories.items():
            found = asyncio.run(new.lookup(user, h))
            assert found.tier == "device" and found.length == len(h) - 4
            ts = float(h.timestamps[-1]) + 5
            runner = ModelRunner(model)
            computed = runner.prefill(h.slice(0, len(h) - 4))
            adopted = runner.rank(found.prefix, h.slice(len(h) - 4), cands, ts)
            assert torch.equal(adopted, runner.rank(computed, h.slice(len(h) - 4), cands, ts))
    finally:
        new.close()
        old.close()


def test_a_changed_history_or_another_model_version_is_refused(tmp_path) -> None:
    model = _model()
    histories = {"u1": _history(40, 1), "u2": _history(25, 2), "u3": _history(30, 3)}
    old = _predecessor(tmp_path, model, histories)
    changed = histories["u1"]
    items = changed.item_ids.clone()
    items[3] = items[3] % (NUM_ITEMS - 1) + 1  # one event differs
    successor = {"u1": Events(items, changed.action_ids, changed.timestamps), "u2": histories["u2"]}
    assert history_fingerprint(successor["u1"], 36) != history_fingerprint(changed, 36)
    # u4's entry matches its history by its index record, but its blob is not a prefix.
    successor["u4"] = _history(12, 4)
    fp4 = history_fingerprint(successor["u4"], 8)
    assert old.placement.disk is not None
    old.placement.disk.write(("u4", model.model_version), b"not a prefix", 8, fp4)
    new, other = _store(model, None), _store(model, None, version="another-model")
    try:
        with DiskSnapshot(tmp_path / "old", tmp_path / "new" / "reader") as view:
            got = adopt_prefixes(view, new, successor.get)
            got_other = adopt_prefixes(view, other, successor.get)
        # u1's history differs: refused; u2 adopted; u3 is not this successor's user; u4 corrupt.
        assert (got.adopted, got.refused_history, got.skipped_users, got.refused_corrupt) == (1, 1, 1, 1)
        assert new.where("u1") is None and new.where("u2") == "device" and new.where("u4") is None
        assert (got_other.adopted, got_other.refused_version) == (0, 3)
        assert other.where("u2") is None
        # A budget that takes one entry: the most recently written one.
        with DiskSnapshot(tmp_path / "old", tmp_path / "new" / "reader") as view:
            one = adopt_prefixes(
                view,
                _store(model, None),
                histories.get,
                max_bytes=max(m.nbytes for m in view.index().values()),
            )
        assert (one.adopted, one.skipped_budget) == (1, 2)
    finally:
        new.close()
        other.close()
        old.close()
