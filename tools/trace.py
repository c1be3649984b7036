"""Request traces from real interactions, and their topics.

A trace turns a dataset into traffic: every interaction of a user becomes, at its time, a request
for that user whose ground truth (``label_item_id``) is the interacted item; the user's earlier
interactions are behaviour events. Requests carry the interaction time as ``event_ts`` (stages
cut histories strictly before it), so a trace can be replayed at any speed.

Primitives:
- ``Trace``: requests and behaviours, each in time order, plus what was synthesised.
- ``build_trace(ml, ...)``: a trace of MovieLens, whole or a window of it. ``min_prior`` keeps
  only interactions with that many real earlier ones; ``target_len`` lengthens each user's history
  before their first request to exactly that many events by time-shifted repetition of their real
  history (``tools.long_users.lengthen``); ``warmup`` adds, per user, a request for their last
  interaction before the window (``Trace.warmup_ids``).
- ``TraceTopics(name, partitions)``: the trace topic (requests, key user_id) and its companion
  ``<name>-behaviors`` (behaviours, key user_id); kept forever (``retention.ms=-1``).
- ``publish_trace(settings, topics, trace)``: create the topics and write the trace.
- ``load_trace(settings, topics, start=...)``: a trace back from its topics
  (``infra.topic_reader``).
- ``log_as_dataset(log, name)``: an interaction log (``workers.training.interactions``) in the form
  ``build_trace`` reads, its items named by their raw ids again (integers or strings).
- CLI: ``relaygr trace build (--dataset ml-100k | --interactions PATH [column flags])
  [--topic NAME] [--min-prior N] [--synth-len L]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relaygr.infra.publishing import progress_printer, send_in_order
from relaygr.infra.settings import Settings
from relaygr.infra.topic_reader import Start, merge_by_time, read_topic
from relaygr.schemas import BehaviorEvent, RecommendationRequest
from relaygr.schemas.topics import TopicSpec
from relaygr.tools.long_users import as_behaviours, lengthen
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training.interactions import InteractionLog
from relaygr.workers.training.movielens import MovieLens
from relaygr.workers.training.train import report_bad_rows
from relaygr.workers.training.train_args import add_source_arguments


@dataclass
class Trace:
    requests: list[RecommendationRequest]
    behaviours: list[BehaviorEvent]
    warmup_ids: frozenset[str] = frozenset()
    meta: dict = field(default_factory=dict)

    @property
    def users(self) -> list[str]:
        return sorted({r.user_id for r in self.requests})


def _user_order(user_id: str) -> tuple[int, int, str]:
    """Numeric user ids in numeric order (MovieLens), then the others in text order."""
    return (0, int(user_id), "") if user_id.isdigit() else (1, 0, user_id)


def log_as_dataset(log: InteractionLog, name: str) -> MovieLens:
    """``log`` in the form ``build_trace`` reads: raw integer ids in the histories, or, for string
    ids, model ids with the log's vocabulary to name them."""
    if not log.vocab.is_int:
        return MovieLens(name=name, num_items=len(log.vocab), histories=dict(log.histories), vocab=log.vocab)
    histories = {}
    for user, h in log.histories.items():
        raw = torch.tensor(log.vocab.to_raw(h.item_ids.tolist()), dtype=torch.int64)
        histories[user] = Events(raw, h.action_ids, h.timestamps)
    largest = max(log.vocab.raw_ids(), default=0)
    return MovieLens(name=name, num_items=int(largest), histories=histories)  # type: ignore[arg-type]


def eligible_interactions(ml: MovieLens, min_prior: int = 0) -> list[tuple[float, int, int]]:
    """``(ts, user, index in the user's history)`` of every interaction with at least ``min_prior``
    earlier ones, in time order (ties: user, then index)."""
    rows = []
    for u, h in ml.histories.items():
        ts = h.timestamps.tolist()
        rows += [(ts[k], u, k) for k in range(min_prior, len(ts))]
    rows.sort()
    return rows


def build_trace(
    ml: MovieLens,
    *,
    min_prior: int = 0,
    start: int = 0,
    count: int | None = None,
    target_len: int | None = None,
    warmup: bool = False,
    users: int | None = None,
    num_candidates: int = 128,
    top_k: int = 10,
) -> Trace:
    """The trace of interactions ``start .. start+count`` among those with ``min_prior`` real earlier
    interactions (all of them by default), optionally of the first ``users`` users only."""
    rows = eligible_interactions(ml, min_prior)
    if users is not None:
        keep = set(sorted(ml.histories)[:users])
        rows = [r for r in rows if r[1] in keep]
    window = rows[start : None if count is None else start + count]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for _, u, k in window:
        first.setdefault(u, k)
        last[u] = max(last.get(u, k), k)
    if target_len is not None and min(first.values(), default=1) < 1:
        raise ValueError(
            "target_len needs every user to have real history before the window (min_prior >= 1)"
        )

    def request(u: int, k: int) -> RecommendationRequest:
        return _request(ml, u, k, num_candidates, top_k)

    beh: list[tuple[float, int, int, BehaviorEvent]] = []
    synthesised = 0
    for u, k0 in first.items():
        seq, added = _user_behaviours(ml, u, k0, last[u], target_len)
        synthesised += added
        beh += [(b.ts, u, j, b) for j, b in enumerate(seq)]
    beh.sort(key=lambda x: x[:3])
    requests = [request(u, k) for _, u, k in window]
    warm: list[RecommendationRequest] = []
    if warmup:
        warm = [request(u, k0 - 1) for u, k0 in first.items() if k0 >= 1]
    reqs = sorted([*warm, *requests], key=lambda r: (r.event_ts, _user_order(r.user_id), r.request_id))
    meta = {
        "dataset": ml.name,
        "min_prior": min_prior,
        "start": start,
        "requests": len(requests),
        "warmup_requests": len(warm),
        "users": len(first),
        "behaviours": len(beh),
        "target_len": target_len,
        "synthesised_events": synthesised,
        "span_s": (requests[-1].event_ts - requests[0].event_ts) if requests else 0.0,
        "synthesis": (
            "each user's real history before their first request, repeated with time shifts "
            "(each earlier copy moved back by the history's span plus one day) and cut to the "
            f"last {target_len} events (synthesised copies compressed in time where they would "
            "reach back before 1970-01-02)"
            if target_len
            else None
        ),
    }
    return Trace(reqs, [b for *_, b in beh], frozenset(r.request_id for r in warm), meta)


def _request(ml: MovieLens, u: int, k: int, num_candidates: int, top_k: int) -> RecommendationRequest:
    """User ``u``'s interaction ``k`` as a request whose ground truth is its item."""
    h = ml.histories[u]
    t = float(h.timestamps[k])
    return RecommendationRequest(
        request_id=f"{ml.name}-{u}-{k}",
        user_id=str(u),
        ts=t,
        event_ts=t,
        num_candidates=num_candidates,
        top_k=top_k,
        label_item_id=ml.raw_items([int(h.item_ids[k])])[0],
    )


def _user_behaviours(
    ml: MovieLens, u: int, k0: int, last_k: int, target_len: int | None
) -> tuple[list[BehaviorEvent], int]:
    """User ``u``'s behaviours: the history before interaction ``k0`` (lengthened to
    ``target_len``), then its interactions ``k0 .. last_k``; and how many events the lengthening
    synthesised."""
    h = ml.histories[u]
    past = h.slice(0, k0)
    synthesised = 0
    if target_len is not None:
        real = len(past)
        past = lengthen(past, target_len)
        synthesised = len(past) - min(real, len(past))
    return as_behaviours(ml, str(u), past) + as_behaviours(ml, str(u), h.slice(k0, last_k + 1)), synthesised


class TraceTopics:
    """A trace's two topics: ``name`` (requests) and ``name-behaviors`` (behaviours)."""

    def __init__(self, name: str, partitions: int) -> None:
        self.requests = TopicSpec(
            "trace", name, RecommendationRequest, "user_id", partitions, co_partitioned=False, retention_ms=-1
        )
        self.behaviours = TopicSpec(
            "trace_behaviors",
            f"{name}-behaviors",
            BehaviorEvent,
            "user_id",
            partitions,
            co_partitioned=False,
            retention_ms=-1,
        )

    def __iter__(self):
        return iter((self.requests, self.behaviours))

    @property
    def names(self) -> list[str]:
        return [self.requests.name, self.behaviours.name]


async def publish_events(settings: Settings, topic: str, events: list, *, what: str = "events") -> None:
    """Write ``events`` to ``topic`` in order (keyed by each event's key) and wait for the acks."""
    from relaygr.infra.kafka import producer

    prod = producer(settings, linger_ms=5)
    await prod.start()
    try:
        await send_in_order(prod, topic, events, on_chunk=progress_printer(f"{what} written"))
    finally:
        await prod.stop()


async def publish_trace(settings: Settings, topics: TraceTopics, trace: Trace) -> None:
    from relaygr.infra.kafka import ensure_topics

    await ensure_topics(topics, settings)  # type: ignore[arg-type]  # any iterable of TopicSpec
    await publish_events(settings, topics.behaviours.name, trace.behaviours, what="trace behaviours")
    await publish_events(settings, topics.requests.name, trace.requests, what="trace requests")


async def load_trace(settings: Settings, topics: TraceTopics, start: Start | None = None) -> Trace:
    """The requests of a trace topic from ``start`` (each partition's order kept, merged by time)
    and all of its behaviours."""
    reqs = await read_topic(settings, topics.requests.name, RecommendationRequest, start)
    behs = await read_topic(settings, topics.behaviours.name, BehaviorEvent)
    requests = merge_by_time(reqs.records, lambda r: r.value.model_ts)
    behaviours = merge_by_time(behs.records, lambda r: r.value.ts)
    return Trace([r.value for r in requests], [b.value for b in behaviours])


# ---------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=["build"], help="build: the dataset or interaction log as a request trace topic"
    )
    add_source_arguments(parser)
    parser.add_argument("--topic", help="trace topic (default <RELAYGR_TOPIC_PREFIX>.trace)")
    parser.add_argument(
        "--min-prior",
        type=int,
        default=0,
        help="only interactions with at least this many earlier ones become requests (default 0: all)",
    )
    parser.add_argument("--users", type=int, help="only the first N users (by id; text order for a log)")
    parser.add_argument("--start", type=int, default=0, help="skip the first N requests (in time order)")
    parser.add_argument("--count", type=int, help="at most N requests")
    parser.add_argument(
        "--synth-len",
        type=int,
        help="lengthen each user's history before their first request to this many events by "
        "time-shifted repetition (needs --min-prior >= 1)",
    )
    parser.add_argument("--candidates", type=int, default=128, help="num_candidates of each request")
    parser.add_argument("--top-k", type=int, default=10)


def run(args: argparse.Namespace) -> int:
    import json

    from relaygr.infra.kafka import TopicError
    from relaygr.infra.local.broker import BrokerError
    from relaygr.infra.local.cluster import ensure_broker
    from relaygr.infra.settings import get_settings
    from relaygr.workers.training.movielens import load_movielens
    from relaygr.workers.training.train import load_log

    try:
        settings, _ = ensure_broker(get_settings())
        t0 = time.monotonic()
        if args.interactions is None and (args.dataset or "ml-100k") == "ml-100k":
            source = "ml-100k"
            dataset = load_movielens(source)
        else:  # a file, or a dataset whose ids are strings (ml-1m)
            log, source = load_log(args)
            report_bad_rows(log)
            dataset = log_as_dataset(log, Path(source).stem)
        trace = build_trace(
            dataset,
            min_prior=args.min_prior,
            start=args.start,
            count=args.count,
            target_len=args.synth_len,
            users=args.users,
            num_candidates=args.candidates,
            top_k=args.top_k,
        )
        topics = TraceTopics(args.topic or f"{settings.topic_prefix}.trace", settings.partitions)
        print(
            f"== trace of {source}: {len(trace.requests)} requests, {len(trace.behaviours)} behaviours, "
            f"{trace.meta['users']} users -> {topics.requests.name} (+ {topics.behaviours.name})",
            file=sys.stderr,
            flush=True,
        )
        asyncio.run(publish_trace(settings, topics, trace))
    except (BrokerError, TopicError, ValueError) as e:
        print(f"relaygr trace: {e}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "trace": topics.requests.name,
                "behaviors": topics.behaviours.name,
                **{k: v for k, v in trace.meta.items() if k != "synthesis"},
                "seconds": round(time.monotonic() - t0, 1),
            }
        )
    )
    return 0
