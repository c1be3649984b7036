"""Relay exactness of the HSTU ranker as its runner serves it (``ModelRunner``): cached prefix + suffix
== full inference, and friends."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.workers.model.dense import dense_rank_full
from relaygr.workers.model.inference import UserRanking
from relaygr.workers.model.model import HSTUConfig, HSTURanker
from relaygr.workers.model.presets import PRESETS, preset
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# fp32: scores are O(1); the paths differ only in summation order and matmul blocking.
RTOL32, ATOL32 = 1e-5, 1e-5
# fp64 model: the paths agree to float64 rounding; the float32 output limits the comparison.
RTOL64, ATOL64 = 1e-6, 1e-6
# bf16 keeps 8 mantissa bits: blockings round differently at every layer. Bound: 5e-2 of the
# score scale (observed differences are a few 1e-3).
BF16_TOL = 5e-2

NUM_ITEMS = 40


def _config(**kw) -> HSTUConfig:
    base = dict(
        num_items=NUM_ITEMS,
        layers=2,
        heads=2,
        dim=16,
        attn_dim=8,
        linear_dim=8,
        attn_block=8,
        candidate_batch=4,
        dropout=0.0,
    )
    return HSTUConfig(**(base | kw))


def _randomise(model: HSTURanker, seed: int, scale: float = 0.5) -> HSTURanker:
    """Large random weights (biases included), so that every path through the model matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.refresh_version()
    return model.eval()


@functools.cache
def model32() -> ModelRunner:
    """With far keys (events 8 or more back weigh at most 3 events' worth together): every test
    that runs both models covers the far-key factors in float32 and the plain sum in float64."""
    return ModelRunner(_randomise(HSTURanker(_config(near_keys=8, far_keys=3.0)), 1))


@functools.cache
def model64() -> ModelRunner:
    m = _randomise(HSTURanker(_config()), 2).to(torch.float64)
    m.refresh_version()
    return ModelRunner(m)


def history(n: int, seed: int) -> Events:
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.randint(0, 3, (n,), generator=gen).double() * 10.0 ** torch.randint(
        0, 6, (n,), generator=gen
    )
    return Events(
        item_ids=torch.randint(-2, NUM_ITEMS + 5, (n,), generator=gen),  # includes unknown ids
        action_ids=torch.randint(0, 8, (n,), generator=gen),
        timestamps=8.8e8 + torch.cumsum(gaps, 0),
    )


def candidates(c: int, seed: int) -> torch.Tensor:
    return torch.randint(-1, NUM_ITEMS + 3, (c,), generator=torch.Generator().manual_seed(seed + 7))


def request_time(h: Events, offset: float) -> float:
    return float(h.timestamps[-1]) + offset if len(h) else 8.8e8 + offset


@given(
    n=st.integers(0, 60),
    split=st.floats(0, 1),
    chunk=st.integers(1, 25),
    c=st.integers(1, 13),
    offset=st.sampled_from([0.0, 1.0, 37.0, 86400.0, -100.0]),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=100, deadline=None)
def test_relay_equals_full(n, split, chunk, c, offset, seed) -> None:
    h, cands = history(n, seed), candidates(c, seed)
    ts = request_time(h, offset)
    cut = int(split * n)
    for model, rtol, atol in ((model32(), RTOL32, ATOL32), (model64(), RTOL64, ATOL64)):
        full = model.rank_full(h, cands, ts)
        prefix = model.prefill(h.slice(0, cut), chunk_size=chunk)
        relay = model.rank(prefix, h.slice(cut), cands, ts)
        assert relay.dtype == torch.float32 and relay.device.type == "cpu" and relay.shape == (c,)
        torch.testing.assert_close(relay, full, rtol=rtol, atol=atol)
    # The dense training path computes the same function.
    ref = dense_rank_full(model64().model, h, cands, ts)
    torch.testing.assert_close(model64().rank_full(h, cands, ts), ref, rtol=RTOL64, atol=ATOL64)
    ref32 = dense_rank_full(model32().model, h, cands, ts)
    torch.testing.assert_close(model32().rank_full(h, cands, ts), ref32, rtol=RTOL32, atol=ATOL32)


def _assert_prefix_close(a: PrefixKV, b: PrefixKV, rtol: float, atol: float) -> None:
    a, b = a.dense(), b.dense()  # a paged prefix's tokens, gathered
    assert a.length == b.length and a.fingerprint == b.fingerprint and a.model_version == b.model_version
    assert torch.equal(a.positions, b.positions) and torch.equal(a.timestamps, b.timestamps)
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@given(
    n=st.integers(0, 60),
    first=st.floats(0, 1),
    chunk=st.integers(1, 25),
    extend_chunk=st.one_of(st.none(), st.integers(1, 25)),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_extend_and_chunked_prefill_equal_one_shot(n, first, chunk, extend_chunk, seed) -> None:
    h = history(n, seed)
    cut = int(first * n)
    for model, rtol, atol in ((model32(), RTOL32, ATOL32), (model64(), 1e-12, 1e-12)):
        one_shot = model.prefill(h)
        assert one_shot.fingerprint == history_fingerprint(h)
        _assert_prefix_close(model.prefill(h, chunk_size=chunk), one_shot, rtol, atol)
        extended = model.extend(model.prefill(h.slice(0, cut)), h, chunk_size=extend_chunk)
        _assert_prefix_close(extended, one_shot, rtol, atol)
        assert extended.matches(h)


@given(
    n=st.integers(0, 60),
    split=st.floats(0, 1),
    c=st.integers(1, 9),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_rank_and_extend_scores_like_rank_and_returns_the_whole_prefix(n, split, c, seed) -> None:
    h, cands = history(n, seed), candidates(c, seed)
    ts = request_time(h, 60.0)
    cut = int(split * n)
    for model, rtol, atol in ((model32(), RTOL32, ATOL32), (model64(), 1e-12, 1e-12)):
        for prefix in (model.prefill(h.slice(0, cut)), None):
            scores, grow = model.rank_and_extend(prefix, h, cands, ts)
            grown = grow()
            torch.testing.assert_close(scores, model.rank_full(h, cands, ts), rtol=max(rtol, 1e-6), atol=atol)
            _assert_prefix_close(grown, model.prefill(h), rtol, atol)
            # The grown prefix serves a later, longer history like a fresh pre-inference.
            later = h.concat(history(5, seed + 1))
            after = model.rank(grown, later.slice(n), cands, ts + 60)
            torch.testing.assert_close(after, model.rank_full(later, cands, ts + 60), rtol=rtol, atol=atol)


@given(
    n=st.integers(1, 60),
    cut=st.floats(0, 1),
    ends=st.lists(st.floats(0, 1), min_size=1, max_size=5),
    c=st.integers(1, 9),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=50, deadline=None)
def test_rank_many_ranks_a_burst_like_one_request_at_a_time(n, cut, ends, c, seed) -> None:
    """A burst of one user's requests: nested histories, each with its own candidates and time."""
    h = history(n, seed)
    start = int(cut * n)
    lengths = [start + int(e * (n - start)) for e in ends]
    lengths[seed % len(lengths)] = n  # one request sees the whole history
    requests = [
        (h.slice(0, m), candidates(c + i, seed + i), request_time(h.slice(0, m), 30.0 + i))
        for i, m in enumerate(lengths)
    ]
    for model, rtol, atol in ((model32(), RTOL32, ATOL32), (model64(), 1e-12, 1e-12)):
        prefix = model.prefill(h.slice(0, start))
        scores, grow = model.rank_many(prefix, requests)
        assert len(scores) == len(requests)
        for got, (hi, ci, ti) in zip(scores, requests, strict=True):
            torch.testing.assert_close(got, model.rank_full(hi, ci, ti), rtol=max(rtol, 1e-6), atol=atol)
        _assert_prefix_close(grow(), model.prefill(h), rtol, atol)


def test_rank_many_rejects_histories_that_do_not_nest() -> None:
    model = model32()
    h = history(30, 1)
    other = h.slice(0, 20).concat(history(5, 2))
    prefix = model.prefill(h.slice(0, 10))
    cands = candidates(3, 1)
    with pytest.raises(ValueError, match="do not nest"):
        model.rank_many(prefix, [(h, cands, 2e9), (other, cands, 2e9)])
    with pytest.raises(ValueError, match="prefix"):
        model.rank_many(model.prefill(history(10, 9)), [(h, cands, 2e9)])


@given(
    users=st.lists(
        st.tuples(st.integers(0, 40), st.floats(0, 1), st.integers(0, 9), st.booleans()),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=50, deadline=None)
def test_rank_users_scores_each_user_as_ranking_it_alone(users, seed) -> None:
    """Several users in one forward (one jagged batch): each one's scores and grown prefix equal
    ranking that user alone, with or without a cached prefix, with or without candidates."""
    for model, rtol, atol in ((model32(), RTOL32, ATOL32), (model64(), 1e-12, 1e-12)):
        requests = []
        for i, (n, split, c, cached) in enumerate(users):
            h = history(n, seed + i)
            prefix = model.prefill(h.slice(0, int(split * n))) if cached else None
            requests.append(UserRanking(prefix, h, candidates(c, seed + i), request_time(h, 30.0 + i)))
        together = model.rank_users(requests)
        assert len(together) == len(requests)
        for (scores, grow), r in zip(together, requests, strict=True):
            alone, grow_alone = model.rank_and_extend(r.prefix, r.history, r.candidates, r.request_ts)
            assert scores.shape == alone.shape == (len(r.candidates),)
            torch.testing.assert_close(scores, alone, rtol=rtol, atol=atol)
            _assert_prefix_close(grow(), grow_alone(), rtol, atol)


def test_rank_users_rejects_a_prefix_of_another_history() -> None:
    model = model32()
    h = history(20, 1)
    good = UserRanking(model.prefill(h.slice(0, 5)), h, candidates(3, 1), 2e9)
    bad = UserRanking(model.prefill(history(10, 2)), h, candidates(3, 1), 2e9)
    with pytest.raises(ValueError, match="not the start"):
        model.rank_users([good, bad])
    with pytest.raises(ValueError, match="no requests"):
        model.rank_users([])


@given(
    n=st.integers(0, 60),
    c=st.integers(1, 13),
    step=st.integers(1, 70),
    seed=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_scoring_in_steps_of_keys_equals_one_pass(n, c, step, seed) -> None:
    """Candidates against a cached prefix in steps of whole layers (a heavy user's time slices)
    score exactly as one pass; the steps report every key of every layer once per
    ``candidate_batch`` of candidates (the unit the engine's pacing counts in)."""
    h, cands = history(n, seed), candidates(c, seed)
    ts = request_time(h, 37.0)
    for model in (model32(), model64()):
        prefix = model.prefill(h, chunk_size=7)
        want = model.rank(prefix, h.slice(n), cands, ts)
        steps = list(model.score_steps(prefix, cands, ts, lambda: step))
        *visits, got = steps
        assert torch.equal(got, want)
        per_layer = max(1, n * -(-c // model.config.candidate_batch))
        # Each step reports its keys; what the last step visited goes with the scores.
        left = per_layer * model.config.layers - sum(visits)
        assert 0 <= left < max(per_layer, step)
        assert all(v >= step and v % per_layer == 0 for v in visits)


def test_serving_state_follows_weight_changes() -> None:
    """Serving builds its bias tables and fused weights once per set of weights: a weight changed
    in place (a training step, a load) or a model moved to another dtype is seen at once."""
    model = _randomise(HSTURanker(_config()), 5)
    runner = ModelRunner(model)
    h, cands = history(20, 3), candidates(5, 3)
    ts = request_time(h, 37.0)
    before = runner.rank(None, h, cands, ts)
    with torch.no_grad():
        model.layers[0].pos_bias.add_(1.0)
        model.layers[1].uqkv.weight.mul_(1.5)
        model.action_emb.weight.add_(0.3)
    after = runner.rank(None, h, cands, ts)
    assert not torch.allclose(after, before, rtol=RTOL32, atol=ATOL32)
    torch.testing.assert_close(after, dense_rank_full(model, h, cands, ts), rtol=RTOL32, atol=ATOL32)
    model.to(torch.float64)
    torch.testing.assert_close(
        runner.rank(None, h, cands, ts), dense_rank_full(model, h, cands, ts), rtol=RTOL64, atol=ATOL64
    )


def test_rank_and_extend_rejects_a_prefix_of_another_history() -> None:
    model = model32()
    prefix = model.prefill(history(10, 1))
    with pytest.raises(ValueError, match="not the start"):
        model.rank_and_extend(prefix, history(20, 2), candidates(3, 0), 9e8)


def test_prefill_steps_yield_between_chunks() -> None:
    model, h = model32(), history(30, 3)
    steps = list(model.prefill_steps(h, chunk_size=8))
    assert steps[:-1] == [None, None, None] and isinstance(steps[-1], PrefixKV)
    _assert_prefix_close(steps[-1], model.prefill(h), RTOL32, ATOL32)


@given(c=st.integers(2, 14), mb=st.integers(1, 6), seed=st.integers(0, 10_000))
@settings(max_examples=50, deadline=None)
def test_candidates_are_independent(c, mb, seed) -> None:
    """Permuting candidates permutes scores; a candidate's score does not depend on the others in
    its micro-batch (alone, or among other companions, it scores the same)."""
    model = model32()
    h, cands = history(20, seed), candidates(c, seed)
    ts = request_time(h, 60.0)
    prefix = model.prefill(h.slice(0, 12))
    suffix = h.slice(12)
    base = model.rank(prefix, suffix, cands, ts, micro_batch=mb)
    perm = torch.randperm(c, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(model.rank(prefix, suffix, cands[perm], ts, micro_batch=mb), base[perm])
    alone = torch.cat([model.rank(prefix, suffix, cands[i : i + 1], ts) for i in range(c)])
    torch.testing.assert_close(alone, base, rtol=RTOL32, atol=ATOL32)
    others = torch.cat([cands[:1], candidates(5, seed + 1)])
    torch.testing.assert_close(
        model.rank(prefix, suffix, others, ts, micro_batch=6)[0], base[0], rtol=RTOL32, atol=ATOL32
    )


def test_bf16_relay_close_to_full() -> None:
    module = _randomise(HSTURanker(_config(dtype="bfloat16")), 3)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.5)
    module.refresh_version()
    model = ModelRunner(module)
    assert model.dtype == torch.bfloat16
    worst = 0.0
    for seed in range(6):
        h, cands = history(50, seed), candidates(12, seed)
        ts = request_time(h, 100.0)
        full = model.rank_full(h, cands, ts)
        relay = model.rank(model.prefill(h.slice(0, 20 + seed), chunk_size=7), h.slice(20 + seed), cands, ts)
        scale = full.abs().max().clamp_min(1.0)
        worst = max(worst, float(((relay - full).abs() / scale).max()))
    assert worst <= BF16_TOL, worst


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_relay_equals_full_on_each_presets_shape(name: str) -> None:
    # The preset's heads and width, and its layers up to 8 (a layer's arithmetic is the same at any
    # depth; xl's 24 layers of d=1024 cost 1.5 GB of float64 weights to build; nvidia-block, of
    # xl's width, takes 2), at tiny lengths (small blocks, so that histories still span several of
    # them); weights scaled to the width so that 8 layers keep scores O(1).
    shape = preset(name).config(
        num_items=NUM_ITEMS, attn_block=8, candidate_batch=4, dropout=0.0, max_seq_len=64,
        layers=min(preset(name).layers, 2 if name == "nvidia-block" else 8),
    )  # fmt: skip
    model = ModelRunner(_randomise(HSTURanker(shape), 5, scale=shape.dim**-0.5))
    wide64 = _randomise(HSTURanker(shape), 5, scale=shape.dim**-0.5).to(torch.float64)
    wide64.refresh_version()
    model64 = ModelRunner(wide64)
    for n, cut, seed in ((40, 17, 0), (33, 0, 1), (29, 29, 2)):
        h, cands = history(n, seed), candidates(9, seed)
        ts = request_time(h, 60.0)
        for m, rtol, atol in ((model, RTOL32, ATOL32), (model64, RTOL64, ATOL64)):
            full = m.rank_full(h, cands, ts)
            relay = m.rank(m.prefill(h.slice(0, cut), chunk_size=7), h.slice(cut), cands, ts)
            torch.testing.assert_close(relay, full, rtol=rtol, atol=atol)
            assert float(full.abs().max()) > 1e-3  # the comparison is not between zeros


def test_unknown_ids_and_empty_inputs() -> None:
    model = model32()
    h = Events.from_lists([10**9, -4, 3], [1.0, 2.0, 3.0], [9, -1, 2])
    scores = model.rank_full(h, torch.tensor([0, 10**12, -7, 5]), 4.0)
    assert torch.isfinite(scores).all()
    # ids outside the vocabulary share the unknown embedding: same score as id 0
    assert scores[0] == scores[1] == scores[2]
    empty = model.prefill(Events.empty())
    assert empty.length == 0 and empty.nbytes() >= 0
    torch.testing.assert_close(
        model.rank(empty, h, torch.tensor([1, 2]), 4.0), model.rank_full(h, torch.tensor([1, 2]), 4.0)
    )
    assert model.rank(None, Events.empty(), torch.tensor([], dtype=torch.int64), 0.0).shape == (0,)


def test_extend_rejects_a_different_history() -> None:
    model = model32()
    h = history(20, 5)
    prefix = model.prefill(h.slice(0, 10))
    changed = Events(h.item_ids.clone(), h.action_ids, h.timestamps)
    changed.item_ids[3] += 1
    with pytest.raises(ValueError):
        model.extend(prefix, changed)
    with pytest.raises(ValueError):
        model.extend(prefix, h.slice(0, 5))


def test_prefix_from_another_model_is_rejected() -> None:
    prefix = model32().prefill(history(10, 1))
    other = ModelRunner(_randomise(HSTURanker(_config()), 99))
    with pytest.raises(ValueError):
        other.rank(prefix, Events.empty(), torch.tensor([1]), 0.0)


def test_prefix_size_and_move() -> None:
    model = model32()
    cfg = model.config
    n = 17
    prefix = model.prefill(history(n, 2))
    per_layer = n * cfg.heads * (cfg.attn_dim + cfg.linear_dim) * 4
    # Paged: whole pages of tokens (keys and values of every layer, and a timestamp each).
    token = cfg.layers * cfg.heads * (cfg.attn_dim + cfg.linear_dim) * 4 + 8
    pages = -(-n // model.pages.page_tokens)
    assert prefix.is_paged and prefix.nbytes() == pages * model.pages.page_tokens * token
    # Its dense form: the tokens' keys and values, positions and timestamps.
    assert prefix.dense().nbytes() == cfg.layers * per_layer + n * 8 + n * 8
    moved = prefix.to("cpu", pin=True)
    _assert_prefix_close(moved, prefix, 0.0, 0.0)


def test_save_load_roundtrip(tmp_path) -> None:
    model = model32()
    model.model.save(tmp_path)
    module = HSTURanker.load(tmp_path)
    loaded = ModelRunner(module)
    assert loaded.model_version == model.model_version and loaded.config == model.config
    h, cands = history(25, 4), candidates(6, 4)
    torch.testing.assert_close(
        loaded.rank_full(h, cands, 1e9), model.rank_full(h, cands, 1e9), rtol=0, atol=0
    )
    prefix = model.prefill(h.slice(0, 9))  # a prefix from the saved model works with the loaded one
    loaded.rank(prefix, h.slice(9), cands, 1e9)
    bf16 = HSTURanker.load(tmp_path, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.model_version != model.model_version
    assert module.item_embeddings().shape == (NUM_ITEMS + 1, model.config.dim)


def test_flops_counts_visible_pairs() -> None:
    model = model32()
    cfg = model.config
    pair = 2 * cfg.heads * (cfg.attn_dim + cfg.linear_dim)
    # relay work + the prefix's work = full work (the FLOP model is additive like the computation)
    full = model.flops(0, 30, 5)
    assert model.flops(0, 20, 0) + model.flops(20, 10, 5) == full
    assert model.flops(0, 0, 1) == cfg.layers * (model.flops(0, 0, 1) // cfg.layers)
    assert model.flops(0, 1, 0) - model.flops(0, 0, 0) >= pair


def test_device_and_dtype_resolution() -> None:
    from relaygr.workers.model.devices import resolve_device, resolve_dtype

    assert resolve_device("cpu").type == "cpu"
    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    with pytest.raises(ValueError):
        resolve_dtype("float64")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="torch_npu"):
            resolve_device("npu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            resolve_device("cuda")
    with pytest.raises(ValueError):
        HSTUConfig(device="tpu")


_HEAP_USE = """
import ctypes, ctypes.util, json, sys
import torch
from relaygr.workers.model.devices import keep_all_host_pages, keep_host_pages


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


libc = ctypes.CDLL(ctypes.util.find_library("c"))
keep = {"default": lambda: True, "keep": keep_host_pages, "keep_all": keep_all_host_pages}[sys.argv[1]]
if not hasattr(libc, "mallinfo2") or not keep():
    sys.exit(3)
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2()
scratch = torch.ones(int(sys.argv[2]), dtype=torch.uint8)
during = libc.mallinfo2()
del scratch
after = libc.mallinfo2()
print(json.dumps({"mmapped": during.hblkhd - before.hblkhd, "heap_kept": after.arena >= during.arena}))
"""


def test_keep_host_pages_serves_ranking_scratch_from_the_kept_heap() -> None:
    """By default glibc serves a block of a few MiB as a fresh ``mmap`` (faulted in page by page
    on every use, and returned at free); with ``keep_host_pages`` it comes from the heap, which
    keeps it after the free for the next call. Counted in bytes, in fresh processes, so that
    neither the machine's load nor the rest of the suite moves the figure (the page faults per
    call themselves are a ``relaygr bench model`` figure)."""
    import json
    import subprocess
    import sys

    def heap_use(mode: str, size: int = 4 << 20) -> dict:  # a ranking's scratch: a few MiB
        done = subprocess.run(
            [sys.executable, "-c", _HEAP_USE, mode, str(size)], capture_output=True, text=True, timeout=300
        )
        if done.returncode == 3:
            pytest.skip("glibc's mallopt and mallinfo2 are not available here")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc is Linux only")
    default, kept = heap_use("default"), heap_use("keep")
    assert default["mmapped"] >= 4 << 20, default
    assert kept["mmapped"] == 0 and kept["heap_kept"], kept
    # A training step's attention scores: past glibc's 32 MiB ceiling only ``keep_all_host_pages``
    # (what ``relaygr train`` sets on CPU) serves them from the heap.
    big = 48 << 20
    assert heap_use("keep", big)["mmapped"] >= big
    kept_all = heap_use("keep_all", big)
    assert kept_all["mmapped"] == 0 and kept_all["heap_kept"], kept_all
