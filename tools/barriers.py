"""Barriers between publishing behaviours and measuring: wait until the stages have applied them.

Two ways to know, for two kinds of stage:
- ``wait_groups_caught_up(settings, registry)``: every stage that commits its behaviour offsets
  to a consumer group (the ingress on the public topic, then each stage on the routed one) has
  no lag left. ``ingest_lags`` is one reading of those lags.
- ``wait_sentinels_applied(settings, registry, stages=...)``: the named stages' groups have no lag,
  and the ranking workers' history tables (which keep their own offsets) have applied a
  sentinel behaviour published on every partition after everything else: a probe request of
  the sentinel user comes back ranked with a non-empty history. ``sentinel_users`` picks one
  user per partition.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from relaygr.infra.kafka import admin, consumer, group_lag, partition_for, producer
from relaygr.infra.settings import Settings
from relaygr.schemas import BehaviorEvent, RankedResult, RecommendationRequest, TopicRegistry, decode, encode

STAGE_GROUPS = ("retrieval", "preprocess", "ranking")


async def ingest_lags(
    client: Any, cons: Any, reg: TopicRegistry, stages: Iterable[str] = STAGE_GROUPS
) -> dict[str, int]:
    """Behaviours not yet applied, per stage: the ingress's lag on the public topic, then each
    stage's on the routed one (measured after the ingress's, so a 0 everywhere means that every
    behaviour published before the call is applied). -1: a group not known yet."""
    lags = {
        "ingress": await group_lag(client, cons, f"{reg.prefix}-ingress-behaviors", reg.name("behaviors"))
    }
    for stage in stages:
        lags[stage] = await group_lag(client, cons, f"{reg.prefix}-{stage}", reg.name("routed_behaviors"))
    return lags


async def wait_groups_caught_up(settings: Settings, reg: TopicRegistry, *, timeout_s: float = 600.0) -> float:
    """Wait until the consumer group of every stage has no behaviour left to consume (progress on
    stderr); returns the seconds waited."""
    t0 = time.monotonic()
    client = admin(settings)
    cons = consumer(settings, group_id=None)
    await client.start()
    await cons.start()
    last_note = 0.0
    try:
        while True:
            lags = await ingest_lags(client, cons, reg)
            if all(v == 0 for v in lags.values()):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"behaviours not ingested after {timeout_s:.0f} s: lag {lags}")
            if time.monotonic() - last_note >= 1.0:
                last_note = time.monotonic()
                print(
                    "   ingesting behaviours, still to apply: "
                    + ", ".join(f"{k} {v}" for k, v in lags.items()),
                    file=sys.stderr,
                    flush=True,
                )
            # A few group-offset reads a look: often enough that a caller waits for the lag's end,
            # not for the next look (a second, before).
            await asyncio.sleep(0.2)
    finally:
        await cons.stop()
        await client.close()


def sentinel_users(partitions: int, nonce: str) -> dict[int, str]:
    """One user id per partition."""
    out: dict[int, str] = {}
    i = 0
    while len(out) < partitions:
        uid = f"~sentinel-{nonce}-{i}"
        out.setdefault(partition_for(uid.encode(), partitions), uid)
        i += 1
    return out


async def wait_sentinels_applied(
    settings: Settings,
    reg: TopicRegistry,
    *,
    timeout_s: float = 300.0,
    stages: Sequence[str] | None = None,
    progress: bool = False,
) -> float:
    """Block until every behaviour published so far is applied by the stages; seconds waited.
    ``stages``' consumer groups must have no lag, and on every partition a probe request must
    see the sentinel behaviour published after them in the ranking worker's history."""
    t0 = time.monotonic()
    stages = list(stages if stages is not None else ("retrieval", "preprocess"))
    nonce = uuid.uuid4().hex[:8]
    sentinels = sentinel_users(reg.partitions, nonce)
    prod = producer(settings)
    results = consumer(settings, reg.name("results"), group_id=None, auto_offset_reset="latest")
    client = admin(settings)
    await prod.start()
    await results.start()
    await client.start()
    try:
        await results.seek_to_end()
        for p, uid in sentinels.items():
            b = BehaviorEvent(user_id=uid, item_id=1, ts=1.0, action=1)
            await prod.send_and_wait(reg.name("behaviors"), encode(b), key=b.key(), partition=p)
        pending = dict(sentinels)
        probes: dict[str, int] = {}
        last_probe = last_note = 0.0
        lag = -1
        while time.monotonic() - t0 < timeout_s:
            if stages and lag != 0:
                lags = await ingest_lags(client, results, reg, stages)
                lag = -1 if -1 in lags.values() else sum(lags.values())
            if pending and time.monotonic() - last_probe > 1.0:
                for p, uid in pending.items():
                    rid = f"{uid}-{len(probes)}"
                    req = RecommendationRequest(request_id=rid, user_id=uid, ts=time.time(), num_candidates=8)
                    await prod.send_and_wait(reg.name("requests"), encode(req), key=req.key())
                    probes[rid] = p
                last_probe = time.monotonic()
            for msgs in (await results.getmany(timeout_ms=200)).values():
                for m in msgs:
                    res = decode(RankedResult, m.value)
                    p = probes.get(res.request_id)
                    if p is not None and res.history_len >= 1:
                        pending.pop(p, None)
            if not pending and (not stages or lag == 0):
                return time.monotonic() - t0
            if progress and time.monotonic() - last_note > 5:
                last_note = time.monotonic()
                print(
                    f"   waiting for the stages to apply the behaviours: group lag {lag}, "
                    f"{len(pending)} partition(s) of the ranking workers behind",
                    file=sys.stderr,
                    flush=True,
                )
        raise TimeoutError(f"stages did not apply the behaviours within {timeout_s:.0f} s (lag {lag})")
    finally:
        await client.close()
        await results.stop()
        await prod.stop()
