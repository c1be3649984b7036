"""Traffic for the pipeline from real MovieLens data, and reading the answers back.

Primitives:
- ``leave_last_out(ml, users, synth_factor)``: per user, the behaviours before their last
  interaction and a request whose ground truth is that last item (``event_ts`` = its time);
  histories lengthened by ``tools.long_users``.
- ``publish(settings, registry, behaviours, requests, qps)``: behaviours first (keyed by user),
  then requests paced at ``qps`` by ``tools.sender`` (wall-clock ``ts`` stamped at send time).
- ``count_results(settings, registry, request_ids, timeout_s, linger_s)``: every result of some
  requests on the results topic: the first of each, and how many there were of each.
- ``collect_results(settings, registry, request_ids, timeout_s)``: their results by request id.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable

import torch

from relaygr.infra.kafka import consumer, producer
from relaygr.infra.publishing import send_in_order
from relaygr.infra.settings import Settings
from relaygr.schemas import BehaviorEvent, RankedResult, RecommendationRequest, TopicRegistry, decode
from relaygr.tools.barriers import wait_groups_caught_up
from relaygr.tools.long_users import as_behaviours, lengthen, synthesise
from relaygr.tools.sender import PacedSender, rate_offsets
from relaygr.workers.model.vocab import item_keys
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training.movielens import MovieLens


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
        past = lengthen(past, target_len) if target_len is not None else synthesise(past, synth_factor)
        if max_len is not None and len(past) > max_len:
            past = past.slice(len(past) - max_len)
        behaviours += as_behaviours(ml, str(u), past)
        requests.append(
            RecommendationRequest(
                request_id=f"ml-{u}-{len(h) - 1}",
                user_id=str(u),
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
    prod = producer(settings, linger_ms=5)
    await prod.start()
    try:
        await send_in_order(prod, reg.name("behaviors"), behaviours)
    finally:
        await prod.stop()
    if wait_for_ingest and behaviours:
        await wait_groups_caught_up(settings, reg)
    await asyncio.sleep(settle_s)
    if not requests:
        return []
    async with PacedSender(settings, reg.name("requests")) as sender:
        return await sender.send(requests, rate_offsets(qps))


async def count_results(
    settings: Settings,
    reg: TopicRegistry,
    request_ids: set[str],
    *,
    timeout_s: float = 120.0,
    linger_s: float = 3.0,
    keep: str = "first",
) -> tuple[dict[str, RankedResult], Counter[str]]:
    """Every result on the results topic for ``request_ids``: the first of each (what a caller got;
    ``keep="last"``: the last, as a table of results reads them), and how many there were of each.
    Reads until all came and ``linger_s`` more (a late second copy counts), or ``timeout_s``."""
    cons = consumer(settings, reg.name("results"), group_id=None)
    await cons.start()
    first: dict[str, RankedResult] = {}
    counts: Counter[str] = Counter()
    try:
        deadline = time.monotonic() + timeout_s
        done_at: float | None = None
        while time.monotonic() < deadline and (done_at is None or time.monotonic() < done_at + linger_s):
            for msgs in (await cons.getmany(timeout_ms=200)).values():
                for m in msgs:
                    r = decode(RankedResult, m.value)
                    if r.request_id in request_ids:
                        counts[r.request_id] += 1
                        if keep == "last" or r.request_id not in first:
                            first[r.request_id] = r
            if done_at is None and request_ids <= first.keys():
                done_at = time.monotonic()
    finally:
        await cons.stop()
    return first, counts


async def collect_results(
    settings: Settings, reg: TopicRegistry, request_ids: set[str], *, timeout_s: float = 60.0
) -> dict[str, RankedResult]:
    """The results of ``request_ids`` by id (the last of each read, as a table of results keeps
    them), as soon as every one came (or ``timeout_s``)."""
    got, _ = await count_results(settings, reg, request_ids, timeout_s=timeout_s, linger_s=0.0, keep="last")
    return got
