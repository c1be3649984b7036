"""Kafka hop overhead, and relay vs baseline ranking latency, on the real broker (``relaygr bench pipeline``).

Both modes run in one invocation, back to back, on the same broker, model and trace:
0. each pipeline (relay, then baseline) first ranks --warmup-requests unmeasured requests at --qps;
1. relay pipeline: short real MovieLens histories at --qps (default 100 req/s): P50/P99 of each
   Kafka hop (requests -> retrieval, retrieved -> pre-processing, rank-requests -> worker);
2. relay pipeline, then baseline pipeline: --users users with histories of --history events
   (``tools.long_users``), ranking-stage latency (rank request produced -> result produced),
   P50/P99, and the relay/baseline ratio, next to the model's FLOP bound on that ratio (suffix +
   candidates against the cached prefix over full).
One JSON line per phase and mode, then one line with the headline figures and ratios.

``--brokers N`` (N > 1) runs it all on a local N-node cluster of its own (replication min(3, N),
min ISR 2 with 3), started for the run and stopped after it; every line then says ``"brokers": N``.
Against a cluster of your own, set RELAYGR_BOOTSTRAP to its nodes instead.

The ranking worker's device thread has a CPU core of its own and every other process (stages,
broker, this load generator) the other cores, where the machine has one to spare (``--no-pin``:
not; ``workers.engine.cores``); the hop line says which.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from relaygr.infra.settings import Settings
from relaygr.tools.args import int_at_least
from relaygr.tools.experiment.harness import Deployment
from relaygr.tools.experiment.scenarios.runner import Scenario, ScenarioRun, Setup, run_scenario
from relaygr.tools.report.figures import percentile
from relaygr.tools.report.summary import RunSummary
from relaygr.workers.engine.cores import CoreLayout

SHORT_TERM = 64  # events computed at ranking time on the relay path
CANDIDATES = 128  # of a long-history request


class Latency(Scenario):
    name, tag = "pipeline", "bench"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
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
            "--hop-users",
            type=int_at_least(1),
            default=100,
            help="users whose requests repeat in the hop phase",
        )
        parser.add_argument(
            "--users", type=int_at_least(1), default=200, help="users with long histories (one request each)"
        )
        parser.add_argument(
            "--history", type=int_at_least(1), default=2048, help="history length of the long-history phase"
        )
        parser.add_argument(
            "--long-qps", type=float, default=8.0, help="request rate of the long-history phase"
        )
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

    def check(self, args: argparse.Namespace) -> None:
        if args.results is not None:  # fail now, not after minutes of measuring
            args.results.parent.mkdir(parents=True, exist_ok=True)
            args.results.touch()

    def setups(self, args: argparse.Namespace) -> list[Setup]:
        return [Setup(f"bench-{mode}", mode) for mode in ("relay", "baseline")]

    def env(self, args: argparse.Namespace) -> dict[str, str]:
        from relaygr.streams.config import PipelineSettings

        return PipelineSettings.to_env(
            budget_ms=args.budget_ms,
            feature_fetch_ms=args.fetch_ms,
            theta=0.0001,  # the long-history phase is "at risk" by construction
            short_term=SHORT_TERM,
            device_cache_mb=2048,
        )

    def cores(self, args: argparse.Namespace, setup: Setup) -> CoreLayout:
        from relaygr.workers.engine.cores import available_cores, plan_cores

        if args.no_pin:
            return CoreLayout((), tuple(sorted(available_cores())), False, "--no-pin")
        return plan_cores(1)

    @contextlib.contextmanager
    def broker(
        self, args: argparse.Namespace, say: Callable[[str], None]
    ) -> Iterator[tuple[Settings, Settings]]:
        if args.brokers == 1:
            with super().broker(args, say) as got:
                yield got
            return
        from relaygr.infra.local import broker
        from relaygr.infra.settings import get_settings

        # A local cluster in a folder of its own under RELAYGR_HOME, stopped however the run ends.
        base = get_settings()
        own = base.model_copy(update={"home": Path(base.home) / f"bench-cluster-{uuid.uuid4().hex[:6]}"})
        t0 = time.monotonic()
        state = broker.start(own, brokers=args.brokers)
        say(f"local cluster of {args.brokers} nodes up in {time.monotonic() - t0:.1f} s at {state.bootstrap}")
        try:
            yield own.model_copy(update={"bootstrap": state.bootstrap, "home": base.home}), own
        finally:
            broker.stop(own)
            shutil.rmtree(own.home, ignore_errors=True)

    async def measure(self, run: ScenarioRun, dep: Deployment, setup: Setup) -> list[dict]:
        from relaygr.tools.traffic import collect_results, publish

        args = run.args
        hop_b, warm_r, hop_r, long_b, long_r = run.kept.setdefault("traffic", _traffic(args, run.ml))
        phases = [("warmup", hop_b, warm_r, args.qps)]
        if dep.mode == "relay":
            phases.append(("hops", [], hop_r, args.qps))
        # The baseline pipeline gets the same warm-up as the relay one before its long-history phase.
        phases.append(("long", long_b, long_r, args.long_qps))
        out = {}
        for name, behaviours, requests, qps in phases:
            run.say(f"{dep.mode}/{name}: {len(behaviours)} behaviours, {len(requests)} requests at {qps:g}/s")
            sent = await publish(
                dep.settings, dep.reg, behaviours, requests, qps=qps, settle_s=1.0, wait_for_ingest=True
            )
            out[name] = (
                sent,
                await collect_results(dep.settings, dep.reg, {r.request_id for r in sent}, timeout_s=300),
            )
        run.kept[dep.mode] = out
        lines = [_hop_line(args, out["hops"])] if "hops" in out else []
        return [
            {**line, "brokers": args.brokers}
            for line in [*lines, _long_history_line(args, dep.mode, out["long"])]
        ]

    def summary(self, run: ScenarioRun, lines: list[dict]) -> list[dict]:
        args = run.args
        per_mode = {line["mode"]: line for line in lines if line.get("phase") == "long_history"}
        hop = next(line for line in lines if line.get("phase") == "kafka_hops")
        by_mode = {mode: run.kept[mode] for mode in ("relay", "baseline")}
        line = _summary_line(args, run.model_dir, by_mode, hop, per_mode)
        line["seconds"] = round(time.monotonic() - run.t0, 1)
        if args.results is not None:
            _write_results(args.results, by_mode)
        return [{**line, "brokers": args.brokers}]


def _traffic(args: argparse.Namespace, ml) -> tuple[list, list, list, list, list]:
    """The Kafka-hop phase's users (behaviours, warm-up requests, measured requests) and the
    long-history phase's (behaviours, requests, their users named apart)."""
    from relaygr.tools.long_users import long_users
    from relaygr.tools.traffic import leave_last_out

    hop_b, hop_r = leave_last_out(ml, sorted(ml.histories)[: args.hop_users], num_candidates=64)
    n_hop = args.warmup_requests + args.hop_requests
    hop_r = (hop_r * math.ceil(n_hop / len(hop_r)))[:n_hop]
    hop_r = [r.model_copy(update={"request_id": f"{r.request_id}-{i}"}) for i, r in enumerate(hop_r)]
    warm_r, hop_r = hop_r[: args.warmup_requests], hop_r[args.warmup_requests :]
    long_b, long_r = long_users(
        ml, args.users, args.history, tag="L", min_events=50, num_candidates=CANDIDATES
    )
    return hop_b, warm_r, hop_r, long_b, long_r


def _hop_line(args: argparse.Namespace, phase: tuple[list, dict]) -> dict:
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
    return line


def _long_history_line(args: argparse.Namespace, mode: str, phase: tuple[list, dict]) -> dict:
    sent, res = phase
    summary = RunSummary.of(
        sorted(res.values(), key=lambda r: r.ts), slo_ms=args.budget_ms, expected=len(sent)
    )
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
    args: argparse.Namespace, model_dir: Path, by_mode: dict, hop_line: dict, per_mode: dict
) -> dict:
    """Relay over baseline, next to the model's own bound on the ratio: FLOPs of ranking the
    suffix and the candidates against the cached prefix over FLOPs of full inference."""
    from relaygr.workers.model.model import HSTURanker

    r, b = per_mode["relay"], per_mode["baseline"]
    m = HSTURanker.load(model_dir, device="cpu")
    st = SHORT_TERM
    flop_ratio = m.flops(args.history - st, st, CANDIDATES) / m.flops(0, args.history, CANDIDATES)
    compute = {
        mode: percentile([x.breakdown_ms.get("compute", math.nan) for x in runs["long"][1].values()], 50)
        for mode, runs in by_mode.items()
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


KIND = Latency()
add_arguments = KIND.arguments


def run(args: argparse.Namespace) -> int:
    return run_scenario(KIND, args)
