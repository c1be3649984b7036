"""Adopting a predecessor's prefixes: a successor takes over the prefixes another process of the
same worker left on its disk tier, but only those still valid for the successor's own histories.

Primitives:
- ``adopt_prefixes(snapshot, store, history_of, max_bytes=None) -> Adoption``: for each entry of
  ``snapshot`` (a ``tiers.DiskSnapshot``) whose user ``history_of`` knows, check it as a lookup
  would (the store's model version; the fingerprint of the successor's history over the entry's
  length), decode it (the cold format's decoding, as a disk-tier hit) and ``put`` it into
  ``store``. Anything else is refused and counted: nothing computed from another history or by
  another model is ever adopted. The most recently written entries are chosen first, within
  ``max_bytes`` (default: the store's device and host budgets), and put oldest first, so that
  the store's LRU order keeps the predecessor's.
- ``Adoption``: the counts (adopted, refused by reason, skipped users it does not know), bytes
  and seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from relaygr.workers.prefix_kv import Events, history_fingerprint
from relaygr.workers.store.kv_codec import CodecError, decode
from relaygr.workers.store.kv_formats import to_warm
from relaygr.workers.store.prefix_store import PrefixStore, UserId
from relaygr.workers.store.tiers import DiskMeta, DiskSnapshot, StoreKey


@dataclass
class Adoption:
    """What ``adopt_prefixes`` did. ``bytes``: stored bytes of the adopted entries."""

    adopted: int = 0
    refused_version: int = 0  # computed by another model version
    refused_history: int = 0  # the successor's history differs over the entry's length
    refused_corrupt: int = 0  # did not read or decode, or its header does not match its index
    skipped_users: int = 0  # users the successor has no history of (not its partitions)
    skipped_budget: int = 0  # valid, but beyond ``max_bytes``
    bytes: int = 0
    seconds: float = 0.0

    @property
    def refused(self) -> int:
        return self.refused_version + self.refused_history + self.refused_corrupt

    def fields(self) -> dict[str, int | float]:
        return {**asdict(self), "refused": self.refused, "seconds": round(self.seconds, 3)}


def adopt_prefixes(
    snapshot: DiskSnapshot,
    store: PrefixStore,
    history_of: Callable[[UserId], Events | None],
    max_bytes: int | None = None,
) -> Adoption:
    """Put into ``store`` every prefix of ``snapshot`` valid for the history ``history_of`` gives
    its user (None or empty: not this store's user). Blocking: call it off the event loop."""
    t0 = time.monotonic()
    out = Adoption()
    budget = max_bytes if max_bytes is not None else _memory_budget(store)
    chosen: list[tuple[StoreKey, DiskMeta]] = []
    newest_first = sorted(snapshot.index().items(), key=lambda kv: kv[1].seq, reverse=True)
    for key, meta in newest_first:
        history = history_of(key[0])
        if not history:
            out.skipped_users += 1
        elif key[1] != store.model_version:
            out.refused_version += 1
        elif meta.length > len(history) or history_fingerprint(history, meta.length) != meta.fingerprint:
            out.refused_history += 1
        elif out.bytes + meta.nbytes > budget:
            out.skipped_budget += 1
        else:
            chosen.append((key, meta))
            out.bytes += meta.nbytes
    for key, meta in reversed(chosen):  # oldest first: the newest end up most recently used
        try:
            blob = snapshot.read(key, meta)
            if blob is None:
                raise CodecError("missing", "rewritten or deleted since the index was read")
            prefix = decode(blob, expected_model_version=store.model_version)
            if prefix.length != meta.length or prefix.fingerprint != meta.fingerprint:
                raise CodecError("bad_header", "blob does not match its index record")
        except Exception:  # a codec error, or a file its owner deleted before this read opened it
            out.refused_corrupt += 1
            out.bytes -= meta.nbytes
            continue
        store.put(key[0], to_warm(prefix, store.device), keep_longer=True)
        out.adopted += 1
    out.seconds = time.monotonic() - t0
    return out


def _memory_budget(store: PrefixStore) -> int:
    return store.config.device_budget_bytes + store.config.host_budget_bytes
