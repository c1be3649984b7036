"""Pipeline benchmark on the real broker: Kafka hop overhead, and relay vs baseline ranking latency.

Both modes run in one invocation, back to back, on the same broker, model and trace:
0. each pipeline (relay, then baseline) first ranks --warmup-requests unmeasured requests at --qps;
1. relay pipeline: short real MovieLens histories at --qps (default 100 req/s): P50/P99 of each
   Kafka hop (requests -> retrieval, retrieved -> pre-processing, rank-requests -> worker);
2. relay pipeline, then baseline pipeline: --users users with histories of --history events
   (MovieLens histories lengthened by time-shifted repetition), ranking-stage latency (rank
   request produced -> result produced), P50/P99, and the relay/baseline ratio, next to the
   model's FLOP bound on that ratio (suffix + candidates against the cached prefix over full).
One JSON line per phase and mode, then one line with the headline figures and ratios.

``--brokers N`` (N > 1) runs it all on a local N-node cluster of its own (replication min(3, N),
min ISR 2 with 3), started for the run and stopped after it; every line then says ``"brokers": N``.
Against a cluster of your own, set RELAYGR_BOOTSTRAP to its nodes instead.

The ranking worker's device thread has a CPU core of its own and every other process (stages,
broker, this load generator) the other cores, where the machine has one to spare (``--no-pin``:
not; ``workers.cores``); the hop line says which.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from relaygr.infra.kafka import delete_topics_with_prefix, ensure_topics
from relaygr.infra.settings import Settings, get_settings
from relaygr.schemas import TopicRegistry
from relaygr.tools.args import int_at_least
from relaygr.tools.report.figures import percentile
from relaygr.tools.report.summary import RunSummary

SHORT_TERM = 64  # events computed at ranking time on the relay path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON lines")
    parser.add_argument("--qps", type=float, default=100.0, help="request rate of the hop measurement")
    parser.add_argument(
        "--hop-requests", type=int_at_least(1), default=600, help="requests of the hop measurement"
    )
    parser.add_argument(
        "--warmup-requests",
        type=int_at_least(0),
        default=300,
        help="unmeasured requests at --qps first (a fresh broker and fresh stages run slow for a while)",
    )
    parser.add_argument(
        "--hop-users", type=int_at_least(1), default=100, help="users whose requests repeat in the hop phase"
    )
    parser.add_argument(
        "--users", type=int_at_least(1), default=200, help="users with long histories (one request each)"
    )
    parser.add_argument(
        "--history", type=int_at_least(1), default=2048, help="history length of the long-history phase"
    )
    parser.add_argument("--long-qps", type=float, default=8.0, help="request rate of the long-history phase")
    parser.add_argument(
        "--fetch-ms", type=float, default=25.0, help="emulated feature fetch per upstream stage"
    )
    parser.add_argument(
        "--budget-ms", type=float, default=1000.0, help="ranking budget (no truncation by default)"
    )
    parser.add_argument(
        "--results", type=Path, default=None, help="also write every result as JSON lines to this file"
    )
    parser.add_argument(
        "--brokers",
        type=int_at_least(1),
        default=1,
        help="1: the configured broker (RELAYGR_BOOTSTRAP, or the local one, started if needed); "
        "N > 1: a local N-node cluster started for this run (replication factor min(3, N), min ISR 2 "
        "with 3) and stopped after it",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="don't give the ranking worker's device thread a core of its own",
    )


class _Say:
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"== {msg}", file=sys.stderr, flush=True)


def _phase(
    settings: Settings,
    mode: str,
    env: dict[str, str],
    traffic: list[tuple[str, list, list, float]],
    say,
    cores=None,
):
    """Run one pipeline in ``mode`` and replay each (name, behaviours, requests, qps) through it."""
    from relaygr.tools.traffic import collect_results, publish
    from relaygr.tools.up import Pipeline

    run = f"bench-{mode}-{uuid.uuid4().hex[:6]}"
    s = settings.model_copy(
        update={"topic_prefix": f"{settings.topic_prefix}-{run}", "home": Path(settings.home) / run}
    )
    reg = TopicRegistry(s.topic_prefix, s.partitions)
    asyncio.run(ensure_topics(reg, s))
    out = {}
    try:
        with Pipeline(s, ranking_workers=1, mode=mode, env=env, cores=cores) as pipe:
            say(f"{mode}: pipeline ready in {asyncio.run(pipe.wait_ready()):.1f} s")
            for name, behaviours, requests, qps in traffic:
                say(f"{mode}/{name}: {len(behaviours)} behaviours, {len(requests)} requests at {qps:g}/s")
                sent = asyncio.run(
                    publish(s, reg, behaviours, requests, qps=qps, settle_s=1.0, wait_for_ingest=True)
                )
                res = asyncio.run(collect_results(s, reg, {r.request_id for r in sent}, timeout_s=300))
                out[name] = (sent, res)
    finally:
        asyncio.run(delete_topics_with_prefix(s, s.topic_prefix))
        shutil.rmtree(s.home, ignore_errors=True)
    return out


def _broker_pids(broker_settings: Settings) -> list[int]:
    """The pids of every node of the local broker or cluster recorded under ``broker_settings``."""
    from relaygr.infra.local.broker import status

    alive, state = status(broker_settings)
    return [n.pid for n in state.nodes] if alive and state is not None else []


def _pin(broker_settings: Settings, off: bool):
    """The core layout of one ranking worker; pinned, this process and the local broker's nodes
    move off its device core."""
    from relaygr.workers.engine.cores import CoreLayout, available_cores, pin_tasks, plan_cores

    if off:
        return CoreLayout((), tuple(sorted(available_cores())), False, "--no-pin")
    cores = plan_cores(1)
    if cores.pinned:
        for pid in [os.getpid(), *_broker_pids(broker_settings)]:
            pin_tasks(pid, cores.shared)
    return cores


def _unpin(broker_settings: Settings, cores) -> None:
    """The local broker and this process back on every core."""
    from relaygr.workers.engine.cores import pin_tasks

    if cores.pinned:
        every = set(cores.shared) | set(cores.device)
        for pid in [os.getpid(), *_broker_pids(broker_settings)]:
            pin_tasks(pid, every)


def run(args: argparse.Namespace) -> int:
    from relaygr.infra.local.cluster import ensure_broker
    from relaygr.streams.config import PipelineSettings
    from relaygr.tools.prepare import ensure_calibration, ensure_model

    say = _Say(args.json)
    if args.results is not None:  # fail now, not after minutes of measuring
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.touch()
    with contextlib.ExitStack() as cluster:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON lines
            pipeline = PipelineSettings()
            ensure_model(pipeline.model_dir)
            calib = ensure_calibration(pipeline.model_dir)
            if args.brokers > 1:  # stopped when the measurement ends, however it ends
                settings, nodes = cluster.enter_context(_own_cluster(get_settings(), args.brokers, say))
            else:
                settings, _ = ensure_broker(get_settings())
                nodes = settings
        return _measure(args, settings, nodes, pipeline, calib, say)


@contextlib.contextmanager
def _own_cluster(base: Settings, brokers: int, say):
    """A local cluster of ``brokers`` nodes in a folder of its own under RELAYGR_HOME, for one run:
    the clients' settings, and those its nodes are recorded under."""
    from relaygr.infra.local import broker

    own = base.model_copy(update={"home": Path(base.home) / f"bench-cluster-{uuid.uuid4().hex[:6]}"})
    t0 = time.monotonic()
    state = broker.start(own, brokers=brokers)
    say(f"local cluster of {brokers} nodes up in {time.monotonic() - t0:.1f} s at {state.bootstrap}")
    try:
        yield own.model_copy(update={"bootstrap": state.bootstrap, "home": base.home}), own
    finally:
        broker.stop(own)
        shutil.rmtree(own.home, ignore_errors=True)


def _measure(
    args: argparse.Namespace, settings: Settings, nodes: Settings, pipeline, calib: Path, say
) -> int:
    env = pipeline.to_env(
        model_dir=pipeline.model_dir,
        calibration_file=calib,
        budget_ms=args.budget_ms,
        feature_fetch_ms=args.fetch_ms,
        theta=0.0001,  # the long-history phase is "at risk" by construction
        short_term=SHORT_TERM,
        device_cache_mb=2048,
    )
    hop_b, warm_r, hop_r, long_b, long_r = _traffic(args)
    cores = _pin(nodes, args.no_pin)
    say(f"cores: {cores.describe()}")
    try:
        t0 = time.monotonic()
        relay = _phase(
            settings,
            "relay",
            env,
            [
                ("warmup", hop_b, warm_r, args.qps),
                ("hops", [], hop_r, args.qps),
                ("long", long_b, long_r, args.long_qps),
            ],
            say,
            cores,
        )
        # The baseline pipeline gets the same warm-up as the relay one before its long-history phase.
        base = _phase(
            settings,
            "baseline",
            env,
            [("warmup", hop_b, warm_r, args.qps), ("long", long_b, long_r, args.long_qps)],
            say,
            cores,
        )
    finally:
        _unpin(nodes, cores)
    hop_line = _hop_line(args, relay["hops"], cores.describe())
    per_mode = {
        mode: _long_history_line(args, mode, runs["long"], pipeline.budget_ms)
        for mode, runs in (("relay", relay), ("baseline", base))
    }
    summary = _summary_line(args, pipeline.model_dir, relay, base, hop_line, per_mode)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    if args.results is not None:
        _write_results(args.results, {"relay": relay, "baseline": base})
    for line in [hop_line, per_mode["relay"], per_mode["baseline"], summary]:
        print(json.dumps({**line, "brokers": args.brokers}))
    return 0


def _traffic(args: argparse.Namespace) -> tuple[list, list, list, list, list]:
    """The Kafka-hop phase's users (behaviours, warm-up requests, measured requests) and the
    long-history phase's (behaviours, requests, their users renamed apart)."""
    from relaygr.tools.traffic import leave_last_out
    from relaygr.workers.training.movielens import load_movielens

    ml = load_movielens("ml-100k")
    users = sorted(ml.histories)
    hop_users = users[: args.hop_users]
    hop_b, hop_r = leave_last_out(ml, hop_users, num_candidates=64)
    n_hop = args.warmup_requests + args.hop_requests
    hop_r = (hop_r * math.ceil(n_hop / len(hop_r)))[:n_hop]
    hop_r = [r.model_copy(update={"request_id": f"{r.request_id}-{i}"}) for i, r in enumerate(hop_r)]
    warm_r, hop_r = hop_r[: args.warmup_requests], hop_r[args.warmup_requests :]
    long_users = [u for u in users if len(ml.histories[u]) >= 50][: args.users]
    long_b, long_r = leave_last_out(ml, long_users, target_len=args.history, num_candidates=128)
    long_b = [b.model_copy(update={"user_id": f"L{b.user_id}"}) for b in long_b]
    long_r = [
        r.model_copy(update={"user_id": f"L{r.user_id}", "request_id": f"L{r.request_id}"}) for r in long_r
    ]
    return hop_b, warm_r, hop_r, long_b, long_r


def _hop_line(args: argparse.Namespace, phase: tuple[list, dict], cores: str) -> dict:
    """The Kafka hops of the relay pipeline's hop phase: P50 and P99 of each."""
    sent, res = phase
    hops = {
        h: [r.breakdown_ms[h] for r in res.values() if h in r.breakdown_ms]
        # routing: the ingress's part of hop_requests (the cost of re-keying the public input).
        for h in ("hop_requests", "routing", "hop_retrieved", "hop_rank")
    }
    line = {
        "bench": "pipeline",
        "phase": "kafka_hops",
        "qps": args.qps,
        "requests": len(sent),
        "results": len(res),
        **{f"{h}_ms_p50": percentile(v, 50) for h, v in hops.items()},
        **{f"{h}_ms_p99": percentile(v, 99) for h, v in hops.items()},
    }
    line["max_hop_ms_p99"] = max(line[f"{h}_ms_p99"] for h in hops if h != "routing")
    line["cores"] = cores
    return line


def _long_history_line(
    args: argparse.Namespace, mode: str, phase: tuple[list, dict], budget_ms: float
) -> dict:
    sent, res = phase
    summary = RunSummary.of(sorted(res.values(), key=lambda r: r.ts), slo_ms=budget_ms, expected=len(sent))
    ranking = summary.ranking
    return {
        "bench": "pipeline",
        "phase": "long_history",
        "mode": mode,
        "history": args.history,
        "requests": len(sent),
        "results": len(res),
        "ranking_ms_p50": ranking.p50 if ranking else math.nan,
        "ranking_ms_p99": ranking.p99 if ranking else math.nan,
        "e2e_ms_p99": summary.latency_ms["end_to_end"].p99,
        "timeouts": summary.slo.timeouts,
        "paths": summary.path_counts,
        "path_reasons": summary.path_reasons,
        "tokens_computed_mean": summary.history.mean_tokens_computed,
    }


def _summary_line(
    args: argparse.Namespace, model_dir: Path, relay: dict, base: dict, hop_line: dict, per_mode: dict
) -> dict:
    """Relay over baseline, next to the model's own bound on the ratio: FLOPs of ranking the
    suffix and the candidates against the cached prefix over FLOPs of full inference."""
    from relaygr.workers.model.model import HSTURanker

    r, b = per_mode["relay"], per_mode["baseline"]
    m = HSTURanker.load(model_dir, device="cpu")
    st = SHORT_TERM
    flop_ratio = m.flops(args.history - st, st, 128) / m.flops(0, args.history, 128)
    compute = {
        mode: percentile([x.breakdown_ms.get("compute", math.nan) for x in runs["long"][1].values()], 50)
        for mode, runs in (("relay", relay), ("baseline", base))
    }
    return {
        "bench": "pipeline",
        "summary": True,
        "kafka_hop_ms_p99": hop_line["max_hop_ms_p99"],
        "relay_ranking_ms_p99": r["ranking_ms_p99"],
        "baseline_ranking_ms_p99": b["ranking_ms_p99"],
        "relay_over_baseline_p99": r["ranking_ms_p99"] / b["ranking_ms_p99"],
        "relay_over_baseline_p50": r["ranking_ms_p50"] / b["ranking_ms_p50"],
        "relay_over_baseline_compute_p50": compute["relay"] / compute["baseline"],
        "relay_over_baseline_flops": flop_ratio,
        "target_hop_p99_ms": 5.0,
        "target_ratio": 0.25,
    }


def _write_results(path: Path, by_mode: dict[str, dict]) -> None:
    """Every result of every phase, one JSON line each, with its mode and phase."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for mode, runs in by_mode.items():
            for phase, (_, res) in runs.items():
                for r in res.values():
                    f.write(json.dumps({"mode": mode, "phase": phase, **r.model_dump(mode="json")}) + "\n")
