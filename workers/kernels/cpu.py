"""The CPU backend of ``hstu_mha``: PyTorch operations laid out for a CPU (also what runs on an NPU
and any device without a kernel). Not the definition: ``oracle`` is; this is held to it.

Primitives:
- ``cpu_hstu_mha(q, k, v, batch, bias_table, params)``: the users laid out in one dense
  ``[B, H, max_q, max_k]`` score tensor per layer (each user's tokens right-aligned, so that a
  query's own key sits on one diagonal for every user). What does not depend on the layer (each
  pair's bias index, and its weight: visibility, far factor and normaliser together) is derived once
  per batch and kept in ``batch.scratch``, so a layer costs a fixed handful of operations (a bias
  gather, two batched matmuls, SiLU and the weight) whatever the history length or user count.
- ``pair_layout(batch, params)``: that once-per-batch part. With a row index (``batch.k_rows``: keys
  read in place from a larger tensor, a paged pool's layer) the layout holds each dense key slot's
  row instead, and a layer gathers its keys and values straight into the dense layout (one
  ``index_select`` each). The layout is as wide as the longest user (its offsets read back: free
  on a CPU), or ``max_k`` wide (the capacity) while a CUDA graph is captured.
- ``causal_tiles(total, device)`` (``CausalTiles``): one user whose queries are all its keys (a full
  ranking) is laid out in square tiles on and below the diagonal of its causal square instead, so
  that the hidden upper triangle is not computed; the same fixed handful of operations per layer
  (gathers into the tiles, one batched product each way, one ``index_add`` back into the rows).
- ``host_frame(batch)`` (``HostFrame``): what the host reads of such a user first: whether its
  positions allow skipping the tiles above the diagonal, and whether its pair differences fit
  int32 (then the layout's arithmetic runs in int32 planes, bit for bit the int64 result).
- ``SPARE_BYTES``: on a CPU a finished tile layout leaves its memory to the next forward (fresh
  memory of this size costs a page fault per page).

The position part of a pair's bias index comes from a table over position differences, built once
per process and shape (``position_bucket`` up to the difference where buckets saturate), so that
the layout reads it with one gather instead of re-deriving buckets pair by pair.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from relaygr.workers.kernels.batch import AttentionParams, JaggedBatch, check_key_rows
from relaygr.workers.kernels.buckets import EXACT_POSITIONS, F32_EXP_BIAS, position_bucket

PAD_POSITION = 1 << 40
"""Position of a padding key: after every real query, so no one sees it."""
LUT_LIMIT = 1 << 21
"""Largest position table; beyond it (over ~80 position buckets) buckets are computed per pair."""
TILE_TOKENS = 512
"""Largest side of a causal tile: smaller tiles skip more of the hidden triangle (a user cut in
``b`` blocks computes ``(b + 1) / 2b`` of its square) but copy each query, key and value into
more tiles."""
POSITION_FRAME = 1 << 30
"""A user whose positions span at most this has its pair differences in int32 (padding keys at one
past it: after every query)."""
SPARE_BYTES = 1 << 30
"""Largest tile scratch (layout planes, layer buffers) a CPU process keeps for its next forward."""
# Kept by dtype and whether it is an inference tensor: one made under ``torch.inference_mode``
# cannot be written in place outside it.
_spare: dict[tuple[torch.dtype, bool], torch.Tensor] = {}
TIME_FRAME = (1 << 31) - 1
"""Whole-second timestamps spanning at most this have their gaps in int32, exact."""
_TIME_SHIFT = 22  # a float32 gap's exponent and first mantissa bit: two time codes per doubling
_TIME_CODE0 = F32_EXP_BIAS << 1  # the code of a 1 s gap


@dataclass(frozen=True)
class PairLayout:
    """Once per batch: where each packed token sits in the dense layout (``None`` for one user:
    the packed tensors are the layout), and per (user, query, key) slot the bias index and the
    pair's weight (0 for a hidden pair or padding)."""

    q_slots: torch.Tensor | None  # [Tq] rows of the [B * max_q] layout
    k_slots: torch.Tensor | None  # [Tk] rows of the [B * max_k] layout
    index: torch.Tensor  # [B, max_q, max_k] int32 ([tiles, side, side] when tiled)
    weight: torch.Tensor  # [B, max_q, max_k] float32 ([tiles, side, side] when tiled)
    tiles: CausalTiles | None = None
    buffers: dict[str, object] = field(default_factory=dict)  # reused by every layer
    k_gather: torch.Tensor | None = None  # [B * max_k] row of k/v of each key slot (``k_rows``)


@dataclass(frozen=True)
class CausalTiles:
    """One user's causal square cut into ``blocks`` blocks of ``side`` tokens (``pad`` padding
    tokens first), and the tiles on or below the diagonal: the diagonal ones first, then the rest
    row by row. A tile is block ``r``'s queries against block ``c``'s keys; tiles above the
    diagonal hold only hidden pairs and are never computed."""

    pad: int
    side: int
    blocks: int
    rows: torch.Tensor  # [tiles * side] packed query (and own key) of each tile row; padding: 0
    cols: torch.Tensor  # [tiles * side] packed key of each tile column; padding: 0
    out_rows: torch.Tensor  # [(tiles - blocks) * side] padded row each tile below adds into
    col_slots: torch.Tensor  # [tiles * side] padded column of each tile column


def saturation(num_pos: int) -> int:
    """The smallest position difference whose bucket is the last one (``num_pos - 1``)."""
    if num_pos <= EXACT_POSITIONS:
        return num_pos - 1
    above = num_pos - 1 - EXACT_POSITIONS  # four buckets per doubling from 16 on
    return (4 + above % 4) << (above // 4 + 2)


@functools.cache
def _position_table(num_pos: int, num_time: int, device: torch.device) -> torch.Tensor | None:
    """``table[d]`` = ``position_bucket(d) * num_time - code(1 s)`` for ``d`` in ``0 ..
    saturation`` (a negative difference has bucket 0, as 0 has); ``None`` when that is over
    ``LUT_LIMIT`` entries. Built from numpy, so it is a real tensor whatever mode the first call
    runs under."""
    top = saturation(num_pos)
    if top + 1 > LUT_LIMIT:
        return None
    d = np.arange(0, top + 1, dtype=np.int32)
    # ``buckets.position_bucket`` in numpy (the same float32 bits; tests hold them equal).
    log_part = (d.astype(np.float32).view(np.int32) >> 21) - (((F32_EXP_BIAS + 4) << 2) - EXACT_POSITIONS)
    bucket = np.where(d < EXACT_POSITIONS, d, log_part).clip(0, num_pos - 1)
    table = torch.from_numpy((bucket * num_time - _TIME_CODE0).astype(np.int32))
    return table if device.type == "cpu" else table.to(device)


def _dense(
    values: torch.Tensor, slots: torch.Tensor | None, users: int, rows: int, fill: float
) -> torch.Tensor:
    if slots is None:
        return values.reshape(1, rows, *values.shape[1:])
    out = values.new_full((users * rows, *values.shape[1:]), fill)
    return out.index_copy_(0, slots, values).reshape(users, rows, *values.shape[1:])


def _slots(offsets: torch.Tensor, total: int, rows: int, users: int) -> torch.Tensor:
    """Dense row of each packed token, users right-aligned: token ``t`` of user ``b`` (which ends
    at ``offsets[b + 1]``) goes to ``(b + 1) * rows - (offsets[b + 1] - t)``."""
    shift = torch.arange(1, users + 1, device=offsets.device) * rows - offsets[1:]
    counts = offsets[1:] - offsets[:-1]
    per_token = torch.repeat_interleave(shift, counts, output_size=total)
    return torch.arange(total, device=offsets.device) + per_token


def _index(d: torch.Tensor, gaps: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """Bias index (int32) of pairs ``d`` (int64) positions apart with time gaps ``gaps`` (float32,
    overwritten): ``buckets.position_bucket`` and ``buckets.time_bucket`` combined."""
    gap = gaps.view(torch.int32).bitwise_right_shift_(_TIME_SHIFT)
    # A gap under 1.5 s (negative, -0 and NaN's sign included) is code 254; the top code repeats.
    gap = gap.clamp_(_TIME_CODE0, _TIME_CODE0 + params.num_time - 1)
    table = _position_table(params.num_pos, params.num_time, d.device)
    if table is None:
        return gap.add_(position_bucket(d, params.num_pos) * params.num_time - _TIME_CODE0)
    near = d.clamp(0, table.shape[0] - 1)
    return gap.add_(torch.index_select(table, 0, near.view(-1)).view(near.shape))


def _weight(
    d: torch.Tensor, q_pos: torch.Tensor, params: AttentionParams, dtype: torch.dtype
) -> torch.Tensor:
    """Each pair's weight: ``1 / N`` for a visible near pair, the query's far factor over ``N`` for
    a far one, 0 for a hidden one (a query's own key is set by the caller)."""
    visible = d > 0
    near = (
        visible * (1.0 / params.normaliser)
        if dtype == torch.float32
        else visible.to(dtype).mul_(1.0 / params.normaliser)
    )
    if params.near_keys > 0:
        near = torch.where(d >= params.near_keys, _far_factor(q_pos, params, dtype).unsqueeze(-1), near)
    return near


def _pairs(
    q_pos: torch.Tensor,
    q_ts: torch.Tensor,
    k_pos: torch.Tensor,
    k_ts: torch.Tensor,
    params: AttentionParams,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bias index and weight of every (query, key) pair of ``[n, rows]`` queries and ``[n, cols]``
    keys: ``[n, rows, cols]`` each, own keys not yet set."""
    d = q_pos[:, :, None] - k_pos[:, None, :]  # i - j
    # The gaps straight into float32 (computed in float64, rounded once: as ``.to(float32)``).
    gaps = torch.empty(d.shape, dtype=torch.float32, device=d.device)
    index = _index(d, torch.sub(q_ts[:, :, None], k_ts[:, None, :], out=gaps), params)
    return index, _weight(d, q_pos, params, dtype)


def causal_tiles(total: int, device: torch.device) -> CausalTiles:
    """The tiles of one user's ``total`` x ``total`` causal square (its queries are all its keys),
    in blocks of at most ``TILE_TOKENS``. Planned on the host (index maps, no device operation)."""
    blocks = -(-total // TILE_TOKENS)
    side = -(-total // blocks)
    pad = blocks * side - total
    below_r, below_c = np.tril_indices(blocks, -1)  # row by row
    diagonal = np.arange(blocks)
    within = np.arange(side)
    out_rows = (np.concatenate([diagonal, below_r])[:, None] * side + within).reshape(-1)
    col_slots = (np.concatenate([diagonal, below_c])[:, None] * side + within).reshape(-1)
    maps = np.stack([np.maximum(out_rows - pad, 0), np.maximum(col_slots - pad, 0), out_rows, col_slots])
    rows, cols, out_rows_t, col_slots_t = torch.from_numpy(maps).to(device)
    return CausalTiles(pad, side, blocks, rows, cols, out_rows_t[blocks * side :], col_slots_t)


def _take(numel: int, like: torch.Tensor) -> torch.Tensor:
    """At least ``numel`` elements of ``like``'s dtype. On a CPU, the memory a finished forward left
    (``_keep``): memory this large is a fresh ``mmap`` whatever ``devices.keep_host_pages`` says, and
    faulting it in costs as much as the work. Taken with one ``pop`` (atomic): two forwards alive
    at once never share it."""
    key = (like.dtype, torch.is_inference_mode_enabled())
    kept = _spare.pop(key, None) if like.device.type == "cpu" else None
    if kept is None or kept.numel() < numel:
        kept = like.new_empty(numel)
    return kept


def _keep(owner: object, taken: torch.Tensor) -> None:
    """Once ``owner`` (the layout, whose tensors view ``taken``) is gone, keep ``taken``'s memory for
    the next forward: one buffer per dtype, up to ``SPARE_BYTES``, on a CPU only."""
    if taken.device.type == "cpu" and taken.numel() * taken.element_size() <= SPARE_BYTES:
        weakref.finalize(owner, _spare.__setitem__, (taken.dtype, taken.is_inference()), taken)


@dataclass(frozen=True)
class HostFrame:
    """What the host reads of one user's positions and timestamps before tiling it."""

    ordered: bool  # keys after a query's own key are all hidden from it: tiles above are skipped
    pos_base: int | None  # the smallest position, where positions span at most POSITION_FRAME
    ts_base: float | None  # the smallest timestamp, where all are whole seconds within TIME_FRAME


def host_frame(batch: JaggedBatch) -> HostFrame:
    """For one user: whether its key positions never decrease and each query sits at or before
    its own key's position (then every key after a query's own key is hidden from it); whether its
    pair differences fit int32 (positions, and whole-second timestamps, whose int32 difference
    rounds to float32 as the float64 one does). Read on the host (no device operation); the meta
    device (operation counts) has no values and is taken as ordered, in both frames at 0."""
    if batch.k_pos.device.type == "meta":
        return HostFrame(True, 0, 0.0)
    shift = batch.max_k - batch.max_q
    k, q = batch.k_pos.cpu().numpy(), batch.q_pos.cpu().numpy()
    ordered = bool((k[1:] >= k[:-1]).all() and (q <= k[shift:]).all())
    low = int(min(k.min(), q.min()))
    pos_base = low if int(max(k.max(), q.max())) - low <= POSITION_FRAME else None
    ts = np.concatenate([batch.k_ts.cpu().numpy(), batch.q_ts.cpu().numpy()])
    whole = bool(np.isfinite(ts).all() and (np.floor(ts) == ts).all() and ts.max() - ts.min() <= TIME_FRAME)
    return HostFrame(ordered, pos_base, float(ts.min()) if whole else None)


@functools.cache
def _near_weights(params: AttentionParams, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``table[d]`` for a clamped position difference ``d`` in ``0 .. saturation``: 0 for ``d = 0``
    (hidden), ``1 / N`` for a near visible pair, 0 for a far one (its query's factor goes in by
    row). Built from numpy, as ``_position_table``."""
    d = np.arange(0, saturation(params.num_pos) + 1)
    near = (d > 0) & ((d < params.near_keys) | (params.near_keys <= 0))
    table = torch.from_numpy(near * (1.0 / params.normaliser)).to(dtype)
    return table if device.type == "cpu" else table.to(device)


def _far_factor(q_pos: torch.Tensor, params: AttentionParams, dtype: torch.dtype) -> torch.Tensor:
    """min(1, far_keys / (pos - near_keys + 1)) / N per query, the factor in float32 whatever the
    scores' dtype, rounded as training rounds it (``hstu_attention.far_scale``)."""
    count = (q_pos - (params.near_keys - 1)).clamp_(min=1)
    return torch.reciprocal(count).mul_(params.far_keys).clamp_(max=1.0).to(dtype).div_(params.normaliser)


def _tile_pairs(
    rel: tuple[torch.Tensor, torch.Tensor],
    ts: tuple[torch.Tensor, torch.Tensor],
    q_pos: torch.Tensor,
    params: AttentionParams,
    dtype: torch.dtype,
    planes: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_pairs`` for tiles, with fewer passes and no memory but ``planes`` (int32, three per pair):
    ``rel`` the queries' and keys' positions in an int32 frame (``[n, side]``), ``ts`` their
    timestamps (float64, or int32 whole seconds in a frame), ``q_pos`` the queries' absolute
    positions (the far factor). Needs the position table, and ``near_keys`` at most where buckets
    saturate: the difference is clamped in place and still tells visibility and farness."""
    (q_rel, k_rel), (q_ts, k_ts) = rel, ts
    shape = (q_rel.shape[0], q_rel.shape[1], k_rel.shape[1])
    # Three int32 planes: the time gaps (float64 over planes 0-1), then the clamped position
    # difference; the position part of the index, then the weight when float32; the index.
    planes = planes.view(3, -1)
    into = planes[0] if q_ts.dtype == torch.int32 else planes[:2].view(-1).view(torch.float64)
    gaps = torch.sub(q_ts[:, :, None], k_ts[:, None, :], out=into.view(shape))
    index = planes[2].view(torch.float32).view(shape).copy_(gaps).view(torch.int32)
    index = index.bitwise_right_shift_(_TIME_SHIFT)
    # A gap under 1.5 s (negative, -0 and NaN's sign included) is code 254; the top code repeats.
    index = index.clamp_(_TIME_CODE0, _TIME_CODE0 + params.num_time - 1)
    d = torch.sub(q_rel[:, :, None], k_rel[:, None, :], out=planes[0].view(shape))
    d = d.clamp_(0, saturation(params.num_pos)).view(-1)
    table = _position_table(params.num_pos, params.num_time, d.device)
    index.add_(torch.index_select(table, 0, d, out=planes[1]).view(shape))
    into = planes[1].view(torch.float32) if dtype == torch.float32 else None
    weight = torch.index_select(_near_weights(params, dtype, d.device), 0, d, out=into).view(shape)
    if params.near_keys > 0:
        far = _far_factor(q_pos, params, dtype).unsqueeze(-1)
        weight = torch.where(d.view(shape) >= params.near_keys, far, weight, out=weight)
    return index, weight


def _tiled_layout(
    batch: JaggedBatch, params: AttentionParams, dtype: torch.dtype, frame: HostFrame
) -> PairLayout:
    """One user whose queries are all its keys, in causal tiles (``CausalTiles``)."""
    tiles = causal_tiles(batch.max_k, batch.k_pos.device)
    n = int(tiles.rows.shape[0]) // tiles.side
    q_pos = batch.q_pos[tiles.rows].view(n, -1)
    k_pos = batch.k_pos[tiles.cols].view(n, -1)
    q_ts, k_ts = batch.q_ts[tiles.rows].view(n, -1), batch.k_ts[tiles.cols].view(n, -1)
    key_pad = (tiles.col_slots < tiles.pad).view(n, -1)
    top, planes = saturation(params.num_pos), None
    if frame.pos_base is not None and 1 <= top < LUT_LIMIT and params.near_keys <= top:
        q_rel = (q_pos - frame.pos_base).to(torch.int32)
        k_rel = (k_pos - frame.pos_base).to(torch.int32).masked_fill_(key_pad, POSITION_FRAME + 1)
        if frame.ts_base is not None:
            q_ts, k_ts = (q_ts - frame.ts_base).to(torch.int32), (k_ts - frame.ts_base).to(torch.int32)
        pairs = q_rel.numel() * tiles.side
        planes = _take(3 * pairs, q_rel)  # kept whole for the next forward (``_keep``)
        index, weight = _tile_pairs((q_rel, k_rel), (q_ts, k_ts), q_pos, params, dtype, planes[: 3 * pairs])
    else:
        index, weight = _pairs(q_pos, q_ts, k_pos.masked_fill(key_pad, PAD_POSITION), k_ts, params, dtype)
    # Own keys: the diagonal of the diagonal tiles (the first ``blocks``).
    weight[: tiles.blocks].diagonal(dim1=-2, dim2=-1).fill_(1.0 / params.normaliser)
    layout = PairLayout(None, None, index, weight, tiles)
    if planes is not None:
        _keep(layout, planes)
    return layout


@functools.cache
def _slot_steps(width: int, device: torch.device) -> torch.Tensor:
    """``[-width, ..., -1]`` (int64), built once per width and device (a static input)."""
    steps = torch.from_numpy(np.arange(-width, 0, dtype=np.int64))
    return steps if device.type == "cpu" else steps.to(device)


def _key_width(batch: JaggedBatch) -> int:
    """Key slots per user of a row-indexed batch's dense layout: the longest user's where its
    offsets can be read (on a CPU for free; on another device at the cost of a wait), ``max_k``
    (the capacity) while a CUDA graph is captured (which cannot wait) and on the meta device."""
    device = batch.k_offsets.device
    if device.type == "meta" or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return batch.max_k
    return max(batch.max_q, int((batch.k_offsets[1:] - batch.k_offsets[:-1]).max()))


def _gathered_layout(batch: JaggedBatch, params: AttentionParams, dtype: torch.dtype) -> PairLayout:
    """The dense layout of a batch whose keys are rows of a larger tensor (``k_rows``): slot ``c``
    of user ``b`` (right-aligned) is its packed key ``k_offsets[b + 1] - width + c``, padding where
    that is before the user's first key; a padded slot reads some real row (a finite key and
    value: its weight 0 leaves exactly nothing) at the padding position."""
    users, lq, lk = batch.users, batch.max_q, _key_width(batch)
    device = batch.k_pos.device
    token = batch.k_offsets[1:, None] + _slot_steps(lk, device)[None, :]  # [B, lk]
    padded = token < batch.k_offsets[:-1, None]
    flat = token.clamp_(min=0).view(-1)
    k_pos = batch.k_pos.index_select(0, flat).view(users, lk).masked_fill_(padded, PAD_POSITION)
    k_ts = batch.k_ts.index_select(0, flat).view(users, lk)
    assert batch.k_rows is not None
    k_gather = batch.k_rows.index_select(0, flat)
    q_slots = None if users == 1 else _slots(batch.q_offsets, int(batch.q_pos.shape[0]), lq, users)
    q_pos, q_ts = _dense(batch.q_pos, q_slots, users, lq, 0), _dense(batch.q_ts, q_slots, users, lq, 0.0)
    index, weight = _pairs(q_pos, q_ts, k_pos, k_ts, params, dtype)
    weight.diagonal(lk - lq, dim1=-2, dim2=-1).fill_(1.0 / params.normaliser)  # a query's own key
    return PairLayout(q_slots, None, index, weight, k_gather=k_gather)


def pair_layout(
    batch: JaggedBatch, params: AttentionParams, dtype: torch.dtype = torch.float32
) -> PairLayout:
    """The layer-independent part of the CPU backend (kept in ``batch.scratch``); weights in
    ``dtype`` (the scores')."""
    key = ("cpu", params, dtype)
    if key in batch.scratch:
        return batch.scratch[key]
    if batch.k_rows is not None:
        batch.scratch[key] = _gathered_layout(batch, params, dtype)
        return batch.scratch[key]
    users, lq, lk = batch.users, batch.max_q, batch.max_k
    if users == 1 and lq == lk:
        frame = host_frame(batch)
        if frame.ordered:
            batch.scratch[key] = _tiled_layout(batch, params, dtype, frame)
            return batch.scratch[key]
    q_slots = k_slots = None
    if users > 1:
        q_slots = _slots(batch.q_offsets, int(batch.q_pos.shape[0]), lq, users)
        k_slots = _slots(batch.k_offsets, int(batch.k_pos.shape[0]), lk, users)
    index, weight = _pairs(
        _dense(batch.q_pos, q_slots, users, lq, 0),
        _dense(batch.q_ts, q_slots, users, lq, 0.0),
        _dense(batch.k_pos, k_slots, users, lk, PAD_POSITION),
        _dense(batch.k_ts, k_slots, users, lk, 0.0),
        params,
        dtype,
    )
    weight.diagonal(lk - lq, dim1=-2, dim2=-1).fill_(1.0 / params.normaliser)  # a query's own key
    layout = PairLayout(q_slots, k_slots, index, weight)
    batch.scratch[key] = layout
    return layout


def _buffers(
    layout: PairLayout, like: torch.Tensor, **shapes: tuple[int, ...]
) -> dict[str, torch.Tensor | None]:
    """Buffers every layer of the batch writes into, carved from one allocation (fresh memory costs
    a page fault per page on a CPU, as much as the work at these sizes); ``None`` (fresh tensors)
    when autograd records."""
    if torch.is_grad_enabled() and like.requires_grad:
        return dict.fromkeys(shapes)
    sizes = [math.prod(shape) for shape in shapes.values()]
    key = (like.dtype, like.device, tuple(shapes.items()))
    if layout.buffers.get("key") != key:
        layout.buffers.update(key=key, flat=_take(sum(sizes), like))
        _keep(layout, layout.buffers["flat"])
    parts = layout.buffers["flat"][: sum(sizes)].split(sizes)
    return {name: part.view(shape) for (name, shape), part in zip(shapes.items(), parts, strict=True)}


def _tiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias_table: torch.Tensor, layout: PairLayout
) -> torch.Tensor:
    """Attention over causal tiles: the heads and tiles flattened into one batch ``[H * tiles]``,
    each tile row's output added into its block row. ``q``/``k``/``v`` in the sums' dtype."""
    tiles = layout.tiles
    assert tiles is not None
    (heads, dqk, dv), (n, side) = (q.shape[1], q.shape[2], v.shape[2]), layout.index.shape[:2]
    flat = (heads, n * side)
    into = _buffers(
        layout,
        q,
        q=(*flat, dqk),
        k=(*flat, dqk),
        v=(*flat, dv),
        bias=(n * side * side,),
        scores=(heads * n, side, side) if heads > 1 else (0,),
        out=(heads, n, side, dv),
    )
    # [H, tiles * side, d]: token rows copied into their tiles, head-major.
    qt = torch.index_select(q.transpose(0, 1), 1, tiles.rows, out=into["q"]).view(heads * n, side, dqk)
    kt = torch.index_select(k.transpose(0, 1), 1, tiles.cols, out=into["k"]).view(heads * n, side, dqk)
    vt = torch.index_select(v.transpose(0, 1), 1, tiles.cols, out=into["v"]).view(heads, n, side, dv)
    bias = torch.index_select(bias_table, 0, layout.index.view(-1), out=into["bias"]).view(n, side, side)
    if heads == 1:  # the bias is the scores' buffer: no copy of it
        scores = bias.baddbmm_(qt, kt.transpose(1, 2)).unsqueeze(0)
    else:
        scores = torch.matmul(qt, kt.transpose(1, 2), out=into["scores"])
        scores = scores.view(heads, n, side, side).add_(bias)
    scores = F.silu(scores, inplace=True).mul_(layout.weight)
    out = torch.matmul(scores, vt, out=into["out"]).view(heads, n * side, dv)
    # The diagonal tiles cover every padded row once, in order; the tiles below add into theirs.
    rows = tiles.blocks * side
    out = torch.index_add(out[:, :rows], 1, tiles.out_rows, out[:, rows:])
    return out[:, tiles.pad :].transpose(0, 1)  # [T, H, dv]


def cpu_hstu_mha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: JaggedBatch,
    bias_table: torch.Tensor,
    params: AttentionParams,
) -> torch.Tensor:
    """``hstu_mha`` in PyTorch (see ``interface``)."""
    f32 = torch.float64 if q.dtype == torch.float64 else torch.float32  # sums in float32 at least
    check_key_rows(batch, k, v)
    layout = pair_layout(batch, params, f32)
    if layout.tiles is not None:
        return _tiled_attention(q.to(f32), k.to(f32), v.to(f32), bias_table.to(f32), layout).to(q.dtype)
    users, lq, lk = batch.users, batch.max_q, int(layout.index.shape[-1])
    heads = q.shape[1]
    qd = _dense(q.to(f32), layout.q_slots, users, lq, 0.0).transpose(1, 2)  # [B, H, lq, d]
    if layout.k_gather is not None:  # the keys' rows, read straight into the dense layout
        kd = k.index_select(0, layout.k_gather).to(f32).view(users, lk, *k.shape[1:]).permute(0, 2, 3, 1)
        vd = v.index_select(0, layout.k_gather).to(f32).view(users, lk, *v.shape[1:]).transpose(1, 2)
    else:
        kd = _dense(k.to(f32), layout.k_slots, users, lk, 0.0).permute(0, 2, 3, 1)  # [B, H, d, lk]
        vd = _dense(v.to(f32), layout.k_slots, users, lk, 0.0).transpose(1, 2)  # [B, H, lk, dv]
    # index_select, not advanced indexing: several times faster on a CPU for int32 indices.
    bias = torch.index_select(bias_table.to(f32), 0, layout.index.view(-1)).view(layout.index.shape)
    if users == 1 or heads == 1:  # the bias broadcasts over the flattened (user, head) batch
        flat = users * heads
        scores = torch.baddbmm(bias, qd.reshape(flat, lq, -1), kd.reshape(flat, -1, lk))
        scores = F.silu(scores, inplace=True).mul_(layout.weight).view(users, heads, lq, lk)
    else:
        scores = torch.matmul(qd, kd).add_(bias.unsqueeze(1))
        scores = F.silu(scores, inplace=True).mul_(layout.weight.unsqueeze(1))
    out = torch.matmul(scores, vd).transpose(1, 2)  # [B, lq, H, dv]
    if layout.q_slots is None:
        return out.reshape(lq, *out.shape[2:]).to(q.dtype)
    return out.reshape(users * lq, *out.shape[2:])[layout.q_slots].to(q.dtype)
