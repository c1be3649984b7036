"""The expander's tier choice (``tier_costs``) and the disk tier's blob files (``blob_files``).

A lookup never serves from a tier predicted slower than recomputing, and a prefix is not written
to a disk predicted slower (each counted); the figures come from a calibration file or a
measurement. The blob files: crash leftovers are cleaned at open, an older folder's values move
into files, unaligned buffers fall back to buffered reads, and a large prefix of a small real
model goes through the disk path (several read chunks, the checksum computed while reading) and
ranks exactly as the computed one.
"""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch
from rocksdict import Options, Rdict
from test_model_relay import NUM_ITEMS, _config
from test_prefix_store import MV, NB10, ND10, PAGE, history, make_store, prefix_for, same

from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events
from relaygr.workers.store import blob_files
from relaygr.workers.store.blob_files import BlobFiles, RecyclingBuffers, aligned_buffer
from relaygr.workers.store.kv_codec import CodecError, decode, encode
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig
from relaygr.workers.store.tier_costs import (
    DEFAULT_TIER_COSTS,
    TierChoice,
    TierCosts,
    measure_tier_costs,
)
from relaygr.workers.store.tiers import BLOB_DIR, INDEX_PREFIX, VALUE_PREFIX, DiskTier, encode_key

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GBPS = 1e9


def _choice(disk_bytes_per_s: float, host_bytes_per_s: float = 10 * GBPS, ms_per_event: float = 1.0):
    """Recompute costs ``ms_per_event`` per event; no fixed costs, so that only speeds decide."""
    costs = TierCosts(host_bytes_per_s, disk_bytes_per_s, host_fixed_ms=0.0, disk_fixed_ms=0.0)
    return TierChoice(costs, lambda n: ms_per_event * n)


def _on_disk_only(tmp_path, choice: TierChoice | None) -> tuple[PrefixStore, Events]:
    h = history(1, 10)
    first = make_store(tmp_path, disk=10)
    first.put(1, prefix_for(h))
    first.close()  # persisted: the entry lives on disk only
    store = make_store(tmp_path, disk=10)
    store.set_tier_choice(choice)
    assert store.where(1) == "disk"
    return store, h


# 10 events recompute in 10 ms; the blob (~2.3 kB) reads in 2.3 ms at 1 MB/s, 23 ms at 0.1 MB/s.
async def test_a_disk_predicted_faster_than_recompute_serves(tmp_path) -> None:
    store, h = _on_disk_only(tmp_path, _choice(disk_bytes_per_s=1e6))
    got = await store.lookup(1, h)
    assert got.tier == "disk" and got.length == 10
    assert store.metrics()["skips_disk_slower"] == 0
    store.close()


async def test_a_disk_predicted_slower_than_recompute_is_a_counted_miss(tmp_path) -> None:
    store, h = _on_disk_only(tmp_path, _choice(disk_bytes_per_s=1e5))
    got = await store.lookup(1, h)
    m = store.metrics()
    assert got.tier == "miss" and m["skips_disk_slower"] == 1 and m["misses"] == 1
    assert store.where(1) == "disk"  # kept: a later calibration may favour it
    store.set_tier_choice(None)
    assert (await store.lookup(1, h)).tier == "disk"
    store.close()


async def test_disk_is_weighed_against_extending_a_shorter_valid_prefix(tmp_path) -> None:
    h = history(1, 10)
    first = make_store(tmp_path, disk=10)
    first.put(1, prefix_for(h))
    first.close()
    store = make_store(tmp_path, disk=10)
    store.put(1, prefix_for(h, 8))  # 8 of the 10 events on the device: extending costs 2 ms
    store.set_tier_choice(_choice(disk_bytes_per_s=1e6))  # disk 2.3 ms: slower than 2 ms
    got = await store.lookup(1, h)
    assert got.tier == "device" and got.length == 8
    assert store.metrics()["skips_disk_slower"] == 1
    store.close()


async def test_a_host_tier_predicted_slower_is_not_served(tmp_path) -> None:
    store = make_store(device=1, host=3)
    h1, h2 = history(1, 10), history(2, 10)
    store.put(1, prefix_for(h1))
    store.put(2, prefix_for(h2))  # 1 is on host now
    store.set_tier_choice(_choice(disk_bytes_per_s=GBPS, host_bytes_per_s=1e5))
    assert (await store.lookup(1, h1)).tier == "miss"
    assert store.metrics()["skips_host_slower"] == 1 and store.where(1) == "host"
    store.set_tier_choice(_choice(disk_bytes_per_s=GBPS, host_bytes_per_s=1e9))
    assert (await store.lookup(1, h1)).tier == "host"
    store.close()


async def test_no_prefix_is_written_to_a_disk_slower_than_recompute(tmp_path) -> None:
    store = PrefixStore(
        PrefixStoreConfig(
            device_budget_bytes=ND10,
            page_tokens=PAGE,
            host_budget_bytes=0,
            disk_path=str(tmp_path / "kv"),
            disk_budget_bytes=10 * (NB10 + 1024),
            persist_on_close=False,
        ),
        MV,
        tier_choice=_choice(disk_bytes_per_s=1e5),
    )
    store.put(1, prefix_for(history(1, 10)))
    store.put(2, prefix_for(history(2, 10)))  # 1 leaves memory; disk would be slower
    store.flush()
    m = store.metrics()
    assert m["disk_writes_skipped_slower"] == 1 and m["disk_writes"] == 0 and m["evictions"] == 1
    assert store.where(1) is None
    store.close()


def test_tier_costs_reject_bad_figures_and_load_from_a_calibration_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="positive"):
        TierCosts(host_bytes_per_s=0, disk_bytes_per_s=1)
    with pytest.raises(ValueError, match="fixed"):
        TierCosts(1, 1, disk_fixed_ms=-1)
    with pytest.raises(ValueError, match="tier"):
        DEFAULT_TIER_COSTS.promote_ms("device", 1)
    with pytest.raises(ValueError, match="disk_bytes_per_s"):
        TierCosts.from_dict({"host_bytes_per_s": 1})
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"coeffs": {}}))
    assert TierCosts.from_calibration(calibration) is None  # an older file
    costs = TierCosts(3e9, 1e9, source="measured")
    calibration.write_text(json.dumps({"coeffs": {}, "tier_costs": costs.to_dict()}))
    assert TierCosts.from_calibration(calibration) == costs
    assert costs.promote_ms("disk", 10**9) == pytest.approx(1000.5)


def test_measured_tier_costs_are_positive_and_say_so(tmp_path) -> None:
    costs = measure_tier_costs(tmp_path, "cpu", nbytes=1 << 20, repeats=1)
    assert costs.source == "measured" and costs.host_bytes_per_s > 0 and costs.disk_bytes_per_s > 0
    assert list(tmp_path.iterdir()) == []  # its file is gone
    with pytest.raises(ValueError, match="nbytes"):
        measure_tier_costs(tmp_path, "cpu", nbytes=10)


# -- the blob files -----------------------------------------------------------------------------


def test_crash_leftovers_are_cleaned_at_open(tmp_path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    disk.write(("a", MV), b"a" * 5000, 5, b"fp-a")
    disk.write(("b", MV), b"b" * 5000, 5, b"fp-b")
    seq_b = disk.meta(("b", MV)).seq  # type: ignore[union-attr]
    disk.close()
    files = BlobFiles(tmp_path / BLOB_DIR)
    (tmp_path / BLOB_DIR / "00000000000000ff.kv.tmp").write_bytes(b"half")  # never renamed
    (tmp_path / BLOB_DIR / f"{99:016x}.kv").write_bytes(b"x")  # renamed, its record never written
    files.delete(seq_b)  # a record whose file is gone
    disk = DiskTier(tmp_path, 1 << 20)
    try:
        assert disk.list_keys() == [("a", MV)] and disk.used_bytes == 5000
        assert sorted(p.name for p in (tmp_path / BLOB_DIR).iterdir()) == [f"{1:016x}.kv"]
        blob, _ = disk.read(("a", MV)) or (b"", 0)
        assert bytes(blob) == b"a" * 5000
    finally:
        disk.close()


def test_a_folder_of_the_older_layout_moves_into_files(tmp_path) -> None:
    db = Rdict(str(tmp_path), Options(raw_mode=True))
    ek = encode_key(("u", MV))
    db[VALUE_PREFIX + ek] = struct.pack("<Q", 7) + b"old" * 100
    db[INDEX_PREFIX + ek] = struct.pack("<QQQ", 308, 3, 7) + b"fp"
    db.close()
    disk = DiskTier(tmp_path, 1 << 20)
    try:
        blob, seq = disk.read(("u", MV)) or (b"", 0)
        assert bytes(blob) == b"old" * 100 and seq == 7
        disk.write(("v", MV), b"new", 1, b"fp")
        assert disk.meta(("v", MV)).seq == 8  # type: ignore[union-attr]
    finally:
        disk.close()


def test_a_rewrite_after_a_hide_leaves_no_stale_file(tmp_path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    try:
        disk.write(("u", MV), b"1" * 100, 1, b"fp")
        assert disk.hide(("u", MV), 1)
        disk.write(("u", MV), b"2" * 100, 1, b"fp")
        assert not disk.delete(("u", MV), 1)  # that version is gone already
        assert BlobFiles(tmp_path / BLOB_DIR).seqs() == {2}
    finally:
        disk.close()


def test_reads_are_exact_through_any_buffer_and_chunking(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(blob_files, "CHUNK", 8192)
    files = BlobFiles(tmp_path)
    try:
        payload = bytes(range(256)) * 200 + b"tail"  # not a multiple of the alignment
        files.write(3, payload)
        aligned = files.read(3, len(payload))
        assert aligned is not None and bytes(aligned.blob) == payload
        unaligned_buf = aligned_buffer(len(payload) + 4096 + 1)[1:]
        unaligned = files.read(3, len(payload), lambda n: memoryview(unaligned_buf[:n].numpy()))
        assert unaligned is not None and not unaligned.direct and bytes(unaligned.blob) == payload
        assert aligned.body_crc == unaligned.body_crc == zlib.crc32(payload[:-4])
        assert files.read(4, 10) is None
    finally:
        files.close()


def test_a_wrong_reader_checksum_is_a_codec_error() -> None:
    blob = bytearray(encode(prefix_for(history(1, 10))))
    with pytest.raises(CodecError, match="checksum"):
        decode(blob, body_crc=0)
    owned = decode(blob, owned=True)
    base = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
    assert base <= owned.keys[0].data_ptr() < base + len(blob)  # viewed, not copied
    with pytest.raises(ValueError, match="writable"):
        decode(bytes(blob), owned=True)


async def test_a_large_prefix_of_a_real_model_goes_through_the_disk_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(blob_files, "CHUNK", 256 << 10)  # several chunks: checksum beside the reads
    model = ModelRunner(HSTURanker(_config(max_seq_len=8192, attn_block=256)).eval())
    gen = torch.Generator().manual_seed(5)
    n = 6000
    h = Events(
        item_ids=torch.randint(1, NUM_ITEMS, (n + 4,), generator=gen),
        action_ids=torch.randint(0, 4, (n + 4,), generator=gen),
        timestamps=1e9 + torch.cumsum(torch.randint(1, 100, (n + 4,), generator=gen).double(), 0),
    )
    computed = model.prefill(h.slice(0, n))
    nb = computed.nbytes()
    config = PrefixStoreConfig(
        device_budget_bytes=nb,
        host_budget_bytes=0,
        disk_path=str(tmp_path / "kv"),
        disk_budget_bytes=4 * nb,
        disk_write_policy="write_through",
    )
    with PrefixStore(
        config, model.model_version, tier_choice=TierChoice(DEFAULT_TIER_COSTS, lambda k: 1e9)
    ) as s:
        s.put("u", computed)
        s.put("other", model.prefill(h.slice(0, 100)))  # "u" leaves the device for disk
        s.flush()
        assert s.where("u") == "disk"
        got = await s.lookup("u", h)
        assert got.tier == "disk" and same(got.prefix, computed)
        assert s.metrics()["promotions_disk_to_device"] == 1
    cands = torch.arange(1, 9)
    ts = float(h.timestamps[-1]) + 5
    tail = h.slice(n)
    assert torch.equal(model.rank(got.prefix, tail, cands, ts), model.rank(computed, tail, cands, ts))


def test_the_default_costs_never_skip_a_large_prefix_on_this_path() -> None:
    # 64 MB at the default disk speed is ~80 ms; a recompute predicted at 100 ms keeps the disk.
    choice = TierChoice(DEFAULT_TIER_COSTS, lambda n: 100.0 * n / 4096)
    assert choice.worth("disk", 64 << 20, 4096)
    assert not choice.worth("disk", 64 << 20, 2048)


def test_a_read_buffer_is_reused_only_once_nothing_views_it() -> None:
    pool = RecyclingBuffers(keep=2)
    first = torch.frombuffer(pool.alloc(10_000), dtype=torch.uint8)  # as a decoded prefix holds it
    second = torch.frombuffer(pool.alloc(10_000), dtype=torch.uint8)
    assert first.data_ptr() != second.data_ptr()  # the first is still viewed
    address = first.data_ptr()
    del first
    assert torch.frombuffer(pool.alloc(8_000), dtype=torch.uint8).data_ptr() == address
    assert torch.frombuffer(pool.alloc(10_000), dtype=torch.uint8).data_ptr() != second.data_ptr()


def test_a_calibration_with_tier_costs_is_read_back(tmp_path) -> None:
    from relaygr.workers.engine.calibration import calibrate_and_save

    model = ModelRunner(HSTURanker(_config()).eval())
    out = tmp_path / "calibration.json"
    calibrate_and_save(
        model, out, lengths=(16, 32, 64), candidates=4, repeats=1, tier_costs_dir=tmp_path / "d"
    )
    costs = TierCosts.from_calibration(out)
    assert costs is not None and costs.source == "measured" and costs.disk_bytes_per_s > 0
    calibrate_and_save(model, out, lengths=(16, 32, 64), candidates=4, repeats=1)
    assert TierCosts.from_calibration(out) is None  # not asked for: not measured
