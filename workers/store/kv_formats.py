"""Formats of the prefix store's cold tiers (host memory and disk): ``exact``, ``bf16`` or ``int8``.

The device tier always holds a prefix exactly as the model computed it (in pages: ``PrefixKV.paged``).
A colder tier may keep its keys and values in fewer bytes; a promotion decodes them back to the
model's dtype on the device. A paged prefix is gathered from its pages first (``PrefixKV.dense``).

Primitives:
- ``ColdFormat`` (named in ``store_config``, without torch): ``exact`` (the model's dtype, bit for
  bit), ``bf16`` (bfloat16 keys and values) or ``int8`` (symmetric int8 with one float16 scale per block; a block is one head's key or
  value vector of one token, so an outlier token costs precision only to itself).
- ``to_cold(prefix, fmt) -> PrefixKV``: the cold form, on the prefix's device (an exact or
  already-cold prefix in that format is returned as it is). Positions are stored as int32 when
  they fit (they always do below 2^31 events; lossless).
- ``to_warm(prefix, device) -> PrefixKV``: the exact-dtype prefix on ``device`` (compressed
  tensors are moved first, then decoded there: fewer bytes cross the bus). int8 blocks that lie
  back to back (as ``to_cold`` and the disk codec lay them out) move in one copy and decode in one
  multiplication for all layers.
- ``warm_layer(prefix, li, device)``: layer ``li``'s exact keys and values on ``device`` (moved,
  then decoded there): what a promotion writes into the device tier's pages, a layer at a time.
- ``same_device(a, b)``: one device (``cuda`` and ``cuda:0`` alike).
- ``cold_nbytes(prefix, fmt)``: the bytes of ``to_cold(prefix, fmt)`` without building it.
- ``token_bytes(layers, heads, attn_dim, linear_dim, dtype, fmt)``: bytes one cached token takes in
  a format (what ``relaygr plan`` multiplies by history lengths).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from relaygr.workers.prefix_kv import PrefixKV
from relaygr.workers.store.store_config import COLD_FORMATS, ColdFormat

_INT8_MAX = 127
_SCALE_DTYPE = torch.float16
_MIN_SCALE = 2.0**-24  # the smallest float16 subnormal: an all-zero block stays exactly zero
_SMALL_POSITIONS = torch.int32


def same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def check_format(fmt: str) -> ColdFormat:
    if fmt not in COLD_FORMATS:
        raise ValueError(f"cold KV format must be one of {', '.join(COLD_FORMATS)}, got {fmt!r}")
    return fmt  # type: ignore[return-value]


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _kv_elem_bytes(fmt: str, exact: torch.dtype) -> int:
    if fmt == "exact":
        return _elem(exact)
    return 2 if fmt == "bf16" else 1


def token_bytes(layers: int, heads: int, attn_dim: int, linear_dim: int, dtype: torch.dtype, fmt: str) -> int:
    """Bytes one cached token takes in ``fmt``: keys and values of every layer (plus the int8
    scales), its position and its timestamp (float64)."""
    check_format(fmt)
    per_layer = heads * (attn_dim + linear_dim) * _kv_elem_bytes(fmt, dtype)
    if fmt == "int8":
        per_layer += 2 * heads * _elem(_SCALE_DTYPE)
    position = 8 if fmt == "exact" else _elem(_SMALL_POSITIONS)
    return layers * per_layer + position + 8


def cold_nbytes(prefix: PrefixKV, fmt: str) -> int:
    """``to_cold(prefix, fmt).nbytes()``, computed from the shapes alone."""
    check_format(fmt)
    if prefix.pages is not None:  # its dense form's, per token
        lay = prefix.pages.pool.layout
        return prefix.length * token_bytes(
            lay.layers, lay.heads, lay.attn_dim, lay.linear_dim, lay.dtype, fmt
        )
    if fmt == "exact" or prefix.kv_format == fmt:
        return prefix.nbytes()
    if prefix.kv_format != "exact":  # re-encoding a cold prefix goes through its exact form
        fmt_elem = _kv_elem_bytes(fmt, prefix.exact_dtype or torch.float32)
    else:
        fmt_elem = _kv_elem_bytes(fmt, prefix.dtype)
    total = 0
    for t in (*prefix.keys, *prefix.values):
        total += t.numel() * fmt_elem
        if fmt == "int8":
            total += (t.numel() // max(1, t.shape[-1])) * _elem(_SCALE_DTYPE)
    total += prefix.positions.numel() * _elem(_positions_dtype(prefix.positions))
    return total + prefix.timestamps.numel() * prefix.timestamps.element_size()


def _positions_dtype(positions: torch.Tensor) -> torch.dtype:
    if positions.numel() == 0:
        return _SMALL_POSITIONS
    top = int(positions.abs().max())
    return _SMALL_POSITIONS if top < 2**31 else positions.dtype


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float16 scales (one per last-axis vector). The scale is rounded to float16
    before quantizing, so that decoding multiplies by exactly the scale the values were made with."""
    x = t.float()
    absmax = x.abs().amax(dim=-1, keepdim=True)
    scale = (absmax / _INT8_MAX).clamp(min=_MIN_SCALE).to(_SCALE_DTYPE)
    q = torch.round(x / scale.float()).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale


def _quantize_layers(
    keys: list[torch.Tensor], values: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """int8 keys, values and their scales; when every block has one shape, all of them in one
    pass and back to back in memory (``to_warm`` and the codec then treat them as one tensor)."""
    blocks = (*keys, *values)
    n = len(keys)
    if blocks and all(t.shape == blocks[0].shape for t in blocks):
        q, s = _quantize(torch.stack(blocks))
        qs, ss = list(q.unbind(0)), list(s.unbind(0))
    else:
        pairs = [_quantize(t) for t in blocks]
        qs, ss = [q for q, _ in pairs], [s for _, s in pairs]
    return qs[:n], qs[n:], ss


def _back_to_back(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` as one tensor ``[len, *shape]`` when they are contiguous views of one base
    tensor, of one shape and dtype, lying one after another; else None."""
    first = tensors[0] if tensors else None
    base = first._base if first is not None else None
    if first is None or base is None:
        return None
    shape, dtype = first.shape, first.dtype
    step = first.numel() * first.element_size()
    at = first.data_ptr()
    for t in tensors:
        if t._base is not base or t.data_ptr() != at or t.shape != shape or t.dtype != dtype:
            return None
        if not t.is_contiguous():
            return None
        at += step
    return first.as_strided((len(tensors), *shape), (first.numel(), *first.stride()))


def to_cold(prefix: PrefixKV, fmt: str) -> PrefixKV:
    """The cold form of ``prefix`` in ``fmt``, on the prefix's device (a paged one's gathered)."""
    check_format(fmt)
    prefix = prefix.dense()
    if fmt == "exact" or prefix.kv_format == fmt:
        return prefix
    if prefix.kv_format != "exact":
        prefix = to_warm(prefix, prefix.device)
    if fmt == "bf16":
        keys = [k.to(torch.bfloat16) for k in prefix.keys]
        values = [v.to(torch.bfloat16) for v in prefix.values]
        scales: list[torch.Tensor] = []
    else:
        keys, values, scales = _quantize_layers(prefix.keys, prefix.values)
    return replace(
        prefix,
        keys=keys,
        values=values,
        positions=prefix.positions.to(_positions_dtype(prefix.positions)),
        kv_format=fmt,
        scales=scales,
        exact_dtype=prefix.dtype,
        meta=dict(prefix.meta),
    )


def to_warm(prefix: PrefixKV, device: torch.device | str, *, non_blocking: bool = False) -> PrefixKV:
    """``prefix`` in its exact dtype on ``device`` (decoded there when it is a cold form).
    ``non_blocking``: the copies from pinned host memory are queued on the current stream without
    waiting for each (work queued after them on that stream sees their result)."""
    device = torch.device(device)
    if prefix.pages is not None:  # exact already: in its pages, or gathered to go elsewhere
        return prefix if same_device(prefix.device, device) else prefix.to(device, non_blocking=non_blocking)
    dtype = prefix.exact_dtype or torch.float32
    n = len(prefix.keys)
    if prefix.kv_format == "int8":
        if len(prefix.scales) != 2 * n:
            raise ValueError(f"int8 prefix with {len(prefix.scales)} scales for {n} layers")
        blocks, scales = _back_to_back([*prefix.keys, *prefix.values]), _back_to_back(prefix.scales)
        if blocks is not None and scales is not None:
            # Every layer in one copy and one multiplication (float16 scales are exact in float32).
            if not same_device(blocks.device, device):
                blocks = blocks.to(device, non_blocking=non_blocking)
                scales = scales.to(device, non_blocking=non_blocking)
            warm = blocks.to(torch.float32).mul_(scales)
            return _exact_form(
                prefix, list((warm if dtype == torch.float32 else warm.to(dtype)).unbind(0)), device
            )
    moved = prefix if same_device(prefix.device, device) else prefix.to(device, non_blocking=non_blocking)
    if moved.kv_format == "exact":
        return moved
    if moved.kv_format == "int8":
        tensors = [
            q.to(torch.float32).mul_(s).to(dtype)
            for q, s in zip((*moved.keys, *moved.values), moved.scales, strict=True)
        ]
    else:
        tensors = [t.to(dtype) for t in (*moved.keys, *moved.values)]
    return _exact_form(moved, tensors, device)


def warm_layer(
    prefix: PrefixKV, li: int, device: torch.device | str, *, non_blocking: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``li``'s keys and values of ``prefix`` (dense, any format) in its exact dtype on
    ``device``: the compressed tensors moved, then decoded there, as ``to_warm`` decodes them."""
    device = torch.device(device)
    n, dtype = len(prefix.keys), prefix.exact_dtype or prefix.dtype
    pair = []
    for i, t in ((li, prefix.keys[li]), (n + li, prefix.values[li])):
        moved = t if same_device(t.device, device) else t.to(device, non_blocking=non_blocking)
        if prefix.kv_format == "int8":
            scale = prefix.scales[i]
            scale = (
                scale if same_device(scale.device, device) else scale.to(device, non_blocking=non_blocking)
            )
            moved = moved.to(torch.float32).mul_(scale).to(dtype)
        elif prefix.kv_format != "exact":
            moved = moved.to(dtype)
        pair.append(moved)
    return pair[0], pair[1]


def _exact_form(prefix: PrefixKV, tensors: list[torch.Tensor], device: torch.device) -> PrefixKV:
    """``prefix`` with ``tensors`` (its layers' keys, then values, decoded) as an exact prefix."""
    n = len(prefix.keys)
    return replace(
        prefix,
        keys=tensors[:n],
        values=tensors[n:],
        positions=prefix.positions.to(device, torch.int64),
        timestamps=prefix.timestamps
        if same_device(prefix.timestamps.device, device)
        else prefix.timestamps.to(device),
        kv_format="exact",
        scales=[],
        exact_dtype=None,
        meta=dict(prefix.meta),
    )
