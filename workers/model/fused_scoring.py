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
- ``score_layer_begin`` / ``score_key_range`` / ``score_layer_end`` / ``score_final``: the same
  pass in pieces (``score_candidates`` is made of them), so that scoring can stop between two key
  ranges of a layer and go on later: a heavy user's candidates in time slices that still read
  each key once per layer.
- ``advance_tokens(...)``: one causal chunk of history tokens through every layer, filling their
  keys and values; the same arithmetic as ``HSTURanker._advance`` (tests hold them equal).
- ``rank_relay(...)``: whole relay rankings in one call: the events after the cached prefix
  (their bias indices and causal masks planned in the call), then the candidates. A ranking then
  takes the GIL twice, not once per tensor op. Several requests of one user whose histories
  nest (a burst) share the call: the new events are computed once, for the longest history.
- ``bias_index(...)``: wide bias-table indices of token pairs, the integers ``hstu_attention``
  computes from float bit patterns, here from ``frexp`` (tests hold them equal).
- ``candidate_index(q_pos, q_ts, segments)``: those indices for candidate tokens (one position
  and timestamp, every key visible), one flat tensor per segment, without a plan.
- ``layer_weights(layer)``: the eight tensors of one ``HSTULayer`` in the order they expect.
- ``unspecialised()``: the context to call them in (no shape specialisation).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from relaygr.workers.model.hstu_attention import (
    EXACT_POSITIONS,
    WIDE_TIME_COLUMNS,
    Segment,
    block_far,
    candidate_far,
    far_queries,
    far_weights,
    key_block_size,
)

if TYPE_CHECKING:
    from relaygr.workers.model.model import HSTULayer


def _score_candidates(
    x0: Tensor,
    e: Tensor,
    seg_keys: list[Tensor],
    seg_values: list[Tensor],
    seg_index: list[Tensor],
    seg_far: list[int],
    far_factor: float,
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
    so one row serves them all); the first ``seg_far[s]`` keys of segment ``s`` are far and count
    ``far_factor`` each (``candidate_far``; an empty list when every key counts whole).
    ``weights[8 l : 8 l + 8]``: layer ``l``'s norm, U/Q/K/V
    projection, attention norm and output projection (weight, bias each); ``dims``: heads, query/
    key dim, value dim; ``consts``: query scale, attention normaliser, layer-norm epsilon. Keys
    are visited in blocks of ``block``. Returns float32 scores ``[C]``."""
    n_seg = len(seg_index)
    x = x0
    for li in range(len(tables)):
        w = weights[8 * li : 8 * li + 8]
        u, q, k, v = _score_layer_begin(x, w, dims, consts)
        acc = torch.zeros(dims[0], x.shape[0], dims[2], dtype=x.dtype, device=x.device)
        far_acc = torch.zeros_like(acc) if len(seg_far) > 0 else acc
        for si in range(n_seg):
            keys, values = seg_keys[li * n_seg + si], seg_values[li * n_seg + si]
            bias = tables[li].index_select(0, seg_index[si])
            far_until = seg_far[si] if len(seg_far) > 0 else 0
            _score_key_range(acc, far_acc, q, keys, values, bias, far_until, 0, keys.shape[1], block)
        if len(seg_far) > 0:
            acc.add_(far_acc, alpha=far_factor)
        x = _score_layer_end(x, acc, u, q, k, v, tables[li], w, consts)
    return _score_final(x, x0, e, final_w, final_b, consts)


def _score_layer_begin(
    x: Tensor, w: list[Tensor], dims: tuple[int, int, int], consts: tuple[float, float, float]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One layer's projections of candidate tokens ``x [C, dim]`` (layer weights ``w``, as in
    ``_score_candidates``): ``u [C, H*dv]``, the scaled queries ``q [H, C, dqk]``, ``k``, ``v``."""
    heads, dqk, dv = dims
    scale, eps = consts[0], consts[2]
    c, dim = x.shape
    hv, hk = heads * dv, heads * dqk
    p = F.silu(F.linear(F.layer_norm(x, [dim], w[0], w[1], eps), w[2], w[3]))
    u = p[:, :hv]
    q = p[:, hv : hv + hk].reshape(c, heads, dqk).transpose(0, 1) * scale
    k = p[:, hv + hk : hv + 2 * hk].reshape(c, heads, dqk).transpose(0, 1)
    v = p[:, hv + 2 * hk :].reshape(c, heads, dv).transpose(0, 1)
    return u, q, k, v


def _score_key_range(
    acc: Tensor,
    far_acc: Tensor,
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    far_until: int,
    k0: int,
    k1: int,
    block: int,
) -> None:
    """Adds to ``acc [H, C, dv]`` the candidates' attention (``q [H, C, dqk]``) to keys ``k0 ..
    k1`` of one segment (``keys [H, n, dqk]``, ``values [H, n, dv]``, ``bias [n]`` per key); that
    to its first ``far_until`` keys (the far ones) goes to ``far_acc`` instead. In blocks of
    ``block`` keys from ``k0`` (a block that holds both is cut where they meet): the blocks of a
    whole pass when ``k0`` is a multiple of ``block``, so that a pass in ranges sums exactly as
    one pass does."""
    for b0 in range(k0, k1, block):
        b1 = min(k1, b0 + block)
        cut = min(max(far_until, b0), b1)
        if cut > b0:
            _add_keys(far_acc, q, keys, values, bias, b0, cut)
        if b1 > cut:
            _add_keys(acc, q, keys, values, bias, cut, b1)


def _add_keys(acc: Tensor, q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, b0: int, b1: int) -> None:
    s = torch.baddbmm(bias[b0:b1].view(1, 1, b1 - b0), q, keys[:, b0:b1].transpose(1, 2))
    acc.baddbmm_(F.silu(s), values[:, b0:b1])


def _score_layer_end(
    x: Tensor,
    acc: Tensor,
    u: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    w: list[Tensor],
    consts: tuple[float, float, float],
) -> Tensor:
    """The layer's output for candidate tokens ``x`` once ``acc`` holds their attention to every
    key: each token's attention to itself (bias ``table[0]``), normalised, then the residual."""
    normaliser, eps = consts[1], consts[2]
    c = x.shape[0]
    hv = u.shape[1]
    own = F.silu((q * k).sum(-1, keepdim=True) + table[0]) * v
    attn = ((acc + own) / normaliser).transpose(0, 1).reshape(c, hv)
    return x + F.linear(F.layer_norm(attn, [hv], w[4], w[5], eps) * u, w[6], w[7])


def _score_final(
    x: Tensor, x0: Tensor, e: Tensor, final_w: Tensor, final_b: Tensor, consts: tuple[float, float, float]
) -> Tensor:
    """Scores (float32 ``[C]``) from the last layer's candidate tokens."""
    return (F.layer_norm(x - x0, [x.shape[1]], final_w, final_b, consts[2]) * e).sum(-1).float()


def _advance_tokens(
    x: Tensor,
    seg_keys: list[Tensor],
    seg_values: list[Tensor],
    task_seg: list[int],
    task_k0: list[int],
    task_k1: list[int],
    task_index: list[Tensor],
    task_hidden: list[Tensor],
    task_far: list[int],
    tables: list[Tensor],
    weights: list[Tensor],
    kbufs: list[Tensor],
    vbufs: list[Tensor],
    q0: int,
    far_first: int,
    far_scale: Tensor,
    dims: tuple[int, int, int],
    consts: tuple[float, float, float],
) -> None:
    """History tokens ``x [nq, dim]`` through every layer, writing their keys and values into
    rows ``q0 .. q0 + nq`` of ``kbufs[l]`` / ``vbufs[l]`` (the pending segment, which is also the
    last of the ``seg_keys`` / ``seg_values`` segments of each layer). The attention follows a
    causal plan (``hstu_attention.plan_attention``): task ``t`` covers keys ``task_k0[t] ..
    task_k1[t]`` of segment ``task_seg[t]`` with bias indices ``task_index[t]`` and, if not empty,
    the mask ``task_hidden[t]``; a pair whose index is at least ``far_first`` is far and counts
    ``far_scale [nq, 1]`` of its query (empty: every pair counts whole), ``task_far[t]`` says
    whether a block has none, only or some far pairs (``hstu_attention.BlockTask.far``). The last
    layer computes only keys and values."""
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
        scaled = far_scale.numel() > 0
        far_acc = torch.zeros_like(acc) if scaled else acc
        for t in range(len(task_seg)):
            keys, values = seg_keys[li * n_seg + task_seg[t]], seg_values[li * n_seg + task_seg[t]]
            k0, k1 = task_k0[t], task_k1[t]
            idx = task_index[t]
            bias = tables[li].index_select(0, idx.reshape(-1)).view(idx.shape[0], idx.shape[1])
            s = F.silu(torch.bmm(q, keys[:, k0:k1].transpose(1, 2)) + bias)
            hidden = task_hidden[t]
            if hidden.numel() > 0:
                s = s.masked_fill(hidden, 0.0)
            if scaled and task_far[t] == 2:  # SOME_FAR: weigh each pair
                s = s * far_weights(idx, far_scale, far_first).to(s.dtype)
            if scaled and task_far[t] == 1:  # ALL_FAR: into the sum scaled once
                far_acc.baddbmm_(s, values[:, k0:k1])
            else:
                acc.baddbmm_(s, values[:, k0:k1])
        if scaled:
            acc = acc + far_acc * far_scale.to(acc.dtype)
        attn = (acc / normaliser).transpose(0, 1).reshape(nq, hv)
        x = x + F.linear(F.layer_norm(attn, [hv], w[4], w[5], eps) * u, w[6], w[7])


# TorchScript reads no module globals: _bias_index spells these out, and this holds them equal.
assert (EXACT_POSITIONS, WIDE_TIME_COLUMNS) == (16, 258), "update _bias_index's constants"


def _bias_index(q_pos: Tensor, q_ts: Tensor, k_pos: Tensor, k_ts: Tensor, num_pos: int) -> Tensor:
    """Wide bias-table index (int32) of queries at positions ``q_pos [nq]`` (int64) and times
    ``q_ts [nq]`` (float64) against keys at ``k_pos [nk]`` / ``k_ts [nk]``: ``[nq, nk]``.

    Position bucket of ``d = q - k >= 16``: ``4 floor(log2 d) + (two bits after the leading one)``;
    time code of a gap ``g >= 1`` (float32): ``2 floor(log2 g) + (g >= 1.5 * 2^floor(log2 g))``.
    ``frexp`` gives both exactly, so they equal ``hstu_attention``'s bit-pattern versions. Gaps
    that are NaN or past the float32 range take the largest code (the last time bucket, as there)."""
    exact_positions, wide_columns, f32_max = 16, 258, 3.4028234663852886e38
    d = (q_pos[:, None] - k_pos[None, :]).clamp(min=0)
    m, e = torch.frexp(d.to(torch.float32))
    log_part = 4 * (e.to(torch.int64) - 1) + (m * 8.0).floor().to(torch.int64) - 4
    pos = torch.where(d < exact_positions, d, log_part).clamp(0, num_pos - 1)
    gap = (q_ts[:, None] - k_ts[None, :]).to(torch.float32)
    gap = torch.nan_to_num(gap, nan=f32_max, posinf=f32_max).clamp(min=1.0)
    gm, ge = torch.frexp(gap)
    code = 2 * (ge.to(torch.int64) - 1) + (gm >= 0.75).to(torch.int64)
    return (pos * wide_columns + code).to(torch.int32)


def _known_ids(ids: Tensor, count: int) -> Tensor:
    """Ids ``1 .. count`` as they are, any other as row 0 (``HSTURanker.vocab_items``'s rule)."""
    return torch.where((ids >= 1) & (ids <= count), ids, 0)


def _with_pending(
    seg_keys: list[Tensor], seg_values: list[Tensor], kbufs: list[Tensor], vbufs: list[Tensor], n_seg: int
) -> tuple[list[Tensor], list[Tensor]]:
    """Each layer's cached segments followed by its pending one (``kbufs[l]`` / ``vbufs[l]``), in
    the ``[l * (S + 1) + s]`` order the scoring and advancing passes read."""
    keys: list[Tensor] = []
    values: list[Tensor] = []
    for li in range(len(kbufs)):
        for si in range(n_seg):
            keys.append(seg_keys[li * n_seg + si])
            values.append(seg_values[li * n_seg + si])
        keys.append(kbufs[li])
        values.append(vbufs[li])
    return keys, values


def _causal_plan(
    start: int, n: int, starts: list[int], times: list[Tensor], block: int, num_pos: int, near_keys: int
) -> tuple[list[int], list[int], list[int], list[Tensor], list[Tensor], list[int]]:
    """One causal chunk of the ``n`` events from position ``start`` (the last of ``times``): every
    key block it sees as (segment, first key, end key, bias indices, mask of the keys after each
    query where the block reaches past the first query, else empty, ``BlockTask.far``)."""
    device = times[0].device
    q_pos = torch.arange(start, start + n, device=device)
    q_ts = times[len(times) - 1]
    kb = key_block_size(block, n)
    t_seg: list[int] = []
    t_k0: list[int] = []
    t_k1: list[int] = []
    t_index: list[Tensor] = []
    t_hidden: list[Tensor] = []
    t_far: list[int] = []
    no_mask = torch.empty(0, dtype=torch.bool, device=device)
    for si in range(len(times)):
        visible = min(times[si].shape[0], start + n - starts[si])
        for k0 in range(0, visible, kb):
            k1 = min(k0 + kb, visible)
            k_pos = torch.arange(starts[si] + k0, starts[si] + k1, device=device)
            t_seg.append(si)
            t_k0.append(k0)
            t_k1.append(k1)
            t_index.append(_bias_index(q_pos, q_ts, k_pos, times[si][k0:k1], num_pos))
            if starts[si] + k1 - 1 > start:
                t_hidden.append(k_pos[None, :] > q_pos[:, None])
            else:
                t_hidden.append(no_mask)
            d_min = max(0, start - (starts[si] + k1 - 1))
            t_far.append(block_far(d_min, start + n - 1 - (starts[si] + k0), near_keys))
    return t_seg, t_k0, t_k1, t_index, t_hidden, t_far


def _request_index(
    position: int, request_ts: float, starts: list[int], times: list[Tensor], m: int, num_pos: int
) -> list[Tensor]:
    """Bias indices (flat, int64) of a request's candidates at ``position`` and ``request_ts``
    against every cached key and the first ``m`` new events (the last of ``times``)."""
    device = times[0].device
    when = torch.full([1], request_ts, dtype=torch.float64, device=device)
    last = torch.full([1], position, dtype=torch.int64, device=device)
    n_seg = len(times) - 1
    seg_index: list[Tensor] = []
    for si in range(n_seg + 1):
        k_ts = times[si] if si < n_seg else times[n_seg][:m]
        k_pos = torch.arange(starts[si], starts[si] + k_ts.shape[0], device=device)
        seg_index.append(_bias_index(last, when, k_pos, k_ts, num_pos).reshape(-1).long())
    return seg_index


def _advance_new_events(
    x: Tensor,
    start: int,
    starts: list[int],
    times: list[Tensor],
    keys: list[Tensor],
    values: list[Tensor],
    kbufs: list[Tensor],
    vbufs: list[Tensor],
    tables: list[Tensor],
    weights: list[Tensor],
    dims: tuple[int, int, int],
    consts: tuple[float, float, float],
    sizes: tuple[int, int, int],
    far: tuple[int, int, float],
) -> None:
    """The new events' tokens ``x`` (from position ``start``) through every layer as one causal
    chunk, their keys and values written into ``kbufs`` / ``vbufs``."""
    num_pos, block = sizes[0], sizes[1]
    t_seg, t_k0, t_k1, t_index, t_hidden, t_far = _causal_plan(
        start, x.shape[0], starts, times, block, num_pos, far[1]
    )
    scale = far_queries(start, x.shape[0], far, x.device)
    _advance_tokens(
        x,
        keys,
        values,
        t_seg,
        t_k0,
        t_k1,
        t_index,
        t_hidden,
        t_far,
        tables,
        weights,
        kbufs,
        vbufs,
        0,
        far[0],
        scale,
        dims,
        consts,
    )


def _score_requests(
    raw_cands: list[Tensor],
    request_ts: list[float],
    ends: list[int],
    keys: list[Tensor],
    values: list[Tensor],
    seg_keys: list[Tensor],
    seg_values: list[Tensor],
    kbufs: list[Tensor],
    vbufs: list[Tensor],
    starts: list[int],
    times: list[Tensor],
    cand_action: Tensor,
    embeddings: list[Tensor],
    tables: list[Tensor],
    weights: list[Tensor],
    dims: tuple[int, int, int],
    consts: tuple[float, float, float],
    vocab: tuple[int, int, int],
    sizes: tuple[int, int, int],
    far: tuple[int, int, float],
) -> list[Tensor]:
    """Scores of each request's candidates, ``mb`` at a time (``_rank_relay``'s arguments): request
    ``r`` sees the cached segments and the first ``ends[r]`` new events (``keys`` / ``values``
    hold them all)."""
    num_items, num_pos, block, mb = vocab[0], sizes[0], sizes[1], sizes[2]
    item_table, final_w, final_b = embeddings[0], embeddings[2], embeddings[3]
    n_seg = len(starts) - 1
    n = times[n_seg].shape[0]
    device = item_table.device
    outs: list[Tensor] = []
    for r in range(len(raw_cands)):
        m = ends[r]
        if m < 0 or m > n:
            raise ValueError("rank_relay: a request sees more events than there are")
        keys_r, values_r = keys, values
        if m < n:  # an earlier request: the same keys, less of the new events
            keys_r, values_r = _with_pending(
                seg_keys, seg_values, [k[:, :m] for k in kbufs], [v[:, :m] for v in vbufs], n_seg
            )
        seg_index = _request_index(starts[n_seg] + m, request_ts[r], starts, times, m, num_pos)
        lengths = [t.shape[0] for t in times[:n_seg]] + [m]
        seg_far, far_factor = candidate_far(starts, lengths, starts[n_seg] + m, far)
        cands = _known_ids(raw_cands[r].to(device, torch.int64), num_items)
        c = cands.shape[0]
        out = torch.empty(c, dtype=torch.float32, device=device)
        cb = key_block_size(block, min(mb, max(1, c)))
        for c0 in range(0, c, mb):
            e = F.embedding(cands[c0 : c0 + mb], item_table)
            out[c0 : c0 + mb] = _score_candidates(
                e + cand_action,
                e,
                keys_r,
                values_r,
                seg_index,
                seg_far,
                far_factor,
                tables,
                weights,
                final_w,
                final_b,
                dims,
                consts,
                cb,
            )
        outs.append(out)
    return outs


def _rank_relay(
    raw_items: Tensor,
    raw_actions: Tensor,
    raw_ts: Tensor,
    raw_cands: list[Tensor],
    request_ts: list[float],
    ends: list[int],
    seg_keys: list[Tensor],
    seg_values: list[Tensor],
    seg_start: list[int],
    seg_ts: list[Tensor],
    embeddings: list[Tensor],
    tables: list[Tensor],
    weights: list[Tensor],
    dims: tuple[int, int, int],
    consts: tuple[float, float, float],
    vocab: tuple[int, int, int],
    sizes: tuple[int, int, int],
    far: tuple[int, int, float],
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Rankings of one or more requests of a user against the cached segments (``seg_keys[l * S +
    s]``, ``seg_values``, positions from ``seg_start[s]``, float64 times ``seg_ts[s]``; contiguous
    from 0) and the events ``raw_items``, ``raw_actions``, ``raw_ts [n]`` after them, computed
    once: request ``r`` sees the first ``ends[r]`` of those events and scores the raw item ids
    ``raw_cands[r]`` at time ``request_ts[r]``. ``embeddings``: item and action tables, final norm
    weight and bias; ``vocab``: number of items, number of actions, the candidate action (ids out
    of range map to row 0, as ``HSTURanker.vocab_items`` does); ``sizes``: position buckets,
    attention block, candidate micro-batch; ``far``: the first far index of the tables, the near
    keys (0: none is far) and the far keys' weight (``hstu_attention``). Returns the scores (float32, one tensor per request)
    and the events' keys and values per layer (``[H, n, d]``), which extend the cache."""
    heads, dqk, dv = dims
    num_items, num_actions, cand_act = vocab
    item_table, action_table = embeddings[0], embeddings[1]
    device = item_table.device
    items = _known_ids(raw_items.to(device, torch.int64), num_items)
    actions = _known_ids(raw_actions.to(device, torch.int64), num_actions)
    ts = raw_ts.to(device, torch.float64)
    cand_action = action_table[cand_act]
    n_layers = len(tables)
    n_seg = len(seg_start)
    n = items.shape[0]
    start = seg_start[n_seg - 1] + seg_ts[n_seg - 1].shape[0] if n_seg > 0 else 0
    kbufs = [torch.empty(heads, n, dqk, dtype=item_table.dtype, device=device) for _ in range(n_layers)]
    vbufs = [torch.empty(heads, n, dv, dtype=item_table.dtype, device=device) for _ in range(n_layers)]
    keys, values = _with_pending(seg_keys, seg_values, kbufs, vbufs, n_seg)
    starts = seg_start + [start]  # noqa: RUF005 (TorchScript has no starred lists)
    times = seg_ts + [ts]  # noqa: RUF005
    if n > 0:
        x = F.embedding(items, item_table) + F.embedding(actions, action_table)
        _advance_new_events(
            x, start, starts, times, keys, values, kbufs, vbufs, tables, weights, dims, consts, sizes, far
        )
    outs = _score_requests(
        raw_cands,
        request_ts,
        ends,
        keys,
        values,
        seg_keys,
        seg_values,
        kbufs,
        vbufs,
        starts,
        times,
        cand_action,
        embeddings,
        tables,
        weights,
        dims,
        consts,
        vocab,
        sizes,
        far,
    )
    return outs, kbufs, vbufs


with warnings.catch_warnings():
    # TorchScript is deprecated in favour of torch.compile, which needs a C++ toolchain at run time
    # and recompiles per shape; a scripted function needs neither.
    warnings.simplefilter("ignore", FutureWarning)
    score_candidates = torch.jit.script(_score_candidates)
    score_layer_begin = torch.jit.script(_score_layer_begin)
    score_key_range = torch.jit.script(_score_key_range)
    score_layer_end = torch.jit.script(_score_layer_end)
    score_final = torch.jit.script(_score_final)
    advance_tokens = torch.jit.script(_advance_tokens)
    rank_relay = torch.jit.script(_rank_relay)
    bias_index = torch.jit.script(_bias_index)


def candidate_index(q_pos: int, q_ts: Tensor, segments: Sequence[Segment], *, num_pos: int) -> list[Tensor]:
    """Indices into the wide bias table (int64, one ``[n_s]`` tensor per segment) of queries at
    position ``q_pos`` and time ``q_ts`` (a one-element float64 tensor) against every key: the
    indices ``plan_attention(..., causal=False)`` spreads over its blocks (tests hold them equal)."""
    last = torch.tensor([q_pos], dtype=torch.int64, device=q_ts.device)
    out = []
    for seg in segments:
        if seg.stop > q_pos:
            raise ValueError("candidate_index: candidates must follow every key")
        k_pos = torch.arange(seg.start, seg.stop, device=q_ts.device)
        out.append(bias_index(last, q_ts, k_pos, seg.timestamps, num_pos).reshape(-1).long())
    return out


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
