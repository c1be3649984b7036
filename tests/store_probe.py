"""What tests read of a ``PrefixStore``'s inside: which keys each tier holds, and who is leased.

The store's public surface is lookups, leases and counters; these views exist for assertions only.
"""

from __future__ import annotations

from typing import Any

from relaygr.workers.prefix_store import PrefixStore, UserId


def keys_by_tier(store: PrefixStore) -> dict[str, Any]:
    """Keys per tier (device and host in LRU order), keys on their way to disk, and the leases
    as ``{key: (expires_at, reserved_bytes)}``."""
    with store._lock:
        return {
            "device": store._device_tier.keys(),
            "host": store._host_tier.keys(),
            "pending": store._writer.pending_keys() if store._writer is not None else [],
            "disk": store._disk.list_keys() if store._disk is not None else [],
            "leases": {k: (v.expires_at, v.reserved) for k, v in store._leases.items()},
        }


def is_leased(store: PrefixStore, user_id: UserId) -> bool:
    """Whether ``user_id`` holds a lease now (expired leases are ended first)."""
    with store._lock:
        store._maybe_expire(store._clock())
        return store._key(user_id) in store._leases
