"""Relay rankings as one static forward per shape bucket: on CUDA captured once as a CUDA graph and
replayed for any users; elsewhere (CPU, NPU, a failed capture) run eagerly on the same buffers.

A bucket fixes every shape of the forward: users ``B``, suffix events ``S`` and candidates ``C``
per user; the prefix capacity ``P`` pages per user is one for all the buckets of a
``graph_relay.GraphRelay`` (the model's longest history, at most the pages, in whole pages): a
capacity no user fills costs index slots (48 bytes a key slot), never a key read or computed, so
buckets have no prefix dimension and every one the worker uses is built, and captured, before it
takes traffic (``graph_relay.GraphRelay.warm_up``). Each user owns a fixed stretch of ``S + C``
new tokens: ``S`` event slots (its events, then padding) and ``C`` candidate slots. Its keys are
read in place from the pages (``kv_pages.KVPages``, the prefix store's device tier) through a row
index (``JaggedBatch.k_rows``): its real cached tokens, then its new tokens' rows, the users packed
one after another by offsets computed from the loaded prefix lengths; the key buffers keep the
static capacity of ``P`` pages and ``S + C`` rows per user, and its unused rest is never read (no
copy of a key, no padded key computed). Each layer writes the new tokens' keys and values to their
rows, loaded with the request: a user's events to pages after its prefix's when its grown prefix is
kept (the grown run: nothing is copied to keep it), the rest to the buckets' own rows. Padding
cannot change a real score: a padded event sits at the candidates' position (no real token sees
it), a padded candidate is one more candidate (no candidate sees another), a padded user is a
user of its own.

Primitives:
- ``RelayBucket``; ``bucket_for(users, suffix, candidates)``: the smallest bucket on the grids
  (``BUCKET_USERS``, ``BUCKET_SUFFIX``, ``BUCKET_CANDIDATES``), or ``None``; ``grid_buckets(users,
  suffix, candidates)``: every bucket up to those maxima, smallest first;
  ``pool_tokens_for(prefix_tokens, users)``: pages that hold them and the buckets' shared rows.
- ``GraphUser``: one user of a bucketed forward (its prefix's run, new events, candidates, time,
  and the run its grown prefix takes, if kept).
- ``BucketRunner``: a bucket's static buffers, ``load(users)`` (the host's inputs in two copies),
  ``forward()`` (the layers of ``inference.LayerPass``; no host sync, no shape that depends on the
  data), ``capture()`` (CUDA only), ``run()`` (replay or eager), ``results(users)`` and ``close()``.
  Its new tokens' rows that no grown prefix keeps are the ones all buckets share, or its own where
  it is larger.

This module is one bucket's forward; which bucket a call takes, which users' events are kept and
which runners are kept is the policy of ``graph_relay.GraphRelay``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from relaygr.workers.kernels import JaggedBatch
from relaygr.workers.kv_pages import DEFAULT_PAGE_TOKENS, KVPages, PagedKV
from relaygr.workers.model.inference import LayerPass, ServingRunner
from relaygr.workers.model.inference_state import Serving
from relaygr.workers.model.jagged import host_ids
from relaygr.workers.prefix_kv import Events

BUCKET_USERS = (1, 2, 4, 8, 16)
# 128 new events and 256 candidates (a production shape, NVIDIA's cached HSTU block's among them)
# have buckets of their own: on a 4x grid they were padded to 256 and 512, twice the rows.
BUCKET_SUFFIX = (16, 64, 128, 256)
BUCKET_CANDIDATES = (32, 128, 256, 512)


NEW_ROWS = BUCKET_USERS[-1] * (BUCKET_SUFFIX[-1] + BUCKET_CANDIDATES[-1])
"""The rows the grid's largest bucket's new tokens take: what the buckets' shared rows hold."""
INDEX_BYTES_PER_KEY = 48
"""A bucket's index buffers per key slot: row and position (16 bytes), timestamp (8), and
per user's slot its row and position (16) and where it goes (8)."""


@dataclass(frozen=True, order=True)
class RelayBucket:
    users: int
    suffix: int
    candidates: int

    @property
    def rows(self) -> int:
        """The bucket's new tokens (each user's events and candidates)."""
        return self.users * (self.suffix + self.candidates)


def _ceil_on(value: int, grid: tuple[int, ...]) -> int | None:
    return next((g for g in grid if g >= value), None)


def bucket_for(users: int, suffix: int, candidates: int) -> RelayBucket | None:
    """The smallest bucket holding ``users`` users of at most ``suffix`` new events and
    ``candidates`` candidates each; ``None`` past the grids."""
    b = _ceil_on(users, BUCKET_USERS)
    s = _ceil_on(suffix, BUCKET_SUFFIX)
    c = _ceil_on(candidates, BUCKET_CANDIDATES)
    if b is None or s is None or c is None:
        return None
    return RelayBucket(b, s, c)


def grid_buckets(
    users: int = BUCKET_USERS[-1], suffix: int = BUCKET_SUFFIX[-1], candidates: int = BUCKET_CANDIDATES[-1]
) -> list[RelayBucket]:
    """Every bucket of the grids up to the one holding these maxima, fewest rows first."""
    top = bucket_for(users, suffix, candidates)
    if top is None:
        raise ValueError(
            f"{users} users, {suffix} events and {candidates} candidates are past the bucket grids"
        )
    grids = (BUCKET_USERS, BUCKET_SUFFIX, BUCKET_CANDIDATES)
    limits = (top.users, top.suffix, top.candidates)
    sizes = [[g for g in grid if g <= limit] for grid, limit in zip(grids, limits, strict=True)]
    return sorted((RelayBucket(*b) for b in itertools.product(*sizes)), key=lambda b: (b.rows, b))


def pool_tokens_for(prefix_tokens: int, users: int = 1, page_tokens: int = DEFAULT_PAGE_TOKENS) -> int:
    """Tokens of pages that hold ``users`` prefixes of ``prefix_tokens`` and the rows every
    bucket's new tokens share (``NEW_ROWS``, the grid's largest bucket's)."""
    per_user = -(-prefix_tokens // page_tokens) * page_tokens
    return max(1, users * per_user + -(-NEW_ROWS // page_tokens) * page_tokens)


@dataclass(frozen=True)
class GraphUser:
    prefix: PagedKV | None  # its cached prefix's run (None: none)
    events: Events
    candidates: np.ndarray  # raw item ids
    request_ts: float
    grown: PagedKV | None = None  # the grown prefix's run: its events written there (None: not kept)

    @property
    def cached(self) -> int:
        return 0 if self.prefix is None else self.prefix.length


@dataclass(frozen=True)
class _StaticPlan:
    """What ``LayerPass._layer`` reads of a plan: one batch for every layer."""

    batch: JaggedBatch
    last: JaggedBatch


class BucketRunner(LayerPass):
    """One bucket's static buffers and forward (see the module docstring)."""

    def __init__(
        self,
        runner: ServingRunner,
        sv: Serving,
        pages: KVPages,
        bucket: RelayBucket,
        prefix_pages: int,
        new_rows: PagedKV | None = None,
    ) -> None:
        dev, pt = pages.device, pages.page_tokens
        users, rows, slots = bucket.users, bucket.suffix + bucket.candidates, prefix_pages * pt
        self.prefix_pages = prefix_pages
        self.bucket, self.pages, self.rows, self.slots = bucket, pages, rows, slots
        i64, f64, dt = torch.int64, torch.float64, runner.dtype
        # The request's integer inputs in one buffer (one copy in): bags, positions, prefix
        # lengths, key offsets (each user's keys: its prefix's and its rows), page tables (each
        # page's first row), candidate items, and the rows of the new tokens' keys and values.
        sizes = (
            2 * users * rows,
            users * rows,
            users,
            users + 1,
            users * prefix_pages,
            users * bucket.candidates,
            users * rows,
        )
        self.ints = torch.zeros(sum(sizes), dtype=i64, device=dev)
        split = self.ints.split(sizes)
        self.bags, self.q_pos, self.prefix_len, self.k_offsets, self.block_table, self.cand_items = split[:6]
        self.own_rows = split[6]
        self.k_offsets.copy_(torch.arange(users + 1) * rows)  # no prefixes yet: a valid forward
        self.q_ts = torch.zeros(users * rows, dtype=f64, device=dev)
        # Host staging of those inputs, page-locked on CUDA so that the copies are asynchronous
        # (a call reads its scores back before the next one writes here).
        pin = dev.type == "cuda"
        self.host_ints = torch.zeros(self.ints.shape, dtype=i64, pin_memory=pin)
        self.host_ts = torch.zeros(self.q_ts.shape, dtype=f64, pin_memory=pin)
        self.cand_rows = (
            (torch.arange(users)[:, None] * rows + bucket.suffix + torch.arange(bucket.candidates))
            .reshape(-1)
            .to(dev)
        )
        slot = torch.arange(slots)
        self.slot_index, self.slot_block, self.slot_offset = (
            slot.to(dev),
            (slot // pt).to(dev),
            (slot % pt).to(dev),
        )
        keys = slots + rows  # a user's capacity: its prefix's and its own
        self.capacity = users * keys
        self.gate = torch.zeros(users * rows, sv.splits[0] + 1, dtype=dt, device=dev)
        self.gate[:, -1] = 1.0  # the output projection's bias row
        self.score_buf = torch.zeros(users * bucket.candidates, dtype=torch.float32, device=dev)
        # The rows of the new tokens no grown prefix keeps, written each layer (the attention reads
        # a user's prefix and its new keys in place): ``new_rows`` where they hold them (shared
        # with other buckets), else rows of its own. ``own_rows``, loaded with each request, says
        # where each new token goes: these, or pages after its user's prefix.
        self.own_run: PagedKV | None = None
        scratch = new_rows
        if scratch is None or scratch.length < users * rows:
            self.own_run = scratch = pages.allocate(users * rows)
        self.scratch_rows = scratch.rows()[: users * rows].reshape(users, rows)
        self.own_rows.copy_(torch.from_numpy(self.scratch_rows.reshape(-1)))
        self._key_buffers()
        batch = JaggedBatch(
            q_offsets=(torch.arange(users + 1) * rows).to(dev),
            k_offsets=self.k_offsets,
            q_pos=self.q_pos,
            q_ts=self.q_ts,
            k_pos=self.k_pos,
            k_ts=self.k_ts,
            max_q=rows,
            max_k=keys,
            k_rows=self.k_rows,
        )
        super().__init__(runner, _StaticPlan(batch, batch), sv)  # type: ignore[arg-type]
        self.graph: torch.cuda.CUDAGraph | None = None

    def _key_buffers(self) -> None:
        """The packed keys (``_pack``): per user its real prefix, then its own rows, one user after
        another (``k_offsets``), the capacity's rest unused; ``packed`` row 0 each key's row in the pages,
        row 1 its position, its last column the prefix slots past a user's length. Per user's key
        slot (its prefix slots, then its new tokens): the row and position (``src``), and
        where it goes in the packed keys (``dest``)."""
        users, rows, slots, dev = self.bucket.users, self.rows, self.slots, self.pages.device
        self.packed = torch.zeros(2, self.capacity + 1, dtype=torch.int64, device=dev)
        self.k_rows, self.k_pos = self.packed[0, : self.capacity], self.packed[1, : self.capacity]
        self.k_ts = torch.zeros(self.capacity, dtype=torch.float64, device=dev)
        self.src = torch.zeros(2, users, slots + rows, dtype=torch.int64, device=dev)
        self.src[1, :, :slots] = self.slot_index
        self.dest = torch.zeros(users, slots + rows, dtype=torch.int64, device=dev)
        self.own_steps = torch.arange(-rows, 0, device=dev)  # own row r: r - rows from the user's end

    @property
    def own_tokens(self) -> int:
        """Rows of the pages this bucket holds for itself (0: it uses the shared ones)."""
        return 0 if self.own_run is None else self.own_run.length

    def close(self) -> None:
        """Gives the pages back the rows of the bucket's new tokens (if they were its own)."""
        if self.own_run is not None:
            self.own_run.release()
            self.own_run = None

    def static_buffers(self) -> list[torch.Tensor]:
        """Every buffer a forward reads or writes (the same ones, at the same addresses, each run)."""
        return [
            *(self.ints, self.q_ts, self.packed, self.k_ts, self.src, self.dest),
            *(self.gate, self.score_buf),
        ]

    def load(self, users: list[GraphUser]) -> None:
        """Writes ``users``' inputs into the static buffers: two copies, whatever the users."""
        b = self.bucket
        if len(users) > b.users:
            raise ValueError(f"{len(users)} users for a bucket of {b.users}")
        num_items, num_actions = self.runner.config.num_items, self.runner.config.num_actions
        rows = self.rows
        items = np.zeros((b.users, rows), np.int64)
        actions = np.zeros((b.users, rows), np.int64)
        actions[:, b.suffix :] = num_actions + 1  # candidates take the action after the last
        q_pos = np.zeros((b.users, rows), np.int64)
        q_ts = np.zeros((b.users, rows), np.float64)
        lengths = np.zeros(b.users, np.int64)
        tables = np.zeros((b.users, self.prefix_pages), np.int64)  # unused pages: the zero page's row
        cands = np.zeros((b.users, b.candidates), np.int64)
        dest = self.scratch_rows.copy()
        for u, user in enumerate(users):
            s, c, n = len(user.events), len(user.candidates), user.cached
            pages = () if user.prefix is None else user.prefix.pages
            if s > b.suffix or c > b.candidates or len(pages) > self.prefix_pages:
                raise ValueError(
                    f"a user of {s} events, {c} candidates and {n} cached ones exceeds {b} of "
                    f"{self.slots} prefix slots"
                )
            if user.grown is not None:  # its events' keys and values go where its grown prefix keeps them
                dest[u, :s] = user.grown.rows()[n : n + s]
            items[u, :s] = host_ids(user.events.item_ids, num_items)
            items[u, b.suffix : b.suffix + c] = cands[u, :c] = host_ids(user.candidates, num_items)
            actions[u, :s] = host_ids(user.events.action_ids, num_actions)
            q_pos[u, :s] = np.arange(n, n + s)
            q_pos[u, s:] = n + s  # padded events and the candidates: the position after the history
            q_ts[u, :s] = user.events.timestamps.numpy()
            q_ts[u, s:] = user.request_ts
            lengths[u] = n
            tables[u, : len(pages)] = np.asarray(pages, np.int64) * self.pages.page_tokens
        bags = np.stack([items, actions + num_items + 1], axis=-1).reshape(-1)
        offsets = np.concatenate([[0], np.cumsum(lengths + rows)])
        host = np.concatenate(
            [
                bags,
                q_pos.reshape(-1),
                lengths,
                offsets,
                tables.reshape(-1),
                cands.reshape(-1),
                dest.reshape(-1),
            ]
        )
        self.host_ints.numpy()[:] = host
        self.host_ts.numpy()[:] = q_ts.reshape(-1)
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.q_ts.copy_(self.host_ts, non_blocking=True)

    def _kv(self, li: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages' layer, read in place through the batch's ``k_rows`` (the new keys and values
        written to their rows first)."""
        keys, values = self.pages.keys[li], self.pages.values[li]
        keys.index_copy_(0, self.own_rows, k_new)
        values.index_copy_(0, self.own_rows, v_new)
        return keys, values

    def _pack(self) -> None:
        """Each user's keys, packed on the device from the loaded prefix lengths and offsets (no
        host read): per key its row in the pages (``k_rows``), position and timestamp."""
        users, rows, slots = self.bucket.users, self.rows, self.slots
        length = self.prefix_len[:, None]
        in_pages = self.block_table.view(users, -1).index_select(1, self.slot_block)
        torch.add(in_pages, self.slot_offset, out=self.src[0, :, :slots])
        self.src[0, :, slots:].copy_(self.own_rows.view(users, rows))
        self.src[1, :, slots:].copy_(self.q_pos.view(users, rows))
        # A prefix slot goes after its user's earlier keys, or past the capacity beyond its length;
        # the own rows end the user's keys.
        prefix_dest = torch.add(self.k_offsets[:-1, None], self.slot_index, out=self.dest[:, :slots])
        prefix_dest.masked_fill_(self.slot_index >= length, self.capacity)
        torch.add(self.k_offsets[1:, None], self.own_steps, out=self.dest[:, slots:])
        self.packed.index_copy_(1, self.dest.view(-1), self.src.view(2, -1))
        self.pages.timestamps.index_copy_(0, self.own_rows, self.q_ts)
        torch.index_select(self.pages.timestamps, 0, self.k_rows, out=self.k_ts)

    def forward(self) -> None:
        """The bucket's forward on the static buffers: scores into ``score_buf``, every layer's new
        keys and values into their rows (``own_rows``)."""
        self.plan.batch.scratch.clear()  # what the kernels derive from positions: derived again
        self.new_kv = []
        self._pack()
        # A token: its item's row plus its action's; two rows each, summed (no offsets to read).
        x = x0 = F.embedding(self.bags.view(-1, 2), self.sv.tokens).sum(dim=1)
        for li in range(len(self.sv.layers)):
            x = self._layer(li, x, self.gate)
        xc, x0c = x.index_select(0, self.cand_rows), x0.index_select(0, self.cand_rows)
        e = F.embedding(self.cand_items, self.sv.items)
        norm_w, norm_b, eps = self.sv.final_norm
        out = torch.linalg.vecdot(F.layer_norm(xc - x0c, xc.shape[-1:], norm_w, norm_b, eps), e)
        self.score_buf.copy_(out)

    def capture(self, pool: object | None = None) -> None:
        """Captures ``forward`` as a CUDA graph (after two warm-up runs on a side stream)."""
        side = torch.cuda.Stream(device=self.pages.device)
        side.wait_stream(torch.cuda.current_stream(self.pages.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream(self.pages.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # other threads copy
            self.forward()
        self.graph = graph

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.forward()

    def results(self, users: list[GraphUser]) -> list[tuple[torch.Tensor, PagedKV | None]]:
        """Per user, its scores (float32, CPU; the one read of the device) and its grown prefix's
        run (its events' keys and values written there by the forward; None: not kept)."""
        scores = self.score_buf.view(self.bucket.users, -1).to("cpu", copy=True)  # a copy on a CPU too
        return [(scores[u, : len(user.candidates)], user.grown) for u, user in enumerate(users)]
