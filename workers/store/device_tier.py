"""The prefix store's device tier: its entries are prefixes in the pages of a ``kv_pages.KVPages``,
which the tier owns, and which the model runner reads and writes in place.

Primitives:
- ``DeviceTier(budget_bytes, device, page_tokens)``: an LRU-ordered, byte-budgeted map of the
  device's entries (a ``tiers.MemoryTier``: an entry's bytes are its pages') and the pages they lie
  in, made on first need: by ``pages_for(layout, reserve_tokens)`` (the engine, for its runner) or
  from the first prefix placed. They hold ``budget_bytes`` of pages for the entries and
  ``reserve_tokens`` more for what the runner holds beside them (the buckets' rows, a forward's
  prefixes in flight); ``reclaim`` is what the pages ask when too few are free (the placement's:
  it demotes prefixes nobody holds).
  - ``nbytes(prefix)``: the bytes ``prefix`` takes there: its pages', or those its tokens would take.
  - ``admit(prefix) -> PrefixKV``: ``prefix`` in these pages: itself when it lies there already,
    else its tokens written into fresh pages (a dense or cold prefix from a colder tier, decoded
    layer by layer: on CUDA from pinned memory on a side stream, the device's stream waiting for
    the last layer; ``PagesExhausted`` when the pages cannot take it).
- ``layout_of(prefix, page_tokens)``: the ``KVLayout`` of a prefix's tokens.

Demotion is the prefix's ``dense()`` (its pages gathered on the device, the pages given back when no
one else holds them); the copy to host memory that follows is the store's (``staging.to_host``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from relaygr.workers.kv_pages import KVLayout, KVPages, PagedKV
from relaygr.workers.prefix_kv import PrefixKV
from relaygr.workers.store.kv_formats import warm_layer
from relaygr.workers.store.tiers import MemoryTier, StoreKey


def layout_of(prefix: PrefixKV, page_tokens: int) -> KVLayout:
    """The pages' layout of ``prefix``'s tokens (its exact dtype, whatever its format)."""
    if prefix.pages is not None:
        lay = prefix.pages.pool.layout
        return KVLayout(lay.layers, lay.heads, lay.attn_dim, lay.linear_dim, lay.dtype, page_tokens)
    if not prefix.keys:
        raise ValueError("a prefix without layers has no pages")
    heads, _, attn_dim = prefix.keys[0].shape
    dtype = prefix.exact_dtype or prefix.dtype
    return KVLayout(len(prefix.keys), heads, attn_dim, prefix.values[0].shape[2], dtype, page_tokens)


class DeviceTier(MemoryTier[StoreKey, Any]):
    """The device tier's entries and pages (see the module docstring)."""

    def __init__(self, budget_bytes: int, device: torch.device, page_tokens: int) -> None:
        super().__init__("device", budget_bytes)
        self.device, self.page_tokens = device, page_tokens
        self.pages: KVPages | None = None
        self.reclaim: Callable[[int], None] | None = None
        self._made = threading.Lock()
        self._stream: Any = None  # the side stream of admissions on CUDA

    def pages_for(self, layout: KVLayout, reserve_tokens: int = 0) -> KVPages:
        """The pages, made at the first call for ``layout`` (its page size the tier's): the budget's
        pages for the entries, and ``reserve_tokens`` more; later calls check the layout."""
        layout = KVLayout(
            layout.layers, layout.heads, layout.attn_dim, layout.linear_dim, layout.dtype, self.page_tokens
        )
        with self._made:
            if self.pages is None:
                num = self.budget_bytes // layout.page_bytes + layout.pages_for(reserve_tokens) + 1
                self.pages = KVPages(layout, num, self.device, reclaim=self.reclaim)
            elif self.pages.layout != layout:
                raise ValueError(f"the device tier's pages are {self.pages.layout}, not {layout}")
            return self.pages

    def nbytes(self, prefix: PrefixKV) -> int:
        """What ``prefix`` takes in the tier: its pages' bytes (whole pages of its tokens)."""
        if prefix.pages is not None and prefix.pages.pool is self.pages:
            return prefix.pages.nbytes()
        if not prefix.length:
            return 0
        return layout_of(prefix, self.page_tokens).bytes_for(prefix.length)

    def admit(self, prefix: PrefixKV, *, reclaim: bool = True) -> PrefixKV:
        """``prefix`` in these pages (see the module docstring); ``reclaim`` False: in free pages
        only (``PagesExhausted`` rather than a demotion)."""
        pages = self.pages_for(layout_of(prefix, self.page_tokens)) if prefix.length else self.pages
        if pages is None or (prefix.pages is not None and prefix.pages.pool is pages):
            return prefix
        source = prefix.dense()  # in other pages (another runner's): gathered first
        run = pages.allocate(source.length, reclaim=reclaim)
        self._write(pages, run, source)
        return PrefixKV.paged(run, source.fingerprint, source.model_version, source.meta)

    def _write(self, pages: KVPages, run: PagedKV, prefix: PrefixKV) -> None:
        """Every layer of ``prefix`` (any format, any device) into ``run``: on CUDA on a side
        stream, a layer at a time (one layer's decoded tensors in flight), from pinned memory
        without a wait per copy; the device's stream waits for the last layer, and the call returns
        once it is written (a staging buffer it was read from is free again)."""
        device = pages.device
        if device.type != "cuda":
            self._write_layers(pages, run, prefix, non_blocking=False)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        default = torch.cuda.current_stream(device)
        self._stream.wait_stream(default)  # no write may overtake work queued before it
        with torch.cuda.stream(self._stream):
            rows = self._write_layers(pages, run, prefix, non_blocking=True)
            rows.record_stream(default)  # made here, read by rankings on the device's stream
            done = torch.cuda.Event()
            done.record(self._stream)
        default.wait_event(done)
        done.synchronize()

    @staticmethod
    def _write_layers(pages: KVPages, run: PagedKV, prefix: PrefixKV, non_blocking: bool) -> torch.Tensor:
        rows = run.row_index()
        for li in range(prefix.num_layers):
            keys, values = warm_layer(prefix, li, pages.device, non_blocking=non_blocking)
            pages.keys[li].index_copy_(0, rows, keys.transpose(0, 1))
            pages.values[li].index_copy_(0, rows, values.transpose(0, 1))
        pages.timestamps.index_copy_(
            0, rows, prefix.timestamps.to(pages.device, torch.float64, non_blocking=non_blocking)
        )
        pages.rows_written += prefix.length
        return rows
