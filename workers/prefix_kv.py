"""The baton of the relay: a user's behaviour sequence and the per-layer KV cache of its prefix.

Primitives:
- ``Events``: a user's behaviours as aligned tensors (item ids, action ids, timestamps).
- ``history_fingerprint``: a digest of the first ``n`` events of a history. Histories are
  append-only, so a cached prefix of length ``n`` is valid for a longer history exactly when the
  fingerprint of the longer history's first ``n`` events equals the cached one.
- ``window_step(max_len)``, ``window_start(total, max_len, step)``, ``served(history, first,
  max_len, step)``: the part of a long history that is served. A ranker serves at most the
  ``max_len`` most recent events (real logs have users with tens of thousands: bots, shared
  accounts, years of history); the window's start moves in whole steps (an eighth of the cap by
  default), not one event at a time, so a prefix cached for a window stays valid while new
  events arrive, until the start moves on by a step. A capped user is served between
  ``max_len - step`` and ``max_len`` events.
- ``PrefixKV``: what pre-inference leaves behind for ranking — per-layer keys and values of the
  prefix tokens plus what the suffix needs to attend to them (positions, timestamps, length),
  the fingerprint of the history it came from and the version of the model that computed it; in
  a cold tier, possibly in a compressed form (``kv_formats``). On the device it is paged
  (``PrefixKV.paged``: its tokens in the pages of a ``kv_pages.KVPages``, read in place, grown by
  appending pages); ``dense()`` gathers such a prefix into tensors of its own.

This module is the interface between the model (which produces and consumes ``PrefixKV``) and the
prefix store (which keeps it in device memory, host memory or RocksDB). It imports only torch and
the pages (``kv_pages``).
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field, replace

import torch

from relaygr.workers.kv_pages import PagedKV

FINGERPRINT_BYTES = 16


@dataclass(frozen=True)
class Events:
    """A sequence of user behaviours, oldest first.

    ``item_ids`` and ``action_ids`` are int64; ``timestamps`` are float64 seconds. Ties in
    timestamp keep their given order: the caller sorts with a fixed tie-break.
    """

    item_ids: torch.Tensor
    action_ids: torch.Tensor
    timestamps: torch.Tensor

    def __post_init__(self) -> None:
        n = self.item_ids.shape[0]
        if self.item_ids.dim() != 1 or self.action_ids.shape != (n,) or self.timestamps.shape != (n,):
            raise ValueError(
                "Events: item_ids, action_ids and timestamps must be 1-D tensors of one length, got "
                f"{tuple(self.item_ids.shape)}, {tuple(self.action_ids.shape)}, "
                f"{tuple(self.timestamps.shape)}"
            )

    @classmethod
    def from_lists(
        cls,
        item_ids: list[int],
        timestamps: list[float],
        action_ids: list[int] | None = None,
    ) -> Events:
        n = len(item_ids)
        return cls(
            item_ids=torch.as_tensor(item_ids, dtype=torch.int64).reshape(n),
            action_ids=torch.as_tensor(
                action_ids if action_ids is not None else [0] * n, dtype=torch.int64
            ).reshape(n),
            timestamps=torch.as_tensor(timestamps, dtype=torch.float64).reshape(n),
        )

    @classmethod
    def empty(cls) -> Events:
        return cls.from_lists([], [], [])

    def __len__(self) -> int:
        return int(self.item_ids.shape[0])

    def slice(self, start: int, stop: int | None = None) -> Events:
        return Events(self.item_ids[start:stop], self.action_ids[start:stop], self.timestamps[start:stop])

    def concat(self, other: Events) -> Events:
        return Events(
            torch.cat([self.item_ids, other.item_ids]),
            torch.cat([self.action_ids, other.action_ids]),
            torch.cat([self.timestamps, other.timestamps]),
        )


def history_fingerprint(events: Events, n: int | None = None) -> bytes:
    """Digest of the first ``n`` events (all if ``None``): ids, actions and timestamps."""
    n = len(events) if n is None else n
    if n < 0 or n > len(events):
        raise ValueError(f"history_fingerprint: n={n} outside [0, {len(events)}]")
    h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
    h.update(n.to_bytes(8, "little"))
    for t in (events.item_ids, events.action_ids, events.timestamps):
        h.update(t[:n].detach().to("cpu").contiguous().numpy().tobytes())
    return h.digest()


@dataclass
class PrefixKV:
    """Per-layer KV cache of a history prefix of ``length`` tokens.

    ``keys[l]`` and ``values[l]`` have shape ``[heads, length, head_dim]`` (values may use their
    own head dim) on one device and in one dtype. ``positions`` (int64) and ``timestamps``
    (float64) of the prefix tokens travel with them: relative attention bias is computed from
    the absolute positions and timestamps of each token pair. ``fingerprint`` is
    ``history_fingerprint(history, length)``. ``model_version`` names the weights that computed it.

    Paged (``pages`` set, ``PrefixKV.paged``): the keys, values and timestamps live in the pages
    of a ``KVPages`` (``keys``, ``values``, ``positions`` and ``timestamps`` are then empty; the
    positions are ``0 .. length - 1``); ``dense()`` gathers them.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    timestamps: torch.Tensor
    length: int
    fingerprint: bytes
    model_version: str
    meta: dict[str, str] = field(default_factory=dict)
    # A cold tier's compressed form (``kv_formats``): keys and values in ``kv_format``, with the
    # int8 scales, to be decoded to ``exact_dtype``. The model only ever sees "exact" prefixes.
    kv_format: str = "exact"
    scales: list[torch.Tensor] = field(default_factory=list)
    exact_dtype: torch.dtype | None = None
    # The last history found to match (``matches``): a ranking checks one history several times
    # (the cached length, then the lookup), and hashing thousands of events is the costly part.
    _matched: weakref.ref[Events] | None = field(default=None, init=False, repr=False, compare=False)
    # The device's paged form: where its tokens lie (the tensors above are then empty).
    pages: PagedKV | None = field(default=None, repr=False, compare=False)

    @classmethod
    def paged(
        cls, run: PagedKV, fingerprint: bytes, model_version: str, meta: dict[str, str] | None = None
    ) -> PrefixKV:
        """A prefix of ``run.length`` tokens held in ``run``'s pages."""
        device = run.pool.device
        return cls(
            keys=[],
            values=[],
            positions=torch.empty(0, dtype=torch.int64, device=device),
            timestamps=torch.empty(0, dtype=torch.float64, device=device),
            length=run.length,
            fingerprint=fingerprint,
            model_version=model_version,
            meta=dict(meta or {}),
            pages=run,
        )

    @property
    def is_paged(self) -> bool:
        return self.pages is not None

    @property
    def device(self) -> torch.device:
        if self.pages is not None:
            return self.pages.pool.device
        return self.keys[0].device if self.keys else self.positions.device

    @property
    def dtype(self) -> torch.dtype:
        if self.pages is not None:
            return self.pages.pool.layout.dtype
        return self.keys[0].dtype if self.keys else torch.float32

    @property
    def num_layers(self) -> int:
        return self.pages.pool.layout.layers if self.pages is not None else len(self.keys)

    def nbytes(self) -> int:
        """Bytes held by all tensors (what the prefix store budgets); paged, its pages' bytes."""
        if self.pages is not None:
            return self.pages.nbytes()
        tensors = [*self.keys, *self.values, *self.scales, self.positions, self.timestamps]
        return sum(t.numel() * t.element_size() for t in tensors)

    def dense(self) -> PrefixKV:
        """This prefix with tensors of its own, on its device: a paged one's tokens gathered from
        its pages (a copy), any other itself."""
        run = self.pages
        if run is None:
            return self
        keys, values, timestamps = run.pool.gather(run)
        # [layers, n, H, d] -> per layer [H, n, d], every layer in one tensor (back to back).
        keys, values = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
        return replace(
            self,
            keys=list(keys.unbind(0)),
            values=list(values.unbind(0)),
            positions=torch.arange(self.length, device=run.pool.device),
            timestamps=timestamps,
            meta=dict(self.meta),
            pages=None,
        )

    def to(self, device: torch.device | str, *, pin: bool = False, non_blocking: bool = False) -> PrefixKV:
        """A copy on ``device`` (a paged prefix's tokens gathered first). ``pin=True`` on a CPU
        target pins host memory (for fast H2D)."""
        if self.pages is not None:
            return self.dense().to(device, pin=pin, non_blocking=non_blocking)
        device = torch.device(device)

        def move(t: torch.Tensor) -> torch.Tensor:
            if device.type == "cpu":
                out = t.to("cpu")
                if pin and torch.cuda.is_available() and not out.is_pinned():
                    out = out.pin_memory()
                return out
            return t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            keys=[move(k) for k in self.keys],
            values=[move(v) for v in self.values],
            scales=[move(s) for s in self.scales],
            positions=move(self.positions),
            timestamps=move(self.timestamps),
            meta=dict(self.meta),
        )

    def matches(self, history: Events) -> bool:
        """True when this prefix was computed from the first ``length`` events of ``history``."""
        if self._matched is not None and self._matched() is history:  # an ``Events`` is a value
            return True
        ok = len(history) >= self.length and history_fingerprint(history, self.length) == self.fingerprint
        if ok:
            self._matched = weakref.ref(history)
        return ok


# ---------------------------------------------------------------- the served window


def window_step(max_len: int) -> int:
    return max(1, max_len // 8)


def window_start(total: int, max_len: int, step: int) -> int:
    if total <= max_len:
        return 0
    return -(-(total - max_len) // step) * step  # rounded up to a whole step: never over the cap


def served(history: Events, first: int, max_len: int, step: int) -> tuple[Events, bool]:
    start = max(first, window_start(first + len(history), max_len, step))
    return (history.slice(start - first) if start > first else history), start > 0
