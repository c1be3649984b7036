"""What tests read of a ``PrefixStore``'s inside: which keys each tier holds, and who is leased.

The store's public surface is lookups, leases and counters; these views exist for assertions only.
"""

from __future__ import annotations

from typing import Any

from relaygr.workers.store.prefix_store import PrefixStore, UserId


def keys_by_tier(store: PrefixStore) -> dict[str, Any]:
    """Keys per tier (device and host in LRU order), keys on their way to disk, and the leases
    as ``{key: (expires_at, reserved_bytes)}``."""
    return store.placement.layout()


def is_leased(store: PrefixStore, user_id: UserId) -> bool:
    """Whether ``user_id`` holds a lease now (expired leases are ended first)."""
    return store.placement.is_leased(user_id)


def resident_prefix(store: PrefixStore, user_id: UserId) -> Any:
    """The ``PrefixKV`` the device or host tier holds for ``user_id`` (None: none)."""
    with store.placement.lock:
        entry = store.placement._entries.get(store.placement.key(user_id))
        return None if entry is None else entry.prefix
