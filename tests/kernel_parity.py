"""Parity cases of the HSTU attention backends against the oracle (``kernels.oracle``, the
definition), shared by the tests and the GPU check.

``make_case`` builds a jagged batch the way the model lays one out: each user's keys are the
cached prefix then the new history tokens then the candidates (which share the position after the
history), and the queries are the new tokens and the candidates. ``CASES`` are tiny (the
interpreter runs them on a CPU). An ``indexed`` case runs the backend on the same keys read through
a row index (``index_keys``: rows of a larger tensor, skipped, repeated and out of order, with an
unused tail of keys and a capacity above every user's count) against the oracle on the packed
keys. ``run_case`` runs the Triton kernel, ``run_gated_case`` its gated form (attention, the norm
over the heads and the gate: ``GATED_CASES``), ``run_cpu_case`` the CPU backend.
Run as a script (``TRITON_INTERPRET=1`` on a CPU) it prints one JSON object: per case and dtype,
the Triton kernel's worst absolute difference from the oracle and the oracle's largest value.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from relaygr.workers.kernels import AttentionParams, JaggedBatch
from relaygr.workers.kernels.cpu import cpu_hstu_mha
from relaygr.workers.kernels.oracle import oracle_hstu_mha

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    """Users as (cached prefix keys, new history tokens, candidates); tile sizes forced or not."""

    users: tuple[tuple[int, int, int], ...]
    heads: int = 2
    d_qk: int = 16
    d_v: int = 16
    near_keys: int = 0
    far_keys: float = 4.0
    shuffled: bool = False  # positions in no order: the kernel must not cut keys short
    base: int = 0  # added to every position
    prefix_shift: int = 0  # taken from the cached prefix's positions (a user spanning over 2^30)
    block: int = 16  # 0: the kernel's own choice
    splits: int = 1
    head_group: int = 1
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    indexed: bool = False  # the kernel reads the keys through a row index (``index_keys``)
    row_terms: bool = False  # uniform query blocks take their pair terms per key (``KernelConfig``)


RELAY_USERS = ((60, 5, 27), (33, 0, 20), (0, 3, 17), (90, 1, 1))
"""Users of a relay-shaped case: blocks of candidates alone (16 rows), a user with no new events,
one with no cached prefix, one with a single candidate."""

CASES: dict[str, Case] = {
    "single_user_relay": Case(((40, 6, 5),), near_keys=8),
    "users_full_causal": Case(((0, 37, 0), (0, 16, 0), (0, 5, 0)), heads=1),
    "users_candidates_far": Case(((33, 4, 6), (0, 9, 3), (50, 2, 7)), near_keys=16, far_keys=3.0),
    "relay_split_keys": Case(
        ((90, 3, 5), (21, 2, 4)), near_keys=8, splits=3, dtypes=("fp32", "bf16", "fp16")
    ),
    "full_split_keys": Case(((0, 45, 0),), splits=2),
    "odd_head_dims": Case(((19, 5, 3), (0, 7, 2)), d_qk=24, d_v=40, near_keys=4),
    "shuffled_positions": Case(((20, 30, 4), (5, 3, 2)), shuffled=True, near_keys=8),
    "grouped_heads": Case(((30, 5, 4), (0, 6, 3)), heads=4, head_group=4, near_keys=8),
    "grouped_heads_split": Case(((60, 3, 4),), heads=4, d_qk=24, d_v=20, head_group=2, splits=3),
    "own_choice_of_tiles": Case(((70, 8, 6), (0, 12, 4)), heads=4, block=0, splits=0, near_keys=16),
    "positions_past_int32": Case(
        ((30, 5, 4), (0, 9, 3)), heads=4, head_group=2, near_keys=8, prefix_shift=3 << 30
    ),
    "positions_past_int32_one_head": Case(((40, 6, 5), (0, 7, 2)), base=-(1 << 35), prefix_shift=3 << 30),
    "indexed_one_user": Case(((40, 6, 5),), near_keys=8, indexed=True),
    "indexed_users_split": Case(
        ((33, 4, 6), (0, 9, 3), (50, 2, 7)), near_keys=16, far_keys=3.0, splits=3, indexed=True
    ),
    "indexed_grouped_split": Case(
        ((60, 3, 4), (21, 2, 4)), heads=4, head_group=2, splits=2, near_keys=8, indexed=True
    ),
    "indexed_full_causal": Case(((0, 37, 0), (0, 16, 0)), heads=1, indexed=True),
    # A relay ranking's shape: most query blocks are candidates alone (one position, one time),
    # whose bias and weight the kernel derives per key; ragged users, keys split 1 to 9 ways.
    "relay_uniform_blocks": Case(RELAY_USERS, near_keys=8, far_keys=3.0, row_terms=True),
    "relay_uniform_split_2": Case(
        RELAY_USERS, heads=4, head_group=2, splits=2, near_keys=8, indexed=True, row_terms=True
    ),
    "relay_uniform_split_5": Case(RELAY_USERS, heads=4, splits=5, near_keys=16, indexed=True),
    "relay_uniform_split_9": Case(
        RELAY_USERS,
        heads=1,
        splits=9,
        near_keys=8,
        indexed=True,
        row_terms=True,
        dtypes=("fp32", "bf16", "fp16"),
    ),
}


def _user_tokens(gen: torch.Generator, prefix: int, new: int, cands: int, case: Case):
    history = prefix + new
    pos = torch.cat([torch.arange(history), torch.full((cands,), history)]) + case.base
    pos[:prefix] -= case.prefix_shift
    gaps = 10 ** (torch.rand(history, generator=gen, dtype=torch.float64) * 7 - 1)
    ts = 1.7e9 + torch.cumsum(gaps, 0)
    now = (ts[-1] if history else torch.tensor(1.7e9, dtype=torch.float64)) + 3.0
    ts = torch.cat([ts, now.expand(cands)])
    if case.shuffled:
        pos = torch.randint(0, 2 * (history + 1), (history + cands,), generator=gen)
        ts = ts[torch.randperm(history + cands, generator=gen)]
    return pos, ts


def make_case(case: Case, dtype: torch.dtype, device: str, seed: int = 0):
    """(q, k, v, batch, bias_table, params) of a case on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    pos_k, ts_k, pos_q, ts_q, nq, nk = [], [], [], [], [], []
    for prefix, new, cands in case.users:
        pos, ts = _user_tokens(gen, prefix, new, cands, case)
        n_q = new + cands
        pos_k.append(pos)
        ts_k.append(ts)
        pos_q.append(pos[len(pos) - n_q :])
        ts_q.append(ts[len(ts) - n_q :])
        nq.append(n_q)
        nk.append(len(pos))
    batch = JaggedBatch.build(nq, nk, *(torch.cat(t).to(device) for t in (pos_q, ts_q, pos_k, ts_k)))
    params = AttentionParams(num_pos=24, num_time=20, normaliser=16.0, near_keys=case.near_keys,
                             far_keys=case.far_keys)  # fmt: skip

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    q = rand(sum(nq), case.heads, case.d_qk, scale=case.d_qk**-0.5)
    k = rand(sum(nk), case.heads, case.d_qk)
    v = rand(sum(nk), case.heads, case.d_v)
    bias = (torch.randn(params.num_pos * params.num_time, generator=gen) * 0.5).to(device)
    return q, k, v, batch, bias, params


TAIL_KEYS = 7  # keys past the last user's in an indexed batch: a static capacity's unused rest


def index_keys(
    k: torch.Tensor, v: torch.Tensor, batch: JaggedBatch, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, JaggedBatch]:
    """The same keys as rows of larger tensors (random rows elsewhere): each key a row of its
    own in no order, rows skipped, every third key sharing the row of the key before it (its key and
    value made equal first, in place), and ``TAIL_KEYS`` keys past the last user's with
    ``max_k`` raised by as many (a capacity no user fills)."""
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = int(k.shape[0])
    for j in range(2, tokens, 3):  # a repeated row: the same key and value
        k[j], v[j] = k[j - 1], v[j - 1]
    total = 2 * tokens + 5
    rows = torch.randperm(total, generator=gen)[:tokens]
    for j in range(2, tokens, 3):
        rows[j] = rows[j - 1]
    k_store = torch.randn(total, *k.shape[1:], generator=gen).to(k.dtype).to(k.device)
    v_store = torch.randn(total, *v.shape[1:], generator=gen).to(v.dtype).to(v.device)
    rows = rows.to(k.device)
    k_store[rows], v_store[rows] = k, v
    tail = torch.randint(0, total, (TAIL_KEYS,), generator=gen).to(k.device)

    def padded(t: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.cat([t, t.new_full((TAIL_KEYS,), fill)])

    indexed = JaggedBatch(
        q_offsets=batch.q_offsets, k_offsets=batch.k_offsets, q_pos=batch.q_pos, q_ts=batch.q_ts,
        k_pos=padded(batch.k_pos, 0), k_ts=padded(batch.k_ts, 0.0), max_q=batch.max_q,
        max_k=batch.max_k + TAIL_KEYS, k_rows=torch.cat([rows, tail]),
    )  # fmt: skip
    return k_store, v_store, indexed


def _worst(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    if got.dtype != dtype or got.shape != want.shape:
        raise AssertionError(f"got {got.dtype} {tuple(got.shape)}, want {dtype} {tuple(want.shape)}")
    want = want.double()
    return {"worst": float((got.double() - want).abs().max()), "scale": float(want.abs().max())}


def _inputs(case: Case, dtype: torch.dtype, device: str):
    """The case's call for a backend (through the row index where the case is ``indexed``) and the
    oracle's answer on the packed keys (in float64 for float64 inputs, float32 otherwise)."""
    q, k, v, batch, bias, params = make_case(case, dtype, device)
    if not case.indexed:
        return (q, k, v, batch, bias, params), oracle_hstu_mha(q, k, v, batch, bias, params)
    k_store, v_store, indexed = index_keys(k, v, batch)  # (makes some packed keys equal first)
    return (q, k_store, v_store, indexed, bias, params), oracle_hstu_mha(q, k, v, batch, bias, params)


def _config(case: Case):
    """The case's tiles (``None``: the kernel's own choice)."""
    from relaygr.workers.kernels.triton_hstu import KernelConfig

    if case.block == 0:
        return None
    return KernelConfig(
        case.block, case.block, splits=case.splits, head_group=case.head_group, row_terms=case.row_terms
    )


def run_case(case: Case, dtype: torch.dtype, device: str) -> dict[str, float]:
    """The worst absolute difference of the Triton kernel from the oracle, and the oracle's scale."""
    from relaygr.workers.kernels.triton_hstu import hstu_forward

    call, want = _inputs(case, dtype, device)
    return _worst(hstu_forward(*call, _config(case)), want, dtype)


def run_cpu_case(case: Case, dtype: torch.dtype) -> dict[str, float]:
    """The worst absolute difference of the CPU backend from the oracle, and the oracle's scale."""
    call, want = _inputs(case, dtype, "cpu")
    return _worst(cpu_hstu_mha(*call), want, dtype)


GATED_CASES = ("single_user_relay", "odd_head_dims", "relay_uniform_split_5", "relay_uniform_split_9")
"""Cases also run through ``hstu_forward_gated`` (attention, its norm over the heads, the gate)."""


def run_gated_case(case: Case, dtype: torch.dtype, device: str) -> dict[str, float]:
    """``hstu_forward_gated`` against the oracle's attention (summed in float32), normalised and
    gated in float32; the gate and the output rows strided as in the model (views of wider rows)."""
    from relaygr.workers.kernels.triton_hstu import hstu_forward_gated

    (q, k, v, batch, bias, params), _ = _inputs(case, dtype, device)
    attn = oracle_hstu_mha(q.float(), k.float(), v.float(), batch, bias, params)
    gen = torch.Generator().manual_seed(7)
    heads, d_v = q.shape[1], v.shape[2]
    weight, shift = (torch.randn(heads, d_v, generator=gen).to(device) for _ in range(2))
    rows = torch.randn(q.shape[0], 3 * heads * d_v + 1, generator=gen).to(dtype).to(device)
    gate, out = rows[:, : heads * d_v], rows[:, heads * d_v + 1 : 2 * heads * d_v + 1]
    want = F.layer_norm(attn, attn.shape[-2:], weight, shift, eps=1e-5) * gate.float().view(attn.shape)
    hstu_forward_gated(q, k, v, batch, bias, params, (weight, shift, 1e-5), gate, out, _config(case))
    return _worst(out.view(want.shape), want, dtype)


def run_all(device: str) -> dict[str, dict[str, dict[str, float]]]:
    """Per case and dtype, the kernel's worst difference from the oracle and the oracle's scale;
    ``gated:<case>`` the same through ``hstu_forward_gated``."""
    plain = {
        name: {dt: run_case(case, DTYPES[dt], device) for dt in case.dtypes} for name, case in CASES.items()
    }
    gated = {
        f"gated:{name}": {dt: run_gated_case(CASES[name], DTYPES[dt], device) for dt in CASES[name].dtypes}
        for name in GATED_CASES
    }
    return plain | gated


if __name__ == "__main__":
    json.dump(run_all(sys.argv[1] if len(sys.argv) > 1 else "cpu"), sys.stdout)
