"""HSTU pointwise attention with relative position/time bias: a dense reference and a blockwise path.

Attention of query token ``i`` over key token ``j`` (HSTU style, no softmax)::

    out_i = (1 / N) * sum_j  visible(i, j) * silu(q_i . k_j + bias[bucket(i, j)]) * v_j

with ``N`` a fixed normaliser (never the sequence length) and ``bias`` one learned value per
(position bucket, time bucket) pair, shared by the heads. Buckets come only from the absolute
positions and timestamps of the two tokens, so a token's attention never depends on how long the
sequence is or on where it was cut: that is what makes a cached prefix exact.

Far keys (optional, ``near_keys > 0``): a key at least ``near_keys`` positions before its query is
far, and the far keys' terms are multiplied by ``min(1, far_keys / n_far(i))``, with ``n_far(i) =
i - near_keys + 1`` the far keys query ``i`` sees (positions count from 0). The recent keys are read
one by one; the older ones weigh at most ``far_keys`` keys' worth together, however many there
are, so a long history adds a summary of old taste instead of swamping the recent events. The
factor depends only on the query's position, so a cached prefix stays exact. ``near_keys`` is a
position-bucket boundary, so "far" is a threshold on a pair's bias index.

Primitives:
- ``position_bucket(dpos)``: bucket of a position difference ``i - j`` (exact below 16, then four
  buckets per doubling).
- ``time_bucket(dt)``: bucket of a time gap ``ts_i - ts_j`` in seconds (two buckets per doubling,
  gaps under 1.5 s share bucket 0, negative gaps count as 0).
- ``pair_index(dpos, dt, ...)``: combined bucket index into a layer's bias table;
  ``SELF_BIAS_INDEX``: the index of a token with itself.
- ``far_index(near_keys, num_pos, columns)``: the first bias index of a far pair, in a table of
  ``columns`` per position bucket; ``far_scale(q_pos, near_keys, far_keys)``: each query's factor
  ``[nq, 1]``; ``far_weights(index, scale, first)``: the factor of each pair (1 for a near one);
  ``wide_far_index``: ``far_index`` in the blockwise path's table. ``far_queries(first, count,
  far, device)``: ``far_scale`` of history queries, empty when every key counts whole;
  ``candidate_far(starts, lengths, position, far)``: for candidates, how many
  leading keys of each segment are far, and their one factor (``far``: first far index, near
  keys, far keys' weight). The serving paths add far keys into a second sum, scaled once.
- ``dense_attention``: the plain reference; materialises the full score matrix, the bias of every
  pair and an explicit visibility mask.
- ``Segment``, ``plan_attention``, ``run_attention``: the optimised path. Keys live in segments of
  consecutive positions (a cached prefix, then the tokens being computed); ``plan_attention``
  splits them into blocks, drops the blocks a causal query chunk cannot see, keeps a mask only
  for blocks that straddle the diagonal and precomputes each block's bias indices, once for all
  layers; ``run_attention`` executes the plan for one layer. No tensor larger than one block of
  scores is ever materialised.

Both bucket functions work on the bit pattern of a float32 (exponent and leading mantissa bits),
so they are exact integer functions of their input: the same token pair gets the same bucket on
every path, whatever the blocking, vectorisation or device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SELF_BIAS_INDEX = 0
"""Bias index of a token with itself: position bucket 0 and time bucket 0."""
EXACT_POSITIONS = 16
"""Position differences below this get a bucket of their own; beyond, four buckets per doubling."""

_TILE = 65536  # pairs per tile when computing time codes (a float64 tile is 512 KiB)

_F32_EXP_BIAS = 127


def position_bucket(dpos: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket (int32) of position differences ``i - j``; negative differences map to bucket 0."""
    d = dpos.clamp_min(0).to(torch.int32)
    # For d >= 16: 16 + 4 * (floor(log2 d) - 4) + (two mantissa bits after the leading one).
    log_part = (d.to(torch.float32).view(torch.int32) >> 21) - (((_F32_EXP_BIAS + 4) << 2) - EXACT_POSITIONS)
    return torch.where(d < EXACT_POSITIONS, d, log_part).clamp_(0, num_buckets - 1)


def time_bucket(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket (int32) of time gaps in seconds: ``floor(log2 gap)`` doubled, plus one if the gap is
    at least 1.5 times that power of two. Gaps under 1.5 s (negative ones included) are bucket 0."""
    g = dt.to(torch.float32).clamp_(min=1.0)
    return ((g.view(torch.int32) >> 22) - (_F32_EXP_BIAS << 1)).clamp_(0, num_buckets - 1)


def pair_index(dpos: torch.Tensor, dt: torch.Tensor, num_pos: int, num_time: int) -> torch.Tensor:
    """Index (int32) into a flattened ``[num_pos, num_time]`` bias table for each token pair."""
    return position_bucket(dpos, num_pos) * num_time + time_bucket(dt, num_time)


def far_index(near_keys: int, num_pos: int, columns: int) -> int:
    """First bias index of a far pair (``near_keys`` > 0, a position-bucket boundary) in a table of
    ``columns`` entries per position bucket: that of the first far bucket with time column 0."""
    return int(position_bucket(torch.tensor([near_keys]), num_pos)[0]) * columns


def wide_far_index(near_keys: int, num_pos: int) -> int:
    """``far_index`` in ``wide_bias_table``'s layout."""
    return far_index(near_keys, num_pos, WIDE_TIME_COLUMNS)


def is_bucket_boundary(n: int, num_pos: int) -> bool:
    """Whether position differences ``>= n`` are exactly the buckets from ``bucket(n)`` on."""
    below, at = position_bucket(torch.tensor([n - 1, n]), 1 << 30).tolist()
    return n >= 1 and at > below and at < num_pos


def far_scale(q_pos: torch.Tensor, near_keys: int, far_keys: float) -> torch.Tensor:
    """Factor ``[nq, 1]`` (float32) of the far keys of queries at positions ``q_pos [nq]``:
    ``min(1, far_keys / (q_pos - near_keys + 1))`` (1 while a query sees no more than ``far_keys``)."""
    count = (q_pos - near_keys + 1).clamp(min=1).to(torch.float32)
    return (far_keys / count).clamp(max=1.0).reshape(-1, 1)


def far_weights(index: torch.Tensor, scale: torch.Tensor, first: int) -> torch.Tensor:
    """Factor of each pair: ``scale`` (broadcast over the keys) where ``index >= first``, else 1."""
    return torch.where(index >= first, scale, torch.ones_like(scale))


def far_queries(first: int, count: int, far: tuple[int, int, float], device: torch.device) -> torch.Tensor:
    """Far-key factors ``[count, 1]`` of the queries at positions ``first .. first + count - 1``;
    empty when no key is far (``far[1]`` = 0) or none of them sees more than ``far[2]`` far keys
    (every factor is 1). Decided from the integers: no device round trip per chunk."""
    if far[1] == 0 or count == 0 or first + count - far[1] <= far[2]:
        return torch.empty(0, device=device)
    return far_scale(torch.arange(first, first + count, device=device), far[1], far[2])


def candidate_far(
    starts: list[int], lengths: list[int], position: int, far: tuple[int, int, float]
) -> tuple[list[int], float]:
    """For candidates at ``position``: how many leading keys of each segment (from ``starts[s]``,
    ``lengths[s]`` keys) are far, and the factor of each; an empty list when every key counts
    whole (no far keys, or no more than ``far[2]`` of them)."""
    near, weight = far[1], far[2]
    count = position - near + 1  # keys at positions 0 .. position - near
    if near == 0 or count <= weight:
        return [], 1.0
    return [min(max(count - starts[s], 0), lengths[s]) for s in range(len(starts))], weight / count


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: torch.Tensor,
    visible: torch.Tensor,
    table: torch.Tensor,
    normaliser: float,
) -> torch.Tensor:
    """Reference attention: ``q [..., H, Tq, dqk]``, ``k [..., H, Tk, dqk]``, ``v [..., H, Tk, dv]``;
    ``index [..., Tq, Tk]`` the pairs' bias indices (``pair_index`` of their position differences
    and time gaps), ``visible [..., Tq, Tk]`` (bool, or each pair's factor: 0 for a hidden one),
    both shared by the heads and broadcastable;
    ``table`` the flattened bias table. Differentiable: the training path and the test oracle."""
    bias = table[index.long()].unsqueeze(-3)
    scores = F.silu(torch.matmul(q, k.transpose(-1, -2)) + bias)
    scores = scores * visible.unsqueeze(-3).to(scores.dtype)
    return torch.matmul(scores, v) / normaliser


@dataclass(frozen=True)
class Segment:
    """Keys of consecutive positions ``start, start + 1, ...`` and their timestamps (float64)."""

    start: int
    timestamps: torch.Tensor

    @property
    def stop(self) -> int:
        return self.start + int(self.timestamps.shape[0])


@dataclass(frozen=True)
class BlockTask:
    """One key block of a plan: keys ``[k0, k1)`` of segment ``segment``; ``index`` the bias index
    per (query, key), ``[1, Bk]`` when all queries share position and timestamp; ``hidden`` marks
    the pairs a causal query must not see (``None`` when the whole block is visible); ``far``:
    ``NO_FAR`` (no pair of the block is far), ``ALL_FAR`` (every visible one is), ``SOME_FAR``,
    or ``UNPLANNED`` (planned without ``near_keys``: each pair is weighed if far keys apply)."""

    segment: int
    k0: int
    k1: int
    index: torch.Tensor
    hidden: torch.Tensor | None
    far: int = -1


NO_FAR, ALL_FAR, SOME_FAR, UNPLANNED = 0, 1, 2, -1
"""``BlockTask.far``: a block with no far pair, one whose visible pairs are all far, a mix, and a
block planned without ``near_keys`` (treated as a mix)."""


def block_far(d_min: int, d_max: int, near_keys: int) -> int:
    """``BlockTask.far`` of a block whose visible pairs are ``d_min .. d_max`` positions apart
    (literals, not the names: TorchScript, which runs it too, reads no module globals)."""
    if near_keys <= 0 or d_max < near_keys:
        return 0  # NO_FAR
    return 1 if d_min >= near_keys else 2  # ALL_FAR, SOME_FAR


def key_block_size(block: int, rows: int) -> int:
    """Keys per block for ``rows`` queries: ``block`` keys for a full query block; skinny query
    chunks get wider key blocks so that every score block holds about ``block * block`` values."""
    return block * max(1, block // max(1, rows))


# The blockwise path addresses a wide table: column = the raw float32 code of the clamped gap
# (``bits >> 22``) minus 254, i.e. the time bucket before its upper clamp; columns past the last
# bucket repeat it. That saves two passes per score block and gives the very same bias values.
_CODE0 = _F32_EXP_BIAS << 1
WIDE_TIME_COLUMNS = 258
"""Columns per position bucket in ``wide_bias_table``: every code a float32 gap >= 1 can take."""


def wide_bias_table(pos_bias: torch.Tensor, time_bias: torch.Tensor) -> torch.Tensor:
    """``[position_buckets * WIDE_TIME_COLUMNS]`` table for ``run_attention``: entry
    ``p * WIDE_TIME_COLUMNS + c`` is ``pos_bias[p] + time_bias[min(c, time_buckets - 1)]``."""
    cols = torch.arange(WIDE_TIME_COLUMNS, device=time_bias.device).clamp_(max=time_bias.shape[0] - 1)
    return (pos_bias[:, None] + time_bias[cols][None, :]).reshape(-1)


def plan_attention(
    q_start: int,
    q_ts: torch.Tensor,
    segments: Sequence[Segment],
    *,
    rows: int,
    causal: bool,
    block: int,
    num_pos: int,
    near_keys: int = 0,
    cache: dict | None = None,
) -> list[BlockTask]:
    """Blocks a query chunk attends to, with their indices into ``wide_bias_table`` (layer
    independent: computed once, used by every layer).

    ``cache`` (a dict kept across the chunks of one pass) remembers the position part of the
    indices (it depends only on a block's offset, and consecutive chunks meet the same offsets)
    and holds scratch buffers: the tasks of one call are invalid once the same cache is passed to
    the next call.

    ``near_keys`` (the model's; 0: none) classifies each block by its far pairs
    (``BlockTask.far``), so that ``run_attention`` weighs pairs one by one only where a block holds
    both kinds.

    Causal chunk: queries are at positions ``q_start .. q_start + len(q_ts) - 1`` and see keys at
    positions up to their own; blocks entirely after the chunk are skipped. Non-causal (candidate
    tokens): ``rows`` queries all at position ``q_start`` with the one timestamp ``q_ts[0]``, seeing
    every key of the segments (which must all precede ``q_start``).
    """
    device = q_ts.device
    nq = int(q_ts.shape[0])
    q_stop = q_start + nq  # exclusive
    # Never wider than the keys a segment shows: a one-token chunk would otherwise build (and flip)
    # position tables for block * block keys to read a thousand of them.
    widest = max((_visible(seg, q_start, q_stop, causal) for seg in segments), default=0)
    kb = max(1, min(key_block_size(block, rows), widest))
    # d = q_pos - k_pos = (q_start - ks - kb + 1) + grid[a, b] for query a and key b of a block at ks.
    cache = {} if cache is None else cache
    grid = cache.get(("grid", nq, kb))
    if grid is None:
        grid = torch.arange(nq, device=device, dtype=torch.int32)[:, None] + (kb - 1)
        grid = cache[("grid", nq, kb)] = grid - torch.arange(kb, device=device, dtype=torch.int32)[None, :]
    last_key = max((seg.stop for seg in segments), default=0) - 1
    d_lo, d_hi = q_start - max(last_key, 0) - kb + 1, q_stop - 1
    pos_lut = (
        position_bucket(torch.arange(d_lo, d_hi + 1, device=device), num_pos) * WIDE_TIME_COLUMNS - _CODE0
    )

    # Time codes are computed tile by tile into reused buffers: the float64 differences of a whole
    # block row would not stay in cache, and fresh large allocations cost page faults.
    tile_rows = max(1, min(nq, _TILE // kb))
    gap64 = _scratch(cache, "gap64", tile_rows * kb, torch.float64, device)
    gap32 = _scratch(cache, "gap32", tile_rows * kb, torch.float32, device)

    total = sum(-(-_visible(seg, q_start, q_stop, causal) // kb) for seg in segments) * nq * kb
    codes_buf = _scratch(cache, "codes", total, torch.int32, device)
    used = 0
    tasks: list[BlockTask] = []
    for si, seg in enumerate(segments):
        visible = _visible(seg, q_start, q_stop, causal)
        for k0 in range(0, visible, kb):
            k1 = min(k0 + kb, visible)
            d0 = q_start - (seg.start + k0) - kb + 1
            index = codes_buf[used : used + nq * (k1 - k0)].view(nq, k1 - k0)
            used += nq * (k1 - k0)
            _time_codes(index, q_ts, seg.timestamps[k0:k1], gap64, gap32, tile_rows)
            index.add_(_position_part(cache, pos_lut, d0 - d_lo, nq, kb, k1 - k0, d0))
            hidden = None
            if causal and seg.start + k1 - 1 > q_start:  # straddles the diagonal
                hidden = grid[:, : k1 - k0] < -d0
            d_min = max(0, q_start - (seg.start + k1 - 1))  # hidden pairs are never far
            far = block_far(d_min, q_stop - 1 - (seg.start + k0), near_keys) if near_keys else UNPLANNED
            tasks.append(BlockTask(si, k0, k1, index, hidden, far))
    return tasks


def _time_codes(
    out: torch.Tensor,
    q_ts: torch.Tensor,
    k_ts: torch.Tensor,
    gap64: torch.Tensor,
    gap32: torch.Tensor,
    tile_rows: int,
) -> None:
    """Raw time codes ``out [nq, width]`` (int32) of queries at ``q_ts [nq]`` against keys at
    times ``k_ts [width]``, ``tile_rows`` rows at a time through the scratch buffers ``gap64`` and
    ``gap32``."""
    nq, width = q_ts.shape[0], k_ts.shape[0]
    for r0 in range(0, nq, tile_rows):
        r1 = min(nq, r0 + tile_rows)
        g64 = gap64[: (r1 - r0) * width].view(r1 - r0, width)
        g32 = gap32[: (r1 - r0) * width].view(r1 - r0, width)
        torch.sub(q_ts[r0:r1, None], k_ts[None, :], out=g64)
        g32.copy_(g64).clamp_(min=1.0)
        torch.bitwise_right_shift(g32.view(torch.int32), 22, out=out[r0:r1])


def _position_part(
    cache: dict, pos_lut: torch.Tensor, at: int, nq: int, kb: int, width: int, d0: int
) -> torch.Tensor:
    """Position part of the indices of a block whose offset is ``d0`` (at ``at`` in ``pos_lut``),
    kept in ``cache``: it is Toeplitz in ``d0``, and consecutive chunks meet the same offsets."""
    key = (d0, nq, kb, width)
    part = cache.get(key)
    if part is None:
        # part[a, b] = pos_lut[at + kb - 1 + a - b]: a Toeplitz matrix, built from windows.
        window = pos_lut[at : at + nq + kb - 1].flip(0)
        part = cache[key] = window.unfold(0, kb, 1).flip(0)[:, :width]
    return part


def _visible(seg: Segment, q_start: int, q_stop: int, causal: bool) -> int:
    """Keys of ``seg`` a query chunk can see (a prefix of the segment)."""
    n = seg.stop - seg.start
    if causal:
        return max(0, min(n, q_stop - seg.start))  # keys after the last query are skipped
    if n and seg.stop > q_start:
        raise ValueError("plan_attention: non-causal queries must follow every key")
    return n


def _scratch(cache: dict, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable flat buffer of at least ``numel`` elements kept in ``cache``."""
    buf = cache.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = cache[name] = torch.empty(max(numel, 1), dtype=dtype, device=device)
    return buf


def run_attention(
    q: torch.Tensor,
    tasks: Sequence[BlockTask],
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    table: torch.Tensor,
    value_dim: int,
    far: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Unnormalised attention sum ``[H, Tq, value_dim]`` of ``q [H, Tq, dqk]`` over the planned
    blocks; ``kv[s]`` holds segment ``s``'s keys ``[H, n, dqk]`` and values ``[H, n, value_dim]``.
    ``far``: the queries' far-key factors ``[Tq, 1]`` (``far_scale``) and the first far index in
    ``table`` (``far_index``), or ``None`` when every pair counts whole. Blocks whose pairs are all
    far add into a second sum, scaled once at the end; only blocks with some far pairs (where
    ``near_keys`` cuts through them) weigh each pair.
    Inference only (in-place ops); the caller adds any extra terms and divides by the normaliser."""
    heads, nq, _ = q.shape
    acc = q.new_zeros(heads, nq, value_dim)
    if not tasks:
        return acc
    # One score buffer and one bias buffer for every block: no allocation inside the loop.
    widest = max(t.index.numel() for t in tasks) // max(1, min(t.index.shape[0] for t in tasks))
    score_buf = q.new_empty(heads * nq * widest)
    bias_buf = table.new_empty(max(t.index.numel() for t in tasks))
    far_acc = q.new_zeros(heads, nq, value_dim) if far is not None else acc
    for t in tasks:
        k, v = kv[t.segment]
        w = t.k1 - t.k0
        scores = torch.bmm(
            q, k[:, t.k0 : t.k1].transpose(1, 2), out=score_buf[: heads * nq * w].view(heads, nq, w)
        )
        bias = torch.index_select(table, 0, t.index.reshape(-1), out=bias_buf[: t.index.numel()])
        scores.add_(bias.view(1, *t.index.shape))
        F.silu(scores, inplace=True)
        if t.hidden is not None:
            scores.masked_fill_(t.hidden, 0.0)
        if far is not None and t.far in (SOME_FAR, UNPLANNED):
            scores.mul_(far_weights(t.index, far[0], far[1]).to(scores.dtype))
        (far_acc if far is not None and t.far == ALL_FAR else acc).baddbmm_(scores, v[:, t.k0 : t.k1])
    if far is not None:
        acc.add_(far_acc.mul_(far[0].to(acc.dtype)))
    return acc
