"""Long users from real histories: the one place a history is lengthened and turned into traffic.

Real histories (MovieLens-100K: a few dozen to a few hundred events) are shorter than the lengths
the experiments, scenarios and benchmarks measure at. A history is lengthened by time-shifted
repetition of the real one, and every report that uses it says so.

Primitives:
- ``synthesise(history, factor)``: ``factor`` copies of ``history``, each earlier copy shifted back
  by the history's span plus one day, the last copy being the real history.
- ``lengthen(past, target_len)``: exactly ``target_len`` events (the most recent ones) of ``past``
  repeated so; synthesised timestamps stay after ``EPOCH_FLOOR`` (compressed in time where the
  copies would reach back before it).
- ``as_behaviours(ml, user_id, history)``: a history as ``user_id``'s behaviour events, items by
  the ids the dataset's log gave them.
- ``long_users(ml, count, events, tag=...)``: ``count`` users of the dataset, each history
  lengthened to ``events``, renamed ``<tag>-<user>``, and one request each.
"""

from __future__ import annotations

from relaygr.schemas import BehaviorEvent, RecommendationRequest
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training.movielens import MovieLens

DAY = 86400.0
EPOCH_FLOOR = 86400.0
"""Synthesised timestamps stay after this (event timestamps must be positive)."""


def synthesise(history: Events, factor: int) -> Events:
    if factor <= 1 or len(history) == 0:
        return history
    ts = history.timestamps
    span = float(ts[-1] - ts[0]) + DAY
    copies = [
        Events(history.item_ids, history.action_ids, ts - (factor - 1 - j) * span) for j in range(factor)
    ]
    out = copies[0]
    for c in copies[1:]:
        out = out.concat(c)
    return out


def lengthen(past: Events, target_len: int) -> Events:
    """Exactly ``target_len`` events (the most recent ones) of ``past`` repeated with time shifts
    (``synthesise``). Where the shifted copies would reach back before ``EPOCH_FLOOR``, the
    synthesised part is compressed linearly in time to end one day (at most a quarter of the time
    since the epoch) before the first real event (order kept; the real history is untouched)."""
    real = len(past)
    if real == 0 or target_len <= real:
        return past.slice(max(0, real - target_len))
    out = synthesise(past, -(-target_len // real))
    out = out.slice(len(out) - target_len)
    ts = out.timestamps.clone()
    n_syn = target_len - real
    first_real = float(past.timestamps[0])
    floor = min(EPOCH_FLOOR, first_real / 4)
    if float(ts[0]) < floor:
        lo, top = float(ts[0]), float(ts[n_syn - 1])
        hi = first_real - min(DAY, first_real / 4)
        scale = (hi - floor) / (top - lo) if top > lo else 0.0
        ts[:n_syn] = floor + (ts[:n_syn] - lo) * scale
        out = Events(out.item_ids, out.action_ids, ts)
    return out


def as_behaviours(ml: MovieLens, user_id: str, history: Events) -> list[BehaviorEvent]:
    """``history`` as behaviour events of ``user_id``, oldest first, items named as the log did."""
    return [
        BehaviorEvent(user_id=user_id, item_id=i, ts=float(t), action=int(a))
        for i, a, t in zip(
            ml.raw_items(history.item_ids.tolist()),
            history.action_ids.tolist(),
            history.timestamps.tolist(),
            strict=True,
        )
    ]


def long_users(
    ml: MovieLens,
    count: int,
    events: int,
    *,
    tag: str,
    longest_first: bool = False,
    min_events: int = 1,
    skip: int = 0,
    num_candidates: int = 128,
) -> tuple[list[BehaviorEvent], list[RecommendationRequest]]:
    """``count`` users of ``ml`` with at least ``min_events`` real events (in id order, or the
    longest histories first; the first ``skip`` of them left out), each whole history lengthened to exactly ``events`` events
    (``lengthen``) as user ``<tag>-<user>``; and one request each, of the same id, stamped when
    it is sent. Raises ``ValueError`` when fewer users qualify."""
    users = [u for u in ml.histories if len(ml.histories[u]) >= min_events]
    users.sort(key=(lambda u: (-len(ml.histories[u]), u)) if longest_first else None)
    if len(users) < skip + count:
        raise ValueError(f"{ml.name} has {len(users)} users with {min_events}+ events, not {skip + count}")
    behaviours: list[BehaviorEvent] = []
    requests: list[RecommendationRequest] = []
    for u in users[skip : skip + count]:
        uid = f"{tag}-{u}"
        behaviours += as_behaviours(ml, uid, lengthen(ml.histories[u], events))
        requests.append(
            RecommendationRequest(request_id=uid, user_id=uid, ts=0.0, num_candidates=num_candidates)
        )
    return behaviours, requests
