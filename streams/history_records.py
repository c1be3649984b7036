"""The history table's record format, and incoming behaviours packed into it.

Primitives:
- ``RECORD``: one event as a fixed-width record (item int64, action int16, ts float64, 18 bytes);
  the item column holds ``relaygr.workers.model.vocab.item_key`` of the raw id.
- ``event_record(event, source, seen)``: one event packed, or nothing when its source offset was
  applied before; ``batch_records(batch, seen)``: a routed batch's events packed at once, without
  those already applied. Both move ``seen`` (source partition -> last applied offset) on.

The table (``relaygr.streams.history``) writes what they pack; they read nothing from it.
"""

from __future__ import annotations

import struct

import numpy as np

from relaygr.schemas import BehaviorBatch, BehaviorEvent
from relaygr.schemas.routing import Positions
from relaygr.workers.model.vocab import item_key, item_keys

RECORD = np.dtype([("item", "<i8"), ("action", "<i2"), ("ts", "<f8")])
# One record packed without numpy (the ingestion hot path): the same 18 bytes as RECORD.
_RECORD_STRUCT = struct.Struct("<qhd")
assert _RECORD_STRUCT.size == RECORD.itemsize


def event_record(ev: BehaviorEvent, source: tuple[int, int] | None, seen: Positions) -> tuple[bytes, int]:
    """One event packed (or nothing, when its source offset was applied before), moving ``seen``."""
    if source is not None:
        q, src_offset = source
        if src_offset <= seen.get(q, -1):
            return b"", 0
        seen[q] = src_offset
    return _RECORD_STRUCT.pack(item_key(ev.item_id), ev.action, ev.ts), 1


def batch_records(ev: BehaviorBatch, seen: Positions) -> tuple[bytes, int]:
    """A routed batch's events packed at once, without those whose source offset is not above
    the last applied one of its source partition (``seen``, moved on). Per source partition the
    ingress forwards in offset order, so an event is new iff it is above every earlier one."""
    n = len(ev.item_ids)
    if not n:
        return b"", 0
    parts = np.asarray(ev.source_partitions, dtype=np.int64)
    offsets = np.asarray(ev.source_offsets, dtype=np.int64)
    keep = np.ones(n, dtype=bool)
    for q in np.unique(parts).tolist():
        at = np.flatnonzero(parts == q)
        offs = offsets[at]
        before = np.maximum.accumulate(np.concatenate(([seen.get(q, -1)], offs[:-1])))
        keep[at] = offs > before
        seen[q] = max(seen.get(q, -1), int(offs.max()))
    rec = np.empty(n, dtype=RECORD)
    rec["item"] = item_keys(ev.item_ids)
    rec["action"] = ev.actions
    rec["ts"] = ev.timestamps
    if not keep.all():
        rec = rec[keep]
    return rec.tobytes(), len(rec)
