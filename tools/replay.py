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
- ``poisson_offsets(n, qps, seed)``: send times of Poisson arrivals (exponential gaps).
- ``scaled_offsets(times, speed)``: the original inter-arrival times divided by ``speed``.
- ``plan_replay(requests, qps=|speed=, duration_s, max_requests)``: requests and their send offsets.
- ``Replayer(settings, registry, behaviours, user_prefix)``: ``preload(before_ts)`` and
  ``run(plan)`` against one pipeline's topics (an async context manager).
- CLI: ``relaygr replay --topic T (--qps Q | --speed S) [--duration D] [--from-offset|--from-timestamp]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relaygr.infra.publishing import send_in_order
from relaygr.infra.settings import Settings
from relaygr.infra.topic_reader import Start, merge_by_time, read_topic
from relaygr.schemas import BehaviorEvent, RecommendationRequest, TopicRegistry
from relaygr.tools.barriers import wait_sentinels_applied
from relaygr.tools.sender import PacedSender


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
        self.sender: PacedSender | None = None
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Replayer:
        from relaygr.infra.kafka import producer

        self.prod = producer(self.settings, linger_ms=2)
        await self.prod.start()
        self._stack.push_async_callback(self.prod.stop)
        sender = PacedSender(self.settings, self.reg.name("requests"), linger_ms=2)
        self.sender = await self._stack.enter_async_context(sender)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()
        self.prod = self.sender = None

    def _say(self, msg: str) -> None:
        if self.progress:
            print(f"   {msg}", file=sys.stderr, flush=True)

    def _due(self, ts: float) -> Iterator[BehaviorEvent]:
        """The pending behaviours older than ``ts``, renamed; each counts as published once taken."""
        while self.next_behaviour < len(self.behaviours) and self.behaviours[self.next_behaviour].ts < ts:
            yield renamed(self.behaviours[self.next_behaviour], self.user_prefix)
            self.next_behaviour += 1

    async def _behaviours_before(self, ts: float) -> int:
        """Publish every pending behaviour older than ``ts``; wait for the broker's acks."""
        n0 = self.next_behaviour
        return await send_in_order(
            self.prod,
            self.reg.name("behaviors"),
            self._due(ts),
            on_chunk=lambda n: self._say(f"behaviours published: {n0 + n}/{len(self.behaviours)}"),
        )

    async def preload(self, before_ts: float | Mapping[str, float] = math.inf) -> int:
        """Publish the behaviours older than ``before_ts`` (all by default), or, given a mapping,
        each listed user's behaviours older than that user's time. Returns how many."""
        if not isinstance(before_ts, Mapping):
            return await self._behaviours_before(before_ts)
        rest = self.behaviours[self.next_behaviour :]
        now = [b for b in rest if b.ts < before_ts.get(b.user_id, -math.inf)]
        self.behaviours = [b for b in rest if not b.ts < before_ts.get(b.user_id, -math.inf)]
        self.next_behaviour = 0
        return await send_in_order(
            self.prod,
            self.reg.name("behaviors"),
            (renamed(b, self.user_prefix) for b in now),
            on_chunk=lambda n: self._say(f"behaviours preloaded: {n}/{len(now)}"),
        )

    async def run(self, plan: ReplayPlan, *, behaviours: bool = True) -> list[RecommendationRequest]:
        """Send ``plan``'s requests at their offsets (``tools.sender``), each preceded by the
        behaviours older than it (none with ``behaviours=False``: a side replay, such as a warm-up,
        must not publish a later replay's behaviours ahead of their time). Returns the requests as
        sent (renamed, ``ts`` = send time, ``event_ts`` set)."""
        assert self.sender is not None, "a Replayer is used as an async context manager"
        requests = [
            renamed(r, self.user_prefix).model_copy(update={"event_ts": r.model_ts}) for r in plan.requests
        ]
        t0, last_note = time.monotonic(), [time.monotonic()]

        def note(n: int) -> None:
            if self.progress and time.monotonic() - last_note[0] > 5:
                last_note[0] = time.monotonic()
                self._say(f"replayed {n}/{len(requests)} requests in {last_note[0] - t0:.0f} s")

        async def before(r: RecommendationRequest) -> None:
            await self._behaviours_before(r.model_ts)

        return await self.sender.send(
            requests, plan.offsets, before=before if behaviours else None, progress=note
        )


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
    from relaygr.infra.local.broker import BrokerError
    from relaygr.infra.local.cluster import ensure_broker
    from relaygr.infra.settings import get_settings

    try:
        settings, _ = ensure_broker(get_settings())
        out = asyncio.run(_replay(settings, args))
    except (BrokerError, LookupError, ValueError, TimeoutError) as e:
        print(f"relaygr replay: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        print(f"replayed {out['requests']} requests in {out['seconds']} s ({out['qps']} req/s)")
    return 0


def _record_time(timing: str) -> Callable[[Any], float]:
    """A read record's time on the replay's clock: its broker timestamp (``record``), the request's
    send time (``sent``) or its model time."""
    if timing == "record":
        return lambda r: r.timestamp_ms / 1000
    if timing == "sent":
        return lambda r: r.value.ts
    return lambda r: r.value.model_ts


async def _replay(settings: Settings, args: argparse.Namespace) -> dict:
    """Read the trace topic, plan its replay, and send it (behaviours first) into the deployment."""
    prefix = args.prefix or settings.topic_prefix
    reg = TopicRegistry(prefix, settings.partitions)
    topic = args.topic or f"{settings.topic_prefix}.trace"
    start = Start.parse(args.from_offset, args.from_timestamp)
    got = await read_topic(settings, topic, RecommendationRequest, start, progress=True)
    record_time = _record_time(args.timing)
    records = merge_by_time(got.records, record_time)
    plan = plan_replay(
        [r.value for r in records],
        qps=args.qps,
        speed=args.speed,
        duration_s=args.duration,
        max_requests=args.max_requests,
        seed=args.seed,
        times=[record_time(r) for r in records],
    )
    behaviours = await _behaviours(settings, args, topic)
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
            await wait_sentinels_applied(settings, reg, progress=True)
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


async def _behaviours(settings: Settings, args: argparse.Namespace, topic: str) -> list[BehaviorEvent]:
    """The trace's behaviours: from ``--behaviors-topic``, else ``<topic>-behaviors`` where it exists."""
    from relaygr.infra.kafka import describe_partitions

    btopic = args.behaviors_topic or f"{topic}-behaviors"
    if args.no_behaviors:
        return []
    if args.behaviors_topic or btopic in await describe_partitions(settings, [btopic]):
        return [r.value for r in (await read_topic(settings, btopic, BehaviorEvent)).records]
    return []
