"""The policy of bucketed relay rankings over the paged KV: on CUDA replayed from CUDA graphs,
elsewhere (CPU, NPU, a failed capture) run eagerly on the same static buffers.

``GraphRelay(runner, capture=, max_buckets=, prefix_tokens=, rows_tokens=)`` reads the cached
prefixes where they are, in the runner's pages (``kv_pages.KVPages``: the prefix store's device
tier), owns the buckets' runners (``graph_runner.BucketRunner``, one static forward per shape
bucket) and the pages their new tokens take, and decides:
- which bucket a call takes (``bucket_of``), and ``None`` (the caller's eager path) for what fits
  no bucket or its prefix capacity, or has a prefix outside the pages (a dense one);
- where each user's new tokens go (``rank``): with ``keep_kv``, its events into pages after its
  prefix's (the grown prefix's run, returned: nothing is copied to keep it), else into the
  buckets' rows, as its candidates;
- which runners are kept (at most ``max_buckets``, least recently used out; all of them when the
  weights change, since a graph holds their addresses), each captured once when ``capture``;
- ``replays(suffix, candidates, prefix_tokens)``: whether one user's ranking of that shape is a
  graph replay (the engine does not slice those);
- ``warm_up()``: every bucket up to the grid's maxima built (captured) before traffic;
  ``counters()``: rankings graphed and not, buckets, warm-up, the pages' counters; ``close()``.

The buckets' shapes, the prefix capacity every bucket shares and the rows their new tokens share
are described in ``graph_runner``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from relaygr.workers.kv_pages import KVPages, PagedKV, PagesExhausted
from relaygr.workers.model.graph_runner import (
    BUCKET_CANDIDATES,
    BUCKET_SUFFIX,
    BUCKET_USERS,
    INDEX_BYTES_PER_KEY,
    NEW_ROWS,
    BucketRunner,
    GraphUser,
    RelayBucket,
    bucket_for,
    grid_buckets,
)
from relaygr.workers.model.inference import ServingRunner
from relaygr.workers.model.inference_state import Serving
from relaygr.workers.model.jagged import UserSlot

log = logging.getLogger(__name__)

DEFAULT_MAX_BUCKETS = 8


class GraphRelay:
    """Bucketed relay rankings over the paged KV (the module docstring says what it decides)."""

    def __init__(
        self,
        runner: ServingRunner,
        *,
        capture: bool | None = None,
        max_buckets: int = DEFAULT_MAX_BUCKETS,
        prefix_tokens: int | None = None,
        rows_tokens: int | None = None,
    ) -> None:
        cfg, device = runner.config, runner.device
        if max_buckets < 1:
            raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
        self.pages: KVPages = runner.pages
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {device}")
        self.runner, self.max_buckets = runner, max_buckets
        pt = self.pages.page_tokens
        # Every bucket's prefix capacity per user: the longest history the model serves (or
        # ``prefix_tokens``), at most the pages, in whole pages.
        longest = min(cfg.max_seq_len if prefix_tokens is None else prefix_tokens, self.pages.capacity_tokens)
        self.prefix_pages = max(1, -(-longest // pt))
        # The new tokens' rows of whichever bucket runs, shared by all the buckets: one forward
        # runs at a time (on the device thread) and its scores are read before the next one writes
        # there. The grid's largest bucket's rows, at most ``rows_tokens`` (default: what the pages
        # hold beyond one longest prefix); a bucket larger than that takes rows of its own.
        spare = self.pages.capacity_tokens - self.prefix_pages * pt if rows_tokens is None else rows_tokens
        shared = min(-(-NEW_ROWS // pt) * pt, max(0, spare) // pt * pt)
        self.new_rows: PagedKV | None = None
        if shared > 0:
            try:
                self.new_rows = self.pages.allocate(shared)
            except PagesExhausted as e:
                log.warning("the buckets' shared rows do not fit the pages: %s", e)
        self.runners: OrderedDict[RelayBucket, BucketRunner] = OrderedDict()
        self.warmed: dict[str, object] | None = None
        self.graph_error: str | None = None
        self.ranked = self.fallbacks = 0
        self._weights: tuple | None = None
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def prefix_capacity(self) -> int:
        """The most cached tokens a bucket's user may have."""
        return self.prefix_pages * self.pages.page_tokens

    def replays(self, suffix: int, candidates: int, prefix_tokens: int) -> bool:
        """Whether one user's relay ranking of this shape is a graph replay: captured buckets (CUDA)
        and a bucket and prefix capacity that hold it. Such a ranking is one launch of a few
        milliseconds at most: slicing it (``pacing.slice_relay``) would only run it eagerly, a
        layer a slice."""
        return (
            self.capture
            and self.graph_error is None
            and bucket_for(1, suffix, candidates) is not None
            and prefix_tokens <= self.prefix_capacity
        )

    def _shared_rows(self) -> int:
        return 0 if self.new_rows is None else self.new_rows.length

    def _own_rows(self, bucket: RelayBucket) -> int:
        """Rows ``bucket`` takes for itself: none where the shared rows hold its rows."""
        pt = self.pages.page_tokens
        return 0 if bucket.rows <= self._shared_rows() else -(-bucket.rows // pt) * pt

    def bucket_of(self, slots: list[UserSlot]) -> RelayBucket | None:
        if any(s.reads is not None for s in slots):
            return None
        if max(s.cached for s in slots) > self.prefix_capacity:
            return None
        if any(
            s.prefix is not None and (s.prefix.pages is None or s.prefix.pages.pool is not self.pages)
            for s in slots
        ):
            return None  # a dense prefix: the eager path reads it as it is
        return bucket_for(
            len(slots), max(len(s.events) for s in slots), max(len(s.candidates) for s in slots)
        )

    def rank(self, sv: Serving, slots: list[UserSlot], keep_kv: bool = True) -> list | None:
        """Per slot, its scores and (``keep_kv``) the run of its grown prefix, whose new tokens the
        forward wrote, in one bucketed forward; ``None`` when the slots fit no bucket (the
        caller's eager path)."""
        bucket = self.bucket_of(slots) if slots else None
        if bucket is None:
            self.fallbacks += 1
            return None
        users = []
        try:
            for s in slots:
                run = s.prefix.pages if s.prefix is not None else None
                grown = self.pages.extend(run, len(s.events)) if keep_kv else None
                users.append(GraphUser(run, s.events, s.candidates, s.request_ts, grown))
            runner = self._runner(sv, bucket)
        except (PagesExhausted, ValueError) as e:
            log.debug("relay ranking outside the graphed path: %s", e)
            self.fallbacks += 1
            return None
        runner.load(users)
        runner.run()
        if keep_kv:  # the kept events' keys and values, written by the forward where they stay
            self.pages.rows_written += sum(len(s.events) for s in slots)
        self.ranked += 1
        return runner.results(users)

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
        runner = BucketRunner(self.runner, sv, self.pages, bucket, self.prefix_pages, self.new_rows)
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
        bucket. Buckets share one run of rows for their new tokens; a bucket larger than it, whose
        own rows would bring the buckets' rows over half the pages, is left to be built on demand
        (the rest is for prefixes). Returns (and logs) what it built: buckets, those left,
        seconds, index and row bytes, and on CUDA the device memory taken."""
        started, device = time.perf_counter(), self.pages.device
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        sv = self.runner.serving()
        wanted = grid_buckets(users, suffix, candidates)
        self.max_buckets = max(self.max_buckets, len(self.runners) + len(wanted))
        reserved = self._shared_rows() + sum(self._own_rows(r.bucket) for r in self.runners.values())
        built, left = [], []
        for bucket in wanted:
            rows = self._own_rows(bucket)
            if bucket not in self.runners and rows and reserved + rows > self.pages.capacity_tokens // 2:
                left.append(bucket)
                continue
            reserved += 0 if bucket in self.runners else rows
            runner = self._runner(sv, bucket)
            if runner.graph is None:
                runner.forward()  # the eager twin: its one-off costs paid here
            built.append(runner)
        self.warmed = {
            "buckets": len(built),
            "left_to_demand": len(left),
            "captured": self.capture,
            "seconds": round(time.perf_counter() - started, 3),
            "index_bytes": sum(r.capacity * INDEX_BYTES_PER_KEY for r in built),
            "rows_reserved": reserved,
            "rows_bytes_reserved": reserved * self.pages.layout.token_bytes,
            "device_bytes": torch.cuda.memory_allocated(device) - before if device.type == "cuda" else None,
        }
        log.info("relay buckets warmed up: %s", self.warmed)
        return self.warmed

    def rows_reserved(self) -> int:
        """Rows of the pages the buckets' new tokens hold: the shared ones and the buckets' own."""
        return self._shared_rows() + sum(r.own_tokens for r in self.runners.values())

    def counters(self) -> dict[str, object]:
        return {
            "graphed_rankings": self.ranked,
            "fallbacks": self.fallbacks,
            "buckets": [list(b.__dict__.values()) for b in self.runners],
            "prefix_capacity": self.prefix_capacity,
            "rows_reserved": self.rows_reserved(),
            "warm_up": self.warmed,
            "captured": self.capture,
            "graph_error": self.graph_error,
            **{f"pages_{k}": v for k, v in self.pages.counters().items()},
        }

    def close(self) -> None:
        """Gives the pages back every row the buckets' new tokens held (its runners stay, for a
        look at what they were; it ranks no more)."""
        for runner in self.runners.values():
            runner.close()
        if self.new_rows is not None:
            self.new_rows.release()
            self.new_rows = None
