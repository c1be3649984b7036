"""Traffic for the pipeline from real MovieLens data, and reading the answers back.

Primitives:
- ``leave_last_out(ml, users, synth_factor)``: per user, the behaviours before their last
  interaction and a request whose ground truth is that last item (``event_ts`` = its time).
- ``synthesise(history, factor)``: a longer history by time-shifted repetition of the real one:
  ``factor`` copies, each earlier copy shifted back by the history's span plus one day, the last
  copy being the real history. Used where MovieLens histories are shorter than the experiment
  needs; reports say so.
- ``publish(settings, registry, behaviours, requests, qps)``: behaviours first (keyed by user),
  then requests paced at ``qps`` (wall-clock ``ts`` stamped at send time).
- ``collect_results(settings, registry, request_ids, timeout_s)``: results by request_id (the
  last one per id: results are idempotent by key).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import torch

from relaygr.infra.kafka import consumer, producer
from relaygr.infra.publishing import send_in_order
from relaygr.infra.settings import Settings
from relaygr.schemas import BehaviorEvent, RankedResult, RecommendationRequest, TopicRegistry, decode, encode
from relaygr.tools.barriers import wait_groups_caught_up
from relaygr.workers.model.vocab import item_keys
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training.movielens import MovieLens

DAY = 86400.0


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


def leave_last_out(
    ml: MovieLens,
    users: Iterable[int],
    *,
    synth_factor: int = 1,
    target_len: int | None = None,
    max_len: int | None = None,
    num_candidates: int = 128,
    top_k: int = 10,
) -> tuple[list[BehaviorEvent], list[RecommendationRequest]]:
    """Per user: the history before the last interaction as behaviours (lengthened by
    ``synth_factor`` repetitions, or to exactly ``target_len`` events by as many as needed; then
    at most the ``max_len`` most recent) and a request for the last interaction."""
    behaviours: list[BehaviorEvent] = []
    requests: list[RecommendationRequest] = []
    for u in users:
        h = ml.histories[u]
        if len(h) < 2:
            continue
        past = h.slice(0, len(h) - 1)
        if target_len is not None:
            past = synthesise(past, -(-target_len // len(past)))
            past = past.slice(max(0, len(past) - target_len))
        else:
            past = synthesise(past, synth_factor)
        if max_len is not None and len(past) > max_len:
            past = past.slice(len(past) - max_len)
        uid = str(u)
        behaviours += [
            BehaviorEvent(user_id=uid, item_id=i, ts=float(t), action=int(a))
            for i, a, t in zip(
                ml.raw_items(past.item_ids.tolist()),
                past.action_ids.tolist(),
                past.timestamps.tolist(),
                strict=True,
            )
        ]
        requests.append(
            RecommendationRequest(
                request_id=f"ml-{u}-{len(h) - 1}",
                user_id=uid,
                ts=time.time(),
                event_ts=float(h.timestamps[-1]),
                num_candidates=num_candidates,
                top_k=top_k,
                label_item_id=ml.raw_items([int(h.item_ids[-1])])[0],
            )
        )
    return behaviours, requests


def history_of(behaviours: list[BehaviorEvent], user_id: str, before_ts: float | None = None) -> Events:
    """The history a stage sees for ``user_id`` at ``before_ts``: its events strictly before it,
    items as the ranking worker's history table keeps them (``item_key``: integers as is)."""
    mine = [b for b in behaviours if b.user_id == user_id and (before_ts is None or b.ts < before_ts)]
    return Events(
        torch.from_numpy(item_keys([b.item_id for b in mine])),
        torch.tensor([b.action for b in mine], dtype=torch.int64),
        torch.tensor([b.ts for b in mine], dtype=torch.float64),
    )


async def publish(
    settings: Settings,
    reg: TopicRegistry,
    behaviours: list[BehaviorEvent],
    requests: list[RecommendationRequest],
    *,
    qps: float = 50.0,
    settle_s: float = 1.0,
    wait_for_ingest: bool = False,
) -> list[RecommendationRequest]:
    """Publish behaviours, then requests at ``qps``; returns the requests as sent (with their
    send-time ``ts``). ``wait_for_ingest`` waits until every stage consumed the behaviours."""
    # No lingering: a request's send time is its timestamp, so batching would count as latency.
    prod = producer(settings, linger_ms=0)
    await prod.start()
    sent = []
    try:
        await send_in_order(prod, reg.name("behaviors"), behaviours)
        if wait_for_ingest and behaviours:
            await wait_groups_caught_up(settings, reg)
        await asyncio.sleep(settle_s)
        t0 = time.monotonic()
        for i, r in enumerate(requests):
            wait = t0 + i / qps - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            r = r.model_copy(update={"ts": time.time()})
            await prod.send_and_wait(reg.name("requests"), encode(r), key=r.key())
            sent.append(r)
    finally:
        await prod.stop()
    return sent


async def collect_results(
    settings: Settings, reg: TopicRegistry, request_ids: set[str], *, timeout_s: float = 60.0
) -> dict[str, RankedResult]:
    cons = consumer(settings, reg.name("results"), group_id=None)
    await cons.start()
    out: dict[str, RankedResult] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while not request_ids <= out.keys() and time.monotonic() < deadline:
            for msgs in (await cons.getmany(timeout_ms=200)).values():
                for m in msgs:
                    r = decode(RankedResult, m.value)
                    if r.request_id in request_ids:
                        out[r.request_id] = r
    finally:
        await cons.stop()
    return out
