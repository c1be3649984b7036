"""Candidate scoring and short history chunks as single TorchScript calls: the optimised twins of
``HSTURanker._score`` and ``HSTURanker._advance``.

Scoring candidates against a cached history, and computing the few events that are new since
the cached prefix, are all of a relay ranking. Run op by op from
Python, each of its ~60 tensor ops hands the GIL back and forth, and in a worker whose Kafka loop
runs on another thread of the same process every handoff can wait for that loop. One scripted
call runs the whole pass in the TorchScript interpreter with the GIL released (and without
Python's per-op dispatch).

Primitives:
- ``score_candidates(...)``: scores of one micro-batch of candidate tokens against key/value
  segments, layer by layer; the same arithmetic as the Python path (tests hold them equal).
- ``advance_tokens(...)``: one causal chunk of history tokens through every layer, filling their
  keys and values; the same arithmetic as ``HSTURanker._advance`` (tests hold them equal).
- ``layer_weights(layer)``: the eight tensors of one ``HSTULayer`` in the order they expect.
- ``unspecialised()``: the context to call them in (no shape specialisation).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from relaygr.workers.model import HSTULayer


def _score_candidates(
    x0: Tensor,
    e: Tensor,
    seg_keys: list[Tensor],
    seg_values: list[Tensor],
    seg_index: list[Tensor],
    tables: list[Tensor],
    weights: list[Tensor],
    final_w: Tensor,
    final_b: Tensor,
    dims: tuple[int, int, int],
    consts: tuple[float, float, float],
    block: int,
) -> Tensor:
    """``x0 [C, dim]``: candidate tokens (item + candidate-action embedding); ``e [C, dim]``: their
    item embeddings. Segment ``s`` of layer ``l`` is ``seg_keys[l * S + s] [H, n_s, dqk]`` and
    ``seg_values[l * S + s] [H, n_s, dv]``; ``seg_index[s] [n_s]`` (int64) indexes each key's bias in
    the layer's wide bias table ``tables[l]`` (all candidates share a position and a timestamp,
    so one row serves them all). ``weights[8 l : 8 l + 8]``: layer ``l``'s norm, U/Q/K/V
    projection, attention norm and output projection (weight, bias each); ``dims``: heads, query/
    key dim, value dim; ``consts``: query scale, attention normaliser, layer-norm epsilon. Keys
    are visited in blocks of ``block``. Returns float32 scores ``[C]``."""
    heads, dqk, dv = dims
    scale, normaliser, eps = consts
    c, dim = x0.shape
    hv, hk = heads * dv, heads * dqk
    n_seg = len(seg_index)
    x = x0
    for li in range(len(tables)):
        w = weights[8 * li : 8 * li + 8]
        p = F.silu(F.linear(F.layer_norm(x, [dim], w[0], w[1], eps), w[2], w[3]))
        u = p[:, :hv]
        q = p[:, hv : hv + hk].reshape(c, heads, dqk).transpose(0, 1) * scale
        k = p[:, hv + hk : hv + 2 * hk].reshape(c, heads, dqk).transpose(0, 1)
        v = p[:, hv + 2 * hk :].reshape(c, heads, dv).transpose(0, 1)
        acc = torch.zeros(heads, c, dv, dtype=x.dtype, device=x.device)
        for si in range(n_seg):
            keys, values = seg_keys[li * n_seg + si], seg_values[li * n_seg + si]
            bias = tables[li].index_select(0, seg_index[si])
            n = keys.shape[1]
            for k0 in range(0, n, block):
                k1 = min(n, k0 + block)
                s = torch.baddbmm(bias[k0:k1].view(1, 1, k1 - k0), q, keys[:, k0:k1].transpose(1, 2))
                acc.baddbmm_(F.silu(s), values[:, k0:k1])
        own = F.silu((q * k).sum(-1, keepdim=True) + tables[li][0]) * v
        attn = ((acc + own) / normaliser).transpose(0, 1).reshape(c, hv)
        x = x + F.linear(F.layer_norm(attn, [hv], w[4], w[5], eps) * u, w[6], w[7])
    return (F.layer_norm(x - x0, [dim], final_w, final_b, eps) * e).sum(-1).float()


def _advance_tokens(
    x: Tensor,
    seg_keys: list[Tensor],
    seg_values: list[Tensor],
    task_seg: list[int],
    task_k0: list[int],
    task_k1: list[int],
    task_index: list[Tensor],
    task_hidden: list[Tensor],
    tables: list[Tensor],
    weights: list[Tensor],
    kbufs: list[Tensor],
    vbufs: list[Tensor],
    q0: int,
    dims: tuple[int, int, int],
    consts: tuple[float, float, float],
) -> None:
    """History tokens ``x [nq, dim]`` through every layer, writing their keys and values into
    rows ``q0 .. q0 + nq`` of ``kbufs[l]`` / ``vbufs[l]`` (the pending segment, which is also the
    last of the ``seg_keys`` / ``seg_values`` segments of each layer). The attention follows a
    causal plan (``hstu_attention.plan_attention``): task ``t`` covers keys ``task_k0[t] ..
    task_k1[t]`` of segment ``task_seg[t]`` with bias indices ``task_index[t]`` and, if not empty,
    the mask ``task_hidden[t]``. The last layer computes only keys and values."""
    heads, dqk, dv = dims
    scale, normaliser, eps = consts
    nq, dim = x.shape
    hv, hk = heads * dv, heads * dqk
    n_seg = len(seg_keys) // len(tables)
    last = len(tables) - 1
    q1 = q0 + nq
    for li in range(len(tables)):
        w = weights[8 * li : 8 * li + 8]
        h = F.layer_norm(x, [dim], w[0], w[1], eps)
        if li == last:
            kv = F.silu(F.linear(h, w[2][hv + hk :], w[3][hv + hk :]))
            kbufs[li][:, q0:q1] = kv[:, :hk].reshape(nq, heads, dqk).transpose(0, 1)
            vbufs[li][:, q0:q1] = kv[:, hk:].reshape(nq, heads, dv).transpose(0, 1)
            break
        p = F.silu(F.linear(h, w[2], w[3]))
        u = p[:, :hv]
        q = p[:, hv : hv + hk].reshape(nq, heads, dqk).transpose(0, 1) * scale
        kbufs[li][:, q0:q1] = p[:, hv + hk : hv + 2 * hk].reshape(nq, heads, dqk).transpose(0, 1)
        vbufs[li][:, q0:q1] = p[:, hv + 2 * hk :].reshape(nq, heads, dv).transpose(0, 1)
        acc = torch.zeros(heads, nq, dv, dtype=x.dtype, device=x.device)
        for t in range(len(task_seg)):
            keys, values = seg_keys[li * n_seg + task_seg[t]], seg_values[li * n_seg + task_seg[t]]
            k0, k1 = task_k0[t], task_k1[t]
            idx = task_index[t]
            bias = tables[li].index_select(0, idx.reshape(-1)).view(idx.shape[0], idx.shape[1])
            s = F.silu(torch.bmm(q, keys[:, k0:k1].transpose(1, 2)) + bias)
            hidden = task_hidden[t]
            if hidden.numel() > 0:
                s = s.masked_fill(hidden, 0.0)
            acc.baddbmm_(s, values[:, k0:k1])
        attn = (acc / normaliser).transpose(0, 1).reshape(nq, hv)
        x = x + F.linear(F.layer_norm(attn, [hv], w[4], w[5], eps) * u, w[6], w[7])


with warnings.catch_warnings():
    # TorchScript is deprecated in favour of torch.compile, which needs a C++ toolchain at run time
    # and recompiles per shape; a scripted function needs neither.
    warnings.simplefilter("ignore", FutureWarning)
    score_candidates = torch.jit.script(_score_candidates)
    advance_tokens = torch.jit.script(_advance_tokens)


def unspecialised():
    """Run the scripted functions as they are: the profiling executor would re-specialise them for
    every new history length (a stall and fresh allocations each time) for no speed-up here."""
    return torch.jit.optimized_execution(False)


def layer_weights(layer: HSTULayer) -> list[Tensor]:
    return [
        layer.norm.weight,
        layer.norm.bias,
        layer.uqkv.weight,
        layer.uqkv.bias,
        layer.attn_norm.weight,
        layer.attn_norm.bias,
        layer.out.weight,
        layer.out.bias,
    ]
