"""Replay recorded requests into a pipeline: at a target QPS or at the original pace, for a duration.

The source is a trace topic (``relaygr trace build``) or any recorded requests topic, read from
the beginning, an offset or a timestamp. Its partitions are merged by each request's time (its
``event_ts``, else its ``ts``) keeping every partition's own order, so a user's requests (one key,
one partition) go out in their recorded order. Each request is re-stamped with the wall clock at
send (``ts``, the latency origin) and keeps its time on the behaviours' clock (``event_ts``; a
recorded request without one gets its original ``ts``), so stages cut histories as they did.

Behaviours of the trace (its ``-behaviors`` companion) are published in time order as well:
those older than the first replayed request up front (``preload``; or, per user, those older than
that user's first request), each later one just before the first request that is later than it.
Publishing a behaviour early changes no history (stages cut at ``event_ts``); late would.

Primitives:
- ``merge_by_time(records, key)``: one stream of several partitions' records, each partition's
  order kept.
- ``poisson_offsets(n, qps, seed)``: send times of Poisson arrivals (exponential gaps).
- ``scaled_offsets(times, speed)``: the original inter-arrival times divided by ``speed``.
- ``plan_replay(requests, qps=|speed=, duration_s, max_requests)``: requests and their send offsets.
- ``Replayer(settings, registry, behaviours, user_prefix)``: ``preload(before_ts)`` and
  ``run(plan)`` against one pipeline's topics (an async context manager).
- ``wait_ingested(settings, registry)``: wait until the stages have applied every behaviour
  published so far (consumer-group offsets of retrieval and pre-processing; a sentinel behaviour
  and probe request per partition for the ranking workers' history tables).
- CLI: ``relaygr replay --topic T (--qps Q | --speed S) [--duration D] [--from-offset|--from-timestamp]``.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from relaygr.infra.kafka import partition_for
from relaygr.infra.settings import Settings
from relaygr.schemas import (
    BehaviorEvent,
    RankedResult,
    RecommendationRequest,
    TopicRegistry,
    decode,
    encode,
)
from relaygr.tools.traffic import ingest_lags

T = TypeVar("T")


def merge_by_time(records: Iterable[T], key: Callable[[T], float]) -> list[T]:
    """Merge records of several partitions (each with a ``partition`` attribute, given in each
    partition's order) by ``key``; within a partition the given order is kept even where ``key``
    is not monotone."""
    parts: dict[int, list[T]] = {}
    for r in records:
        parts.setdefault(r.partition, []).append(r)  # type: ignore[attr-defined]
    return list(heapq.merge(*parts.values(), key=key))


def poisson_offsets(n: int, qps: float, seed: int = 0) -> list[float]:
    """Send offsets (seconds from the start) of ``n`` Poisson arrivals at rate ``qps``; the first
    request goes at 0."""
    if qps <= 0:
        raise ValueError("qps must be positive")
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(qps)
        out.append(t)
    return out


def scaled_offsets(times: Sequence[float], speed: float) -> list[float]:
    """Original inter-arrival times divided by ``speed``; never earlier than the previous send."""
    if speed <= 0:
        raise ValueError("speed must be positive")
    out, last = [], 0.0
    for t in times:
        last = max(last, (t - times[0]) / speed)
        out.append(last)
    return out


@dataclass
class ReplayPlan:
    requests: list[RecommendationRequest]
    offsets: list[float]  # seconds after the start of the replay

    @property
    def duration_s(self) -> float:
        return self.offsets[-1] if self.offsets else 0.0


def plan_replay(
    requests: Sequence[RecommendationRequest],
    *,
    qps: float | None = None,
    speed: float | None = None,
    duration_s: float | None = None,
    max_requests: int | None = None,
    seed: int = 0,
    times: Sequence[float] | None = None,
) -> ReplayPlan:
    """Send offsets for ``requests`` (in the given order): Poisson at ``qps`` or the original
    timing (``times``, default each request's ``model_ts``) sped up by ``speed``; cut at
    ``duration_s`` and ``max_requests``."""
    if (qps is None) == (speed is None):
        raise ValueError("give exactly one of qps and speed")
    reqs = list(requests[:max_requests] if max_requests is not None else requests)
    if qps is not None:
        offsets = poisson_offsets(len(reqs), qps, seed)
    else:
        ts = list(times[: len(reqs)]) if times is not None else [r.model_ts for r in reqs]
        offsets = scaled_offsets(ts, speed)  # type: ignore[arg-type]
    if duration_s is not None:
        keep = sum(1 for o in offsets if o < duration_s)
        reqs, offsets = reqs[:keep], offsets[:keep]
    return ReplayPlan(reqs, offsets)


def renamed(ev: Any, user_prefix: str) -> Any:
    """``ev`` with ``user_prefix`` put before its user id (and request id, if it has one)."""
    if not user_prefix:
        return ev
    upd = {"user_id": user_prefix + ev.user_id}
    if hasattr(ev, "request_id"):
        upd["request_id"] = user_prefix + ev.request_id
    return ev.model_copy(update=upd)


class Replayer:
    """Publishes behaviours and requests into the pipeline with topic registry ``reg``."""

    def __init__(
        self,
        settings: Settings,
        reg: TopicRegistry,
        behaviours: Sequence[BehaviorEvent] = (),
        *,
        user_prefix: str = "",
        progress: bool = False,
    ) -> None:
        self.settings, self.reg = settings, reg
        self.behaviours = sorted(behaviours, key=lambda b: b.ts)  # stable: per-user order kept
        self.next_behaviour = 0
        self.user_prefix = user_prefix
        self.progress = progress
        self.prod = None

    async def __aenter__(self) -> Replayer:
        from relaygr.infra.kafka import producer

        self.prod = producer(self.settings, linger_ms=2)
        await self.prod.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.prod is not None:
            await self.prod.stop()
            self.prod = None

    def _say(self, msg: str) -> None:
        if self.progress:
            print(f"   {msg}", file=sys.stderr, flush=True)

    async def _behaviours_before(self, ts: float) -> int:
        """Publish every pending behaviour older than ``ts``; wait for the broker's acks."""
        topic, futs = self.reg.name("behaviors"), []
        while self.next_behaviour < len(self.behaviours) and self.behaviours[self.next_behaviour].ts < ts:
            b = renamed(self.behaviours[self.next_behaviour], self.user_prefix)
            futs.append(await self.prod.send(topic, encode(b), key=b.key()))
            self.next_behaviour += 1
            if len(futs) >= 5000:
                await asyncio.gather(*futs)
                futs.clear()
                self._say(f"behaviours published: {self.next_behaviour}/{len(self.behaviours)}")
        await asyncio.gather(*futs)
        return len(futs)

    async def preload(self, before_ts: float | Mapping[str, float] = math.inf) -> int:
        """Publish the behaviours older than ``before_ts`` (all by default), or, given a mapping,
        each listed user's behaviours older than that user's time. Returns how many."""
        if not isinstance(before_ts, Mapping):
            n0 = self.next_behaviour
            await self._behaviours_before(before_ts)
            return self.next_behaviour - n0
        rest = self.behaviours[self.next_behaviour :]
        now = [b for b in rest if b.ts < before_ts.get(b.user_id, -math.inf)]
        self.behaviours = [b for b in rest if not b.ts < before_ts.get(b.user_id, -math.inf)]
        self.next_behaviour = 0
        topic, futs = self.reg.name("behaviors"), []
        for i, b in enumerate(now, 1):
            b = renamed(b, self.user_prefix)
            futs.append(await self.prod.send(topic, encode(b), key=b.key()))
            if len(futs) >= 5000:
                await asyncio.gather(*futs)
                futs.clear()
                self._say(f"behaviours preloaded: {i}/{len(now)}")
        await asyncio.gather(*futs)
        return len(now)

    async def run(self, plan: ReplayPlan, *, behaviours: bool = True) -> list[RecommendationRequest]:
        """Send ``plan``'s requests at their offsets, each preceded by the behaviours older than it
        (none with ``behaviours=False``: a side replay, such as a warm-up, must not publish a later
        replay's behaviours ahead of their time). Returns the requests as sent (renamed, ``ts`` =
        send time, ``event_ts`` set)."""
        topic = self.reg.name("requests")
        sent, futs = [], []
        t0 = time.monotonic()
        last_note = t0
        for r, off in zip(plan.requests, plan.offsets, strict=True):
            wait = t0 + off - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if behaviours:
                await self._behaviours_before(r.model_ts)
            out = renamed(r, self.user_prefix).model_copy(update={"ts": time.time(), "event_ts": r.model_ts})
            futs.append(await self.prod.send(topic, encode(out), key=out.key()))
            sent.append(out)
            if self.progress and time.monotonic() - last_note > 5:
                last_note = time.monotonic()
                self._say(f"replayed {len(sent)}/{len(plan.requests)} requests in {last_note - t0:.0f} s")
        await asyncio.gather(*futs)
        return sent


# ---------------------------------------------------------------------- ingestion barrier


def sentinel_users(partitions: int, nonce: str) -> dict[int, str]:
    """One user id per partition."""
    out: dict[int, str] = {}
    i = 0
    while len(out) < partitions:
        uid = f"~sentinel-{nonce}-{i}"
        out.setdefault(partition_for(uid.encode(), partitions), uid)
        i += 1
    return out


async def wait_ingested(
    settings: Settings,
    reg: TopicRegistry,
    *,
    timeout_s: float = 300.0,
    stages: Sequence[str] | None = None,
    progress: bool = False,
) -> float:
    """Block until every behaviour published so far is applied by the stages; seconds waited."""
    from relaygr.infra.kafka import admin, consumer, producer

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


# ---------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--topic", help="trace or recorded requests topic (default <RELAYGR_TOPIC_PREFIX>.trace)"
    )
    parser.add_argument(
        "--behaviors-topic", help="behaviours to replay with it (default <topic>-behaviors, if it exists)"
    )
    parser.add_argument("--no-behaviors", action="store_true", help="replay requests only")
    parser.add_argument(
        "--prefix", help="topic prefix of the pipeline to replay into (default RELAYGR_TOPIC_PREFIX)"
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--from-offset", help="start offset: N for every partition, or P:N,P:N (default: the beginning)"
    )
    start.add_argument(
        "--from-timestamp", help="start at the records written since this time (epoch seconds or ISO 8601)"
    )
    pace = parser.add_mutually_exclusive_group(required=True)
    pace.add_argument("--qps", type=float, help="Poisson arrivals at this rate")
    pace.add_argument("--speed", type=float, help="original inter-arrival times divided by this factor")
    parser.add_argument(
        "--timing",
        choices=["event", "sent", "record"],
        default="event",
        help="original time of a request for --speed: event_ts (else ts), ts, or the record's timestamp",
    )
    parser.add_argument("--duration", type=float, help="stop sending after this many seconds")
    parser.add_argument("--max-requests", type=int, help="send at most this many requests")
    parser.add_argument("--user-prefix", default="", help="put this before every user and request id")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument(
        "--no-wait", action="store_true", help="don't wait for the stages to apply the preloaded behaviours"
    )
    parser.add_argument("--json", action="store_true", help="print the replay's figures as one JSON line")


def run(args: argparse.Namespace) -> int:
    from relaygr.demo import ensure_broker
    from relaygr.infra.broker import BrokerError
    from relaygr.infra.kafka import describe_partitions
    from relaygr.infra.settings import get_settings
    from relaygr.tools.trace import Start, read_topic

    try:
        settings, _ = ensure_broker(get_settings())
        prefix = args.prefix or settings.topic_prefix
        reg = TopicRegistry(prefix, settings.partitions)
        topic = args.topic or f"{settings.topic_prefix}.trace"
        start = Start.parse(args.from_offset, args.from_timestamp)

        async def go() -> dict:
            got = await read_topic(settings, topic, RecommendationRequest, start, progress=True)
            records = merge_by_time(
                got.records,
                (lambda r: r.timestamp_ms / 1000)
                if args.timing == "record"
                else (lambda r: r.value.ts)
                if args.timing == "sent"
                else (lambda r: r.value.model_ts),
            )
            times = [
                r.timestamp_ms / 1000
                if args.timing == "record"
                else r.value.ts
                if args.timing == "sent"
                else r.value.model_ts
                for r in records
            ]
            plan = plan_replay(
                [r.value for r in records],
                qps=args.qps,
                speed=args.speed,
                duration_s=args.duration,
                max_requests=args.max_requests,
                seed=args.seed,
                times=times,
            )
            behaviours: list[BehaviorEvent] = []
            btopic = args.behaviors_topic or f"{topic}-behaviors"
            if not args.no_behaviors and (
                args.behaviors_topic or btopic in await describe_partitions(settings, [btopic])
            ):
                behaviours = [r.value for r in (await read_topic(settings, btopic, BehaviorEvent)).records]
            print(
                f"== replaying {len(plan.requests)} of {len(records)} requests from {topic} "
                f"({len(behaviours)} behaviours) into {prefix}.* over {plan.duration_s:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            async with Replayer(settings, reg, behaviours, user_prefix=args.user_prefix, progress=True) as rp:
                first = plan.requests[0].model_ts if plan.requests else math.inf
                pre = await rp.preload(first)
                if pre and not args.no_wait:
                    await wait_ingested(settings, reg, progress=True)
                t0 = time.monotonic()
                sent = await rp.run(plan)
                secs = time.monotonic() - t0
            return {
                "replay": topic,
                "into": prefix,
                "requests": len(sent),
                "skipped_undecodable": got.undecodable,
                "behaviours_preloaded": pre,
                "behaviours": rp.next_behaviour,
                "seconds": round(secs, 2),
                "qps": round(len(sent) / secs, 2) if secs > 0 else None,
                "first_request_id": sent[0].request_id if sent else None,
                "last_request_id": sent[-1].request_id if sent else None,
            }

        out = asyncio.run(go())
    except (BrokerError, LookupError, ValueError, TimeoutError) as e:
        print(f"relaygr replay: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        print(f"replayed {out['requests']} requests in {out['seconds']} s ({out['qps']} req/s)")
    return 0
