"""The plan of one serving forward: users' cached prefixes, new events and candidates packed into
one jagged batch.

Primitives:
- ``UserSlot``: one user of a forward: its cached prefix, its own new events, or the first events
  of another user's (a burst of one user's requests: the longest history's events are computed
  once), its candidates (model ids) and its request time.
- ``ForwardPlan.build(slots, ...)``: where each user's tokens lie in the packed activations (its
  own events, then its candidates), which keys each user attends to (its prefix, the events it
  sees, its candidates), the tokens' embedding ids, and the ``JaggedBatch``es: one for the layers
  whose queries are every new token, and the last layer's, whose queries are the candidates only.
- ``CachedKeys.of(slots, pieces)``: the cached keys, values and timestamps the users read: every
  paged prefix's (``PrefixKV.paged``) gathered from the pages at once, one copy per tensor for all
  the layers and users; a dense prefix's as it is. One user's keys (a ranking, a pre-inference's
  chunk) are gathered with room for its new rows after them, which each layer writes there: its
  keys are then that buffer's layer, with no concatenation.

Everything here is arithmetic over host lengths (numpy); the device receives a fixed number of
tensors whatever the number of users or events.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from relaygr.workers.kernels import JaggedBatch
from relaygr.workers.prefix_kv import Events, PrefixKV

SHARED_LAST_LAYER_ROWS = 256
"""With at most this many new events in a forward (a ranking's suffix, a burst's new events), the
last layer computes their outputs too, unused, so that one batch (one set of bias indices and
weights) serves every layer; with more (a full ranking, pre-inference), the last layer's queries
are the candidates alone."""


def host_ids(values: torch.Tensor | np.ndarray | list, count: int) -> np.ndarray:
    """Raw ids as an int64 host array with every id outside ``1 .. count`` as 0 (the unknown row)."""
    if isinstance(values, torch.Tensor):
        values = values.numpy() if values.device.type == "cpu" else values.cpu().numpy()
    ids = np.asarray(values, dtype=np.int64).reshape(-1)
    return np.where((ids >= 1) & (ids <= count), ids, 0)


@dataclass(frozen=True)
class UserSlot:
    """One user of a forward. ``reads = (u, m)``: instead of own events, it sees the first ``m``
    new events of user ``u`` (whose prefix must be the same)."""

    prefix: PrefixKV | None
    events: Events
    candidates: np.ndarray  # raw item ids
    request_ts: float
    reads: tuple[int, int] | None = None

    @property
    def cached(self) -> int:
        return self.prefix.length if self.prefix is not None else 0


@dataclass(frozen=True)
class CachedKeys:
    """The cached keys, values and timestamps of a forward's users (see the module docstring):
    ``keys [layers, N, H, dqk]``, ``values`` and ``timestamps [N]`` of the paged prefixes, one
    after another, and per user the rows of its own there (``None``: a dense prefix, or none);
    ``tail``: one user's new rows ``[a, b)`` whose keys and values follow its prefix's there."""

    keys: torch.Tensor | None
    values: torch.Tensor | None
    timestamps: torch.Tensor | None
    spans: list[tuple[int, int] | None]
    tail: tuple[int, int] | None = None

    @classmethod
    def of(cls, slots: list[UserSlot], pieces: list[list[tuple[int, int] | None]]) -> CachedKeys:
        runs = [s.prefix.pages if s.prefix is not None else None for s in slots]
        paged = [r for r in runs if r is not None]
        if not paged:
            return cls(None, None, None, [None] * len(slots))
        pool = paged[0].pool
        if any(r.pool is not pool for r in paged):
            raise ValueError("the prefixes of one forward lie in different pages")
        spans: list[tuple[int, int] | None] = []
        at = 0
        for r in runs:
            spans.append(None if r is None else (at, at + r.length))
            at += 0 if r is None else r.length
        tail = None
        if len(slots) == 1 and runs[0] is not None and len(pieces[0]) == 2 and pieces[0][1] is not None:
            tail = pieces[0][1]  # its prefix, then its own new rows: room for them after the prefix
            rows = paged[0].row_index(pad=tail[1] - tail[0])  # built once a prefix and width
        else:
            rows = _device(np.concatenate([r.rows() for r in paged]), pool.device)
        keys, values = pool.stores()
        return cls(
            keys.index_select(1, rows),
            values.index_select(1, rows),
            pool.timestamps.index_select(0, rows),
            spans,
            tail,
        )

    def tail_layer(
        self, li: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The one user's keys and values of layer ``li``: its prefix's, then its new rows of
        ``k_new``/``v_new`` (``tail``), written after them."""
        assert self.tail is not None and self.keys is not None and self.values is not None
        a, b = self.tail
        n = self.keys.shape[1] - (b - a)
        keys, values = self.keys[li], self.values[li]
        keys[n:].copy_(k_new[a:b])
        values[n:].copy_(v_new[a:b])
        return keys, values

    def layer(self, slot: UserSlot, user: int, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        """User ``user``'s cached keys and values of layer ``li``, ``[n, H, d]``."""
        span = self.spans[user]
        if span is None:
            assert slot.prefix is not None
            return slot.prefix.keys[li].transpose(0, 1), slot.prefix.values[li].transpose(0, 1)
        assert self.keys is not None and self.values is not None
        return self.keys[li, span[0] : span[1]], self.values[li, span[0] : span[1]]

    def times(self, slot: UserSlot, user: int) -> torch.Tensor:
        """User ``user``'s cached timestamps."""
        span = self.spans[user]
        if span is None:
            assert slot.prefix is not None
            return slot.prefix.timestamps
        assert self.timestamps is not None
        return self.timestamps[span[0] : span[1]]


@dataclass(frozen=True)
class ForwardPlan:
    """Where every user's tokens and keys lie in one forward (see the module docstring)."""

    slots: list[UserSlot]
    event_rows: list[tuple[int, int]]  # per user: its own events' rows [start, stop)
    cand_rows: list[tuple[int, int]]  # per user: its candidates' rows [start, stop)
    key_pieces: list[list[tuple[int, int] | None]]  # per user: None (its prefix) or rows [start, stop)
    items: np.ndarray  # [T] item embedding ids
    actions: np.ndarray  # [T] action embedding ids
    batch: JaggedBatch | None  # queries: every row (None: no rows)
    last: JaggedBatch | None  # the last layer's queries: candidate rows, or ``batch`` (None: no candidates)
    cand_index: torch.Tensor | None  # candidate rows, when they are not the last rows of one user
    cached: CachedKeys  # the users' cached keys, values and timestamps

    @property
    def rows(self) -> int:
        return int(self.items.shape[0])

    @property
    def candidates(self) -> int:
        return sum(b - a for a, b in self.cand_rows)

    def candidate_rows(self) -> np.ndarray:
        """The candidates' rows, user after user."""
        return np.concatenate([np.arange(a, b) for a, b in self.cand_rows] or [np.empty(0, np.int64)])

    @classmethod
    def build(cls, slots: list[UserSlot], vocab: tuple[int, int], device: torch.device) -> ForwardPlan:
        """The plan of ``slots``; ``vocab``: the model's item and action counts (raw ids outside
        them are the unknown row; candidates take the action after the last)."""
        num_items, num_actions = vocab
        event_rows, cand_rows, pieces = [], [], []
        items, actions, q_pos, q_ts, k_pos, k_host_ts = [], [], [], [], [], []
        row = 0
        for slot in slots:
            own = len(slot.events)
            event_rows.append((row, row + own))
            cand_rows.append((row + own, row + own + len(slot.candidates)))
            items += [host_ids(slot.events.item_ids, num_items), host_ids(slot.candidates, num_items)]
            actions += [
                host_ids(slot.events.action_ids, num_actions),
                np.full(len(slot.candidates), num_actions + 1),
            ]
            seen_rows, seen_ts = _seen(slot, slots, event_rows)
            pieces.append(_merged(slot, seen_rows, cand_rows[-1]))
            where = slot.cached + (seen_rows[1] - seen_rows[0])  # the candidates' position
            cand_ts = np.full(len(slot.candidates), float(slot.request_ts))
            q_pos += [np.arange(slot.cached, slot.cached + own), np.full(len(slot.candidates), where)]
            q_ts += [slot.events.timestamps.numpy(), cand_ts]
            k_pos += [np.arange(where), np.full(len(slot.candidates), where)]
            k_host_ts.append(np.concatenate([seen_ts, cand_ts]))
            row += own + len(slot.candidates)
        plan_ids = (np.concatenate(items).astype(np.int64), np.concatenate(actions).astype(np.int64))
        k_pos_t = _device(np.concatenate(k_pos), device)
        cached = CachedKeys.of(slots, pieces)
        k_ts = _key_times(slots, cached, k_host_ts, device)
        k_lengths = [len(p) for p in k_pos[::2]]
        k_lengths = [n + len(c) for n, c in zip(k_lengths, [s.candidates for s in slots], strict=True)]
        batch = last = None
        q_lengths = [b - a for a, b in event_rows]
        q_lengths = [n + (b - a) for n, (a, b) in zip(q_lengths, cand_rows, strict=True)]
        q_pos_h, q_ts_h = np.concatenate(q_pos), np.concatenate(q_ts)
        if sum(q_lengths):
            batch = JaggedBatch.build(
                q_lengths, k_lengths, _device(q_pos_h, device), _device(q_ts_h, device), k_pos_t, k_ts
            )
        cand = np.concatenate([np.arange(a, b) for a, b in cand_rows])
        cand_index = None
        if len(cand) and row - len(cand) <= SHARED_LAST_LAYER_ROWS:
            last = batch
        elif len(cand):
            last = JaggedBatch.build(
                [b - a for a, b in cand_rows],
                k_lengths,
                _device(q_pos_h[cand], device),
                _device(q_ts_h[cand], device),
                k_pos_t,
                k_ts,
            )
        if len(cand) and len(slots) > 1 and not np.array_equal(cand, np.arange(row - len(cand), row)):
            cand_index = _device(cand, device)
        return cls(slots, event_rows, cand_rows, pieces, *plan_ids, batch, last, cand_index, cached)


def _seen(
    slot: UserSlot, slots: list[UserSlot], event_rows: list[tuple[int, int]]
) -> tuple[tuple[int, int], np.ndarray]:
    """The rows and timestamps of the new events ``slot`` sees: its own, or another user's first ones."""
    if slot.reads is None:
        return event_rows[-1], slot.events.timestamps.numpy()
    user, count = slot.reads
    if user >= len(event_rows) - 1 or count > len(slots[user].events) or len(slot.events):
        raise ValueError(
            "a user reads the events of an earlier user, at most all of them, and has none of its own"
        )
    start = event_rows[user][0]
    return (start, start + count), slots[user].events.timestamps.numpy()[:count]


def _merged(slot: UserSlot, seen: tuple[int, int], cands: tuple[int, int]) -> list[tuple[int, int] | None]:
    """A user's key pieces: its prefix (``None``), the event rows it sees, its candidate rows (one
    piece when they follow each other)."""
    rows = [(seen[0], cands[1])] if seen[1] == cands[0] else [seen, cands]
    return ([None] if slot.prefix is not None else []) + rows


def _device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(values))
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _key_times(
    slots: list[UserSlot], cached: CachedKeys, host: list[np.ndarray], device: torch.device
) -> torch.Tensor:
    """Every user's key timestamps: its prefix's (on the device), then the host ones."""
    tail = _device(np.concatenate(host).astype(np.float64), device)
    if all(s.prefix is None for s in slots):
        return tail
    pieces, at = [], 0
    for user, (slot, part) in enumerate(zip(slots, host, strict=True)):
        if slot.prefix is not None:
            pieces.append(cached.times(slot, user))
        pieces.append(tail[at : at + len(part)])
        at += len(part)
    return torch.cat(pieces)
