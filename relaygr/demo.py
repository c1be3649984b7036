"""The main job: relay against baseline on one MovieLens trace, sized to this machine, side by side.

1. starts the local broker unless one runs (or RELAYGR_BOOTSTRAP names a cluster);
2. trains the HSTU ranker on MovieLens-100K unless a checkpoint exists (RELAYGR_MODEL_DIR);
3. calibrates the latency model of full ranking on this machine, and sizes the workload from it
   (``tools.sizing.size_demo``): the history length at which full ranking is predicted to take
   twice the ranking budget, within the model's serving cap, and a request rate the device serves
   on the relay path; ``--max-history`` and ``--qps`` override either;
4. publishes one trace (``tools.trace``): a window of MovieLens interactions in time order, each a
   request whose ground truth is the interacted item; each user's earlier interactions, lengthened
   to the chosen length by time-shifted repetition, are its history;
5. for each mode (relay, then baseline; ``--mode`` runs one): a fresh pipeline (ingress,
   retrieval, pre-processing, the ranking workers) on topics of its own, measured as an experiment
   point is (``tools.experiment.deployment.run_point``): unmeasured pipeline warm-up, the users'
   previous visits replayed unmeasured (returning users: the paper's gain assumes them), then the
   window's requests at the chosen rate;
6. prints both modes' figures side by side (``tools.report.compare``: nearest-rank percentiles of
   ``RunSummary``, SLO compliance, truncated and timed-out shares, HR@10 / NDCG@10, paths, cache
   tiers) and a one-line verdict; writes each mode's ``relaygr report`` and the comparison (table,
   JSON, ranking-latency CDF of both modes against the budget) into ``<run folder>/report``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from relaygr.infra.kafka import TopicError, delete_topics_with_prefix
from relaygr.infra.local import broker
from relaygr.infra.local.cluster import ensure_broker
from relaygr.infra.settings import Settings, get_settings
from relaygr.tools.args import float_above, int_at_least
from relaygr.tools.prepare import ensure_calibration, ensure_model
from relaygr.tools.report.compare import comparison_markdown, plot_comparison, verdict
from relaygr.tools.report.figures import RELAY_PATHS, json_safe
from relaygr.tools.report.summary import RunSummary
from relaygr.tools.sizing import Workload, relay_pace_of, size_demo
from relaygr.workers.engine.cores import plan_cores

MODES = ("relay", "baseline")
DEMO_MIN_PRIOR = 20
"""A request's user has at least this many real earlier interactions (so its history is real
before it is lengthened)."""


def default_ranking_workers(cores: int | None = None) -> int:
    """One ranking worker per two cores, at most two: a worker's device thread takes a core, and
    on a small machine the other stages and the broker need the rest."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(1, min(2, cores // 2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests", type=int_at_least(1), default=100, help="measured requests per mode (default 100)"
    )
    parser.add_argument(
        "--qps",
        type=float_above(0, 1000),
        default=None,
        help="request rate (default: sized from the calibration, a rate the device serves on the relay path)",
    )
    parser.add_argument(
        "--max-history",
        type=int_at_least(1),
        default=None,
        help="history length in events (default: sized from the calibration, where full ranking is "
        "predicted at twice the budget, within the model's serving cap)",
    )
    parser.add_argument(
        "--mode",
        choices=["both", *MODES],
        default="both",
        help="run relay and baseline on the same trace (default), or one of them alone",
    )
    parser.add_argument(
        "--ranking-workers",
        type=int_at_least(1),
        default=default_ranking_workers(),
        help="ranking worker processes per mode (default: one per two cores, at most two)",
    )
    parser.add_argument(
        "--theta",
        type=float_above(0, 10),  # the trigger's own bounds
        default=None,
        help="trigger threshold: pre-infer a request whose full ranking is predicted above budget x theta "
        "(default RELAYGR_THETA or the trigger's own default)",
    )
    parser.add_argument(
        "--warmup", type=int_at_least(0), default=20, help="unmeasured requests through each fresh pipeline"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the comparison as one JSON line on standard output (the progress goes to standard error)",
    )
    parser.add_argument("--stop-broker", action="store_true", help="stop the local broker at the end")


def _step(msg: str) -> None:
    print(f"== {msg}", flush=True)


@dataclass
class ModeRun:
    summary: RunSummary
    results_file: Path


def run(args: argparse.Namespace) -> int:
    base = get_settings()
    started = False
    json_out = sys.stdout
    # With --json, standard output carries the JSON line alone, for a program to read.
    progress = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with progress:
            settings, started = ensure_broker(base)
            return _run(args, settings, base, json_out)
    except (broker.BrokerError, TopicError, RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
        print(f"relaygr demo: {e}", file=sys.stderr)
        return 1
    finally:
        if started and args.stop_broker:
            broker.stop(base)
        elif started:  # kept for the next run to reuse; said, so that it is not forgotten
            print(
                f"== the local Kafka broker stays up at {settings.bootstrap} for the next run "
                "(`relaygr broker stop` stops it; `--stop-broker` stops it at the end)",
                file=sys.stderr if args.json else sys.stdout,
            )


def size_to_machine(
    args: argparse.Namespace, model_dir: Path, calibration: Path, budget_ms: float, short_term: int
) -> Workload:
    from relaygr.workers.engine.latency_model import LatencyModel

    cfg = json.loads((model_dir / "config.json").read_text())
    max_seq_len = int(cfg.get("max_seq_len") or 8192)
    # The demo never pins cores apart: a CPU device shares its cores with the stages and the broker.
    calibrated = json.loads(calibration.read_text())
    device = str(calibrated.get("device", "cpu"))
    work = size_demo(
        LatencyModel.load(calibration),
        budget_ms,
        max_seq_len,
        short_term,
        history=args.max_history,
        qps=args.qps,
        shared_device=device.startswith("cpu"),
        relay_pace=relay_pace_of(calibrated),
    )
    _step("workload sized to this machine")
    for line in work.lines():
        print("   " + line)
    return work


def _run(args: argparse.Namespace, settings: Settings, base: Settings, json_out: TextIO = sys.stdout) -> int:
    from relaygr.streams.config import PipelineSettings
    from relaygr.tools.experiment.deployment import build_and_publish
    from relaygr.workers.training.movielens import load_movielens

    pipeline = PipelineSettings()
    ensure_model(pipeline.model_dir)
    calibration = ensure_calibration(pipeline.model_dir)
    work = size_to_machine(args, pipeline.model_dir, calibration, pipeline.budget_ms, pipeline.short_term)
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    settings = settings.model_copy(
        update={"topic_prefix": f"{base.topic_prefix}-{run_id}", "home": Path(base.home) / run_id}
    )
    run_dir = Path(settings.home)
    ml = load_movielens("ml-100k")
    trace_args = argparse.Namespace(min_prior=DEMO_MIN_PRIOR, no_warmup=False)
    count = args.requests + args.warmup
    _step(f"publishing the trace: {count} MovieLens requests at {work.history}-event histories")
    start = _window_start(ml)
    trace = build_and_publish(
        settings, ml, trace_args, start, count, work.history, f"{settings.topic_prefix}.trace"
    )
    env = PipelineSettings.to_env(
        model_dir=pipeline.model_dir,
        calibration_file=calibration,
        # Production's upstream stages take time (feature fetching): emulate W = the ranking
        # budget, split over retrieval and pre-processing, unless configured otherwise.
        feature_fetch_ms=pipeline.feature_fetch_ms or pipeline.budget_ms / 2,
        **({"theta": args.theta} if args.theta else {}),
    )
    runs: dict[str, ModeRun] = {}
    try:
        for mode in MODES if args.mode == "both" else (args.mode,):
            runs[mode] = _run_mode(mode, args, settings, env, trace, work, run_dir, pipeline.budget_ms)
    finally:
        asyncio.run(delete_topics_with_prefix(settings, settings.topic_prefix))
    summaries = {m: r.summary for m, r in runs.items()}
    report_dir = _write_comparison(run_dir / "report", runs, work, args)
    _print_comparison(summaries, work)
    if args.json:
        print(json.dumps(json_safe(_json_doc(summaries, work))), file=json_out, flush=True)
    _drop_stores(run_dir)
    print(
        f"== report in {report_dir} (compare.md, compare.json, ranking_cdf.png; each mode's report in its folder)"
    )
    return 0 if all(s.slo.results == s.slo.requests for s in summaries.values()) else 1


def _window_start(ml) -> int:
    """The middle of the eligible interactions (as the experiments start their window)."""
    from relaygr.tools.trace import eligible_interactions

    return len(eligible_interactions(ml, DEMO_MIN_PRIOR)) // 2


def _run_mode(
    mode: str,
    args: argparse.Namespace,
    settings: Settings,
    env: dict[str, str],
    trace,
    work: Workload,
    run_dir: Path,
    budget_ms: float,
) -> ModeRun:
    """One mode on a pipeline of its own: start, warm up, measure, stop."""
    from relaygr.tools.experiment.deployment import run_point
    from relaygr.tools.experiment.harness import Deployment

    cores = plan_cores(args.ranking_workers, pin=False)
    dep = Deployment(settings, mode, env, run_dir, settings.topic_prefix, args.ranking_workers, cores)
    _step(f"{mode}: starting ingress, retrieval, pre-processing, {args.ranking_workers} ranking worker(s)")
    results = run_dir / "results"

    async def go():
        await dep.start()
        waited = await dep.pipe.wait_ready(timeout_s=300)
        print(f"   ready in {waited:.1f} s (logs in {dep.pipe.log_dir}); cores: {cores.describe()}")
        if args.warmup:
            print(f"   warming up: {args.warmup} unmeasured requests on users of their own")
            await run_point(
                dep, _warmup_part(trace, args), x=work.history, qps=work.qps, n_requests=args.warmup,
                user_prefix="w-", slo_ms=budget_ms, seed=args.seed + 1000, out_dir=run_dir / "warmup",
            )  # fmt: skip
        print(
            f"   measuring: {args.requests} requests at {work.qps:g}/s (each user's previous visit first, unmeasured)"
        )
        t0 = time.monotonic()
        point = await run_point(
            dep, _measured_part(trace, args), x=work.history, qps=work.qps, n_requests=args.requests,
            user_prefix="d-", slo_ms=budget_ms, seed=args.seed, out_dir=results,
        )  # fmt: skip
        print(f"   {point.summary.slo.results}/{point.requests} results in {time.monotonic() - t0:.1f} s")
        return point

    try:
        point = asyncio.run(go())
    finally:
        dep.pipe.stop()
    return ModeRun(point.summary, results / f"{mode}-{work.history:g}.jsonl")


def _measured_part(trace, args: argparse.Namespace):
    """The trace without the interactions the warm-up replays (its first ``args.warmup``)."""
    return _window_slice(trace, args.warmup, None)


def _warmup_part(trace, args: argparse.Namespace):
    return _window_slice(trace, 0, args.warmup)


def _window_slice(trace, lo: int, hi: int | None):
    """``trace`` with only the window requests ``lo:hi`` (and every warm-up visit: ``run_point``
    keeps those of the users it replays)."""
    import copy

    window = [r for r in trace.requests if r.request_id not in trace.warmup_ids]
    keep = {r.request_id for r in window[lo:hi]} | set(trace.warmup_ids)
    part = copy.copy(trace)
    part.requests = [r for r in trace.requests if r.request_id in keep]
    return part


def _write_comparison(out: Path, runs: dict[str, ModeRun], work: Workload, args: argparse.Namespace) -> Path:
    """Each mode's ``relaygr report`` in ``out/<mode>``; the comparison in ``out``."""
    from relaygr.schemas import RankedResult
    from relaygr.tools.report.command import write_run_report
    from relaygr.tools.report.figures import ranking_ms

    out.mkdir(parents=True, exist_ok=True)
    latencies = {}
    for mode, r in runs.items():
        results = [
            RankedResult.model_validate_json(line) for line in r.results_file.read_text().splitlines() if line
        ]
        inputs = {"mode": mode, "history": work.history, "qps": work.qps, "requests": args.requests,
                  "ranking_workers": args.ranking_workers, "slo_ms": work.budget_ms}  # fmt: skip
        write_run_report(out / mode, results, r.summary.to_dict(), slo_ms=work.budget_ms, inputs=inputs)
        (out / mode / "results.jsonl").write_text(r.results_file.read_text())
        latencies[mode] = [ranking_ms(x) for x in results]
    summaries = {m: r.summary for m, r in runs.items()}
    plot_comparison(latencies, work.budget_ms, out / "ranking_cdf.png", history=work.history)
    (out / "compare.json").write_text(json.dumps(json_safe(_json_doc(summaries, work)), indent=2))
    md = [
        "# RelayGR demo: relay against baseline",
        "Workload, sized to this machine:\n\n" + "\n".join(f"- {line}" for line in work.lines()),
        comparison_markdown(summaries),
        verdict(summaries, full_fits=work.full_fits),
        "![ranking latency CDF](ranking_cdf.png)",
    ]
    (out / "compare.md").write_text("\n\n".join(md) + "\n")
    return out


def _drop_stores(run_dir: Path) -> None:
    """Everything but the report, the logs and the workers' event logs (the stages' tables and
    prefix stores are large and of no use once the run is over)."""
    keep = {run_dir / "report", *run_dir.glob("*/logs")}
    for path in sorted(run_dir.rglob("*"), key=lambda x: len(x.parts), reverse=True):
        if any(k == path or k in path.parents for k in keep) or path.name == "events.jsonl":
            continue
        if path.is_dir():
            if not any(path.iterdir()):
                path.rmdir()
        else:
            path.unlink(missing_ok=True)


def _json_line(s: RunSummary) -> dict:
    """One mode's headline figures."""
    ranking = s.ranking
    return {
        "requests": s.slo.requests,
        "results": s.slo.results,
        "ranking_ms_p50": ranking.p50 if ranking else None,
        "ranking_ms_p99": ranking.p99 if ranking else None,
        "holds_budget": bool(ranking and ranking.p99 <= s.slo.slo_ms),
        "e2e_ms_p99": s.latency_ms["end_to_end"].p99,
        "slo_compliance": s.slo.compliance,
        "truncated": s.slo.truncated,
        "timeouts": s.slo.timeouts,
        "paths": s.path_counts,
        "relay_share": sum(n for p, n in s.path_counts.items() if p in RELAY_PATHS) / max(1, s.slo.results),
        "path_reasons": s.path_reasons,
        **s.trigger.model_dump(exclude={"decisions"}),
        "prefix_tiers": s.prefix_tiers,
        "prefill": s.prefill,
        "workers": s.workers,
        "hr@10": s.quality.hr_at_10,
        "ndcg@10": s.quality.ndcg_at_10,
    }


def _json_doc(summaries: dict[str, RunSummary], work: Workload) -> dict:
    return {
        "slo_ms": work.budget_ms,
        "workload": work.to_dict(),
        **{m: _json_line(s) for m, s in summaries.items()},
        "verdict": verdict(summaries, full_fits=work.full_fits),
    }


def _print_comparison(summaries: dict[str, RunSummary], work: Workload) -> None:
    _step(
        f"relay against baseline: {work.history}-event histories, {work.qps:g} requests/s "
        "(percentiles: nearest rank; returning users)"
    )
    for line in comparison_markdown(summaries).splitlines():
        print("   " + line)
    _step(verdict(summaries, full_fits=work.full_fits))
