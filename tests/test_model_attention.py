"""Bucket functions and the blockwise attention against the dense reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.workers.fused_scoring import bias_index, candidate_index
from relaygr.workers.hstu_attention import (
    WIDE_TIME_COLUMNS,
    Segment,
    dense_attention,
    key_block_size,
    pair_index,
    plan_attention,
    position_bucket,
    run_attention,
    time_bucket,
    wide_bias_table,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


F64_TOL = 1e-10  # blockwise vs dense in float64: only summation order differs


def _time_bucket_reference(gap: float, num_buckets: int) -> int:
    g = max(float(torch.tensor(gap, dtype=torch.float64).to(torch.float32)), 1.0)
    mantissa, exp = math.frexp(g)  # g = mantissa * 2**exp, mantissa in [0.5, 1)
    return min(2 * (exp - 1) + (mantissa >= 0.75), num_buckets - 1)


def _position_bucket_reference(d: int, num_buckets: int) -> int:
    d = max(d, 0)
    if d < 16:
        return min(d, num_buckets - 1)
    e = d.bit_length() - 1
    frac = ((d << 2) >> e) & 3  # two bits after the leading one
    return min(16 + 4 * (e - 4) + frac, num_buckets - 1)


def test_bucket_known_values() -> None:
    d = torch.tensor([-5, 0, 1, 15, 16, 19, 20, 24, 28, 32, 1000, 10**6])
    assert position_bucket(d, 64).tolist() == [0, 0, 1, 15, 16, 16, 17, 18, 19, 20, 39, 63]
    gaps = torch.tensor([-3.0, 0.0, 0.5, 1.0, 1.49, 1.5, 2.0, 2.99, 3.0, 4.0, 6.0, 86400.0, 1e30])
    assert time_bucket(gaps.double(), 64).tolist() == [0, 0, 0, 0, 0, 1, 2, 2, 3, 4, 5, 32, 63]
    assert pair_index(torch.tensor(0), torch.tensor(0.0, dtype=torch.float64), 64, 64).item() == 0


@given(st.lists(st.integers(-100, 200_000), min_size=1, max_size=50), st.integers(1, 80))
@settings(max_examples=40, deadline=None)
def test_position_bucket_matches_integer_formula(ds: list[int], nb: int) -> None:
    got = position_bucket(torch.tensor(ds), nb).tolist()
    assert got == [_position_bucket_reference(d, nb) for d in ds]


@given(st.lists(st.floats(-1e3, 1e10, allow_nan=False), min_size=1, max_size=50), st.integers(1, 80))
@settings(max_examples=40, deadline=None)
def test_time_bucket_matches_frexp_formula(gaps: list[float], nb: int) -> None:
    got = time_bucket(torch.tensor(gaps, dtype=torch.float64), nb).tolist()
    assert got == [_time_bucket_reference(g, nb) for g in gaps]


def _random_ts(n: int, gen: torch.Generator, sorted_: bool) -> torch.Tensor:
    gaps = torch.randint(0, 4, (n,), generator=gen).double() * torch.rand(
        n, generator=gen, dtype=torch.float64
    )
    gaps = (gaps * 10.0 ** torch.randint(0, 6, (n,), generator=gen)).floor()
    ts = 8.8e8 + torch.cumsum(gaps, 0)
    return ts if sorted_ else ts[torch.randperm(n, generator=gen)]


@given(
    heads=st.integers(1, 3),
    dqk=st.integers(1, 9),
    dv=st.integers(1, 9),
    prefix=st.integers(0, 70),
    split=st.floats(0, 1),
    nq=st.integers(1, 40),
    block=st.sampled_from([8, 16, 32]),
    sorted_ts=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=120, deadline=None)
def test_blockwise_causal_matches_dense(heads, dqk, dv, prefix, split, nq, block, sorted_ts, seed) -> None:
    """Queries at positions prefix..prefix+nq-1 over keys 0..prefix+nq-1 held in two segments
    (a cached part, then the chunk itself), against the dense reference with an explicit mask."""
    gen = torch.Generator().manual_seed(seed)
    npos, ntime = 24, 40
    total = prefix + nq
    q = torch.randn(heads, nq, dqk, generator=gen, dtype=torch.float64)
    k = torch.randn(heads, total, dqk, generator=gen, dtype=torch.float64)
    v = torch.randn(heads, total, dv, generator=gen, dtype=torch.float64)
    ts = _random_ts(total, gen, sorted_ts)
    pos_b = torch.randn(npos, generator=gen, dtype=torch.float64)
    time_b = torch.randn(ntime, generator=gen, dtype=torch.float64)
    pos = torch.arange(total)
    q_pos = pos[prefix:]
    index = pair_index(q_pos[:, None] - pos[None, :], ts[prefix:, None] - ts[None, :], npos, ntime)
    visible = q_pos[:, None] >= pos[None, :]
    table = (pos_b[:, None] + time_b[None, :]).reshape(-1)
    want = dense_attention(q, k, v, index, visible, table, 7.0)

    cut = int(split * prefix)
    segments = [Segment(0, ts[:cut]), Segment(cut, ts[cut:])]
    kv = [(k[:, :cut], v[:, :cut]), (k[:, cut:], v[:, cut:])]
    tasks = plan_attention(prefix, ts[prefix:], segments, rows=nq, causal=True, block=block, num_pos=npos)
    got = run_attention(q, tasks, kv, wide_bias_table(pos_b, time_b), dv) / 7.0
    torch.testing.assert_close(got, want, rtol=F64_TOL, atol=F64_TOL)
    # No score block is larger than one block of block*block values (wider keys for skinny chunks).
    assert all(t.index.numel() <= max(block, nq) * key_block_size(block, nq) for t in tasks)
    # Fully masked blocks are skipped, and only blocks that straddle the diagonal carry a mask.
    for t in tasks:
        start = segments[t.segment].start
        assert start + t.k0 < total
        assert (t.hidden is not None) == (start + t.k1 - 1 > prefix)


@given(
    heads=st.integers(1, 3),
    d=st.integers(1, 8),
    history=st.integers(0, 90),
    rows=st.integers(1, 20),
    block=st.sampled_from([8, 16]),
    gap=st.floats(-1e4, 1e7),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=80, deadline=None)
def test_blockwise_candidates_match_dense(heads, d, history, rows, block, gap, seed) -> None:
    """Candidate queries share one position (after the history) and timestamp; they see all keys."""
    gen = torch.Generator().manual_seed(seed)
    npos, ntime = 64, 64
    q = torch.randn(heads, rows, d, generator=gen, dtype=torch.float64)
    k = torch.randn(heads, history, d, generator=gen, dtype=torch.float64)
    v = torch.randn(heads, history, d, generator=gen, dtype=torch.float64)
    ts = _random_ts(history, gen, True)
    when = (ts[-1] if history else torch.tensor(8.8e8, dtype=torch.float64)) + gap
    pos_b = torch.randn(npos, generator=gen, dtype=torch.float64)
    time_b = torch.randn(ntime, generator=gen, dtype=torch.float64)
    pos = torch.arange(history)
    index = pair_index((history - pos)[None, :], (when - ts)[None, :], npos, ntime).expand(rows, history)
    visible = torch.ones(rows, history, dtype=torch.bool)
    table = (pos_b[:, None] + time_b[None, :]).reshape(-1)
    want = dense_attention(q, k, v, index, visible, table, 3.0)
    tasks = plan_attention(
        history, when.reshape(1), [Segment(0, ts)], rows=rows, causal=False, block=block, num_pos=npos
    )
    got = run_attention(q, tasks, [(k, v)], wide_bias_table(pos_b, time_b), d) / 3.0
    torch.testing.assert_close(got, want, rtol=F64_TOL, atol=F64_TOL)


@given(
    sizes=st.lists(st.integers(0, 700), min_size=1, max_size=3),
    gap=st.floats(-1e4, 1e9),
    after=st.integers(0, 3),
    rows=st.integers(1, 130),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_candidate_index_equals_the_plans_indices(sizes, gap, after, rows, seed) -> None:
    """The fused scoring pass reads ``candidate_index``; the blockwise path reads the plan."""
    gen = torch.Generator().manual_seed(seed)
    ts = _random_ts(sum(sizes), gen, True)
    segments, start = [], 0
    for n in sizes:
        segments.append(Segment(start, ts[start : start + n]))
        start += n
    when = (ts[-1] if start else torch.tensor(8.8e8, dtype=torch.float64)) + gap
    q_pos = start + after
    tasks = plan_attention(q_pos, when.reshape(1), segments, rows=rows, causal=False, block=512, num_pos=64)
    got = candidate_index(q_pos, when.reshape(1), segments, num_pos=64)
    assert len(got) == len(segments)
    for si, seg in enumerate(segments):
        want = [t.index.reshape(-1) for t in tasks if t.segment == si]
        want = torch.cat(want) if want else torch.empty(0, dtype=torch.int32)
        assert got[si].shape == (seg.stop - seg.start,)
        assert torch.equal(got[si], want.long())


_GAPS = st.one_of(st.floats(-1e4, 1e12, allow_nan=False), st.sampled_from([0.0, 1.0, 1.5, 2.0, 3.0]))


@given(
    pairs=st.lists(st.tuples(st.integers(-50, 3_000_000), _GAPS), min_size=1, max_size=40),
    num_pos=st.integers(1, 80),
)
@settings(max_examples=80, deadline=None)
def test_fused_bias_index_equals_the_bit_pattern_index(pairs, num_pos) -> None:
    """The scripted relay ranking computes bias indices with frexp; the planner from float bits."""
    q_pos = torch.tensor([10_000_000], dtype=torch.int64)
    k_pos = q_pos - torch.tensor([d for d, _ in pairs], dtype=torch.int64)
    q_ts = torch.tensor([1.7e9], dtype=torch.float64)
    k_ts = q_ts - torch.tensor([g for _, g in pairs], dtype=torch.float64)
    got = bias_index(q_pos, q_ts, k_pos, k_ts, num_pos)[0]
    # The planner's index of a pair: its position part, plus the raw float32 code of the gap.
    pos = position_bucket(q_pos - k_pos, num_pos).long()
    gap32 = (q_ts - k_ts).to(torch.float32).clamp(min=1.0)
    code = (gap32.view(torch.int32) >> 22).long() - 254
    assert torch.equal(got.long(), pos * WIDE_TIME_COLUMNS + code)


def test_candidate_index_rejects_keys_after_queries() -> None:
    ts = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(ValueError):
        candidate_index(3, ts[:1], [Segment(0, ts)], num_pos=8)


def test_non_causal_plan_rejects_keys_after_queries() -> None:
    ts = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(ValueError):
        plan_attention(3, ts[:1], [Segment(0, ts)], rows=2, causal=False, block=8, num_pos=8)


def test_skinny_chunks_plan_no_wider_than_their_keys() -> None:
    # A one-token chunk after 1000 cached keys: its key blocks (and the plan's scratch tables)
    # span those 1000 keys, not block * block of them.
    ts = torch.arange(1001, dtype=torch.float64) * 60.0
    cache: dict = {}
    tasks = plan_attention(
        1000, ts[1000:], [Segment(0, ts[:1000]), Segment(1000, ts[1000:])],
        rows=1, causal=True, block=512, num_pos=64, cache=cache,
    )  # fmt: skip
    assert [(t.segment, t.k0, t.k1) for t in tasks] == [(0, 0, 1000), (1, 0, 1)]
    held = sum(t.numel() for t in cache.values() if isinstance(t, torch.Tensor))
    assert held <= 8 * 1001, held
