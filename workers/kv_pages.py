"""The device tier's memory: every layer's keys and values in fixed-address pages, shared by the
prefix store (which owns them and decides what stays) and the model runner (which reads a cached
prefix in place, through its rows, and writes only the tokens it computes).

Primitives:
- ``KVLayout(layers, heads, attn_dim, linear_dim, dtype, page_tokens)``: what one token takes
  (``token_bytes``: its keys and values in every layer and its timestamp) and one page
  (``page_bytes``); ``pages_for(tokens)``, ``bytes_for(tokens)``.
- ``KVPages(layout, num_pages, device, reclaim=None)``: per layer one key and one value tensor
  ``[num_pages * page_tokens, H, d]`` (views of one ``[layers, ...]`` tensor each, ``stores()``)
  and one timestamp per row, allocated once (on a CPU as zeros the kernel maps in as they are
  first written). Page 0 holds zeros and is never handed out: a padded slot may read it.
  - ``allocate(tokens) -> PagedKV``: fresh pages for ``tokens`` tokens. When too few are free,
    ``reclaim(pages)`` (the store's: it demotes prefixes nobody holds) is asked first; then
    ``PagesExhausted``.
  - ``extend(run, tokens) -> PagedKV``: ``run``'s pages, shared, and room for ``tokens`` more
    after them. Its last page, if partly filled, is shared too when no other run wrote past
    ``run`` in it (the usual case: a history grows one way); else its filled rows are copied to a
    fresh page first (``counters()['rows_copied']``), so that two runs never write one row.
  - ``write(run, start, keys, values, timestamps)``: tokens ``start ..`` of ``run`` (keys and
    values of every layer stacked, ``[layers, m, H, d]``), one copy per tensor.
  - ``gather(run)``: its keys and values ``[layers, n, H, d]`` and timestamps ``[n]`` (a copy).
  - ``free_pages``, ``used_pages``, ``capacity_tokens``, ``counters()``.
- ``PagedKV``: one run of tokens in pages: its ``pages`` in token order and its ``length``. It
  holds a reference on each page until ``release()`` or until it is collected; a page is free
  again when no run refers to it. ``rows(capacity)`` (each token's row, then the zero page's),
  ``row_index(pad=)`` (the same on the device, built once), ``nbytes()`` (its pages' bytes).
- ``PagesExhausted``.

A data structure only: which prefixes stay, which are demoted to make room and which are pinned
is the prefix store's policy; which rows a forward reads and writes, the model runner's. It
imports only torch and numpy.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

ZERO_PAGE = 0
"""The page of zeros a padded key slot may read; never handed out."""
DEFAULT_PAGE_TOKENS = 32
"""Tokens per page: a user wastes half a page on average (16 tokens of thousands)."""


class PagesExhausted(RuntimeError):
    """Too few free pages, and the reclaim (if any) freed no more."""


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVLayout:
    """What one token takes in the pages: keys ``[heads, attn_dim]`` and values ``[heads,
    linear_dim]`` in every layer, in ``dtype``, and a float64 timestamp."""

    layers: int
    heads: int
    attn_dim: int
    linear_dim: int
    dtype: torch.dtype
    page_tokens: int = DEFAULT_PAGE_TOKENS

    def __post_init__(self) -> None:
        if min(self.layers, self.heads, self.attn_dim, self.linear_dim, self.page_tokens) < 1:
            raise ValueError(f"a KV layout needs at least one of each, got {self}")

    @property
    def token_bytes(self) -> int:
        return self.layers * self.heads * (self.attn_dim + self.linear_dim) * _elem(self.dtype) + 8

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.token_bytes

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def bytes_for(self, tokens: int) -> int:
        """Device bytes a prefix of ``tokens`` tokens takes: its pages'."""
        return self.pages_for(tokens) * self.page_bytes

    def same_shape(self, other: KVLayout) -> bool:
        """The same tokens (page size aside)."""
        return (self.layers, self.heads, self.attn_dim, self.linear_dim, self.dtype) == (
            other.layers, other.heads, other.attn_dim, other.linear_dim, other.dtype
        )  # fmt: skip


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on a CPU from ``calloc`` (numpy), whose pages the kernel maps in when first written,
    so that a large pool costs memory only as it fills."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = np.zeros(int(np.prod(shape)) * _elem(dtype), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


class KVPages:
    """Fixed-address pages of keys, values and timestamps (see the module docstring)."""

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: torch.device | str,
        *,
        reclaim: Callable[[int], None] | None = None,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"pages need at least the zero page, got num_pages={num_pages}")
        self.layout, self.num_pages, self.device = layout, num_pages, torch.device(device)
        self.page_tokens = layout.page_tokens
        rows = num_pages * layout.page_tokens
        h, dt, dev = layout.heads, layout.dtype, self.device
        # Plain tensors even when made inside ``torch.inference_mode`` (a forward that makes them
        # on first use): a captured or warm-up forward outside it writes to them too.
        with torch.inference_mode(False):
            self._key_store = _zeros((layout.layers, rows, h, layout.attn_dim), dt, dev)
            self._value_store = _zeros((layout.layers, rows, h, layout.linear_dim), dt, dev)
            self.keys, self.values = list(self._key_store.unbind(0)), list(self._value_store.unbind(0))
            self.timestamps = _zeros((rows,), torch.float64, dev)
        self.reclaim = reclaim
        # Reentrant: a run collected (its finalizer gives its pages back) may be collected while
        # this thread holds the lock, by a garbage collection that an allocation set off.
        self._lock = threading.RLock()
        self._free = list(range(num_pages - 1, ZERO_PAGE, -1))  # pop() hands out low ids first
        self._refs = np.zeros(num_pages, np.int32)
        self._filled = np.zeros(num_pages, np.int32)  # rows of a page some run has claimed
        self.allocations = self.rows_copied = self.rows_written = self.exhausted = 0

    # ------------------------------------------------------------------ sizes
    def stores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every layer, ``[layers, rows, H, d]`` (``keys[li]`` is a view)."""
        return self._key_store, self._value_store

    @property
    def capacity_tokens(self) -> int:
        """Tokens every page but the zero page holds."""
        return (self.num_pages - 1) * self.page_tokens

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def nbytes(self) -> int:
        """Device bytes of the pages, the zero page's included."""
        return self.num_pages * self.layout.page_bytes

    def counters(self) -> dict[str, int]:
        return {
            "pages": self.num_pages - 1,
            "pages_used": self.used_pages,
            "pages_free": self.free_pages,
            "page_tokens": self.page_tokens,
            "allocations": self.allocations,
            "rows_written": self.rows_written,
            "rows_copied": self.rows_copied,
            "exhausted": self.exhausted,
        }

    # ------------------------------------------------------------------ runs
    def allocate(self, tokens: int, *, reclaim: bool = True) -> PagedKV:
        """A run of fresh pages for ``tokens`` tokens (see the module docstring)."""
        return self.extend(None, tokens, reclaim=reclaim)

    def extend(self, run: PagedKV | None, tokens: int, *, reclaim: bool = True) -> PagedKV:
        """``run``'s pages, shared, and room for ``tokens`` more tokens after its own (see the
        module docstring); ``run`` None: a fresh run. ``reclaim`` False: free pages only."""
        if tokens < 0:
            raise ValueError(f"cannot extend by {tokens} tokens")
        if run is not None and run.pool is not self:
            raise ValueError("the run lies in other pages")
        pt = self.page_tokens
        length = 0 if run is None else run.length
        pages = [] if run is None else list(run.pages)
        tail = length % pt
        for attempt in range(2):
            with self._lock:
                share = bool(pages) and tail > 0 and self._filled[pages[-1]] == tail
                copy = bool(pages) and tail > 0 and not share and tokens > 0
                room = pt - tail if tail and (share or copy) else 0
                need = -(-max(0, tokens - room) // pt) + int(copy)
                if need <= len(self._free):
                    fresh = [self._free.pop() for _ in range(need)]
                    new_pages = self._claim(pages, fresh, tail, tokens, share, copy)
                    break
            if attempt == 0 and reclaim and self.reclaim is not None:
                self.reclaim(need - len(self._free))
        else:
            self.exhausted += 1
            raise PagesExhausted(
                f"{need} free pages wanted, {len(self._free)} free of {self.num_pages - 1} "
                f"({self.page_tokens} tokens each)"
            )
        if copy:  # the copied page's filled rows, every layer
            src, dst = pages[-1] * pt, new_pages[len(pages) - 1] * pt
            for store in (self._key_store, self._value_store):
                store[:, dst : dst + tail].copy_(store[:, src : src + tail])
            self.timestamps[dst : dst + tail].copy_(self.timestamps[src : src + tail])
            self.rows_copied += tail
        return PagedKV(self, tuple(new_pages), length + tokens)

    def _claim(
        self, pages: list[int], fresh: list[int], tail: int, tokens: int, share: bool, copy: bool
    ) -> list[int]:
        """Under the lock: the new run's pages (references taken) and their claimed rows."""
        pt = self.page_tokens
        out = list(pages)
        if copy:
            out[-1] = fresh.pop(0)
            self._filled[out[-1]] = tail
        left = tokens
        if (share or copy) and tail:
            used = min(pt - tail, left)
            self._filled[out[-1]] += used
            left -= used
        for page in fresh:
            self._filled[page] = min(pt, left)
            left -= min(pt, left)
            out.append(page)
        for page in out:
            self._refs[page] += 1
        if fresh or copy:
            self.allocations += 1
        return out

    def _release(self, pages: tuple[int, ...]) -> None:
        with self._lock:
            for page in pages:
                self._refs[page] -= 1
                if self._refs[page] == 0:
                    self._filled[page] = 0
                    self._free.append(page)

    # ------------------------------------------------------------------ tokens
    def write(
        self,
        run: PagedKV,
        start: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        timestamps: torch.Tensor,
    ) -> None:
        """Tokens ``start .. start + m`` of ``run``: ``keys [layers, m, H, dqk]``, ``values
        [layers, m, H, dv]``, ``timestamps [m]``, one copy each."""
        m = int(timestamps.shape[0])
        if start < 0 or start + m > run.length or keys.shape[1] != m or values.shape[1] != m:
            raise ValueError(f"tokens {start}..{start + m} of a run of {run.length}")
        if m == 0:
            return
        rows = run.row_index(start, start + m)
        self._key_store.index_copy_(1, rows, keys.to(self.layout.dtype))
        self._value_store.index_copy_(1, rows, values.to(self.layout.dtype))
        self.timestamps.index_copy_(0, rows, timestamps.to(self.device, torch.float64))
        self.rows_written += m

    def gather(self, run: PagedKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``run``'s keys ``[layers, n, H, dqk]``, values ``[layers, n, H, dv]`` and timestamps."""
        rows = run.row_index()
        return (
            self._key_store.index_select(1, rows),
            self._value_store.index_select(1, rows),
            self.timestamps.index_select(0, rows),
        )


class PagedKV:
    """One run of tokens in the pages of a ``KVPages`` (see the module docstring)."""

    def __init__(self, pool: KVPages, pages: tuple[int, ...], length: int) -> None:
        self.pool, self.pages, self.length = pool, pages, length
        self._rows: np.ndarray | None = None
        self._index: dict[tuple[int, int, int], torch.Tensor] = {}
        self._finalizer = weakref.finalize(self, pool._release, pages)
        self._finalizer.atexit = False

    def release(self) -> None:
        """Gives the pages back now (they stay valid for other runs that refer to them)."""
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def nbytes(self) -> int:
        """Device bytes of its pages (a page shared with another run counts in both)."""
        return len(self.pages) * self.pool.layout.page_bytes

    def rows(self, capacity: int | None = None) -> np.ndarray:
        """The row (int64) of each token, then, up to ``capacity``, rows of the zero page."""
        if self._rows is None:
            pt = self.pool.page_tokens
            own = (np.asarray(self.pages, np.int64)[:, None] * pt + np.arange(pt)).reshape(-1)
            self._rows = own[: self.length]
        if capacity is None:
            return self._rows
        if capacity < self.length:
            raise ValueError(f"a run of {self.length} tokens does not fit {capacity} slots")
        pad = np.arange(capacity - self.length, dtype=np.int64) % self.pool.page_tokens + ZERO_PAGE
        return np.concatenate([self._rows, pad])

    def row_index(self, start: int = 0, stop: int | None = None, *, pad: int = 0) -> torch.Tensor:
        """``rows()[start:stop]`` on the pages' device, then ``pad`` rows of the zero page (room
        for rows that follow; built once per range)."""
        stop = self.length if stop is None else stop
        got = self._index.get((start, stop, pad))
        if got is None:
            rows = self.rows()[start:stop]
            if pad:
                rows = np.concatenate([rows, np.full(pad, ZERO_PAGE * self.pool.page_tokens, np.int64)])
            got = torch.from_numpy(np.ascontiguousarray(rows))
            if self.pool.device.type != "cpu":
                got = got.to(self.pool.device, non_blocking=True)
            self._index[(start, stop, pad)] = got
        return got

    def __repr__(self) -> str:
        return f"PagedKV(length={self.length}, pages={len(self.pages)})"
