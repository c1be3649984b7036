"""Bucket functions and the blockwise attention against the dense reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.workers.model.fused_scoring import bias_index, candidate_index
from relaygr.workers.model.hstu_attention import (
    WIDE_TIME_COLUMNS,
    Segment,
    dense_attention,
    far_index,
    far_scale,
    far_weights,
    is_bucket_boundary,
    key_block_size,
    pair_index,
    plan_attention,
    position_bucket,
    run_attention,
    time_bucket,
    wide_bias_table,
    wide_far_index,
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
    near=st.sampled_from([0, 1, 4, 16, 20]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=120, deadline=None)
def test_blockwise_causal_matches_dense(
    heads, dqk, dv, prefix, split, nq, block, sorted_ts, near, seed
) -> None:
    """Queries at positions prefix..prefix+nq-1 over keys 0..prefix+nq-1 held in two segments
    (a cached part, then the chunk itself), against the dense reference with an explicit mask;
    with ``near`` > 0 the far keys (``near`` or more back) weigh at most 2.5 keys' worth."""
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
    far = None
    if near:
        scale = far_scale(q_pos, near, 2.5)
        visible = visible * far_weights(index, scale, far_index(near, npos, ntime))
        far = (scale, wide_far_index(near, npos))
    table = (pos_b[:, None] + time_b[None, :]).reshape(-1)
    want = dense_attention(q, k, v, index, visible, table, 7.0)

    cut = int(split * prefix)
    segments = [Segment(0, ts[:cut]), Segment(cut, ts[cut:])]
    kv = [(k[:, :cut], v[:, :cut]), (k[:, cut:], v[:, cut:])]
    tasks = plan_attention(
        prefix, ts[prefix:], segments, rows=nq, causal=True, block=block, num_pos=npos, near_keys=near
    )
    got = run_attention(q, tasks, kv, wide_bias_table(pos_b, time_b), dv, far) / 7.0
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
    near=st.sampled_from([0, 8, 16, 40]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=80, deadline=None)
def test_blockwise_candidates_match_dense(heads, d, history, rows, block, gap, near, seed) -> None:
    """Candidate queries share one position (after the history) and timestamp; they see all keys
    (with ``near`` > 0, the far ones weigh at most 4 keys' worth)."""
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
    far = None
    if near:
        scale = far_scale(torch.tensor([history]), near, 4.0)
        visible = visible * far_weights(index, scale, far_index(near, npos, ntime))
        far = (scale, wide_far_index(near, npos))
    table = (pos_b[:, None] + time_b[None, :]).reshape(-1)
    want = dense_attention(q, k, v, index, visible, table, 3.0)
    tasks = plan_attention(
        history, when.reshape(1), [Segment(0, ts)], rows=rows, causal=False, block=block, num_pos=npos
    )
    got = run_attention(q, tasks, [(k, v)], wide_bias_table(pos_b, time_b), d, far) / 3.0
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


def test_near_keys_must_be_a_bucket_boundary() -> None:
    boundaries = [n for n in range(1, 300) if is_bucket_boundary(n, 64)]
    assert boundaries[:20] == [*range(1, 17), 20, 24, 28, 32]
    assert boundaries[-4:] == [160, 192, 224, 256]
    assert not is_bucket_boundary(0, 64) and not is_bucket_boundary(64, 24)  # bucket 24: the last


@pytest.mark.parametrize("near", [1, 5, 16, 20, 24, 40, 64, 80, 96, 128, 1024])
def test_far_pairs_are_those_near_keys_or_more_apart_in_every_index_layout(near: int) -> None:
    """ "Far" is read off a pair's bias index: in the dense table, the blockwise plan and the fused
    index alike, a pair is far exactly when its positions are ``near`` or more apart."""
    d = torch.arange(0, 5000)
    gaps = torch.tensor([0.0, 1.0, 1.5, 7.0, 86400.0, 3e9, 1e30], dtype=torch.float64)
    want = (d >= near)[:, None].expand(-1, gaps.shape[0])
    dense = pair_index(d[:, None], gaps[None, :], 64, 64)
    assert torch.equal(dense >= far_index(near, 64, 64), want)
    q_pos = torch.tensor([10_000], dtype=torch.int64)
    fused = torch.stack(
        [
            bias_index(
                q_pos, gaps[j : j + 1] + 5e9, q_pos - d, torch.full_like(d, 5e9, dtype=torch.float64), 64
            )[0]
            for j in range(gaps.shape[0])
        ],
        1,
    )
    assert torch.equal(fused >= wide_far_index(near, 64), want)
    ts = torch.full((5000,), 5e9, dtype=torch.float64)
    tasks = plan_attention(5000, ts[:1] + 7.0, [Segment(0, ts)], rows=1, causal=False, block=512, num_pos=64)
    planned = torch.cat([t.index.reshape(-1) for t in tasks]).flip(0)  # key 4999 is 1 back
    assert torch.equal(planned >= wide_far_index(near, 64), (torch.arange(1, 5001) >= near))
    scale = far_scale(torch.tensor([near - 1, near, near + 9]), near, 4.0)
    assert scale.reshape(-1).tolist() == pytest.approx([1.0, 1.0, 0.4])  # 0, 1 and 10 far keys


@pytest.mark.parametrize("history", [0, 10, 64, 100, 192, 193, 1000, 5000])
def test_far_keys_weigh_at_most_far_keys_keys_together(history: int) -> None:
    """Every key worth the same (q.k = 0, bias 1, value 1): a candidate's sum is silu(1) times the
    near keys plus at most ``far_keys`` (128) of the 64-or-more-back ones, however long the history."""
    q, k, v = torch.zeros(1, 1, 4), torch.zeros(1, history, 4), torch.ones(1, history, 1)
    ts = torch.arange(history, dtype=torch.float64)
    when = ts[-1:] + 1 if history else torch.ones(1, dtype=torch.float64)
    far = (far_scale(torch.tensor([history]), 64, 128.0), wide_far_index(64, 64))
    table = wide_bias_table(torch.ones(64), torch.zeros(64))
    near = min(history, 63)  # keys 1..63 back
    want = torch.nn.functional.silu(torch.tensor(1.0)).item() * (near + min(history - near, 128))
    for near_keys in (64, 0):  # blocks classified by their far pairs, and not (each pair weighed)
        tasks = plan_attention(
            history, when, [Segment(0, ts)], rows=1, causal=False, block=48, num_pos=64, near_keys=near_keys
        )
        got = float(run_attention(q, tasks, [(k, v)], table, 1, far)) if history else 0.0
        assert got == pytest.approx(want, rel=1e-5)


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
