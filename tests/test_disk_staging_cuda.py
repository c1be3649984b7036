"""The disk tier's CUDA path (``staging``): a prefix read into the pinned staging buffer and copied
to the device layer by layer equals what was stored, in every cold format, however often the
buffer is reused. Skipped without a CUDA device (the CPU path is covered by the store's tests)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store.kv_formats import COLD_FORMATS, to_cold, to_warm
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _history(user: int, n: int) -> Events:
    return Events.from_lists(
        [user * 100_003 + i for i in range(n)], [1.7e9 + 60.0 * i for i in range(n)], [1] * n
    )


def _prefix(h: Events, seed: int) -> PrefixKV:
    g = torch.Generator().manual_seed(seed)
    n = len(h)
    return PrefixKV(
        keys=[torch.randn(4, n, 32, generator=g).cuda() for _ in range(3)],
        values=[torch.randn(4, n, 32, generator=g).cuda() for _ in range(3)],
        positions=torch.arange(n, device="cuda"),
        timestamps=h.timestamps.cuda(),
        length=n,
        fingerprint=history_fingerprint(h),
        model_version="m1",
    )


@pytest.mark.parametrize("fmt", COLD_FORMATS)
def test_disk_promotions_through_the_staging_buffer_are_exact(tmp_path, fmt: str) -> None:
    hs = [_history(u, 3000 + 500 * u) for u in range(3)]
    ps = [_prefix(h, u) for u, h in enumerate(hs)]
    config = PrefixStoreConfig(
        device="cuda",
        device_budget_bytes=0,
        host_budget_bytes=0,
        disk_path=str(tmp_path / "kv"),
        disk_budget_bytes=1 << 30,
        cold_kv_format=fmt,
    )

    async def run() -> None:
        with PrefixStore(config, "m1") as store:
            for u, p in enumerate(ps):
                assert store.put(u, p) == "disk"
            store.flush()
            for _ in range(2):  # the staging buffer is reused, larger and smaller blobs in turn
                for u in (2, 0, 1):
                    got = await store.lookup(u, hs[u])
                    assert got.tier == "disk" and got.prefix is not None
                    want = to_warm(to_cold(ps[u], fmt), torch.device("cuda"))
                    assert got.prefix.device.type == "cuda"
                    dense = got.prefix.dense()  # in the device tier's pages, or staged: the same tokens
                    for a, b in zip([*dense.keys, *dense.values], [*want.keys, *want.values], strict=True):
                        assert torch.equal(a, b)
                    assert torch.equal(dense.timestamps.cpu(), ps[u].timestamps)
            assert store._staging is not None and store._staging.capacity > 0

    asyncio.run(run())


@pytest.mark.parametrize("fmt", ["exact", "int8"])
def test_host_promotions_from_pinned_memory_are_exact(fmt: str) -> None:
    hs = [_history(u, 2000) for u in range(2)]
    ps = [_prefix(h, u) for u, h in enumerate(hs)]
    nbytes = ps[0].nbytes()
    config = PrefixStoreConfig(
        device="cuda", device_budget_bytes=nbytes, host_budget_bytes=4 * nbytes, cold_kv_format=fmt
    )

    async def run() -> None:
        with PrefixStore(config, "m1") as store:
            store.put(0, ps[0])
            store.put(1, ps[1])  # 0 goes to pinned host memory
            for u in (0, 1, 0, 1):
                store.settle()
                got = await store.lookup(u, hs[u])
                assert got.tier == "host" and got.prefix is not None
                want = to_warm(to_cold(ps[u], fmt), torch.device("cuda"))
                dense = got.prefix.dense()  # its pages gathered on the default stream: after the copies
                for a, b in zip([*dense.keys, *dense.values], [*want.keys, *want.values], strict=True):
                    assert torch.equal(a, b)

    asyncio.run(run())
