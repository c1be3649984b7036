"""Relay vs baseline on the MovieLens trace, side by side: longest history or highest QPS under the SLO.

`relaygr experiment seq-len`: the longest history whose ranking P99 stays within the SLO, per mode.
`relaygr experiment throughput`: the highest QPS whose ranking P99 stays within the SLO at a fixed
long history, per mode. Each prints (and writes) both modes and their ratio.

The protocol is fixed before anything is measured and written at the top of the report; nothing
in it depends on the mode:
- model: the trained checkpoint (its architecture is in the report); one ranking worker per mode
  with ``--threads`` torch threads; the latency model of full ranking is calibrated once, here,
  with the same thread count, and given to both modes' workers (the baseline truncates with it);
- histories (throughput): unless ``--history`` gives it, the longest history whose full ranking at
  low load is predicted (by this machine's calibration) to take 70 % of the product budget, at most
  half the model's serving cap (``tools.sizing``); the report gives the compute ratio of full to
  relay ranking there next to the throughput ratio;
- SLO: a P99 bound B on ranking latency (rank request produced -> result produced). Unless
  ``--slo-ms`` gives it, B is measured so that the baseline serves about ``--slo-tokens`` tokens
  (throughput: its history; seq-len: 1024): a baseline pipeline without truncation ranks the trace window at that history length
  at the reference load (``--slo-qps``, 10); B = the largest of the ranking P99s of
  ``--slo-slices`` (3) consecutive slices of that run × (1 + ``--slo-headroom``, 0.25), rounded up
  to a whole millisecond (on a shared machine the tail of one short run is noisy, and the
  baseline must hold the SLO at its own calibration point);
- upstream time W = B: retrieval and pre-processing each emulate feature fetching for B/2;
- trigger: θ = ``--theta`` (0.1: pre-infer every history whose full ranking is predicted to take
  more than a tenth of B), short-term suffix 64 events; cache budgets at their defaults;
- traffic: a window of the ML-100k trace (interactions with at least ``--min-prior`` real earlier
  ones, in time order, from ``--window-start``): each interaction is a request for that user at its
  time whose ground truth is the interacted item; the user's earlier interactions are behaviours.
  Requests go out in trace order with Poisson arrivals at the point's QPS (same seed in both
  modes), so users come back as they did. Before measuring, each user's last interaction before
  the window is replayed as an unmeasured warm-up request (the user's previous visit). Users get
  a fresh id prefix per point, so no state carries over between points;
- every fresh pipeline (the calibration's too) first ranks ``--pipeline-warmup`` (100) unmeasured
  requests of the reference trace (the window at ``--slo-tokens``) on users of its own: a
  pipeline's first requests run slower (caches, allocators, lazily set-up paths);
- the first point runs twice in each mode, with fresh users each time, and both runs are reported;
  only the second counts (the first point would otherwise be the only one measured on pipelines
  that had served nothing of this shape yet);
- histories: each user's real history before the window, lengthened to exactly the point's length
  by time-shifted repetition (``tools.long_users.lengthen``); their real interactions in the window
  then extend it;
- a point holds the SLO when its P99 of ranking latency (counting missing, timed-out and
  truncated requests as infinitely late) is at most B with 95 % confidence: with n requests of
  which k missed B, the one-sided Clopper-Pearson upper bound of the miss rate is at most 1 %
  (``stopping``). Requests go out in rounds until that rule decides, at most ``--max-requests``;
- both pipelines run on one broker, each on its own topics and state; at every point the two
  modes run back to back, the order flipping from point to point, and only the measured mode's
  processes run: the other mode's are stopped (SIGSTOP) for the point (``--no-isolate``: both
  live);
- cores (``--pin``, on by default where the machine has a core to spare): each ranking worker's
  device thread has a CPU core of its own, every other process of the experiment (stages,
  broker, this load generator) the other cores (``workers.engine.cores``); with ``--core-per-stage``,
  each stage process a core of its own too, where the machine has enough;
- several experiments (``relaygr experiment seq-len throughput``) run one after the other on one
  calibration, one B and one pair of pipelines, each on users of its own, each reported apart;
- ``--repeat N`` runs the whole experiment N times and reports each run's ratio, their median and
  the worst. B is measured by the first run and fixed for the others (unless ``--slo-ms`` fixes
  it for all): measured per run it moved from 73 to 230 ms on one machine, and at the high value
  the trigger found nothing at risk, so that run's ratio measured the calibration, not RelayGR.

The parts: ``kinds`` (one spec per experiment: what is swept and what its report adds),
``protocol``, ``deployment`` (pipelines, points, the SLO bound), ``report``, ``plots``; this
module runs the sweep and is the command.

Outputs in ``--out``: ``report.md`` (protocol, tables, plots), ``report.json``, the plots, and
``results/<mode>-<point>.jsonl`` (every result of every point).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from relaygr.infra.settings import Settings
from relaygr.tools.experiment import deployment
from relaygr.tools.experiment.arguments import add_experiment_arguments
from relaygr.tools.experiment.harness import Deployment, move_back, move_off_device
from relaygr.tools.experiment.kinds import KINDS, ExperimentKind
from relaygr.tools.experiment.protocol import EXPERIMENT_SHORT_TERM, MODES, PointRun, Protocol
from relaygr.tools.experiment.report import print_headline, say, write_experiment_report
from relaygr.tools.experiment.stopping import StopRule
from relaygr.tools.report.figures import json_safe
from relaygr.tools.report.markdown import fmt
from relaygr.workers.engine.cores import PIPELINE_STAGES, CoreLayout, available_cores, pin_tasks, plan_cores
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.training.movielens import MovieLens


@dataclass
class Run:
    """One run of an experiment: where it writes, what it measures with, what it created."""

    kind: ExperimentKind
    args: argparse.Namespace
    settings: Settings
    model_dir: Path
    run_id: str
    out: Path  # the report
    root: Path  # the pipelines' state
    ml: MovieLens
    window_start: int
    latency: LatencyModel
    samples: list[tuple[int, float]]
    cores: CoreLayout
    rule: StopRule
    user_tag: str = ""  # before every point's user prefix: experiments sharing pipelines never share users

    @property
    def topics(self) -> str:
        """The start of every topic and group name of this run: under the deployment's prefix, so
        the cascade role of a secured cluster (prefixed ACLs) may run it."""
        return f"{self.settings.topic_prefix}-{self.run_id}"

    @property
    def calibration(self) -> Path:
        return self.out / "calibration.json"


def prepare(args: argparse.Namespace, kinds: list[ExperimentKind]) -> Run:
    """Broker, model, folders and the latency model of full ranking, before any pipeline (shared by
    every experiment of ``kinds``; the run's ``kind`` is the first)."""
    from relaygr.infra.local.cluster import ensure_broker
    from relaygr.infra.settings import get_settings
    from relaygr.streams.config import PipelineSettings
    from relaygr.tools.experiment.deployment import calibrate_latency, window_start
    from relaygr.tools.prepare import ensure_model
    from relaygr.tools.sizing import relay_pace_of
    from relaygr.tools.trace import log_as_dataset
    from relaygr.workers.training.movielens import load_movielens
    from relaygr.workers.training.train import load_log, report_bad_rows

    settings, _ = ensure_broker(get_settings())
    model_dir = Path(args.model or PipelineSettings().model_dir)
    ensure_model(model_dir)
    kind = kinds[0]
    names = "-".join(k.name for k in kinds)  # topic names take letters, digits, '.', '_' and '-'
    run_id = f"exp-{names}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    out = Path(args.out or Path(settings.home) / "experiments" / run_id)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(settings.home) / "experiments" / "state" / run_id
    say(f"{names} experiment {run_id}: report in {out}")
    for k in kinds:
        if k.name == "seq-len":
            model_dir = deployment.serving_cap_at_least(
                model_dir, 2 * int(max(k.points(args))), out / "model", say
            )
    cores = (
        plan_cores(1, stages=(*PIPELINE_STAGES, "ranker-0") if args.core_per_stage else ())
        if not args.no_pin
        else CoreLayout((), tuple(sorted(available_cores())), False, "--no-pin")
    )
    say(f"cores: {cores.describe()}")
    if cores.pinned:  # the latency model is the device's: calibrate on the device core
        pin_tasks(os.getpid(), {cores.device[0]})
    lat, samples = calibrate_latency(model_dir, args.threads, out / "calibration.json", args.device)
    move_off_device(cores, settings)
    say("latency model of full ranking: " + ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in samples))
    args.relay_pace = relay_pace_of(json.loads((out / "calibration.json").read_text()))
    cap = json.loads((model_dir / "config.json").read_text()).get("max_seq_len") or 8192
    for k in kinds:  # what the calibration decides (one B for all of them)
        k.size(args, lat, int(cap), say)
    if getattr(args, "interactions", None) is not None:
        log, source = load_log(args)
        report_bad_rows(log)
        ml = log_as_dataset(log, Path(source).stem)
    else:
        ml = load_movielens("ml-100k")
    start = window_start(args, ml)
    rule = StopRule(args.miss_rate, args.confidence, args.max_requests, args.min_round, args.max_round)
    return Run(kind, args, settings, model_dir, run_id, out, root, ml, start, lat, samples, cores, rule)


def fix_protocol(run: Run, xs: list[float], slo_ms: float, slo_how: str) -> Protocol:
    from relaygr.tools.experiment.deployment import model_info

    args, kind = run.args, run.kind
    model_cfg, version = model_info(run.model_dir)
    text = kind.protocol_text(args)
    return Protocol(
        experiment=kind.name,
        model_dir=str(run.model_dir),
        model=model_cfg,
        model_version=version,
        threads=args.threads,
        ranking_workers=1,
        partitions=run.settings.partitions,
        latency_model={
            "coeffs": run.latency.coeffs(),
            "samples": run.samples,
            "text": ", ".join(f"{n}: {ms:.1f}" for n, ms in run.samples),
        },
        slo_ms=slo_ms,
        slo_method=slo_how,
        upstream_ms=slo_ms,
        feature_fetch_ms=slo_ms / 2,
        theta=args.theta,
        short_term=EXPERIMENT_SHORT_TERM,
        dataset=run.ml.name,
        min_prior=args.min_prior,
        window_start=run.window_start,
        warmup=not args.no_warmup,
        pipeline_warmup=args.pipeline_warmup,
        arrivals=text["arrivals"] + f" (seed {args.seed})",
        seed=args.seed,
        points=xs,
        point_label=kind.point_label,
        requests_per_point=text["requests_per_point"]
        + ("; the first point runs once (--first-point-once)" if args.first_point_once else ""),
        history=text["history"],
        synthesis=(
            f"{run.ml.name} histories are shorter than these lengths: each user's real history "
            "before the window is repeated with time shifts (each earlier copy moved back by the "
            "history's span plus one day; copies compressed in time where they would reach back "
            "before 1970-01-02) and cut to the most recent events"
        ),
        criterion=(
            f"P99 ≤ B with {args.confidence:.0%} confidence: with n requests of which k were not ranked "
            "within B with their whole history (missing, timed-out and truncated ones count), the "
            f"one-sided Clopper-Pearson upper bound of the miss rate is ≤ {args.miss_rate:.0%} (k = 0 "
            f"needs n ≥ 299); a point fails as soon as not even {args.max_requests} requests could "
            "bring the bound there, or undecided at that cap"
        ),
        core_layout=run.cores.describe(),
        isolation=(
            "both modes' pipelines live at once"
            if args.no_isolate
            else "only the measured mode's processes run during a point: the other mode's pipeline "
            "is stopped (SIGSTOP) and, when its turn comes, resumed (SIGCONT) and probed until it "
            "answers again before its point starts"
        ),
    )


def sweep(run: Run, deps: list, xs: list[float], slo_ms: float) -> tuple[list[PointRun], dict]:
    """Every point, both modes back to back (the order flipping from point to point); a mode
    that failed ``--patience`` points in a row stops. Returns the points and their traces."""
    from relaygr.tools.experiment.deployment import build_and_publish

    args, kind = run.args, run.kind
    built: dict[str, object] = {}  # topic -> trace: points of one shape share it
    traces = {}
    points: list[PointRun] = []
    patience = args.patience if args.patience is not None else kind.default_patience
    active = dict.fromkeys(MODES, True)
    fails: Counter[str] = Counter()
    for i, x in enumerate(xs):
        if not any(active.values()):
            break
        n_requests = kind.requests(args, x)
        shape = kind.trace(args, x, n_requests)
        topic = f"{run.topics}.{shape.topic_suffix}"
        if topic not in built:
            built[topic] = build_and_publish(
                run.settings, run.ml, args, run.window_start, shape.requests, shape.length, topic
            )
        traces[x] = built[topic]
        for d in deps if i % 2 == 0 else deps[::-1]:
            if not active[d.mode]:
                continue
            if not args.no_isolate:
                _isolate(d, deps)
            for attempt in (1, 2) if i == 0 and not getattr(args, "first_point_once", False) else (2,):
                pr = _run_one(run, d, traces[x], x, i, attempt, n_requests, slo_ms, len(xs))
                points.append(pr)
            fails[d.mode] = 0 if pr.holds else fails[d.mode] + 1
            if patience and fails[d.mode] >= patience:
                active[d.mode] = False
    return points, traces


def _isolate(d, deps: list) -> None:
    """Only ``d``'s processes run: the others' are stopped; ``d``'s, if stopped, resume and answer
    a probe before the point (a stopped consumer may have left its group meanwhile)."""
    for other in deps:
        if other is not d and not other.pipe.paused:
            other.pipe.pause()
    if d.pipe.paused:
        d.pipe.resume()
        asyncio.run(d.pipe.wait_ready(timeout_s=300))


def _run_one(
    run: Run, d, trace, x: float, i: int, attempt: int, n_requests: int, slo_ms: float, n_points: int
) -> PointRun:
    """One run of point ``x`` on deployment ``d``, on users of its own (``p<i>-``, ``p<i>a-`` for
    the first point's first run)."""
    from relaygr.tools.experiment.deployment import run_point

    args, kind = run.args, run.kind
    t0 = time.monotonic()
    pr = asyncio.run(
        run_point(
            d,
            trace,
            x=x,
            qps=kind.qps(args, x),
            n_requests=n_requests,
            user_prefix=f"{run.user_tag}p{i}{'a' if attempt == 1 else ''}-",
            slo_ms=slo_ms,
            seed=args.seed + i,
            out_dir=run.out / "results",
            rule=run.rule,
        )
    )
    pr.attempt = attempt
    s = pr.summary
    say(
        f"[{i + 1}/{n_points}] {kind.point_label.split(' (')[0]} {x:g} {d.mode:8s}"
        f"{' (first run)' if attempt == 1 else ''}: "
        f"n {pr.requests}, k {pr.misses}, UB {fmt(pr.upper, 4)}, {s.slo.results} results, ranking P50 "
        f"{fmt(s.ranking.p50 if s.ranking else None)} P99 "
        f"{fmt(s.ranking.p99 if s.ranking else None)} ms, compliance "
        f"{fmt(s.slo.compliance, 3)} -> {'holds' if pr.holds else 'misses'} the SLO "
        f"({time.monotonic() - t0:.0f} s)"
    )
    return pr


def run_sweep(args: argparse.Namespace, kinds: list[ExperimentKind]) -> list[dict]:
    """One run of every experiment of ``kinds`` on one pair of pipelines (one calibration, one SLO
    bound): each experiment's points on users of its own, its report in ``--out`` (in
    ``--out/<experiment>`` when there are several). Returns their headlines."""
    from relaygr.infra.kafka import delete_topics_with_prefix
    from relaygr.tools.experiment.deployment import build_and_publish, measure_slo, pipeline_env

    t_start = time.monotonic()
    run = prepare(args, kinds)
    deps: list[Deployment] = []
    done = False
    try:
        ref = build_and_publish(
            run.settings, run.ml, args, run.window_start, max(args.slo_requests, args.pipeline_warmup),
            args.slo_tokens, f"{run.topics}.trace-ref",
        )  # fmt: skip
        slo_ms, slo_how = measure_slo(
            run.settings, args, run.model_dir, run.calibration, run.latency, ref, run.root, run.topics,
            run.cores,
        )  # fmt: skip
        env = pipeline_env(args, run.model_dir, run.calibration, slo_ms)
        deps = [Deployment(run.settings, m, env, run.root, run.topics, 1, run.cores) for m in MODES]
        asyncio.run(_start_and_warm(deps, ref, args, run.root / "warmup"))
        docs = []
        for k, kind in enumerate(kinds):
            out = run.out if len(kinds) == 1 else run.out / kind.name
            one = replace(run, kind=kind, out=out, user_tag=f"k{k}-" if len(kinds) > 1 else "")
            docs.append(_one_experiment(one, deps, slo_ms, slo_how))
        done = True
    finally:
        for d in deps:
            d.pipe.stop()
        move_back(run.cores, run.settings)  # the broker, and this process for a next run
        if not args.keep:
            asyncio.run(delete_topics_with_prefix(run.settings, run.topics))
            if done:  # after a failure the pipelines' logs and state stay for inspection
                shutil.rmtree(run.root, ignore_errors=True)
            else:
                say(f"logs and state kept in {run.root}")
    heads = []
    for kind, out, doc in docs:
        doc["headline"]["seconds"] = round(time.monotonic() - t_start, 1)
        doc["headline"]["cores"] = run.cores.describe()
        doc["headline"]["load_average"] = list(os.getloadavg())
        (out / "report.json").write_text(json.dumps(json_safe(doc), indent=2))
        print_headline(doc, kind)
        heads.append(doc["headline"])
    return heads


async def _start_and_warm(deps: list, ref, args: argparse.Namespace, scratch: Path) -> None:
    """Start every mode's pipeline, wait until each answers, then warm each up (alone, unless
    ``--no-isolate``)."""
    from relaygr.tools.experiment.deployment import warm_pipeline

    for d in deps:
        await d.start()
    for d in deps:
        say(f"{d.mode} pipeline ready in {await d.pipe.wait_ready(timeout_s=300):.1f} s")
    for d in deps:
        if not args.no_isolate:
            for other in deps:
                if other is not d:
                    other.pipe.pause()
            if d.pipe.paused:
                d.pipe.resume()
                await d.pipe.wait_ready(timeout_s=300)
        await warm_pipeline(d, ref, args, scratch)
    say(f"pipelines warmed up ({args.pipeline_warmup} unmeasured requests each)")


def _one_experiment(run: Run, deps: list, slo_ms: float, slo_how: str) -> tuple[ExperimentKind, Path, dict]:
    """``run.kind``'s protocol, sweep and report on the running pipelines."""
    xs = run.kind.points(run.args)
    proto = fix_protocol(run, xs, slo_ms, slo_how)
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "protocol.json").write_text(proto.model_dump_json(indent=2))
    say(
        f"{run.kind.name}: protocol fixed: B = {slo_ms:g} ms, W = {slo_ms:g} ms, points "
        + ", ".join(f"{x:g}" for x in xs)
    )
    points, traces = sweep(run, deps, xs, slo_ms)
    return run.kind, run.out, write_experiment_report(run.out, run.kind, proto, points, traces, run.args)


def run_repeated(args: argparse.Namespace, kinds: list[ExperimentKind]) -> int:
    """``--repeat`` runs of the whole experiment: each run's headline, the median and worst ratio.
    Several experiments run once, on shared pipelines, and print one JSON line each."""
    if len(kinds) > 1:
        if args.repeat > 1:
            raise SystemExit("--repeat runs one experiment: name only one")
        with contextlib.redirect_stdout(sys.stderr):
            heads = run_sweep(args, kinds)
        if args.json:
            for head in heads:
                print(json.dumps(json_safe(head)))
        return 0
    kind = kinds[0]
    heads = []
    for r in range(max(1, args.repeat)):
        if args.repeat > 1:
            say(f"run {r + 1} of {args.repeat}")
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line
            heads += run_sweep(args, kinds)
        if args.slo_ms is None and heads[-1].get("slo_ms"):
            # One B for every run (see the module docstring).
            how = f"measured by run {r + 1} of {args.repeat} and fixed for the runs after it"
            args = argparse.Namespace(**{**vars(args), "slo_ms": heads[-1]["slo_ms"], "slo_how": how})
            say(f"B = {args.slo_ms:g} ms from run {r + 1} is fixed for the runs after it")
    ratios = [h["ratio"] for h in heads]
    # A run in which either mode held no point has no ratio: it is counted, not guessed.
    known = sorted(x for x in ratios if x is not None)
    out = {
        "experiment": kind.name,
        "runs": heads,
        "ratios": ratios,
        "median_ratio": statistics.median(known) if known else None,
        "worst_ratio": known[0] if known else None,
        "runs_without_ratio": len(ratios) - len(known),
        "target_ratio": kind.target_ratio,
    }
    if args.repeat > 1:
        say(
            f"{kind.name}: ratios {', '.join(fmt(x, 2) for x in ratios)}; median "
            f"{fmt(out['median_ratio'], 2)}, worst {fmt(out['worst_ratio'], 2)} (runs without a ratio: "
            f"{out['runs_without_ratio']})"
        )
    if args.json:
        print(json.dumps(json_safe(out if args.repeat > 1 else heads[0])))
    return 0


# ---------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_experiment_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from relaygr.infra.kafka import TopicError
    from relaygr.infra.local.broker import BrokerError
    from relaygr.infra.local.cluster import broker_for_run
    from relaygr.infra.settings import get_settings

    kinds = [KINDS[w] for w in dict.fromkeys(args.which)]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # Stopped from outside, ``relaygr`` unwinds (SystemExit), so the pipelines (some of them
    # SIGSTOPped) are stopped too, and a local broker started for the run.
    try:
        with broker_for_run(get_settings(), progress=sys.stderr):
            return run_repeated(args, kinds)
    except (BrokerError, TopicError, RuntimeError, TimeoutError) as e:
        print(f"relaygr experiment: {e}", file=sys.stderr)
        return 1
