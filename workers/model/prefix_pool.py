"""A paged pool of cached prefixes on the device, at fixed addresses: what a captured relay
ranking reads its users' keys and values from.

Primitives:
- ``PagedPrefixPool(layers, heads, d_qk, d_v, block_tokens, num_blocks, dtype, device)``: per
  layer one key and one value tensor ``[num_blocks * block_tokens, H, d]`` (views of one
  ``[layers, ...]`` tensor each, ``layer_stores()``) and one timestamp row per token, allocated
  once. Block 0 holds zeros and is never handed out: a padded key reads it,
  and a zero key and value add exactly nothing to HSTU attention (no softmax).
- ``PageTable``: where one admitted prefix lies: its length and its blocks, in order;
  ``rows(capacity)`` the pool row of each of ``capacity`` key slots (past the length: the zero
  block).
- ``admit(key, prefix)``: the prefix's page table, copying its keys, values and timestamps into
  free blocks the first time (least recently used entries that are not pinned make room; a prefix
  larger than the whole pool is a ``ValueError``, a pool whose entries are all pinned a
  ``PoolFull``); ``reserve(key, tokens)``: blocks that their holder writes itself (a bucket's new
  tokens, so that one gather reads a user's prefix and new keys together), never evicted;
  ``lookup(key)``, ``release(key)``, ``pinned(keys)``, ``counters()``.

The pool is a data structure only: which prefixes to admit, and when, is its caller's policy
(``graph_relay.GraphRelay``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from relaygr.workers.prefix_kv import PrefixKV

ZERO_BLOCK = 0
"""The block of zeros every padded key slot reads."""


class PoolFull(RuntimeError):
    """Every block is held by a pinned entry: nothing can be evicted for a new prefix."""


@dataclass(frozen=True)
class PageTable:
    """One admitted prefix: ``length`` tokens in ``blocks`` (pool block ids, in token order)."""

    length: int
    blocks: tuple[int, ...]
    block_tokens: int

    def rows(self, capacity: int) -> np.ndarray:
        """Pool row (int64) of each of ``capacity`` key slots: the prefix's tokens, then rows of
        the zero block."""
        if capacity < self.length:
            raise ValueError(f"a prefix of {self.length} tokens does not fit {capacity} key slots")
        out = np.arange(capacity, dtype=np.int64) % self.block_tokens + ZERO_BLOCK * self.block_tokens
        if self.length:
            blocks = np.asarray(self.blocks, dtype=np.int64)
            own = (blocks[:, None] * self.block_tokens + np.arange(self.block_tokens)).reshape(-1)
            out[: self.length] = own[: self.length]
        return out


class PagedPrefixPool:
    """Cached prefixes in fixed device tensors, block by block (see the module docstring)."""

    def __init__(
        self,
        layers: int,
        heads: int,
        d_qk: int,
        d_v: int,
        block_tokens: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if min(layers, heads, d_qk, d_v, block_tokens) < 1 or num_blocks < 2:
            raise ValueError(
                "a pool needs at least one layer, head, dim and token per block, and two blocks "
                f"(one is the zero block); got layers={layers} heads={heads} d_qk={d_qk} d_v={d_v} "
                f"block_tokens={block_tokens} num_blocks={num_blocks}"
            )
        rows = num_blocks * block_tokens
        self.block_tokens, self.num_blocks, self.dtype = block_tokens, num_blocks, dtype
        self.device = torch.device(device)
        # Every layer in one tensor (one gather reads a row of each); ``keys[li]`` are views of it.
        self._key_store = torch.zeros(layers, rows, heads, d_qk, dtype=dtype, device=self.device)
        self._value_store = torch.zeros(layers, rows, heads, d_v, dtype=dtype, device=self.device)
        self.keys, self.values = list(self._key_store.unbind(0)), list(self._value_store.unbind(0))
        self.timestamps = torch.zeros(rows, dtype=torch.float64, device=self.device)
        self._free = list(range(num_blocks - 1, ZERO_BLOCK, -1))  # pop() hands out low ids first
        self._entries: OrderedDict[Hashable, PageTable] = OrderedDict()  # least recently used first
        self._pins: dict[Hashable, int] = {}
        self._reserved: dict[Hashable, PageTable] = {}  # ``reserve``: never evicted
        self.hits = self.admitted = self.evicted = 0

    def layer_stores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every layer, ``[layers, rows, H, d]`` (``keys[li]`` is a view)."""
        return self._key_store, self._value_store

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one prefix may have (every block but the zero block)."""
        return (self.num_blocks - 1) * self.block_tokens

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: Hashable) -> PageTable | None:
        """``key``'s page table (now the most recently used), or ``None``."""
        table = self._entries.get(key)
        if table is not None:
            self._entries.move_to_end(key)
        return table

    def admit(self, key: Hashable, prefix: PrefixKV) -> PageTable:
        """``key``'s page table, copying ``prefix`` in when it is not there yet."""
        table = self.lookup(key)
        if table is not None:
            self.hits += 1
            return table
        self._check(prefix)
        if key in self._reserved:
            raise ValueError(f"{key!r} is a reservation")
        table = PageTable(prefix.length, self._allocate(prefix.length), self.block_tokens)
        if prefix.length:
            rows = torch.from_numpy(table.rows(prefix.length)).to(self.device)
            # Every layer in one copy each: prefix keys are [H, n, d] per layer, pool rows [n, H, d].
            for store, layers in ((self._key_store, prefix.keys), (self._value_store, prefix.values)):
                store.index_copy_(1, rows, torch.stack(layers).to(self.device).transpose(1, 2))
            self.timestamps.index_copy_(0, rows, prefix.timestamps.to(self.device, torch.float64))
        self._entries[key] = table
        self.admitted += 1
        return table

    def reserve(self, key: Hashable, tokens: int) -> PageTable:
        """Blocks for ``tokens`` rows that their holder writes itself (a forward's new tokens), never
        evicted, until ``release(key)``; ``key``'s reservation if it has one."""
        if key in self._reserved:
            return self._reserved[key]
        if key in self._entries:
            raise ValueError(f"{key!r} already holds a prefix")
        table = PageTable(tokens, self._allocate(tokens), self.block_tokens)
        self._reserved[key] = table
        return table

    def release(self, key: Hashable) -> bool:
        """Frees ``key``'s blocks, a prefix's (unless pinned: ``ValueError``) or a reservation's;
        whether it was there."""
        if self._pins.get(key):
            raise ValueError(f"prefix {key!r} is pinned: it cannot be released")
        table = self._entries.pop(key, None) or self._reserved.pop(key, None)
        if table is None:
            return False
        self._free.extend(reversed(table.blocks))
        return True

    def _allocate(self, tokens: int) -> tuple[int, ...]:
        """Free blocks for ``tokens`` rows, evicting as needed (see ``admit``)."""
        need = -(-tokens // self.block_tokens)
        if need > self.num_blocks - 1:
            raise ValueError(f"{tokens} tokens can never fit a pool of {self.capacity_tokens} tokens")
        while len(self._free) < need:
            self._evict_one()
        return tuple(self._free.pop() for _ in range(need))

    @contextlib.contextmanager
    def pinned(self, keys: Iterable[Hashable]) -> Iterator[None]:
        """Inside the block, ``keys`` are never evicted (the prefixes of one forward)."""
        held = list(keys)
        for k in held:
            self._pins[k] = self._pins.get(k, 0) + 1
        try:
            yield
        finally:
            for k in held:
                self._pins[k] -= 1
                if not self._pins[k]:
                    del self._pins[k]

    def counters(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "blocks_used": self.num_blocks - 1 - len(self._free),
            "blocks_free": len(self._free),
            "blocks_reserved": sum(len(t.blocks) for t in self._reserved.values()),
            "hits": self.hits,
            "admitted": self.admitted,
            "evicted": self.evicted,
        }

    def _evict_one(self) -> None:
        for key in self._entries:
            if not self._pins.get(key):
                self.release(key)
                self.evicted += 1
                return
        raise PoolFull(f"every block of the pool ({self.capacity_tokens} tokens) is held by a prefix in use")

    def _check(self, prefix: PrefixKV) -> None:
        if prefix.num_layers != len(self.keys):
            raise ValueError(f"a prefix of {prefix.num_layers} layers for a pool of {len(self.keys)}")
        if prefix.length and prefix.dtype != self.dtype:
            raise ValueError(f"a {prefix.dtype} prefix for a {self.dtype} pool")
        if prefix.length and (
            prefix.keys[0].shape[0] != self.keys[0].shape[1]
            or prefix.keys[0].shape[2] != self.keys[0].shape[2]
            or prefix.values[0].shape[2] != self.values[0].shape[2]
        ):
            raise ValueError("the prefix's heads or head dims are not the pool's")
