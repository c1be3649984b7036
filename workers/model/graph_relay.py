"""The policy of bucketed relay rankings over a paged device prefix pool: on CUDA replayed from
CUDA graphs, elsewhere (CPU, NPU, a failed capture) run eagerly on the same static buffers.

``GraphRelay(runner, pool_tokens=, block_tokens=, capture=, max_buckets=, prefix_tokens=)`` owns the
``PagedPrefixPool`` and the buckets' runners (``graph_runner.BucketRunner``, one static forward per
shape bucket), and decides:
- which prefixes enter the pool (``rank``: each slot's prefix admitted under its fingerprint and
  length, pinned for the call; one without a fingerprint for that call only);
- which bucket a call takes (``bucket_of``), and ``None`` (the caller's eager path) for what fits
  no bucket, no prefix capacity or no pool;
- which runners are kept (at most ``max_buckets``, least recently used out; all of them when the
  weights change, since a graph holds their addresses), each captured once when ``capture``;
- ``replays(suffix, candidates, prefix_tokens)``: whether one user's ranking of that shape is a
  graph replay (the engine does not slice those);
- ``warm_up()``: every bucket up to the grid's maxima built (captured) before traffic;
  ``counters()``: rankings graphed and not, buckets, warm-up, the pool's counters.

The buckets' shapes, the prefix capacity every bucket shares and the rows their new tokens share
are described in ``graph_runner``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Hashable

import torch

from relaygr.workers.model.graph_runner import (
    BUCKET_CANDIDATES,
    BUCKET_SUFFIX,
    BUCKET_USERS,
    DEFAULT_BLOCK_TOKENS,
    INDEX_BYTES_PER_KEY,
    NEW_ROWS,
    BucketRunner,
    GraphUser,
    NewKV,
    RelayBucket,
    bucket_for,
    grid_buckets,
)
from relaygr.workers.model.inference import ServingRunner
from relaygr.workers.model.inference_state import Serving
from relaygr.workers.model.jagged import UserSlot
from relaygr.workers.model.prefix_pool import PagedPrefixPool, PageTable, PoolFull
from relaygr.workers.prefix_kv import PrefixKV

log = logging.getLogger(__name__)

DEFAULT_POOL_TOKENS = 1 << 18
DEFAULT_MAX_BUCKETS = 8
NEW_ROWS_KEY = ("new-rows",)
"""The pool reservation that every bucket's new tokens share."""


class GraphRelay:
    """Bucketed relay rankings over a paged prefix pool (the module docstring says what it decides)."""

    def __init__(
        self,
        runner: ServingRunner,
        *,
        pool_tokens: int = DEFAULT_POOL_TOKENS,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        capture: bool | None = None,
        max_buckets: int = DEFAULT_MAX_BUCKETS,
        prefix_tokens: int | None = None,
    ) -> None:
        cfg, device = runner.config, runner.device
        if pool_tokens < block_tokens or max_buckets < 1:
            raise ValueError(
                f"pool_tokens ({pool_tokens}) must hold a block ({block_tokens}); max_buckets >= 1"
            )
        self.pool = PagedPrefixPool(
            cfg.layers, cfg.heads, cfg.attn_dim, cfg.linear_dim, block_tokens,
            pool_tokens // block_tokens + 1, runner.dtype, device,
        )  # fmt: skip
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {device}")
        self.runner, self.max_buckets = runner, max_buckets
        # Every bucket's prefix capacity per user: the longest history the model serves (or
        # ``prefix_tokens``), at most the pool, in whole blocks.
        longest = min(cfg.max_seq_len if prefix_tokens is None else prefix_tokens, self.pool.capacity_tokens)
        self.prefix_blocks = max(1, -(-longest // block_tokens))
        # The new tokens' rows of whichever bucket runs, shared by all the buckets: one forward
        # runs at a time (on the device thread) and its results are copied out before the next
        # one writes there. The grid's largest bucket's rows, at most what the pool holds beyond
        # one longest prefix; a bucket larger than that reserves rows of its own.
        spare = self.pool.capacity_tokens - self.prefix_blocks * block_tokens
        shared = min(-(-NEW_ROWS // block_tokens) * block_tokens, spare // block_tokens * block_tokens)
        self.new_rows = self.pool.reserve(NEW_ROWS_KEY, shared) if shared > 0 else None
        self.runners: OrderedDict[RelayBucket, BucketRunner] = OrderedDict()
        self.warmed: dict[str, object] | None = None
        self.graph_error: str | None = None
        self.ranked = self.fallbacks = 0
        self._weights: tuple | None = None
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None

    def replays(self, suffix: int, candidates: int, prefix_tokens: int) -> bool:
        """Whether one user's relay ranking of this shape is a graph replay: captured buckets (CUDA)
        and a bucket and pool that hold it. Such a ranking is one launch of a few milliseconds at
        most: slicing it (``pacing.slice_relay``) would only run it eagerly, a layer a slice."""
        bt = self.pool.block_tokens
        return (
            self.capture
            and self.graph_error is None
            and bucket_for(1, suffix, candidates) is not None
            and prefix_tokens <= self.prefix_blocks * bt
            and -(-prefix_tokens // bt) * bt + self._reserved(bucket_for(1, suffix, candidates))
            <= self.pool.capacity_tokens
        )

    def _shared_rows(self) -> int:
        return 0 if self.new_rows is None else self.new_rows.length

    def _own_rows(self, bucket: RelayBucket) -> int:
        """Pool rows ``bucket`` reserves for itself: none where the shared rows hold its rows."""
        bt = self.pool.block_tokens
        return 0 if bucket.rows <= self._shared_rows() else -(-bucket.rows // bt) * bt

    def _reserved(self, bucket: RelayBucket | None) -> int:
        """Pool rows held for new tokens while ``bucket`` runs: the shared ones and its own."""
        return self._shared_rows() + (0 if bucket is None else self._own_rows(bucket))

    def bucket_of(self, slots: list[UserSlot]) -> RelayBucket | None:
        if any(s.reads is not None for s in slots):
            return None
        if max(s.cached for s in slots) > self.prefix_blocks * self.pool.block_tokens:
            return None
        return bucket_for(
            len(slots), max(len(s.events) for s in slots), max(len(s.candidates) for s in slots)
        )

    def rank(
        self, sv: Serving, slots: list[UserSlot], keep_kv: bool = True
    ) -> list[tuple[torch.Tensor, NewKV]] | None:
        """Per slot, its scores and its events' keys and values, in one bucketed forward; ``None``
        when the slots fit no bucket or their prefixes no pool (the caller's eager path)."""
        bucket = self.bucket_of(slots) if slots else None
        if bucket is None:
            self.fallbacks += 1
            return None
        keys = [_pool_key(s.prefix) for s in slots]
        once = {
            k for k, s in zip(keys, slots, strict=True) if s.prefix is not None and not s.prefix.fingerprint
        }
        try:
            with self.pool.pinned(keys):
                users = []
                for key, s in zip(keys, slots, strict=True):
                    table = PageTable(0, (), self.pool.block_tokens)
                    if s.prefix is not None:
                        table = self.pool.admit(key, s.prefix)
                    users.append(GraphUser(table, s.events, s.candidates, s.request_ts))
                runner = self._runner(sv, bucket)
                runner.load(users)
                runner.run()
                out = runner.results(users, keep_kv)
        except (PoolFull, ValueError) as e:
            log.debug("relay ranking outside the graphed path: %s", e)
            self.fallbacks += 1
            return None
        finally:
            for k in once:
                self.pool.release(k)
        self.ranked += 1
        return out

    def _runner(self, sv: Serving, bucket: RelayBucket) -> BucketRunner:
        if sv.key != self._weights:  # new weights: graphs hold the old ones' addresses
            while self.runners:
                self.runners.popitem()[1].close()
            self._weights = sv.key
        runner = self.runners.get(bucket)
        if runner is not None:
            self.runners.move_to_end(bucket)
            return runner
        while len(self.runners) >= self.max_buckets:
            self.runners.popitem(last=False)[1].close()
        runner = BucketRunner(self.runner, sv, self.pool, bucket, self.prefix_blocks, self.new_rows)
        if self.capture:
            try:
                runner.capture(self._mempool)
            except Exception as e:  # the eager forward on the same buffers still serves
                self.graph_error = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed, relay rankings run eagerly: %s", self.graph_error)
                self.capture = False
                runner.graph = None
        self.runners[bucket] = runner
        return runner

    def warm_up(
        self,
        users: int = BUCKET_USERS[-1],
        suffix: int = BUCKET_SUFFIX[-1],
        candidates: int = BUCKET_CANDIDATES[-1],
    ) -> dict[str, object]:
        """Builds every bucket up to these maxima (``grid_buckets``) before traffic, fewest rows
        first, each captured (CUDA) or run once eagerly, so that no ranking pays for building its
        bucket. Buckets share one reservation of rows for their new tokens; a bucket larger than
        it, whose own rows would bring the reservations over half the pool, is left to be built on
        demand (the rest is for prefixes). Returns (and logs) what it built:
        buckets, those left, seconds, index and pool bytes, and on CUDA the device memory taken."""
        started, device = time.perf_counter(), self.pool.device
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        sv = self.runner.serving()
        wanted = grid_buckets(users, suffix, candidates)
        self.max_buckets = max(self.max_buckets, len(self.runners) + len(wanted))
        reserved = self._shared_rows() + sum(self._own_rows(r.bucket) for r in self.runners.values())
        built, left = [], []
        for bucket in wanted:
            rows = self._own_rows(bucket)
            if bucket not in self.runners and rows and reserved + rows > self.pool.capacity_tokens // 2:
                left.append(bucket)
                continue
            reserved += 0 if bucket in self.runners else rows
            runner = self._runner(sv, bucket)
            if runner.graph is None:
                runner.forward()  # the eager twin: its one-off costs paid here
            built.append(runner)
        row_bytes = sum(t[:, 0].nbytes for t in self.pool.layer_stores()) + 8  # a row of every layer
        self.warmed = {
            "buckets": len(built),
            "left_to_demand": len(left),
            "captured": self.capture,
            "seconds": round(time.perf_counter() - started, 3),
            "index_bytes": sum(r.capacity * INDEX_BYTES_PER_KEY for r in built),
            "pool_rows_reserved": reserved,
            "pool_bytes_reserved": reserved * row_bytes,
            "device_bytes": torch.cuda.memory_allocated(device) - before if device.type == "cuda" else None,
        }
        log.info("relay buckets warmed up: %s", self.warmed)
        return self.warmed

    def counters(self) -> dict[str, object]:
        return {
            "graphed_rankings": self.ranked,
            "fallbacks": self.fallbacks,
            "buckets": [list(b.__dict__.values()) for b in self.runners],
            "prefix_capacity": self.prefix_blocks * self.pool.block_tokens,
            "warm_up": self.warmed,
            "captured": self.capture,
            "graph_error": self.graph_error,
            **{f"pool_{k}": v for k, v in self.pool.counters().items()},
        }


def _pool_key(prefix: PrefixKV | None) -> Hashable:
    """A prefix's key in the pool: its model, history fingerprint and length (the same for every
    copy of it); a prefix without a fingerprint is admitted for one call only."""
    if prefix is None:
        return None
    if not prefix.fingerprint:
        return ("once", id(prefix))
    return (prefix.model_version, prefix.fingerprint, prefix.length)
