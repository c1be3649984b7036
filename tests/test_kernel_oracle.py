"""The oracle of ``hstu_mha`` (``kernels.oracle``) is the definition every backend is held to: the CPU
backend here, on every parity case (``kernel_parity.CASES``) in float32 and float64; the Triton
kernel in ``test_kernels.py``. The oracle is differentiable (what the training forward needs): its
gradients pass ``gradcheck``, and equal those of the dense form training builds for each user."""

from __future__ import annotations

import pytest
import torch
from kernel_parity import CASES, index_keys, make_case, run_cpu_case

from relaygr.workers.kernels import AttentionParams, JaggedBatch, dense_attention, hstu_mha
from relaygr.workers.kernels.oracle import oracle_hstu_mha
from relaygr.workers.model.hstu_attention import far_index, far_scale, pair_index

# Worst absolute difference from the oracle, relative to its largest output (at least 1).
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_cpu_backend_matches_the_oracle(name: str, dtype: torch.dtype) -> None:
    got = run_cpu_case(CASES[name], dtype)
    assert got["scale"] > 0.1, f"{name}: the oracle is near zero, the case checks nothing"
    assert got["worst"] <= TOLERANCE[dtype] * max(got["scale"], 1.0), (name, got)


def _small(indexed: bool, dtype: torch.dtype = torch.float64):
    """Two users (a cached prefix, new tokens and candidates; far keys), tiny enough to gradcheck."""
    from kernel_parity import Case

    case = Case(((7, 3, 2), (0, 4, 1)), heads=2, d_qk=3, d_v=2, near_keys=4, far_keys=2.0, indexed=indexed)
    q, k, v, batch, bias, params = make_case(case, dtype, "cpu")
    if indexed:
        k, v, batch = index_keys(k, v, batch)
    return q, k, v, batch, bias.to(dtype), params


@pytest.mark.parametrize("indexed", [False, True])
def test_the_oracle_gradients_pass_gradcheck(indexed: bool) -> None:
    q, k, v, batch, bias, params = _small(indexed)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v, bias))

    def attention(q, k, v, bias):
        return oracle_hstu_mha(q, k, v, batch, bias, params)

    assert torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-7)


def _dense_user(q, k, v, q_pos, q_ts, k_pos, k_ts, table, params: AttentionParams) -> torch.Tensor:
    """One user's attention in the dense form training builds (``workers/model/dense.py``): every
    pair's index, its visibility as ``pos_i > pos_j`` or the own key, far as an index threshold."""
    index = pair_index(
        q_pos[:, None] - k_pos[None, :], q_ts[:, None] - k_ts[None, :], params.num_pos, params.num_time
    )
    n_q, n_k = len(q_pos), len(k_pos)
    own = torch.arange(n_k)[None, :] == torch.arange(n_k - n_q, n_k)[:, None]
    weight = ((q_pos[:, None] > k_pos[None, :]) | own).double()
    far = index >= far_index(params.near_keys, params.num_pos, params.num_time)
    weight = weight * torch.where(far, far_scale(q_pos, params.near_keys, params.far_keys), 1.0)
    out = dense_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), index, weight, table, params.normaliser
    )
    return out.transpose(0, 1)


def test_hstu_mha_under_autograd_is_the_oracle_and_its_gradients_are_the_dense_forms() -> None:
    q, k, v, batch, bias, params = _small(indexed=False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    got = hstu_mha(*leaves[:3], batch, leaves[3], params)  # autograd records it: the oracle runs
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(3), dtype=got.dtype)
    got_grads = torch.autograd.grad((got * weights).sum(), leaves)
    dense = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    qo, ko = batch.q_offsets.tolist(), batch.k_offsets.tolist()
    parts = []
    for b in range(batch.users):
        qs, ks = slice(qo[b], qo[b + 1]), slice(ko[b], ko[b + 1])
        tokens = (batch.q_pos[qs], batch.q_ts[qs], batch.k_pos[ks], batch.k_ts[ks])
        parts.append(_dense_user(dense[0][qs], dense[1][ks], dense[2][ks], *tokens, dense[3], params))
    want = torch.cat(parts)
    want_grads = torch.autograd.grad((want * weights).sum(), dense)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("qkvb", got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"gradient of {name}")
        assert float(b.abs().max()) > 1e-3, f"the gradient of {name} is near zero: it checks nothing"


def test_an_empty_batch_and_users_without_queries() -> None:
    params = AttentionParams(8, 8, 4.0)
    pos, ts = torch.arange(5), torch.arange(5, dtype=torch.float64)
    batch = JaggedBatch.build([0, 2], [3, 2], pos[3:], ts[3:], pos, ts)
    q, k, v = torch.randn(2, 1, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 3)
    out = oracle_hstu_mha(q, k, v, batch, torch.randn(64), params)
    assert out.shape == (2, 1, 3) and torch.isfinite(out).all()
