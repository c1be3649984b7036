"""One heavy user must not stall a ranking worker, on the real broker (``relaygr bench noisy-neighbour``).

One pipeline (relay mode, one ranking worker, so every user shares its device), trained model:
0. --users MovieLens users' real histories are published and applied; their requests warm the
   pipeline up for --warmup-s seconds (not measured);
1. the same users' requests at --qps, without a pause, for 2 x --duration-s seconds in alternating
   blocks of --block-s seconds: quiet, heavy, quiet, heavy, ... In the first heavy block one user
   with --heavy-events behaviours (the longest MovieLens history, lengthened by
   ``tools.long_users``) is published at once; that block lasts until every stage has applied
   them, then --block-s more. In every heavy block the heavy user also requests once every
   --heavy-every-s seconds (at a random moment of each period, not in step with the ordinary
   requests' fixed beat). In a quiet block it sends nothing: the first has no heavy user at all,
   the later ones keep it stored and cached as any idle user is.
Alternating short blocks is what puts the two conditions side by side: a spell of the shared
machine (steal, a neighbour's burst) lands on both alike instead of on whichever phase it hits.
It prints one JSON line: the ordinary users' ranking-stage P99 (nearest rank) over each
condition's blocks and their ratio (target ≤ 1.2), each condition's slowest ranking and how many
missed the budget, the heavy user's latencies, paths and ``used_len``, and the host's CPU steal in
each condition.

Primitives: ``Blocks`` (when each block began and its condition), ``NoisyNeighbour``.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import multiprocessing
import os
import random
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from relaygr.infra.kafka import producer
from relaygr.schemas import encode
from relaygr.streams.config import PipelineSettings
from relaygr.tools.args import float_above, int_at_least
from relaygr.tools.experiment.harness import Deployment
from relaygr.tools.experiment.scenarios.host_cpu import HostCpuSampler
from relaygr.tools.experiment.scenarios.runner import Scenario, ScenarioRun, Setup, run_scenario
from relaygr.tools.report.figures import breakdown_percentiles, percentile
from relaygr.tools.sender import BackgroundLoad, jittered_offsets
from relaygr.workers.engine.cores import STAGE_NICE

# A result's breakdown before the ranking stage.
UPSTREAM = ("hop_requests", "retrieval", "preprocess", "hop_retrieved", "routing")


class NoisyNeighbour(Scenario):
    name, tag = "noisy-neighbour", "noisy"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--users", type=int_at_least(1), default=50, help="ordinary users")
        parser.add_argument("--qps", type=float_above(0), default=10.0, help="ordinary request rate")
        parser.add_argument(
            "--duration-s",
            type=float_above(0),
            default=60.0,
            help="measured seconds of each condition (60 s at 10 req/s: P99 is the 6th slowest of 600, "
            "not the 2nd of 200, so one slow request does not make the figure)",
        )
        parser.add_argument(
            "--block-s",
            type=float_above(0),
            default=5.0,
            help="length of one block; quiet and heavy blocks alternate (shorter than the machine's "
            "spells of slowness, so that one lands on both conditions)",
        )
        parser.add_argument("--warmup-s", type=float, default=5.0, help="unmeasured requests first")
        parser.add_argument(
            "--heavy-events", type=int_at_least(1), default=60_000, help="the heavy user's history"
        )
        parser.add_argument(
            "--heavy-every-s", type=float_above(0), default=2.0, help="the heavy user's request period"
        )
        parser.add_argument(
            "--results",
            type=Path,
            default=None,
            metavar="FILE",
            help="also write every result as a JSON line (with its condition: quiet, heavy or "
            "heavy_user, and its block's number)",
        )

    def check(self, args: argparse.Namespace) -> None:
        if args.results is not None:  # before minutes of benchmark, not after
            try:
                args.results.parent.mkdir(parents=True, exist_ok=True)
                args.results.open("w").close()
            except OSError as e:
                raise OSError(f"cannot write --results {args.results}: {e}") from e

    def setups(self, args: argparse.Namespace) -> list[Setup]:
        return [Setup(self.tag)]

    async def measure(self, run: ScenarioRun, dep: Deployment, setup: Setup) -> list[dict]:
        from relaygr.tools.long_users import long_users
        from relaygr.tools.traffic import collect_results

        args = run.args
        requests = await _warm_up(dep, args, run)
        heavy_events, (heavy_request,) = long_users(
            run.ml, 1, args.heavy_events, tag="heavy", longest_first=True
        )
        run.say(
            f"{args.duration_s:g} s quiet and {args.duration_s:g} s heavy at {args.qps:g} req/s, in "
            f"alternating {args.block_s:g} s blocks; {len(heavy_events)} behaviours of one user in the "
            "first heavy block"
        )
        burst = [(b.key(), encode(b)) for b in heavy_events]  # encoded before anything is measured
        sent, heavy_sent, blocks, cpu, burst_s = await _alternate(
            dep, args, requests, heavy_request, burst, run.say
        )
        by_condition = blocks.split(sent)
        quiet_sent, hot_sent = by_condition["quiet"], by_condition["heavy"]
        every = {r.request_id for r in quiet_sent + hot_sent + heavy_sent}
        results = await collect_results(dep.settings, dep.reg, every, timeout_s=180)
        if args.results is not None:
            _write_results(
                args.results, results, blocks, quiet=quiet_sent, heavy=hot_sent, heavy_user=heavy_sent
            )
        heavy = [results[r.request_id] for r in heavy_sent if r.request_id in results]
        return [
            {
                **_ordinary_fields(results, quiet_sent, hot_sent),
                "heavy_events": len(heavy_events),
                "qps": args.qps,
                "block_s": args.block_s,
                "blocks": [blocks.labels.count("quiet"), blocks.labels.count("heavy")],
                # From the burst's first send until every stage had applied it (in the first heavy block).
                "burst_applied_s": round(burst_s, 1) if burst_s is not None else None,
                "heavy_requests": len(heavy_sent),
                **_heavy_fields(heavy),
                "target_ratio": 1.2,
                # The host's CPU in each condition (quiet, heavy), in %: busy (the pipeline included), and
                # steal (taken by the machine's neighbours; a spell of it slows a block whatever the
                # pipeline does), over the condition's blocks and at most in any one second. None off Linux.
                "host_cpu": {k: [cpu["quiet"][k], cpu["heavy"][k]] for k in cpu["quiet"]},
            }
        ]


class Blocks:
    """When each block began (wall clock, as requests are stamped) and its condition."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.labels: list[str] = []

    def begin(self, label: str) -> None:
        self.starts.append(time.time())
        self.labels.append(label)

    def of(self, ts: float) -> int:
        """The number of the block a request stamped ``ts`` was sent in."""
        return max(0, bisect.bisect_right(self.starts, ts) - 1)

    def split(self, sent: list) -> dict[str, list]:
        out: dict[str, list] = {label: [] for label in dict.fromkeys(self.labels)}
        for r in sent:
            out[self.labels[self.of(r.ts)]].append(r)
        return out


def _publish_burst(settings, topic: str, messages: list[tuple[bytes, bytes]]) -> None:
    """Send encoded (key, value) messages at once and wait for their acknowledgements. Run in a
    process of its own: sending tens of thousands of messages holds a process's interpreter for
    seconds, and the ordinary requests, sent late, would arrive in a clump of the benchmark's making."""

    async def send_all() -> None:
        prod = producer(settings, linger_ms=5, max_batch_size=1 << 20)
        await prod.start()
        try:
            await asyncio.gather(*[await prod.send(topic, v, key=k) for k, v in messages])
        finally:
            await prod.stop()

    asyncio.run(send_all())


def _started(nice: int) -> None:
    """Submitted first, so the publishing process has started before it is needed. It stands in
    for the users' producers, which run on machines of their own: here it gets the priority of
    the pipeline's ingest stages (``nice``), so it takes the cores the ranking worker leaves."""
    if nice:
        os.nice(nice)


async def _alternate(dep: Deployment, args, requests, heavy_request, burst: list[tuple[bytes, bytes]], say):
    """Ordinary requests at ``args.qps`` throughout, in alternating quiet and heavy blocks; the
    burst in the first heavy block, and the heavy user's requests in every heavy block. Returns
    the ordinary and heavy requests sent, the blocks, the host's CPU per condition and the seconds
    the stages took to apply the burst."""
    from relaygr.tools.barriers import wait_groups_caught_up

    s, topic = dep.settings, dep.reg.name("requests")
    pairs = max(1, round(args.duration_s / args.block_s))
    rng = random.Random(0)  # the heavy user's moments: fixed, so runs compare
    heavy_sent: list = []
    blocks, cpu = Blocks(), HostCpuSampler(label="quiet")
    loop = asyncio.get_running_loop()
    publisher = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    await loop.run_in_executor(publisher, _started, STAGE_NICE)
    blocks.begin("quiet")
    cpu.start()
    ordinary = BackgroundLoad(s, topic, requests, args.qps).start()
    burst_s = None
    try:
        for i in range(pairs):
            if i:
                blocks.begin("quiet")
                cpu.switch("quiet")
            await asyncio.sleep(args.block_s)
            blocks.begin("heavy")
            cpu.switch("heavy")
            heavy = BackgroundLoad(
                s, topic, [heavy_request], offsets=jittered_offsets(args.heavy_every_s, rng)
            )
            if i == 0:
                t0 = time.monotonic()
                await loop.run_in_executor(publisher, _publish_burst, s, dep.reg.name("behaviors"), burst)
                heavy.start()
                await wait_groups_caught_up(s, dep.reg)
                burst_s = time.monotonic() - t0
                say(f"the burst was applied in {burst_s:.1f} s; {pairs - 1} more pairs of blocks")
            else:
                heavy.start()
            await asyncio.sleep(args.block_s)
            heavy_sent += await asyncio.to_thread(heavy.stop)
    finally:
        try:
            sent = await asyncio.to_thread(ordinary.stop)
        finally:
            publisher.shutdown()
    return sent, heavy_sent, blocks, await cpu.stop(), burst_s


async def _warm_up(dep: Deployment, args, run: ScenarioRun) -> list:
    """Publish the users' histories and send their requests for ``--warmup-s``; returns the
    requests (the measured blocks send them again)."""
    from relaygr.tools.traffic import leave_last_out, publish

    behaviours, requests = leave_last_out(run.ml, sorted(run.ml.histories)[: args.users], num_candidates=128)
    await publish(dep.settings, dep.reg, behaviours, [], wait_for_ingest=True, settle_s=0)
    run.say(f"warm-up: {args.warmup_s:g} s at {args.qps:g} req/s")
    load = BackgroundLoad(dep.settings, dep.reg.name("requests"), requests, args.qps).start()
    await asyncio.sleep(args.warmup_s)
    await asyncio.to_thread(load.stop)
    return requests


def _ordinary_fields(results: dict, quiet_sent: list, hot_sent: list) -> dict:
    """The ordinary users' rankings in each condition (quiet, heavy)."""
    quiet = breakdown_percentiles(results, quiet_sent, "ranking")
    hot = breakdown_percentiles(results, hot_sent, "ranking")
    budget_ms = PipelineSettings().budget_ms  # what the pipeline was started with (RELAYGR_BUDGET_MS)

    def ranking_ms(sent: list) -> list[float]:
        return [results[r.request_id].breakdown_ms["ranking"] for r in sent if r.request_id in results]

    return {
        "bench": "noisy_neighbour",
        "ordinary_ranking_p99_ms_quiet": quiet["p99"],
        "ordinary_ranking_p99_ms_heavy": hot["p99"],
        "ordinary_ranking_p50_ms_quiet": quiet["p50"],
        "ordinary_ranking_p50_ms_heavy": hot["p50"],
        "heavy_over_quiet_p99": hot["p99"] / quiet["p99"] if quiet["p99"] else None,
        # Nothing hidden by the percentile: the slowest of each condition, and how many missed the budget.
        "ordinary_ranking_max_ms": [
            round(max(ranking_ms(x), default=0.0), 1) for x in (quiet_sent, hot_sent)
        ],
        "ordinary_over_budget": [sum(ms > budget_ms for ms in ranking_ms(x)) for x in (quiet_sent, hot_sent)],
        "budget_ms": budget_ms,
        "ordinary_requests": [len(quiet_sent), len(hot_sent)],
        "ordinary_answered": [quiet["n"], hot["n"]],
        "ordinary_slowest_heavy": [
            _ranking_parts(r)
            for r in sorted(
                (results[x.request_id] for x in hot_sent if x.request_id in results),
                key=lambda r: -r.breakdown_ms.get("ranking", 0),
            )[:3]
        ],
    }


def _heavy_fields(heavy: list) -> dict:
    """What the heavy user's answered rankings took and were made of (ms)."""
    heavy_ranking = [r.breakdown_ms.get("ranking", float("nan")) for r in heavy]
    return {
        "heavy_answered": len(heavy),
        "heavy_ranking_ms": [round(x, 1) for x in heavy_ranking],
        "heavy_ranking_p99_ms": percentile(heavy_ranking, 99) if heavy else None,
        "heavy_paths": dict(Counter(r.path.value for r in heavy)),
        "heavy_used_len": [r.used_len for r in heavy],
        "heavy_history_len": max((r.history_len for r in heavy), default=0),
        "heavy_breakdowns": [
            {
                "path": r.path.value,
                "tokens_computed": r.tokens_computed,
                "prefix_len": r.prefix_len,
                **_ranking_parts(r),
            }
            for r in heavy
        ],
    }


def _write_results(path: Path, results: dict, blocks: Blocks, **conditions: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for condition, sent in conditions.items():
            for r in sent:
                if r.request_id in results:
                    row = {"condition": condition, "block": blocks.of(r.ts)}
                    f.write(json.dumps({**row, **results[r.request_id].model_dump(mode="json")}) + "\n")


def _ranking_parts(r) -> dict[str, float]:
    """The ranking stage's share of a result's breakdown (ms, rounded)."""
    return {k: round(v, 1) for k, v in r.breakdown_ms.items() if k not in UPSTREAM}


KIND = NoisyNeighbour()
add_arguments = KIND.arguments


def run(args: argparse.Namespace) -> int:
    return run_scenario(KIND, args)
