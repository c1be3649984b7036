"""How fast every stage applies a burst of real-shaped histories, and whether requests stay fast
while it does, on the real broker (``relaygr bench ingest``).

One pipeline (ingress, retrieval, pre-processing, --ranking-workers ranking workers, relay mode):
0. --request-users MovieLens users' histories are published and applied (their requests follow);
1. idle: requests of those users at --qps for --idle-s seconds, nothing else flowing;
2. burst: --events behaviours of new users whose histories are MovieLens histories lengthened
   to between --min-len and --max-len events (``tools.long_users``), produced as fast as the
   client can to random partitions, users interleaved as in a live stream; meanwhile the same
   requests at --qps. Each stage's rate is the burst's events over the time from the first send
   to that stage's last applied event (from its ``relaygr_behaviours_applied_total`` counter).
Both phases report ``hop_requests`` (request produced -> retrieval read it) P50/P99, nearest rank,
side by side, as one JSON line with ``events_per_s`` per stage.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from relaygr.infra.kafka import producer
from relaygr.infra.settings import Settings
from relaygr.schemas import BehaviorEvent, TopicRegistry, encode
from relaygr.tools.args import int_at_least
from relaygr.tools.experiment.harness import Deployment
from relaygr.tools.experiment.scenarios.runner import Scenario, ScenarioRun, Setup, run_scenario
from relaygr.tools.report.figures import breakdown_percentiles
from relaygr.tools.sender import BackgroundLoad

STAGES = ("ingress", "retrieval", "preprocess", "ranking")


class Ingest(Scenario):
    name, tag = "ingest", "ingest"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--events", type=int_at_least(1), default=50_000, help="behaviours in the burst")
        parser.add_argument("--min-len", type=int_at_least(1), default=300, help="shortest burst history")
        parser.add_argument("--max-len", type=int_at_least(1), default=2500, help="longest burst history")
        parser.add_argument("--qps", type=float, default=20.0, help="request rate in both phases")
        parser.add_argument("--idle-s", type=float, default=10.0, help="length of the idle phase, seconds")
        parser.add_argument(
            "--request-users", type=int_at_least(1), default=50, help="users whose requests run"
        )
        parser.add_argument(
            "--ranking-workers", type=int_at_least(1), default=2, help="ranking worker processes"
        )
        parser.add_argument("--timeout-s", type=float, default=600.0, help="give up on the burst after this")

    def check(self, args: argparse.Namespace) -> None:
        if args.min_len > args.max_len:
            raise ValueError("--min-len must not exceed --max-len")

    async def measure(self, run: ScenarioRun, dep: Deployment, setup: Setup) -> list[dict]:
        from relaygr.tools.traffic import collect_results, leave_last_out, publish

        args, s, reg = run.args, dep.settings, dep.reg
        behaviours, requests = leave_last_out(
            run.ml, sorted(run.ml.histories)[: args.request_users], num_candidates=64
        )
        await publish(s, reg, behaviours, [], wait_for_ingest=True, settle_s=0)

        run.say(f"idle: requests at {args.qps:g}/s for {args.idle_s:g} s")
        load = BackgroundLoad(s, reg.name("requests"), requests, args.qps).start()
        await asyncio.sleep(args.idle_s)
        idle_sent = await asyncio.to_thread(load.stop)
        idle_res = await collect_results(s, reg, {r.request_id for r in idle_sent}, timeout_s=120)

        burst = _burst(run.ml, args.events, args.min_len, args.max_len)
        run.say(
            f"burst: {len(burst)} behaviours of {len({b.user_id for b in burst})} users, requests at {args.qps:g}/s"
        )
        before = _applied(dep.pipe)
        load = BackgroundLoad(s, reg.name("requests"), requests, args.qps).start()
        t0 = await _produce_burst(s, reg, burst)
        produced_s = time.time() - t0
        done: dict[str, float] = {}
        while len(done) < len(STAGES) and time.time() - t0 < args.timeout_s:
            now = _applied(dep.pipe)
            for st in STAGES:
                if st not in done and now[st] - before[st] >= len(burst):
                    done[st] = time.time() - t0
            dep.pipe.check()
            await asyncio.sleep(0.05)
        burst_sent = await asyncio.to_thread(load.stop)
        burst_res = await collect_results(s, reg, {r.request_id for r in burst_sent}, timeout_s=120)
        return [_line(burst, produced_s, done, (idle_sent, idle_res), (burst_sent, burst_res))]


def _line(
    burst: list[BehaviorEvent], produced_s: float, done: dict[str, float], idle: tuple, hot: tuple
) -> dict:
    """The figures of both phases (``(sent, results)`` each) and of the burst's stages."""
    quiet, busy = breakdown_percentiles(idle[1], idle[0]), breakdown_percentiles(hot[1], hot[0])
    return {
        "bench": "ingest",
        "events": len(burst),
        "burst_users": len({b.user_id for b in burst}),
        "produce_s": round(produced_s, 3),
        "events_per_s": {st: (round(len(burst) / done[st]) if st in done else None) for st in STAGES},
        "stage_s": {st: round(done[st], 3) if st in done else None for st in STAGES},
        "hop_p99_ms_burst": busy["p99"],
        "hop_p99_ms_idle": quiet["p99"],
        "hop_p50_ms_burst": busy["p50"],
        "hop_p50_ms_idle": quiet["p50"],
        "burst_over_idle_hop_p99": busy["p99"] / quiet["p99"] if quiet["p99"] else None,
        # The ingress's share of hop_requests (request produced -> re-keyed onto routed-requests).
        "routing_p99_ms_burst": breakdown_percentiles(hot[1], hot[0], "routing")["p99"],
        "routing_p99_ms_idle": breakdown_percentiles(idle[1], idle[0], "routing")["p99"],
        "history_wait_p99_ms_burst": breakdown_percentiles(hot[1], hot[0], "history_wait")["p99"],
        "requests_burst": len(hot[0]),
        "results_burst": len(hot[1]),
        "requests_idle": len(idle[0]),
        "results_idle": len(idle[1]),
        "history_incomplete_burst": sum(1 for r in hot[1].values() if not r.history_complete),
        "target_events_per_s": 30_000,
        "target_hop_p99_ms_burst": 50.0,
    }


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
    from relaygr.tools.long_users import as_behaviours, lengthen

    rng = random.Random(seed)
    users = [u for u in sorted(ml.histories) if len(ml.histories[u]) >= 20]
    per_user: list[list[BehaviorEvent]] = []
    total = 0
    while total < events:
        u = rng.choice(users)
        n = min(rng.randint(lo, hi), events - total)
        per_user.append(as_behaviours(ml, f"burst-{len(per_user)}-{u}", lengthen(ml.histories[u], n)))
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


KIND = Ingest()
add_arguments = KIND.arguments


def run(args: argparse.Namespace) -> int:
    return run_scenario(KIND, args)
