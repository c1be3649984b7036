"""Running an experiment's pipelines: one point on a mode's deployment (``tools.experiment.harness``),
and the SLO bound.

Primitives:
- ``run_point(deployment, trace, ...) -> PointRun``: preload the window's users, replay their
  previous visits unmeasured, then the window at the point's QPS (a fixed number of requests, or
  in rounds until a ``StopRule`` decides); summarise the results.
- ``warm_pipeline``: unmeasured traffic through a fresh pipeline.
- ``measure_slo(...) -> (B, how)``: the SLO bound from a baseline pipeline without truncation
  (see ``tools.experiment`` for the protocol).
- ``calibrate_latency``, ``pipeline_env``, ``window_start``, ``build_and_publish``: the set-up
  both modes share; ``serving_cap_at_least``: a copy of the model whose serving cap fits the points.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path

from relaygr.tools.barriers import wait_sentinels_applied
from relaygr.tools.experiment.harness import Deployment
from relaygr.tools.experiment.protocol import EXPERIMENT_SHORT_TERM, PointRun
from relaygr.tools.experiment.report import say
from relaygr.tools.experiment.stopping import StopRule
from relaygr.tools.replay import Replayer, plan_replay
from relaygr.tools.report.figures import meets_slo, percentile, ranking_ms
from relaygr.tools.report.inputs import prefill_statuses, read_admitted_ids
from relaygr.tools.report.summary import RunSummary
from relaygr.tools.trace import TraceTopics, build_trace, eligible_interactions, load_trace, publish_trace
from relaygr.tools.traffic import collect_results


async def run_point(
    dep: Deployment,
    trace,
    *,
    x: float,
    qps: float,
    n_requests: int,
    user_prefix: str,
    slo_ms: float,
    seed: int,
    out_dir: Path,
    allow_truncated: bool = False,
    rule: StopRule | None = None,
) -> PointRun:
    """Preload, warm up, then replay ``n_requests`` window requests at ``qps`` into ``dep``; with
    ``rule``, rounds of window requests (at most ``rule.cap``) until the rule decides."""
    warm_ids = trace.warmup_ids
    cap = rule.cap if rule is not None else n_requests
    window = [r for r in trace.requests if r.request_id not in warm_ids][:cap]
    users = {r.user_id for r in window}
    warm = [r for r in trace.requests if r.request_id in warm_ids and r.user_id in users]
    behaviours = [b for b in trace.behaviours if b.user_id in users]
    s, reg = dep.settings, dep.reg
    dep.pipe.check()
    first: dict[str, float] = {}
    for r in window:
        first.setdefault(r.user_id, r.model_ts)
    async with Replayer(s, reg, behaviours, user_prefix=user_prefix) as rp:
        # Each user's whole history before the window up front; the window's interactions in time.
        await rp.preload(first)
        await wait_sentinels_applied(s, reg, progress=True)
        if warm:
            await _previous_visits(dep, rp, warm, qps, seed)
        before = dep.trigger_counts()
        if rule is None:
            plan = plan_replay(window, qps=qps, seed=seed)
            sent = await rp.run(plan)
            res = await collect_results(s, reg, {r.request_id for r in sent}, timeout_s=60 + plan.duration_s)
            verdict, misses = None, None
        else:
            sent, res, verdict, misses = await _rounds(rp, s, reg, window, rule, qps, seed, slo_ms)
    ids = {r.request_id for r in sent}
    await dep.wait_idle()
    after = dep.trigger_counts()
    trig = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    results = sorted(res.values(), key=lambda r: r.ts)
    statuses = prefill_statuses(Path(s.home) / "workers", ids)
    summary = RunSummary.of(
        results,
        slo_ms=slo_ms,
        expected=len(sent),
        duration_s=len(sent) / qps,
        admitted=await read_admitted_ids(s, reg.name("prefill"), ids, progress=False),
        prefill_statuses=statuses,
        allow_truncated=allow_truncated,
        decisions=trig,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{dep.mode}-{x:g}.jsonl", "w") as f:
        for r in results:
            f.write(r.model_dump_json() + "\n")
    pr = PointRun(x, dep.mode, summary, trig, len(sent), [ranking_ms(r) for r in results])
    if rule is not None and misses is not None:
        pr.misses, pr.upper, pr.verdict = misses, rule.upper(len(sent), misses), verdict
    return pr


async def _previous_visits(dep: Deployment, rp: Replayer, warm: list, qps: float, seed: int) -> None:
    """The window's users' previous visits, unmeasured, so that the window meets returning users.
    Their histories are preloaded; the window's interactions must not go out ahead of time
    (retrieval's history summary assumes ordered input), so no behaviours go with them. Each
    admitted pre-inference finishes, even behind a backlog, so waiting until the workers are idle
    is all it takes: no visit is sent again."""
    s, reg = dep.settings, dep.reg
    plan = plan_replay(warm, qps=qps, seed=seed + 1)
    sent = await rp.run(plan, behaviours=False)
    await collect_results(s, reg, {r.request_id for r in sent}, timeout_s=120)
    await dep.wait_idle()


async def _rounds(rp: Replayer, s, reg, window: list, rule: StopRule, qps: float, seed: int, slo_ms: float):
    """Rounds of the window's next requests at ``qps`` until ``rule`` decides (or the window ends):
    each round's results are collected before the rule is asked. Returns the requests sent, their
    results, the verdict and the misses (results not within B with their whole history, and
    missing ones)."""
    sent: list = []
    res: dict = {}
    misses, verdict, rnd = 0, "continue", 0
    while verdict == "continue":
        chunk = window[len(sent) : len(sent) + rule.next_round(len(sent), misses)]
        if not chunk:
            verdict = "fails"  # undecided when the trace (or the cap) ran out
            break
        plan = plan_replay(chunk, qps=qps, seed=seed + 7919 * rnd)
        got = await rp.run(plan)
        sent += got
        res.update(await collect_results(s, reg, {r.request_id for r in got}, timeout_s=30 + plan.duration_s))
        misses = len(sent) - sum(meets_slo(r, slo_ms) for r in res.values())
        verdict = rule.decide(len(sent), misses)
        rnd += 1
    return sent, res, verdict, misses


def model_info(model_dir: Path) -> tuple[dict, str]:
    cfg = json.loads((model_dir / "config.json").read_text())
    from relaygr.workers.model.model import HSTURanker

    m = HSTURanker.load(model_dir, device="cpu")
    return cfg.get("config", cfg), m.model_version


def calibrate_latency(model_dir: Path, threads: int, out: Path, device: str | None = None):
    """The latency model of full ranking, timed on ``device`` (default: the checkpoint's), where
    the ranking workers will run, with the paces of sliced pre-inference and relay ranking (as
    `relaygr calibrate` measures them; the sizing's relay prediction uses the relay pace)."""
    from relaygr.streams.config import PipelineSettings
    from relaygr.workers.engine.calibration import calibrate_and_save
    from relaygr.workers.model.model import HSTURanker
    from relaygr.workers.model.runner import ModelRunner

    settings = PipelineSettings()
    paces = settings.pace_settings()
    model = HSTURanker.load(model_dir, device=device) if device else HSTURanker.load(model_dir)
    return calibrate_and_save(ModelRunner(model), out, repeats=5, threads=threads, paces=paces)


def pipeline_env(
    args, model_dir: Path, calib: Path, slo_ms: float, *, budget_ms: float | None = None
) -> dict:
    from relaygr.streams.config import PipelineSettings

    device = {"device": args.device} if getattr(args, "device", None) else {}
    return PipelineSettings.to_env(
        **device,
        model_dir=model_dir,
        calibration_file=calib,
        budget_ms=budget_ms if budget_ms is not None else slo_ms,
        feature_fetch_ms=slo_ms / 2,
        theta=args.theta,
        short_term=EXPERIMENT_SHORT_TERM,
        torch_threads=args.threads,
        disk_cache_mb=1024,
    )


def window_start(args, ml) -> int:
    if args.window_start is not None:
        return args.window_start
    return len(eligible_interactions(ml, args.min_prior)) // 2


def build_and_publish(settings, ml, args, start: int, count: int, length: int, topic: str):
    """Build the window's trace at ``length``, publish it to ``topic`` and read it back."""
    tr = build_trace(
        ml, min_prior=args.min_prior, start=start, count=count, target_len=length, warmup=not args.no_warmup
    )
    topics = TraceTopics(topic, settings.partitions)

    async def go():
        await publish_trace(settings, topics, tr)
        back = await load_trace(settings, topics)
        back.warmup_ids, back.meta = tr.warmup_ids, tr.meta
        return back

    return asyncio.run(go())


async def warm_pipeline(dep: Deployment, ref, args, scratch: Path) -> None:
    """Unmeasured traffic through a fresh pipeline (its first requests run slower: caches, allocators,
    lazily set-up paths), on users of its own."""
    n = min(args.pipeline_warmup, len(ref.requests))
    if n > 0:
        await run_point(
            dep, ref, x=0, qps=args.slo_qps, n_requests=n, user_prefix="w-", slo_ms=60000,
            seed=args.seed + 1000, out_dir=scratch,
        )  # fmt: skip


def measure_slo(
    settings, args, model_dir, calib, lat, ref, root: Path, topics: str, cores=None
) -> tuple[float, str]:
    """B from a baseline pipeline without truncation at ``--slo-tokens`` (see the module doc)."""
    if args.slo_ms:
        return float(args.slo_ms), getattr(args, "slo_how", None) or "given with --slo-ms"
    guess = math.ceil(lat.predict_ms(args.slo_tokens) + 10.0)
    say(
        f"SLO calibration: baseline, {args.slo_tokens}-event histories, {args.slo_requests} requests at "
        f"{args.slo_qps:g} QPS, no truncation (W = {guess} ms meanwhile)"
    )
    env = pipeline_env(args, model_dir, calib, guess, budget_ms=60000)
    dep = Deployment(settings, "baseline", env, root / "slo", topics + "-slo", 1, cores)

    async def go() -> PointRun:
        await dep.start()
        try:
            await dep.pipe.wait_ready(timeout_s=300)
            await warm_pipeline(dep, ref, args, root / "slo-results")
            return await run_point(
                dep,
                ref,
                x=args.slo_tokens,
                qps=args.slo_qps,
                n_requests=args.slo_requests,
                user_prefix="slo-",
                slo_ms=60000,
                seed=args.seed,
                out_dir=root / "slo-results",
            )
        finally:
            dep.pipe.stop()

    pr = asyncio.run(go())
    # The tail of one short run is noisy, and the baseline must hold its own calibration point:
    # B comes from the largest of the P99s of consecutive slices.
    n = max(1, args.slo_slices)
    size = max(1, len(pr.ranking) // n)
    p99s = [percentile(pr.ranking[i * size : (i + 1) * size], 99.0) for i in range(n)]
    p99 = max(p99s)
    b = float(math.ceil(p99 * (1 + args.slo_headroom)))
    how = (
        f"measured: a baseline pipeline without truncation ranked {len(pr.ranking)} requests at "
        f"{args.slo_tokens}-event histories and {args.slo_qps:g} QPS; the ranking P99 of its {n} consecutive "
        f"slices were {', '.join(f'{x:.1f}' for x in p99s)} ms; B = the largest × {1 + args.slo_headroom:g}, "
        "rounded up"
    )
    say(f"SLO: B = {b:g} ms ({how})")
    return b, how


def serving_cap_at_least(model_dir: Path, cap: int, out: Path, say) -> Path:
    """``model_dir``, or a copy of it in ``out`` whose serving cap (``max_seq_len``) is ``cap``
    when its own is lower. A point at or above the cap can never hold: its users' histories grow
    past it during the window and every ranking reads a truncated one. The cap bounds serving
    only (the weights do not depend on it), so the copy ranks the events it reads as the original
    does; its model version differs and the protocol records it."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("max_seq_len", 0) >= cap:
        return model_dir
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps({**cfg, "max_seq_len": cap}, indent=2) + "\n")
    say(
        f"serving cap raised from {cfg.get('max_seq_len')} to {cap} events for this run (model copy in {out})"
    )
    return out
