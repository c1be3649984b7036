"""Do returning users reach the relay path? On the real broker (``relaygr bench steady-load``).

Users come back: each sends --visits requests, --users / rate seconds apart. Whether the cascade
converges shows in the relay share by visit number: the first visit of a user can only be on the
relay path if its pre-inference ends within its deadline; the later ones, if some pre-inference
of that user finished in between (a cached prefix serves every later visit).

Per policy (``--policies``), one relay pipeline (``relaygr up``'s ``Pipeline``,
--ranking-workers, the trained model):

- ``converge``, the defaults: an admitted pre-inference finishes even when its ranking went
  ahead without it, pre-inference gets a minimum share of the device (``RELAYGR_PREFILL_SHARE``),
  and the trigger sheds by admission (its backlog bound);
- ``shed``, the policy before: a late pre-inference is dropped while more than two are queued
  (``RELAYGR_ABANDON_BACKLOG=2``), rankings always first, no backlog bound.

Per rate of ``--rates`` (requests/s; ``burst``: all at once), on fresh users of its own:
0. --users MovieLens users, each history lengthened to --events behaviours (``tools.long_users``),
   published and applied;
1. their visits from confluent-kafka (librdkafka, default partitioner: a producer that is not
   ours), round-robin over the users, at the rate, each stamped with its send time;
2. every result, then every admitted pre-inference's outcome (the workers' event logs).

One JSON line per policy and rate: the relay share by visit number, why the others were not on
relay, the pre-inferences admitted (prefill signals), finished (computed or extended), served
from cache, dropped and refused, finished per second, lost and duplicated results, timeouts
(results past their deadline, and rankings longer than the budget) and the ranking P99; then one
line with the policies side by side. Where the requests' time went: each stage's median and P90
(``stages_ms``, from the results' breakdowns: the hops, retrieval, pre-processing, the wait for
the device and the ranking's own compute), and what the device had to do against when it was
due: ``deadline_window_ms`` (from the first request sent to the last rank request's deadline)
next to ``ranking_compute_ms`` (the rankings' device time, summed over the workers) and the
pre-inferences it computed. A shared machine makes these noisy: compare policies run
back to back.

Primitives (the broker test uses them): ``visit_plan``, ``visit_of``, ``prefill_events``,
``await_prefills``, ``visit_figures``, ``stage_figures``, ``side_by_side``; the visits go out through
``tools.sender.send_paced`` (confluent-kafka).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections import Counter
from pathlib import Path

from relaygr.infra.settings import Settings
from relaygr.schemas import RankedResult, RecommendationRequest, TopicRegistry
from relaygr.streams.config import PipelineSettings
from relaygr.tools.args import int_at_least
from relaygr.tools.experiment.harness import Deployment
from relaygr.tools.experiment.scenarios.runner import Scenario, ScenarioRun, Setup, run_scenario
from relaygr.tools.report.figures import percentile, ranking_ms
from relaygr.tools.sender import send_paced

POLICIES: dict[str, dict[str, object]] = {
    "converge": {},
    "shed": {"abandon_backlog": 2, "prefill_share": 0.0, "prefill_backlog_bound_ms": 1e12},
}
# Pre-inference outcomes (the workers' ``prefill`` events) by what became of the work.
FINISHED = frozenset({"computed", "extended"})
CACHED = frozenset({"device", "host", "disk", "merged"})
RELAY_PATHS = ("relay", "relay_waited", "relay_extended")
# A result's breakdown up to the rank request's production (its deadline is that plus the budget).
UPSTREAM = ("hop_requests", "retrieval", "hop_retrieved", "preprocess")
STAGES = (*UPSTREAM, "hop_rank", "history_wait", "signal_wait", "device_queue", "compute", "ranking")


class SteadyLoad(Scenario):
    name, tag = "steady-load", "steady"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--ranking-workers", type=int_at_least(1), default=2, help="ranking workers")
        parser.add_argument("--users", type=int_at_least(1), default=20, help="returning users per rate")
        parser.add_argument("--events", type=int_at_least(1), default=2000, help="behaviours per user")
        parser.add_argument("--visits", type=int_at_least(1), default=3, help="requests per user")
        parser.add_argument(
            "--rates",
            default="10,burst",
            help="comma-separated request rates (req/s), 'burst' for all at once (default 10,burst)",
        )
        parser.add_argument(
            "--policies",
            default="shed,converge",
            help=f"comma-separated pre-inference policies, each on a pipeline of its own ({', '.join(POLICIES)})",
        )
        parser.add_argument(
            "--results", type=Path, default=None, metavar="DIR", help="also write each run's results here"
        )

    def check(self, args: argparse.Namespace) -> None:
        import confluent_kafka  # noqa: F401  the requests' producer: checked before minutes of set-up

        parse_rates(args.rates)
        unknown = set(self._policies(args)) - POLICIES.keys()
        if unknown:
            raise ValueError(f"--policies: no policy {sorted(unknown)} (known: {', '.join(POLICIES)})")

    @staticmethod
    def _policies(args: argparse.Namespace) -> list[str]:
        return [p.strip() for p in args.policies.split(",")]

    def setups(self, args: argparse.Namespace) -> list[Setup]:
        return [
            Setup(
                f"steady-{p}",
                workers=args.ranking_workers,
                env=PipelineSettings.to_env(**POLICIES[p]) if POLICIES[p] else {},
            )
            for p in self._policies(args)
        ]

    async def measure(self, run: ScenarioRun, dep: Deployment, setup: Setup) -> list[dict]:
        """Per rate, fresh users' visits (the module docstring)."""
        from relaygr.tools.long_users import long_users
        from relaygr.tools.traffic import publish

        args, policy = run.args, setup.label.removeprefix("steady-")
        rows = []
        for i, qps in enumerate(parse_rates(args.rates)):
            rate = "burst" if qps is None else f"{qps:g}"
            # Fresh users for each rate: other users' histories, under names of their own.
            behaviours, requests = long_users(
                run.ml, args.users, args.events, tag=f"r{i}", skip=args.users * i
            )
            run.say(f"{policy}, {rate} req/s: {len(requests)} users x {args.events} events published")
            await publish(dep.settings, dep.reg, behaviours, [], wait_for_ingest=True, settle_s=0)
            row = await run_visits(
                dep.settings, dep.reg, requests, args.visits, qps, f"{policy}{i}", args.results
            )
            run.say(f"{policy}, {rate} req/s: relay by visit {_relay_row(row)}; prefill {row['prefill']}")
            rows.append(
                {"bench": "steady_load", "policy": policy, "rate": rate, "users": args.users, "events": args.events,
                 "visits": args.visits, **row}
            )  # fmt: skip
        return rows

    def summary(self, run: ScenarioRun, lines: list[dict]) -> list[dict]:
        return [side_by_side(lines)]


def parse_rates(text: str) -> list[float | None]:
    """``--rates``: positive numbers, or ``burst`` (None: all at once)."""
    out: list[float | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "burst":
            out.append(None)
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--rates: {part!r} is neither a number nor 'burst'") from None
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"--rates: {part!r} is not a positive rate")
        out.append(rate)
    return out


def visit_plan(requests: list[RecommendationRequest], visits: int, tag: str) -> list[RecommendationRequest]:
    """Each user's ``visits`` requests, round-robin over the users (visit 1 of every user, then
    visit 2, ...), with ids ``<tag>-<user's request id>-v<k>``."""
    return [
        r.model_copy(update={"request_id": f"{tag}-{r.request_id}-v{k}"})
        for k in range(1, visits + 1)
        for r in requests
    ]


def visit_of(request_id: str) -> int:
    """The visit number ``visit_plan`` put in a request id."""
    return int(request_id.rsplit("-v", 1)[1])


def prefill_events(home: Path, request_ids: set[str]) -> dict[str, dict]:
    """The ``prefill`` event of each of ``request_ids`` in the ranking workers' event logs (the
    active process's; a standby's copies are left out)."""
    out: dict[str, dict] = {}
    for f in Path(home, "workers").glob("**/events.jsonl"):
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:  # a line being written
                continue
            if e.get("event") == "prefill" and e.get("request_id") in request_ids and not e.get("standby"):
                out[e["request_id"]] = e
    return out


def visit_figures(
    sent: list[RecommendationRequest],
    results: dict[str, RankedResult],
    counts: Counter[str],
    admitted: set[str],
    prefills: dict[str, dict],
    budget_ms: float,
) -> dict:
    """The figures of one run (the module docstring): relay share and reasons by visit, the
    pre-inferences' outcomes, lost, duplicated, timeouts and the ranking P99."""
    by_visit: dict[int, list[RankedResult]] = {}
    for r in results.values():
        by_visit.setdefault(visit_of(r.request_id), []).append(r)
    visits = {}
    for k, rs in sorted(by_visit.items()):
        relay = sum(r.path.value in RELAY_PATHS for r in rs)
        reasons = Counter(r.path_reason for r in rs if r.path.value not in RELAY_PATHS)
        visits[str(k)] = {"n": len(rs), "relay": relay, "off_relay": dict(reasons.most_common())}
    statuses = Counter(str(e.get("status")).split(":")[0] for e in prefills.values())
    finished = sum(statuses[s] for s in FINISHED)
    done_at = [float(e["t"]) for e in prefills.values() if e.get("status") in FINISHED]
    span_s = max(done_at) - min(r.ts for r in sent) if done_at else math.nan
    ms = [ranking_ms(r) for r in results.values()]
    return {
        "requests": len(sent),
        "lost": len(sent) - len(results),
        "duplicated": sum(c - 1 for c in counts.values() if c > 1),
        "relay_by_visit": visits,
        "returning_on_relay": sum(v["relay"] for k, v in visits.items() if k != "1"),
        "returning": sum(v["n"] for k, v in visits.items() if k != "1"),
        "prefill": {
            "admitted": len(admitted),
            "finished": finished,
            "cached": sum(statuses[s] for s in CACHED),
            "dropped": statuses["abandoned"],
            "refused": statuses["refused"],
            "no_outcome": len(admitted - prefills.keys()),
            "finished_per_s": round(finished / span_s, 2) if span_s > 0 else math.nan,
        },
        "timeouts": sum(r.path.value == "timeout" for r in results.values()),
        "over_budget": sum(m > budget_ms for m in ms),
        "ranking_p99_ms": round(percentile(ms, 99), 1) if ms else math.nan,
        "budget_ms": budget_ms,
    }


def stage_figures(
    sent: list[RecommendationRequest], results: dict[str, RankedResult], budget_ms: float
) -> dict:
    """Each stage's median and P90 (ms) over ``results``, the window from the first request sent
    to the last deadline (ms), and the rankings' device time summed (ms)."""
    rs = list(results.values())
    if not rs:
        return {"stages_ms": {}, "deadline_window_ms": math.nan, "ranking_compute_ms": 0.0}
    stages = {}
    for k in STAGES:
        v = [r.breakdown_ms.get(k, 0.0) for r in rs]
        stages[k] = {"p50": round(percentile(v, 50), 1), "p90": round(percentile(v, 90), 1)}
    deadlines = [r.ts + (sum(r.breakdown_ms.get(k, 0.0) for k in UPSTREAM) + budget_ms) / 1000 for r in rs]
    return {
        "stages_ms": stages,
        "deadline_window_ms": round((max(deadlines) - min(r.ts for r in sent)) * 1000, 1),
        "ranking_compute_ms": round(sum(r.breakdown_ms.get("compute", 0.0) for r in rs), 1),
    }


async def await_prefills(home: Path, admitted: set[str], timeout_s: float = 120.0) -> dict[str, dict]:
    """The outcomes of the ``admitted`` pre-inferences, once each has one (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    got = prefill_events(home, admitted)
    while admitted - got.keys() and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        got = prefill_events(home, admitted)
    return got


async def run_visits(
    settings: Settings,
    reg: TopicRegistry,
    requests: list[RecommendationRequest],
    visits: int,
    qps: float | None,
    tag: str,
    out: Path | None = None,
) -> dict:
    """Send the users' visits at ``qps`` and gather the figures (``visit_figures``); with ``out``,
    write the results to ``<out>/<tag>.jsonl``."""
    from relaygr.tools.report.inputs import read_admitted_ids
    from relaygr.tools.traffic import count_results

    plan = visit_plan(requests, visits, tag)
    sent = await asyncio.to_thread(send_paced, settings, reg.name("requests"), plan, qps, "librdkafka")
    ids = {r.request_id for r in sent}
    results, counts = await count_results(settings, reg, ids, timeout_s=180.0)
    admitted = await read_admitted_ids(settings, reg.name("prefill"), ids, progress=False)
    prefills = await await_prefills(Path(settings.home), admitted)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{tag}.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in results.values()))
    budget_ms = PipelineSettings().budget_ms
    return {
        **visit_figures(sent, results, counts, admitted, prefills, budget_ms),
        **stage_figures(sent, results, budget_ms),
    }


def _relay_row(row: dict) -> str:
    return ", ".join(f"{k}: {v['relay']}/{v['n']}" for k, v in row["relay_by_visit"].items())


def side_by_side(rows: list[dict]) -> dict:
    """Per rate, each policy's relay by visit, returning visits on relay, pre-inferences finished
    and dropped, timeouts and ranking P99."""
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["rate"], {})[r["policy"]] = {
            "relay_by_visit": {k: v["relay"] for k, v in r["relay_by_visit"].items()},
            "returning_on_relay": f"{r['returning_on_relay']}/{r['returning']}",
            "prefill_finished": r["prefill"]["finished"],
            "prefill_dropped": r["prefill"]["dropped"],
            "timeouts": r["timeouts"],
            "over_budget": r["over_budget"],
            "ranking_p99_ms": r["ranking_p99_ms"],
            "deadline_window_ms": r.get("deadline_window_ms"),
            "ranking_compute_ms": r.get("ranking_compute_ms"),
        }
    return {"bench": "steady_load", "side_by_side": out}


KIND = SteadyLoad()
add_arguments = KIND.arguments


def run(args: argparse.Namespace) -> int:
    return run_scenario(KIND, args)
