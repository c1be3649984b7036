"""Every ranking worker replaced in turn at a steady load, on the real broker (``relaygr bench rolling-restart``).

One relay pipeline (``relaygr up``'s ``Pipeline``, --ranking-workers), trained model:
0. --users MovieLens users, each history lengthened to --events behaviours (``tools.long_users``),
   are published and applied;
1. requests from confluent-kafka (librdkafka, its default settings: a producer that is not ours)
   at --qps, round-robin over the users, for --warmup-s seconds (the caches fill), then
   --steady-s seconds (the steady level);
2. then, requests going on, each ranking worker in turn is replaced by a warm standby
   (``Pipeline.roll_worker``: the standby warms up beside it, the old process hands over, the
   standby serves from the committed offsets and joins the group), --settle-s seconds apart;
3. then --steady-s seconds more.
It prints one JSON line: requests, lost and duplicated results (every result on the results
topic counted per request id), timeouts (results whose ranking took longer than the budget: a
caller with the ranking budget as its deadline would have given up), per --window-s window of
send time the relay share and the ranking P99 (nearest rank), per restart how long the standby
took to warm up, to serve after the hand-over signal and to join (and, from the worker's audit
trail, from the signal to the old process's handover.json, to its drain and commit, and to the
standby's first ranking, in ms; the prefixes the old process wrote to its disk tier for the
standby, those the standby adopted and refused, and its time to ready), the timeouts and ranking P99
from the standby's start to one window after its hand-over, and the time until the relay share
was back to its steady level (that of step 1) after its hand-over, and the host's CPU (busy and
steal: what else ran on the machine); with --plot, a PNG of the timeline.

The restarts are measured at a steady load: timeouts, the ranking P99 and the per-window P99
range count from the steady level on (step 1's second part onwards). The warm-up, where the
caches are cold by design, is reported apart (``warmup``: its requests, timeouts, P99 and window
P99 range), and each window says its ``phase``; the plot shades it.

Primitives: ``timeline`` (per window: relay share, ranking P99), ``tail_figures`` (the timeouts,
P99 and maximum of some results), ``timeline_figures`` (the run's, from the steady level on),
``handover_ms`` and ``standby_warm_up`` (a restart's, from the worker's audit trail),
``restart_row``. The requests come from ``tools.sender.BackgroundLoad`` (confluent-kafka).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import time
from collections import Counter
from pathlib import Path

from relaygr.infra.settings import Settings
from relaygr.schemas import RankedResult
from relaygr.streams.config import PipelineSettings
from relaygr.tools.args import float_above, int_at_least
from relaygr.tools.experiment.harness import Deployment
from relaygr.tools.experiment.scenarios.host_cpu import HostCpuSampler
from relaygr.tools.experiment.scenarios.runner import Scenario, ScenarioRun, Setup, run_scenario
from relaygr.tools.report.figures import percentile, ranking_ms
from relaygr.tools.sender import BackgroundLoad


class RollingRestart(Scenario):
    name, tag = "rolling-restart", "rolling"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--ranking-workers", type=int_at_least(1), default=2, help="ranking workers")
        parser.add_argument("--users", type=int_at_least(1), default=20, help="users sending requests")
        parser.add_argument(
            "--events", type=int_at_least(1), default=1500, help="behaviours per user (history length)"
        )
        parser.add_argument("--qps", type=float_above(0), default=10.0, help="request rate")
        parser.add_argument(
            "--warmup-s",
            type=float,
            default=30.0,
            help="seconds of requests first, before the steady level is measured (the caches fill)",
        )
        parser.add_argument(
            "--steady-s", type=float_above(0), default=30.0, help="seconds of steady load before and after"
        )
        parser.add_argument(
            "--settle-s", type=float, default=10.0, help="seconds between one worker's hand-over and the next"
        )
        parser.add_argument("--window-s", type=float_above(0), default=5.0, help="window of the timeline")
        parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write the timeline here")
        parser.add_argument(
            "--results",
            type=Path,
            default=None,
            metavar="FILE",
            help="also write every result as a JSON line",
        )
        parser.add_argument(
            "--worker-events",
            type=Path,
            default=None,
            metavar="DIR",
            help="copy each ranking worker's events.jsonl here (the deployment is removed at the end)",
        )

    def check(self, args: argparse.Namespace) -> None:
        try:
            import confluent_kafka  # noqa: F401  the requests' producer: checked before minutes of set-up
        except ImportError as e:
            raise ImportError(
                "the requests come from confluent-kafka, which is not installed (pip install "
                "'confluent-kafka>=2.4', or the package's dev extra)"
            ) from e

    async def measure(self, run: ScenarioRun, dep: Deployment, setup: Setup) -> list[dict]:
        from relaygr.tools.long_users import long_users
        from relaygr.tools.traffic import count_results, publish

        args, settings, reg, say = run.args, dep.settings, dep.reg, run.say
        behaviours, requests = long_users(run.ml, args.users, args.events, tag="roll")
        await publish(settings, reg, behaviours, [], wait_for_ingest=True, settle_s=0)
        cpu = HostCpuSampler(label="run").start()
        t0 = time.time()
        load = BackgroundLoad(settings, reg.name("requests"), requests, args.qps, client="librdkafka").start()
        say(f"warm-up {args.warmup_s:g} s, then steady {args.steady_s:g} s at {args.qps:g} req/s")
        await asyncio.sleep(args.warmup_s + args.steady_s)
        restarts = []
        for i in range(args.ranking_workers):
            started = time.time()
            took = await asyncio.to_thread(dep.pipe.roll_worker, i, say=say)
            handed_over = started + took["warm"]  # the hand-over signal, just after the standby was ready
            restarts.append(
                {
                    "worker": f"ranker-{i}",
                    "at_s": round(handed_over - t0, 2),
                    **{f"{k}_s": round(v, 3) for k, v in took.items()},
                }
            )
            say(f"ranker-{i} rolled: {took}")
            await asyncio.sleep(args.settle_s)
        await asyncio.sleep(args.steady_s)
        sent = await asyncio.to_thread(load.stop)
        host = await cpu.stop()
        results, counts = await count_results(settings, reg, {r.request_id for r in sent})
        for rs in restarts:
            last = last_events(settings, rs["worker"])
            rs.update(handover_ms(last) | standby_warm_up(last))
            say(restart_row(rs))
        if args.worker_events is not None:
            _copy_worker_events(settings, args.worker_events)
        if args.results is not None:
            args.results.parent.mkdir(parents=True, exist_ok=True)
            args.results.write_text("".join(r.model_dump_json() + "\n" for r in results.values()))
        answered = sorted(results.values(), key=lambda r: r.ts)
        budget_ms = PipelineSettings().budget_ms  # what the pipeline was started with (RELAYGR_BUDGET_MS)
        line = {
            "bench": "rolling_restart",
            "ranking_workers": args.ranking_workers,
            "users": args.users,
            "history_len": args.events,
            "qps": args.qps,
            "requests": len(sent),
            "lost": len(sent) - len(results),
            "duplicated": sum(c - 1 for c in counts.values() if c > 1),
            "budget_ms": budget_ms,
            **timeline_figures(answered, restarts, t0, budget_ms, args),
            "host_cpu": host["run"],
        }
        return [line]


def timeline(
    results: list[RankedResult], t0: float, window_s: float, budget_ms: float
) -> list[dict[str, float]]:
    """Per window of send time from ``t0``: its start (s), requests, relay share, ranking P99 (ms),
    and how many rankings took longer than ``budget_ms``."""
    bins: dict[int, list[RankedResult]] = {}
    for r in results:
        bins.setdefault(int((r.ts - t0) // window_s), []).append(r)
    return [
        {
            "t_s": k * window_s,
            "n": len(rs),
            "relay_share": round(sum(r.path.value.startswith("relay") for r in rs) / len(rs), 3),
            "ranking_p99_ms": round(percentile([ranking_ms(r) for r in rs], 99), 1),
            "over_budget": sum(ranking_ms(r) > budget_ms for r in rs),
        }
        for k, rs in sorted(bins.items())
    ]


def tail_figures(results: list[RankedResult], budget_ms: float) -> dict[str, float | int]:
    """The requests of ``results``, how many took longer than ``budget_ms`` to rank (timeouts),
    their ranking P99 and maximum (ms), and their relay share."""
    ms = [ranking_ms(r) for r in results]
    return {
        "requests": len(results),
        "timeouts": sum(m > budget_ms for m in ms),
        "ranking_p99_ms": round(percentile(ms, 99), 1) if ms else math.nan,
        "ranking_max_ms": round(max(ms), 1) if ms else math.nan,
        "relay_share": round(
            sum(r.path.value.startswith("relay") for r in results) / max(1, len(results)), 3
        ),
    }


def _p99_range(windows: list[dict]) -> list[float]:
    """[lowest, highest] ranking P99 of ``windows``."""
    p99 = [w["ranking_p99_ms"] for w in windows]
    return [min(p99), max(p99)] if p99 else []


def _recovery_s(windows: list[dict[str, float]], at_s: float, level: float, window_s: float) -> float | None:
    """Seconds from ``at_s`` until the first window at or after it whose relay share is back at
    ``level`` begins (0 if the window holding ``at_s`` is; None if none is), window granularity."""
    for w in windows:
        if w["t_s"] + window_s <= at_s:
            continue
        if w["relay_share"] >= level:
            return round(max(0.0, w["t_s"] - at_s), 1)
    return None


def timeline_figures(
    answered: list[RankedResult], restarts: list[dict], t0: float, budget_ms: float, args
) -> dict:
    """The timeline's figures: from the steady level on (the restarts at a steady load), the
    warm-up apart, per window and per restart (whose entries this completes)."""
    windows = timeline(answered, t0, args.window_s, budget_ms)
    for w in windows:  # a window that began in the warm-up is the warm-up's
        w["phase"] = "warm-up" if w["t_s"] < args.warmup_s else "measured"
    measured_windows = [w for w in windows if w["phase"] == "measured"]
    warmup_windows = [w for w in windows if w["phase"] == "warm-up"]
    measured = [r for r in answered if r.ts - t0 >= args.warmup_s]
    steady = [r for r in measured if r.ts - t0 < args.warmup_s + args.steady_s]
    steady_share = sum(r.path.value.startswith("relay") for r in steady) / max(1, len(steady))
    level = 0.95 * steady_share  # "back to its steady level": within 5 % of it
    for rs in restarts:
        rs["relay_back_s"] = _recovery_s(windows, rs["at_s"], level, args.window_s)
        # From the standby's start (it warms up beside the serving workers) to a window after
        # the hand-over.
        span = [r for r in answered if -rs["warm_s"] <= r.ts - t0 - rs["at_s"] < args.window_s]
        tail = tail_figures(span, budget_ms)
        rs["timeouts"], rs["ranking_p99_ms"] = tail["timeouts"], tail["ranking_p99_ms"]
        # Why the results sent in the window after the hand-over left the relay path.
        after = [r for r in answered if 0 <= r.ts - t0 - rs["at_s"] < args.window_s]
        rs["off_relay_after"] = dict(
            Counter(r.path_reason or r.path.value for r in after if not r.path.value.startswith("relay"))
        )
    figures = tail_figures(measured, budget_ms)
    warmup = tail_figures([r for r in answered if r.ts - t0 < args.warmup_s], budget_ms)
    return {
        "timeouts": figures["timeouts"],  # from the steady level on: steady load and restarts
        "ranking_max_ms": figures["ranking_max_ms"],
        "ranking_p99_ms": figures["ranking_p99_ms"],
        "window_p99_ms": _p99_range(measured_windows),
        "windows_over_budget": sum(w["ranking_p99_ms"] > budget_ms for w in measured_windows),
        "warmup": {
            **warmup,
            "window_p99_ms": _p99_range(warmup_windows),
            "windows_over_budget": sum(w["ranking_p99_ms"] > budget_ms for w in warmup_windows),
        },
        "warmup_s": args.warmup_s,
        "steady_s": args.steady_s,
        "steady_relay_share": round(steady_share, 3),
        "restarts": restarts,
        "window_s": args.window_s,
        "windows": windows,
        "plot": str(_plot(windows, restarts, budget_ms, args.warmup_s, args.plot)) if args.plot else None,
    }


def last_events(settings: Settings, worker: str) -> dict[str, dict]:
    """The last line of each kind in the worker's audit trail (``events.jsonl``)."""
    from relaygr.streams.state_lineage import deployment_dir

    events = deployment_dir(settings, "workers") / worker / "events.jsonl"
    last: dict[str, dict] = {}
    for line in events.read_text().splitlines():
        e = json.loads(line)
        last[e.get("event", "")] = e
    return last


def handover_ms(last: dict[str, dict]) -> dict[str, float]:
    """From the worker's audit trail (``last_events``), its last hand-over, in ms from the
    signal: until the old process wrote ``handover.json`` (requests that came meanwhile waited in
    Kafka), until it had answered what it held and committed, and until the standby ranked; and
    how long the standby's switch to the group's consumer held its loop."""
    if "handed_over" not in last or "took_over" not in last:
        return {}
    signalled = last["handed_over"]["t"] - last["handed_over"]["ms"] / 1000
    return {
        "handover_file_ms": last["handed_over"]["ms"],
        "drain_commit_ms": last.get("answered", {}).get("ms", math.nan),
        "signal_to_serving_ms": round((last["took_over"]["t"] - signalled) * 1000, 1),
        # The new process's switch to the group's consumer: no fetch meanwhile.
        "switch_ms": last.get("joined", {}).get("switch_ms", math.nan),
    }


def standby_warm_up(last: dict[str, dict]) -> dict[str, float | int | str | None]:
    """From the worker's audit trail, how its last standby warmed up: the prefixes the old process
    wrote to its disk tier for it (and in how many seconds), those it adopted and refused (and in
    how many seconds; ``adopt_why``: why none were tried), and its time from standing by (the
    model warmed up) to ready (``standby_ready_s``)."""
    spilled, adopted = last.get("spilled_for_standby", {}), last.get("standby_adopted", {})
    return {
        "spilled": spilled.get("prefixes"),
        "spill_s": spilled.get("seconds"),
        "adopted": adopted.get("adopted"),
        "refused": adopted.get("refused"),
        "adopted_bytes": adopted.get("bytes"),
        "adopt_s": adopted.get("seconds"),
        "adopt_why": adopted.get("why"),
        "standby_ready_s": last.get("standby_ready", {}).get("seconds"),
    }


def restart_row(rs: dict) -> str:
    """One restart's line for the terminal: the standby's warm-up and the hand-over."""
    return (
        f"{rs['worker']}: standby ready {rs['warm_s']:.1f} s after its start "
        f"({rs.get('standby_ready_s')} s of it standing by), adopted {rs.get('adopted')} "
        f"prefixes of {rs.get('spilled')} (refused {rs.get('refused')}, {rs.get('adopt_s')} s), "
        f"serving {rs.get('signal_to_serving_ms')} ms after the signal"
    )


def _copy_worker_events(settings: Settings, out: Path) -> None:
    from relaygr.streams.state_lineage import deployment_dir

    out.mkdir(parents=True, exist_ok=True)
    for f in deployment_dir(settings, "workers").glob("*/events.jsonl"):
        shutil.copy(f, out / f"{f.parent.name}.events.jsonl")


def _plot(windows: list[dict], restarts: list[dict], budget_ms: float, warmup_s: float, path: Path) -> Path:
    """Relay share and ranking P99 per window, the warm-up shaded, each hand-over marked, the
    timeouts of the warm-up and of the rest in the title."""
    from relaygr.tools.report.plots import pyplot, save_plot

    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    xs = [w["t_s"] for w in windows]
    ax.axvspan(0, warmup_s, color="0.9", lw=0, label="warm-up (cold caches; counted apart)")
    ax.plot(
        xs, [w["ranking_p99_ms"] for w in windows], marker="o", color="tab:blue", label="ranking P99 (ms)"
    )
    ax.axhline(budget_ms, color="red", ls="--", lw=1, label=f"budget {budget_ms:g} ms")
    for rs in restarts:
        ax.axvline(rs["at_s"], color="grey", ls=":", lw=1)
        ax.annotate(rs["worker"], (rs["at_s"], budget_ms), fontsize=7, rotation=90, va="bottom")
    ax.set_xlabel("send time (s), windows of equal length")
    ax.set_ylabel("ranking P99 (ms)")
    share = ax.twinx()
    share.plot(xs, [w["relay_share"] for w in windows], marker="s", color="tab:green", label="relay share")
    share.set_ylim(0, 1.05)
    share.set_ylabel("relay share")
    share.legend(fontsize=8, loc="lower right")
    ax.legend(fontsize=8, loc="center right")
    over = {p: sum(w["over_budget"] for w in windows if w["phase"] == p) for p in ("warm-up", "measured")}
    ax.set_title(
        "Rolling restart: each ranking worker replaced by a warm standby (dotted)\n"
        f"rankings over budget: {over['measured']} from the steady level on, {over['warm-up']} in the warm-up",
        fontsize=10,
    )
    return save_plot(plt, fig, ax, path, legend=False)


KIND = RollingRestart()
add_arguments = KIND.arguments


def run(args: argparse.Namespace) -> int:
    return run_scenario(KIND, args)
