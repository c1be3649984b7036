"""Cold-tier formats: round trips and their bounds, byte accounting in every tier, and the ranking
error of each format on a small model trained on MovieLens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from relaygr.bench.cold_tiers import ndcg_at_k, through_disk, top_k_overlap
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store.kv_codec import decode, encode
from relaygr.workers.store.kv_formats import (
    COLD_FORMATS,
    check_format,
    cold_nbytes,
    to_cold,
    to_warm,
    token_bytes,
)
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS, HEADS, DK, DV = 2, 2, 16, 12


def _prefix(n: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, outlier: bool = False) -> PrefixKV:
    g = torch.Generator().manual_seed(seed)
    history = Events.from_lists(list(range(1, n + 1)), [1000.0 + 7 * i for i in range(n)])
    keys = [torch.randn(HEADS, n, DK, generator=g).to(dtype) for _ in range(LAYERS)]
    if outlier and n:
        keys[0][0, 0, 0] = 1e4  # one huge value: its block loses precision, no other block does
    return PrefixKV(
        keys=keys,
        values=[torch.randn(HEADS, n, DV, generator=g).to(dtype) for _ in range(LAYERS)],
        positions=torch.arange(n, dtype=torch.int64),
        timestamps=history.timestamps.clone(),
        length=n,
        fingerprint=history_fingerprint(history),
        model_version="m1",
        meta={"worker_id": "w0"},
    )


def _history(n: int) -> Events:
    return Events.from_lists(list(range(1, n + 1)), [1000.0 + 7 * i for i in range(n)])


def _tensors(p: PrefixKV) -> list[torch.Tensor]:
    return [*p.keys, *p.values]


def test_exact_is_the_identity_and_unknown_formats_are_refused() -> None:
    p = _prefix(9)
    assert to_cold(p, "exact") is p and to_warm(p, "cpu") is p
    assert cold_nbytes(p, "exact") == p.nbytes()
    with pytest.raises(ValueError, match="cold KV format"):
        check_format("fp8")
    with pytest.raises(ValueError, match="cold_kv_format"):
        PrefixStoreConfig(cold_kv_format="fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 33])
def test_cold_forms_decode_to_the_model_dtype_within_their_bound(dtype: torch.dtype, n: int) -> None:
    p = _prefix(n, dtype=dtype, outlier=True)
    for fmt in ("bf16", "int8"):
        cold = to_cold(p, fmt)
        assert cold.kv_format == fmt and cold.nbytes() == cold_nbytes(p, fmt)
        warm = to_warm(cold, "cpu")
        assert warm.kv_format == "exact" and warm.dtype == dtype and warm.positions.dtype == torch.int64
        assert torch.equal(warm.positions, p.positions) and torch.equal(warm.timestamps, p.timestamps)
        assert (warm.length, warm.fingerprint, warm.meta) == (p.length, p.fingerprint, p.meta)
        for a, b in zip(_tensors(p), _tensors(warm), strict=True):
            err = (a.float() - b.float()).abs()
            absmax = a.float().abs().amax(dim=-1, keepdim=True)
            # bf16 keeps 8 significant bits; int8 rounds to half a step of absmax / 127 per block
            # (plus the float16 rounding of the scale)
            bound = a.float().abs() * 2**-8 if fmt == "bf16" else absmax * (0.5 / 127 + 2**-10)
            if dtype == torch.bfloat16 and fmt == "int8":  # decoded into bf16: its rounding too
                bound = bound + b.float().abs() * 2**-8
            assert bool((err <= bound + 1e-30).all()), fmt
    if n:  # the outlier only costs its own block
        q = to_warm(to_cold(p, "int8"), "cpu")
        assert torch.allclose(q.keys[0][0, 1:], p.keys[0][0, 1:].to(q.dtype), atol=0.05)


def test_all_zero_blocks_stay_exactly_zero() -> None:
    p = _prefix(4)
    p.keys[1].zero_()
    q = to_warm(to_cold(p, "int8"), "cpu")
    assert torch.equal(q.keys[1], p.keys[1])


@pytest.mark.parametrize("fmt", COLD_FORMATS)
def test_the_codec_keeps_a_cold_form_bit_for_bit(fmt: str) -> None:
    cold = to_cold(_prefix(21), fmt)
    back = decode(encode(cold), expected_model_version="m1")
    assert (back.kv_format, back.exact_dtype, len(back.scales)) == (
        cold.kv_format,
        cold.exact_dtype,
        len(cold.scales),
    )
    for a, b in zip(
        [*_tensors(cold), *cold.scales, cold.positions],
        [*_tensors(back), *back.scales, back.positions],
        strict=True,
    ):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(to_warm(back, "cpu").keys[0], to_warm(cold, "cpu").keys[0])


@pytest.mark.parametrize("fmt", COLD_FORMATS)
def test_token_bytes_is_what_a_cold_prefix_holds_per_event(fmt: str) -> None:
    for n in (1, 100):
        p = _prefix(n)
        assert cold_nbytes(p, fmt) == n * token_bytes(LAYERS, HEADS, DK, DV, torch.float32, fmt)
    # the targets' arithmetic on the default model shape (2 layers, 2 heads, 32 + 32 dims)
    exact = token_bytes(2, 2, 32, 32, torch.float32, "exact")
    assert exact / token_bytes(2, 2, 32, 32, torch.float32, "int8") >= 3.5
    assert exact / token_bytes(2, 2, 32, 32, torch.float32, "bf16") >= 1.9


def _store(tmp_path, fmt: str, **budgets: int) -> PrefixStore:
    cfg = PrefixStoreConfig(disk_path=str(tmp_path / fmt), cold_kv_format=fmt, **budgets)
    return PrefixStore(cfg, "m1", executor=ThreadPoolExecutor(1))


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
async def test_host_tier_holds_and_counts_the_cold_form_and_promotes_it_decoded(tmp_path, fmt: str) -> None:
    prefixes = [_prefix(40 + i, seed=i) for i in range(3)]
    host_need = sum(cold_nbytes(p, fmt) for p in prefixes)
    # room on host for exactly the cold forms: the exact ones would not all fit
    with _store(tmp_path, fmt, device_budget_bytes=0, host_budget_bytes=host_need) as store:
        for i, p in enumerate(prefixes):
            assert store.put(i, p) == "host"
        store._executor.submit(lambda: None).result()  # the compressing copies have landed
        m = store.metrics()
        assert m["bytes_host"] == host_need and m["entries_host"] == 3
        held = [store.placement._entries[store.placement.key(i)].prefix for i in range(3)]
        assert [h.kv_format for h in held] == [fmt] * 3
        assert sum(h.nbytes() for h in held) == m["bytes_host"]  # what it holds is what it counts
        got = await store.lookup(1, _history(41))
        assert got.tier == "host" and got.prefix.kv_format == "exact" and got.prefix.dtype == torch.float32
        assert torch.allclose(got.prefix.keys[0], prefixes[1].keys[0], atol=0.05)


@pytest.mark.parametrize("fmt", COLD_FORMATS)
async def test_disk_tier_counts_the_encoded_cold_form_and_survives_a_restart(tmp_path, fmt: str) -> None:
    p = _prefix(50)
    kw = {"device_budget_bytes": 0, "host_budget_bytes": 0}
    with _store(tmp_path, fmt, **kw) as store:
        assert store.put(7, p) == "disk"
        store.flush()
        assert store.metrics()["bytes_disk"] == len(encode(to_cold(p, fmt)))
    with _store(tmp_path, fmt, **kw) as store:
        got = await store.lookup(7, _history(50))
        assert got.tier == "disk" and got.prefix.kv_format == "exact"
        if fmt == "exact":  # the exact format stays exact through the disk
            assert all(torch.equal(a, b) for a, b in zip(_tensors(p), _tensors(got.prefix), strict=True))
        else:
            assert torch.allclose(got.prefix.values[1], p.values[1], atol=0.05)


# ------------------------------------------------------------------ ranking error, trained model


@pytest.fixture(scope="module")
def trained():
    from relaygr.workers.model.model import HSTUConfig, HSTURanker
    from relaygr.workers.training.movielens import load_movielens
    from relaygr.workers.training.train import split_leave_last_out, train_model

    ml = load_movielens("ml-100k")
    history, _ = split_leave_last_out(ml)
    torch.manual_seed(0)
    model = HSTURanker(
        HSTUConfig(num_items=ml.num_items, layers=2, heads=2, dim=32, attn_dim=16, linear_dim=16, max_len=48)
    )
    train_model(model, history, epochs=1, batch_size=32, max_steps=25, log=lambda _: None)
    return model, history


@pytest.mark.slow(seconds=35)  # training its model included
def test_each_format_ranks_within_its_bound_on_a_trained_model(trained) -> None:
    model, history = trained
    gen = torch.Generator().manual_seed(1)
    users = [u for u in sorted(history) if len(history[u]) >= 200][:24]
    stats: dict[str, dict[str, list[float]]] = {
        f: {"max": [], "overlap": [], "ndcg": []} for f in COLD_FORMATS
    }
    model = ModelRunner(model)
    for u in users:
        h = history[u]
        cands = torch.randperm(model.config.num_items, generator=gen)[:128] + 1
        ts = float(h.timestamps[-1]) + 60.0
        full = model.rank_full(h, cands, ts)
        prefix = model.prefill(h.slice(0, len(h) - 32))
        for fmt in COLD_FORMATS:
            got = model.rank(through_disk(prefix, fmt, model.device), h.slice(len(h) - 32), cands, ts)
            stats[fmt]["max"].append(float((got - full).abs().max()))
            stats[fmt]["overlap"].append(top_k_overlap(full, got))
            stats[fmt]["ndcg"].append(ndcg_at_k(full, got))
    spread = float(np.std(full.numpy()))  # how far apart the scores are: the scale of the bounds
    worst = {f: max(s["max"]) / spread for f, s in stats.items()}
    overlap = {f: float(np.mean(s["overlap"])) for f, s in stats.items()}
    ndcg = {f: float(np.mean(s["ndcg"])) for f, s in stats.items()}
    # exact: float rounding only; the cold formats: bounded, and far smaller than the scores' spread
    assert worst["exact"] < 1e-4 and overlap["exact"] == 1.0
    assert worst["bf16"] < 0.05 and overlap["bf16"] >= 0.99 and ndcg["bf16"] >= 0.99, (worst, overlap)
    assert worst["int8"] < 0.05 and overlap["int8"] >= 0.98 and ndcg["int8"] >= 0.98, (worst, overlap)


def test_ranking_comparisons() -> None:
    ref = torch.arange(20, dtype=torch.float32)
    assert top_k_overlap(ref, ref) == 1.0 and ndcg_at_k(ref, ref) == pytest.approx(1.0)
    swapped = ref.clone()
    swapped[[19, 18]] = swapped[[18, 19]]  # the top two trade places
    assert top_k_overlap(ref, swapped) == 1.0 and 0.95 < ndcg_at_k(ref, swapped) < 1.0
    assert top_k_overlap(ref, -ref) == 0.0 and ndcg_at_k(ref, -ref) == 0.0


def test_to_cold_leaves_a_prefix_used_by_the_model_untouched() -> None:
    p = _prefix(12)
    before = [t.clone() for t in _tensors(p)]
    to_cold(p, "int8")
    to_cold(p, "bf16")
    assert all(torch.equal(a, b) for a, b in zip(before, _tensors(p), strict=True))


def _square_prefix(n: int) -> PrefixKV:
    """Keys and values of one shape: ``to_cold`` and the codec lay the int8 blocks back to back."""
    g = torch.Generator().manual_seed(3)
    history = _history(n)
    return PrefixKV(
        keys=[torch.randn(HEADS, n, DK, generator=g) for _ in range(LAYERS)],
        values=[torch.randn(HEADS, n, DK, generator=g) * 5 for _ in range(LAYERS)],
        positions=torch.arange(n, dtype=torch.int64),
        timestamps=history.timestamps.clone(),
        length=n,
        fingerprint=history_fingerprint(history),
        model_version="m1",
    )


@pytest.mark.parametrize("n", [1, 33])
def test_back_to_back_int8_blocks_decode_as_each_block_alone(n: int) -> None:
    from relaygr.workers.store.kv_formats import _back_to_back

    cold = to_cold(_square_prefix(n), "int8")
    read = decode(encode(cold))
    # Both the cold form and the blob read back hold every layer as one run (the fast path) ...
    assert _back_to_back(_tensors(cold)) is not None and _back_to_back(cold.scales) is not None
    assert _back_to_back(_tensors(read)) is not None and _back_to_back(read.scales) is not None
    # ... which decodes exactly as each block scaled on its own.
    want = [
        q.to(torch.float32) * s.to(torch.float32) for q, s in zip(_tensors(cold), cold.scales, strict=True)
    ]
    for got in (to_warm(cold, "cpu"), to_warm(read, "cpu")):
        assert all(torch.equal(a, b) for a, b in zip(_tensors(got), want, strict=True))
        assert got.positions.dtype == torch.int64 and torch.equal(got.timestamps, cold.timestamps)
    # Blocks copied apart (no longer one run) take the block-by-block path, to the same result.
    apart = PrefixKV(
        **{
            **{
                f: getattr(cold, f)
                for f in ("positions", "timestamps", "length", "fingerprint", "model_version")
            },
            "keys": [k.clone() for k in cold.keys],
            "values": [v.clone() for v in cold.values],
            "scales": [s.clone() for s in cold.scales],
            "kv_format": "int8",
            "exact_dtype": torch.float32,
        }
    )
    assert _back_to_back(_tensors(apart)) is None
    assert all(torch.equal(a, b) for a, b in zip(_tensors(to_warm(apart, "cpu")), want, strict=True))


def test_the_codec_reads_a_run_of_like_tensors_as_views_of_one() -> None:
    from relaygr.workers.store.kv_formats import _back_to_back

    exact = _square_prefix(9)
    read = decode(encode(exact))
    assert _back_to_back(_tensors(read)) is not None
    assert all(torch.equal(a, b) for a, b in zip(_tensors(read), _tensors(exact), strict=True))
    mixed = decode(encode(_prefix(9)))  # keys and values of two shapes: two runs
    assert _back_to_back(_tensors(mixed)) is None and _back_to_back(mixed.keys) is not None
