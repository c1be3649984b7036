"""The prefix store's counters: what each one counts, and the snapshot ``PrefixStore.metrics`` gives.

Primitives:
- ``COUNTERS``: every counter's name (all monotonic), reported as 0 until it first counts.
- ``StoreCounters``: a ``Counter`` of them. ``hit(tier, tiers)`` counts one lookup served by
  ``tier`` (``"miss"``: none) as a hit there and a miss in every faster tier it passed;
  ``snapshot()`` is every counter plus the totals ``promotions`` and ``demotions``.
"""

from __future__ import annotations

from collections import Counter

COUNTERS = (
    # lookups: where the prefix was found, and the tiers passed on the way
    "lookups",
    "hits_device",
    "hits_host",
    "hits_disk",
    "misses_device",
    "misses_host",
    "misses_disk",
    "misses",
    "invalidations",  # entries whose history changed under them, dropped
    # the expander's choice (``tier_costs``): a tier predicted slower than recomputing
    "skips_host_slower",  # a valid host entry not served: recomputing was predicted faster
    "skips_disk_slower",  # the same for a valid disk entry
    "disk_writes_skipped_slower",  # a prefix not written to disk: reading it back would lose
    # moves between tiers
    "promotions_host_to_device",
    "promotions_disk_to_device",
    "demotions_device_to_host",
    "demotions_to_disk",
    "evictions",  # left memory with no disk copy
    "evictions_disk",
    # leases
    "leases_admitted",
    "leases_renewed",
    "leases_refused",
    "leases_released",
    "lease_expiries",
    "lease_revocations",  # a prefix larger than the pinned budget allows
    # computations
    "singleflight_merges",
    "computations",
    "extensions",
    "puts",
    # the disk writer and the disk tier
    "disk_writes",
    "disk_bytes_written",
    "disk_write_drops",
    "disk_write_errors",
    "disk_corrupt",
    "disk_purged_other_version",
    "forgotten",  # users whose prefixes were dropped because their state no longer matched
)


class StoreCounters(Counter[str]):
    def hit(self, tier: str, tiers: tuple[str, ...]) -> None:
        self["lookups"] += 1
        for t in tiers:
            if t == tier:
                self[f"hits_{t}"] += 1
                return
            self[f"misses_{t}"] += 1
        self["misses"] += 1

    def snapshot(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict.fromkeys(COUNTERS, 0)
        out.update(self)
        out["promotions"] = out["promotions_host_to_device"] + out["promotions_disk_to_device"]
        out["demotions"] = out["demotions_device_to_host"] + out["demotions_to_disk"]
        return out
