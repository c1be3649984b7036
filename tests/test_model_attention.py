"""Bucket functions, and the attention the model serves with (``kernels.hstu_mha``, its reference
implementation here) against the dense form training differentiates."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.workers.kernels import AttentionParams, JaggedBatch, hstu_mha, use_backend
from relaygr.workers.kernels.cpu import LUT_LIMIT, _position_table, saturation
from relaygr.workers.model.hstu_attention import (
    dense_attention,
    far_index,
    far_scale,
    is_bucket_boundary,
    pair_index,
    position_bucket,
    time_bucket,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


F64_TOL = 1e-10  # the kernel vs dense in float64: only summation order differs


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


def _user(gen, heads, dqk, dv, prefix, nq, cands, sorted_ts, npos, ntime, near, far_keys):
    """One user's keys (``prefix`` cached, then ``nq`` new history tokens, then ``cands``
    candidates at one position and time) and the dense reference of their queries' attention."""
    n_hist = prefix + nq
    total = n_hist + cands
    q = torch.randn(nq + cands, heads, dqk, generator=gen, dtype=torch.float64)
    k = torch.randn(total, heads, dqk, generator=gen, dtype=torch.float64)
    v = torch.randn(total, heads, dv, generator=gen, dtype=torch.float64)
    ts = _random_ts(n_hist, gen, sorted_ts)
    when = (ts[-1] if n_hist else torch.tensor(8.8e8, dtype=torch.float64)) + 37.0
    k_pos = torch.cat([torch.arange(n_hist), torch.full((cands,), n_hist)])
    k_ts = torch.cat([ts, when.reshape(1).expand(cands)])
    q_pos, q_ts = k_pos[prefix:], k_ts[prefix:]
    index = pair_index(q_pos[:, None] - k_pos[None, :], q_ts[:, None] - k_ts[None, :], npos, ntime)
    own = torch.arange(total)[None, :] == torch.arange(prefix, total)[:, None]
    visible = ((q_pos[:, None] > k_pos[None, :]) | own).double()
    if near:
        far = index >= far_index(near, npos, ntime)  # the far test as a threshold on the index
        visible = visible * torch.where(far, far_scale(q_pos, near, far_keys), 1.0)
    return q, k, v, (q_pos, q_ts, k_pos, k_ts), index, visible


_SHAPES = dict(
    heads=st.integers(1, 3),
    dqk=st.integers(1, 9),
    dv=st.integers(1, 9),
    users=st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 20), st.integers(0, 6)), min_size=1, max_size=3
    ),
    sorted_ts=st.booleans(),
    near=st.sampled_from([0, 1, 4, 16, 20]),
    seed=st.integers(0, 2**16),
)


@given(**_SHAPES)
@settings(max_examples=120, deadline=None)
def test_the_kernel_equals_the_dense_form_for_a_jagged_batch(
    heads, dqk, dv, users, sorted_ts, near, seed
) -> None:
    """Users with a cached prefix, new history tokens (causal) and candidates (which see the
    history and themselves, never one another), packed in one batch; with ``near`` > 0 the far
    keys weigh at most 2.5 keys' worth. Each user's output equals the dense form's."""
    users = [(p, nq, c) for p, nq, c in users if nq + c > 0] or [(3, 1, 1)]
    gen = torch.Generator().manual_seed(seed)
    npos, ntime = 24, 40
    table = torch.randn(npos * ntime, generator=gen, dtype=torch.float64)
    made = [_user(gen, heads, dqk, dv, p, nq, c, sorted_ts, npos, ntime, near, 2.5) for p, nq, c in users]
    parts = list(zip(*[m[3] for m in made], strict=True))
    batch = JaggedBatch.build(
        [m[0].shape[0] for m in made], [m[1].shape[0] for m in made], *(torch.cat(p) for p in parts)
    )
    params = AttentionParams(npos, ntime, 7.0, near_keys=near, far_keys=2.5)
    for backend in ("oracle", "cpu"):
        with use_backend(backend):
            got = hstu_mha(*(torch.cat([m[i] for m in made]) for i in range(3)), batch, table, params)
        at = 0
        for q, k, v, _, index, visible in made:
            want = dense_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), index, visible, table, 7.0
            )
            torch.testing.assert_close(
                got[at : at + q.shape[0]], want.transpose(0, 1), rtol=F64_TOL, atol=F64_TOL
            )
            at += q.shape[0]


@pytest.mark.parametrize("num_pos", [1, 8, 16, 17, 24, 63, 64, 65, 80])
def test_the_position_table_is_the_bucket_function(num_pos: int) -> None:
    """The reference reads position buckets from a table up to where they saturate."""
    table = _position_table(num_pos, 5, torch.device("cpu"))
    top = saturation(num_pos)
    assert top + 1 <= LUT_LIMIT and table is not None and table.shape == (top + 1,)
    d = torch.arange(0, top + 1)
    assert torch.equal(table.long(), position_bucket(d, num_pos).long() * 5 - 254)
    assert (
        position_bucket(torch.tensor([top - 1, top, 10 * top + 7]), num_pos).tolist()[1:] == [num_pos - 1] * 2
    )
    assert num_pos == 1 or int(position_bucket(torch.tensor([top - 1]), num_pos)) < num_pos - 1


def test_near_keys_must_be_a_bucket_boundary() -> None:
    boundaries = [n for n in range(1, 300) if is_bucket_boundary(n, 64)]
    assert boundaries[:20] == [*range(1, 17), 20, 24, 28, 32]
    assert boundaries[-4:] == [160, 192, 224, 256]
    assert not is_bucket_boundary(0, 64) and not is_bucket_boundary(64, 24)  # bucket 24: the last


@pytest.mark.parametrize("history", [0, 10, 64, 100, 192, 193, 1000, 5000])
def test_far_keys_weigh_at_most_far_keys_keys_together(history: int) -> None:
    """Every key worth the same (q.k = 0, bias 1, value 1): a candidate's sum is silu(1) times the
    near keys plus at most ``far_keys`` (128) of the 64-or-more-back ones, however long the history."""
    n = history + 1  # the candidate's own key last
    q, k, v = torch.zeros(1, 1, 4), torch.zeros(n, 1, 4), torch.ones(n, 1, 1)
    v[-1] = 0.0  # leave the candidate's own term out
    ts = torch.arange(n, dtype=torch.float64)
    pos = torch.cat([torch.arange(history), torch.tensor([history])])
    batch = JaggedBatch.build([1], [n], pos[-1:], ts[-1:] + 1, pos, ts)
    params = AttentionParams(64, 64, 1.0, near_keys=64, far_keys=128.0)
    with use_backend("cpu"):
        got = float(hstu_mha(q, k, v, batch, torch.ones(64 * 64), params))
    near = min(history, 63)  # keys 1..63 back
    want = torch.nn.functional.silu(torch.tensor(1.0)).item() * (near + min(history - near, 128))
    assert got == pytest.approx(want, rel=1e-5)
