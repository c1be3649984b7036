"""Ingestion benchmark on the real broker: how fast every stage applies a burst of real-shaped
histories, and whether requests stay fast while it does.

One pipeline (ingress, retrieval, pre-processing, --ranking-workers ranking workers, relay mode):
0. --request-users MovieLens users' histories are published and applied (their requests follow);
1. idle: requests of those users at --qps for --idle-s seconds, nothing else flowing;
2. burst: --events behaviours of new users whose histories are MovieLens histories lengthened
   to between --min-len and --max-len events (time-shifted repetition), produced as fast as the
   client can to random partitions, users interleaved as in a live stream; meanwhile the same
   requests at --qps. Each stage's rate is the burst's events over the time from the first send
   to that stage's last applied event (from its ``relaygr_behaviours_applied_total`` counter).
Both phases report ``hop_requests`` (request produced -> retrieval read it) P50/P99, nearest rank,
side by side, as one JSON line with ``events_per_s`` per stage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import sys
import time
import uuid
from pathlib import Path

from relaygr.infra.kafka import delete_topics_with_prefix, ensure_topics, producer
from relaygr.infra.settings import Settings, get_settings
from relaygr.schemas import BehaviorEvent, TopicRegistry, encode
from relaygr.tools.args import int_at_least

STAGES = ("ingress", "retrieval", "preprocess", "ranking")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--events", type=int_at_least(1), default=50_000, help="behaviours in the burst")
    parser.add_argument("--min-len", type=int_at_least(1), default=300, help="shortest burst history")
    parser.add_argument("--max-len", type=int_at_least(1), default=2500, help="longest burst history")
    parser.add_argument("--qps", type=float, default=20.0, help="request rate in both phases")
    parser.add_argument("--idle-s", type=float, default=10.0, help="length of the idle phase, seconds")
    parser.add_argument("--request-users", type=int_at_least(1), default=50, help="users whose requests run")
    parser.add_argument("--ranking-workers", type=int_at_least(1), default=2, help="ranking worker processes")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up on the burst after this")


def _applied(pipe) -> dict[str, float]:
    """Behaviours applied so far, per stage (ranking workers summed)."""
    out = dict.fromkeys(STAGES, 0.0)
    for name in pipe.procs:
        if name == "ingress-requests":
            continue
        m = pipe.scrape(name)
        stage = "ranking" if name.startswith("ranker") else name.split("-")[0]
        if stage == "ingress":
            out[stage] += sum(
                v
                for topic, v in m.by_label("relaygr_ingress_routed_total", "topic").items()
                if topic.endswith(".behaviors")
            )
        else:
            out[stage] += m.value("relaygr_behaviours_applied_total", stage=stage)
    return out


def _burst(ml, events: int, lo: int, hi: int, seed: int = 3) -> list[BehaviorEvent]:
    """Histories of new users, ``lo``..``hi`` events each, interleaved in chunks of a few events
    (a live stream's order), ``events`` in all."""
    from relaygr.tools.traffic import synthesise

    rng = random.Random(seed)
    users = [u for u in sorted(ml.histories) if len(ml.histories[u]) >= 20]
    per_user: list[list[BehaviorEvent]] = []
    total = 0
    while total < events:
        u = rng.choice(users)
        n = min(rng.randint(lo, hi), events - total)
        h = ml.histories[u]
        h = synthesise(h, -(-n // len(h)))
        h = h.slice(len(h) - n)
        uid = f"burst-{len(per_user)}-{u}"
        per_user.append(
            [
                BehaviorEvent(user_id=uid, item_id=int(i), ts=float(t), action=int(a))
                for i, a, t in zip(
                    h.item_ids.tolist(), h.action_ids.tolist(), h.timestamps.tolist(), strict=True
                )
            ]
        )
        total += n
    out: list[BehaviorEvent] = []
    while any(per_user):
        for evs in per_user:
            take = rng.randint(1, 8)
            out += evs[:take]
            del evs[:take]
    return out


async def _produce_burst(settings: Settings, reg: TopicRegistry, events: list[BehaviorEvent]) -> float:
    """Produce ``events`` to random partitions as fast as batches go; returns the start time."""
    prod = producer(settings, linger_ms=5, max_batch_size=1 << 20)
    await prod.start()
    rng = random.Random(11)
    topic = reg.name("behaviors")
    t0 = time.time()
    try:
        futs = []
        builders: dict[int, object] = {}
        for ev in events:
            p = rng.randrange(reg.partitions)
            b = builders.get(p) or prod.create_batch()
            if b.append(key=ev.key(), value=encode(ev), timestamp=None) is None:
                futs.append(await prod.send_batch(b, topic, partition=p))
                b = prod.create_batch()
                b.append(key=ev.key(), value=encode(ev), timestamp=None)
            builders[p] = b
        for p, b in builders.items():
            futs.append(await prod.send_batch(b, topic, partition=p))
        await asyncio.gather(*futs)
    finally:
        await prod.stop()
    return t0


async def request_stream(settings, reg, requests, qps: float, stop: asyncio.Event, sent: list) -> None:
    """Send ``requests`` round-robin at ``qps`` (each re-stamped with a fresh id and the send
    time) until ``stop`` is set; appends what was sent to ``sent``."""
    prod = producer(settings, linger_ms=0)
    await prod.start()
    try:
        i, t0 = 0, time.monotonic()
        while not stop.is_set():
            wait = t0 + i / qps - time.monotonic()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
                continue
            base = requests[i % len(requests)]
            r = base.model_copy(
                update={"request_id": f"{base.request_id}-{uuid.uuid4().hex[:8]}", "ts": time.time()}
            )
            await prod.send_and_wait(reg.name("requests"), encode(r), key=r.key())
            sent.append(r)
            i += 1
    finally:
        await prod.stop()


def breakdown_percentiles(results: dict, sent: list, field: str = "hop_requests") -> dict[str, float]:
    """P50/P99 (nearest rank) of one ``breakdown_ms`` field over the results of ``sent``."""
    from relaygr.tools.report.figures import percentile

    hops = [results[r.request_id].breakdown_ms.get(field) for r in sent if r.request_id in results]
    hops = [h for h in hops if h is not None]
    return {"p50": percentile(hops, 50), "p99": percentile(hops, 99), "n": len(hops)}


async def _measure(settings: Settings, reg: TopicRegistry, pipe, args, ml, say) -> dict:
    from relaygr.tools.traffic import collect_results, leave_last_out, publish

    users = sorted(ml.histories)[: args.request_users]
    behaviours, requests = leave_last_out(ml, users, num_candidates=64)
    await publish(settings, reg, behaviours, [], wait_for_ingest=True, settle_s=0)

    say(f"idle: requests at {args.qps:g}/s for {args.idle_s:g} s")
    stop, idle_sent = asyncio.Event(), []
    task = asyncio.create_task(request_stream(settings, reg, requests, args.qps, stop, idle_sent))
    await asyncio.sleep(args.idle_s)
    stop.set()
    await task
    idle_res = await collect_results(settings, reg, {r.request_id for r in idle_sent}, timeout_s=120)

    burst = _burst(ml, args.events, args.min_len, args.max_len)
    say(
        f"burst: {len(burst)} behaviours of {len({b.user_id for b in burst})} users, requests at {args.qps:g}/s"
    )
    before = _applied(pipe)
    stop, burst_sent = asyncio.Event(), []
    task = asyncio.create_task(request_stream(settings, reg, requests, args.qps, stop, burst_sent))
    t0 = await _produce_burst(settings, reg, burst)
    produced_s = time.time() - t0
    done: dict[str, float] = {}
    while len(done) < len(STAGES) and time.time() - t0 < args.timeout_s:
        now = _applied(pipe)
        for st in STAGES:
            if st not in done and now[st] - before[st] >= len(burst):
                done[st] = time.time() - t0
        pipe.check()
        await asyncio.sleep(0.05)
    stop.set()
    await task
    burst_res = await collect_results(settings, reg, {r.request_id for r in burst_sent}, timeout_s=120)
    idle, hot = breakdown_percentiles(idle_res, idle_sent), breakdown_percentiles(burst_res, burst_sent)
    incomplete = sum(1 for r in burst_res.values() if not r.history_complete)
    return {
        "bench": "ingest",
        "events": len(burst),
        "burst_users": len({b.user_id for b in burst}),
        "produce_s": round(produced_s, 3),
        "events_per_s": {st: (round(len(burst) / done[st]) if st in done else None) for st in STAGES},
        "stage_s": {st: round(done[st], 3) if st in done else None for st in STAGES},
        "hop_p99_ms_burst": hot["p99"],
        "hop_p99_ms_idle": idle["p99"],
        "hop_p50_ms_burst": hot["p50"],
        "hop_p50_ms_idle": idle["p50"],
        "burst_over_idle_hop_p99": hot["p99"] / idle["p99"] if idle["p99"] else None,
        # The ingress's share of hop_requests (request produced -> re-keyed onto routed-requests).
        "routing_p99_ms_burst": breakdown_percentiles(burst_res, burst_sent, "routing")["p99"],
        "routing_p99_ms_idle": breakdown_percentiles(idle_res, idle_sent, "routing")["p99"],
        "history_wait_p99_ms_burst": breakdown_percentiles(burst_res, burst_sent, "history_wait")["p99"],
        "requests_burst": len(burst_sent),
        "results_burst": len(burst_res),
        "requests_idle": len(idle_sent),
        "results_idle": len(idle_res),
        "history_incomplete_burst": incomplete,
        "target_events_per_s": 30_000,
        "target_hop_p99_ms_burst": 50.0,
    }


def on_fresh_pipeline(
    tag: str, ranking_workers: int, measure, say, *, metrics: bool = False, env: dict[str, str] | None = None
) -> dict:
    """Run ``await measure(settings, registry, pipeline, movielens)`` against a relay pipeline on
    topics and a home of its own (broker, model and calibration set up if missing), then remove
    them; returns what ``measure`` returned, with the core layout under ``cores``. ``env``: more
    ``RELAYGR_*`` settings for its stages."""
    from relaygr.infra.local.cluster import ensure_broker
    from relaygr.streams.config import PipelineSettings
    from relaygr.tools.prepare import ensure_calibration, ensure_model
    from relaygr.tools.up import Pipeline
    from relaygr.workers.engine.cores import plan_cores
    from relaygr.workers.training.movielens import load_movielens

    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line
        settings, _ = ensure_broker(get_settings())
        pipeline = PipelineSettings()
        ensure_model(pipeline.model_dir)
        calib = ensure_calibration(pipeline.model_dir)
    env = {**pipeline.to_env(model_dir=pipeline.model_dir, calibration_file=calib), **(env or {})}
    ml = load_movielens("ml-100k")
    run_id = f"{tag}-{uuid.uuid4().hex[:6]}"
    s = settings.model_copy(
        update={"topic_prefix": f"{settings.topic_prefix}-{run_id}", "home": Path(settings.home) / run_id}
    )
    reg = TopicRegistry(s.topic_prefix, s.partitions)
    asyncio.run(ensure_topics(reg, s))
    cores = plan_cores(ranking_workers, pin=False)
    try:
        with Pipeline(
            s, ranking_workers=ranking_workers, mode="relay", env=env, metrics=metrics, cores=cores
        ) as pipe:
            say(f"pipeline ready in {asyncio.run(pipe.wait_ready()):.1f} s; cores: {cores.describe()}")
            return {**asyncio.run(measure(s, reg, pipe, ml)), "cores": cores.describe()}
    finally:
        asyncio.run(delete_topics_with_prefix(s, s.topic_prefix))
        shutil.rmtree(s.home, ignore_errors=True)


def bench_on_fresh_pipeline(tag: str, args: argparse.Namespace, measure, *, metrics: bool = False) -> int:
    """``on_fresh_pipeline`` with ``args.ranking_workers`` workers for a bench command: progress on
    stderr unless ``args.json``; ``await measure(settings, registry, pipeline, movielens, say)``;
    its JSON line on stdout."""

    def say(msg: str) -> None:
        if not args.json:
            print(f"== {msg}", file=sys.stderr, flush=True)

    line = on_fresh_pipeline(
        tag,
        args.ranking_workers,
        lambda s, reg, pipe, ml: measure(s, reg, pipe, ml, say),
        say,
        metrics=metrics,
    )
    print(json.dumps(line))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.min_len > args.max_len:
        print("relaygr bench ingest: --min-len must not exceed --max-len", file=sys.stderr)
        return 2
    return bench_on_fresh_pipeline(
        "ingest", args, lambda s, reg, pipe, ml, say: _measure(s, reg, pipe, args, ml, say), metrics=True
    )
