"""Host cost per ranking on the real broker: the ranking worker's CPU per ranking, at a rate ladder.

At hundreds of rankings a second the limit of one ranking worker is its host work (consume and
decode, history, prefix store lookup, scheduling, building the batch, reading scores back, encode
and produce the result, commits, stats), not the device: a worker whose asyncio loop spends 2 ms
of CPU on each request holds at most 500 a second. This measures that cost on the real pipeline.

Per mode (``--modes``: relay, then baseline), one pipeline (``relaygr up``'s ``Pipeline``, one
ranking worker, its metrics served) with the tiniest ranker (random weights, calibrated on this
machine at the start), so that the model's arithmetic is a small share of what is measured:
0. --users MovieLens users, each history lengthened to --events behaviours, published and applied;
   two visits each (their pre-inferences finish: relay rankings after them use a cached prefix);
   then the worker's idle CPU over --idle-s seconds;
1. a probe at --probe-rate for --seconds gives the CPU per ranking; the ladder's rates are
   --fractions of what one core could then hold (1000 / CPU ms per ranking): sized by the machine;
2. per rate, --seconds of returning visits from confluent-kafka (its defaults: a producer that is
   not ours), until a rate is not held (a result missing, a ranking over the budget at the P99,
   or the results arriving more than a second after the last was due).

``--rates`` fixes the ladder instead (two builds compared at the same rates); ``--profile DIR``
samples the worker with py-spy in one more window at the highest rate held. ``--direct`` loads the
ranking worker alone: each visit's prefill signal and rank request go straight onto its topics
(``tools.sender.send_to_worker``), as retrieval and pre-processing write them, and the stages before it idle, so
that on a small machine the worker's host path is measured at rates the whole cascade cannot hold.

``--fetch-clients rdkafka,aiokafka`` measures each mode once with each client fetching the ranking
worker's records (``RELAYGR_FETCH_CLIENT``), one after the other in the same run.

Per rate: requests, results, ranking P50/P99 (rank request produced -> result produced), the
ranking worker process's CPU (user + system, every thread, from ``/proc/<pid>/stat``) from the
first send to the last result, per ranking; the device thread's part of it (its CPU in ranking jobs:
the model's forward and the tensors built and read on that thread, and in pre-inference jobs, from
``relaygr_device_cpu_seconds``) and the rest, the host path; the same less the idle worker's CPU;
each stage's median. One JSON line per mode with its points
and the highest rate held; then one line with relay and baseline side by side. Every figure is at
--events events of history and the rate it names. On a small machine the load generator, the broker
and the other stages share the cores: the CPU per ranking is the figure to read, the rate held
depends on the machine.

Primitives: ``cpu_seconds_of_stat``, ``process_cpu_s``, ``parse_fractions``, ``ladder``, ``Window``,
``point_figures``, ``held``, ``long_users``, ``tiny_model_dir``, ``deployment``, ``sampled``,
``side_by_side``.
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
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from relaygr.infra.settings import Settings
from relaygr.schemas import RankedResult, RecommendationRequest, TopicRegistry
from relaygr.tools.args import float_above, int_at_least
from relaygr.tools.report.figures import percentile, ranking_ms

MODES = ("relay", "baseline")
FETCH_CLIENTS = ("rdkafka", "aiokafka")
# The stages of a ranking (rank request produced -> result produced) that the results break down.
STAGES = ("hop_rank", "history_wait", "signal_wait", "worker_prep", "lookup", "device_queue", "compute")
LATE_S = 1.0  # results this much after the last was due: the worker (or the cascade) fell behind


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--json", action="store_true", help="print only the JSON lines")
    add("--events", type=int_at_least(1), default=8192, help="behaviours per user")
    add("--users", type=int_at_least(1), default=16, help="returning users")
    add("--seconds", type=float_above(0), default=10.0, help="length of each rate's load")
    add("--idle-s", type=float_above(0), default=3.0, help="the worker's idle CPU is measured this long")
    add("--probe-rate", type=float_above(0), default=10.0, help="request rate of the sizing probe")
    add("--fractions", default="0.5,1,1.5,2,3",
        help="the ladder's rates as fractions of one core's worth of rankings at the probe's CPU cost")  # fmt: skip
    add("--rates", default=None,
        help="the ladder's rates (per s, ascending) instead of sized ones: to compare two builds at the same rates")  # fmt: skip
    add("--modes", default="relay,baseline", help=f"comma-separated ({', '.join(MODES)})")
    add("--fetch-clients", default=None,
        help=f"comma-separated ({', '.join(FETCH_CLIENTS)}): the client that fetches the ranking worker's records, "
        "one pipeline each per mode, measured side by side (default: RELAYGR_FETCH_CLIENT's)")  # fmt: skip
    add("--direct", action="store_true",
        help="load the ranking worker alone: each visit's prefill signal and rank request produced straight onto "
        "its topics (as retrieval and pre-processing write them), the stages before it idle, so their CPU is the "
        "worker's and the broker's (its host path at higher rates)")  # fmt: skip
    add("--profile", type=Path, default=None, metavar="DIR",
        help="then one more window at the highest rate held, the worker sampled by py-spy (a dev "
        "dependency) into DIR/<mode>-<rate>.txt (collapsed stacks, every thread)")  # fmt: skip
    add("--profile-rate", type=float_above(0), default=None,
        help="with --profile: sample at this rate instead of the highest held")  # fmt: skip
    add("--keep-broker", action="store_true",
        help="leave the local broker this run starts up for the next run (default: stopped at the end; "
        "one already up is never stopped)")  # fmt: skip


def cpu_seconds_of_stat(text: str, ticks_per_s: float) -> float:
    """User + system CPU seconds of a ``/proc/<pid>/stat`` line (the name in parentheses may hold
    spaces and parentheses: fields are counted after its last ``)``)."""
    fields = text[text.rindex(")") + 2 :].split()
    # Fields 14 and 15 of the line (utime, stime) are the 12th and 13th after the name.
    return (int(fields[11]) + int(fields[12])) / ticks_per_s


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has used, every thread of it, so far."""
    return cpu_seconds_of_stat(Path(f"/proc/{pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))


def parse_fractions(text: str, flag: str = "--fractions") -> list[float]:
    """``--fractions`` (or ``--rates``): positive numbers, ascending."""
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a list of numbers") from None
    if not out or any(not (math.isfinite(f) and f > 0) for f in out) or out != sorted(out):
        raise ValueError(f"{flag}: {text!r} must be positive numbers, ascending")
    return out


def ladder(cpu_ms_per_ranking: float, fractions: list[float]) -> list[float]:
    """The rates (per s, rounded to 3 significant digits) of ``fractions`` of one core's worth of
    rankings at ``cpu_ms_per_ranking`` each."""
    if not (cpu_ms_per_ranking > 0):
        raise ValueError(f"a CPU cost per ranking of {cpu_ms_per_ranking} ms sizes no ladder")
    core = 1000.0 / cpu_ms_per_ranking
    return [float(f"{f * core:.3g}") for f in fractions]


@dataclass
class Window:
    """What one load window cost the worker: its process CPU and its device thread's, seconds,
    and how long it lasted (first send to last result)."""

    cpu_s: float
    device_rank_s: float
    device_prefill_s: float
    wall_s: float
    idle_cpu_s_per_s: float = 0.0  # what the worker spends with nothing to do (polls, stats)
    # CPU seconds of every process of the cascade over the window, by stage (``stage_pids``).
    stages_cpu_s: dict[str, float] = field(default_factory=dict)


def point_figures(
    rate: float, events: int, sent: int, results: list[RankedResult], window: Window, late_s: float
) -> dict:
    """One rate's figures (the module docstring), CPU in ms per result received."""
    n = len(results)
    ms = [ranking_ms(r) for r in results]
    per = 1000.0 / n if n else math.nan
    cpu = window.cpu_s * per
    device = (window.device_rank_s + window.device_prefill_s) * per
    return {
        "rate": rate,
        "events": events,
        "requests": sent,
        "results": n,
        "ranking_ms_p50": round(percentile(ms, 50), 2) if ms else math.nan,
        "ranking_ms_p99": round(percentile(ms, 99), 2) if ms else math.nan,
        "cpu_ms_per_ranking": round(cpu, 3),
        # Less the idle worker's own CPU over the window: what each ranking adds.
        "cpu_ms_per_ranking_over_idle": round(
            (window.cpu_s - window.idle_cpu_s_per_s * window.wall_s) * per, 3
        ),
        "device_thread_ms_per_ranking": round(device, 3),
        "device_thread_rank_ms_per_ranking": round(window.device_rank_s * per, 3),
        "host_ms_per_ranking": round(cpu - device, 3),
        "device_share": round(device / cpu, 3) if cpu > 0 else math.nan,
        # Every process of the cascade, CPU ms per request sent (the ranking worker's whole
        # process as ``ranker``), and their sum: what one request costs the machine.
        "stages_cpu_ms_per_request": {k: round(v * 1000 / sent, 3) for k, v in window.stages_cpu_s.items()}
        if sent
        else {},
        "cascade_cpu_ms_per_request": round(sum(window.stages_cpu_s.values()) * 1000 / sent, 3)
        if sent and window.stages_cpu_s
        else math.nan,
        "worker_cpu_share": round(window.cpu_s / window.wall_s, 3) if window.wall_s > 0 else math.nan,
        "late_s": round(late_s, 3),
        "paths": dict(Counter(r.path.value for r in results).most_common()),
        # Events a ranking read (a full ranking may be truncated to fit the budget), and of them cached.
        "used_len_p50": percentile([r.used_len for r in results], 50) if results else math.nan,
        "prefix_len_p50": percentile([r.prefix_len for r in results], 50) if results else math.nan,
        # Where a ranking's time went (median of each stage of the results' breakdowns).
        "stages_ms_p50": {
            k: round(percentile([r.breakdown_ms.get(k, 0.0) for r in results], 50), 2)
            for k in STAGES
            if any(k in r.breakdown_ms for r in results)
        },
    }


def held(fig: dict, budget_ms: float) -> bool:
    """Whether the worker held the rate: every result, ranking P99 within the budget, none late."""
    return (
        fig["results"] == fig["requests"] and fig["ranking_ms_p99"] <= budget_ms and fig["late_s"] <= LATE_S
    )


@contextlib.contextmanager
def tiny_model_dir() -> Iterator[Path]:
    """The tiniest ranker (random weights) and its calibration on this machine, in a temporary folder."""
    import torch

    from relaygr.tools.prepare import ensure_calibration
    from relaygr.workers.model.model import HSTUConfig, HSTURanker

    with tempfile.TemporaryDirectory(prefix="host-path-model-") as d:
        torch.manual_seed(7)
        m = HSTURanker(HSTUConfig(layers=1, heads=1, dim=16, attn_dim=8, linear_dim=8))
        m.refresh_version()
        m.save(d)
        with contextlib.redirect_stdout(sys.stderr):
            ensure_calibration(Path(d))
        yield Path(d)


@contextlib.contextmanager
def deployment(
    base: Settings, mode: str, model_dir: Path, say, fetch_client: str | None = None
) -> Iterator[tuple[Settings, TopicRegistry, object]]:
    """One pipeline in ``mode`` with one ranking worker (metrics served; its records fetched by
    ``fetch_client``, None: the settings') on ``base``'s cluster, on topics and a home of its own
    (``tools.experiment.harness``); removed after."""
    from relaygr.streams.config import PipelineSettings
    from relaygr.tools.experiment.harness import fresh_deployment
    from relaygr.workers.engine.cores import plan_cores

    # Every returning user's request is at risk: the relay path is the one measured.
    env = PipelineSettings.to_env(
        model_dir=model_dir, calibration_file=model_dir / "calibration.json", theta=1e-4
    )
    if fetch_client is not None:
        env["RELAYGR_FETCH_CLIENT"] = fetch_client
    with fresh_deployment(base, f"host-{mode}", mode, env, cores=plan_cores(1, pin=False), say=say) as dep:
        yield dep.settings, dep.reg, dep.pipe


@contextlib.contextmanager
def sampled(pid: int, out: Path, seconds: float) -> Iterator[None]:
    """Process ``pid`` sampled by py-spy (every thread, native frames left out) while the body
    runs, at most ``seconds`` + 30 s; collapsed stacks into ``out``."""
    import subprocess

    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("--profile needs py-spy (pip install py-spy, in the dev extras)")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--threads",
           "--duration", str(math.ceil(seconds) + 30), "--output", str(out), "--nonblocking"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # attached before the load starts
    try:
        yield
    finally:
        proc.send_signal(2)  # py-spy writes what it sampled on SIGINT
        _, err = proc.communicate(timeout=60)
        if not out.exists():
            raise RuntimeError(f"py-spy wrote no samples: {err.decode(errors='replace')[-500:]}")


# The pipeline's processes by stage name (``relaygr up``'s), shown under these shorter names.
STAGE_NAMES = {"ingress-requests": "ingress_requests", "ingress-behaviors": "ingress_behaviours"}


def stage_pids(pipe, settings: Settings) -> dict[str, list[int]]:
    """The processes of the cascade by stage: every pipeline process (``ranker-i`` as ``ranker``,
    summed over workers), the local broker's nodes (none when ``settings`` name another cluster)
    and this process (the load generator and the results' reader)."""
    from relaygr.infra.local.broker_files import read_state
    from relaygr.infra.settings import get_settings

    out: dict[str, list[int]] = {}
    for name, proc in pipe.procs.items():
        stage = "ranker" if name.startswith("ranker-") else STAGE_NAMES.get(name, name)
        out.setdefault(stage, []).append(proc.pid)
    state = read_state(get_settings())  # the deployment's own home holds no broker state
    if state is not None and state.bootstrap == settings.bootstrap:
        out["broker"] = [n.pid for n in state.nodes] or [state.pid]
    out["load_generator"] = [os.getpid()]
    return out


def stages_cpu_s(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each stage's processes (a process gone counts as none)."""
    out = {}
    for stage, group in pids.items():
        total = 0.0
        for pid in group:
            with contextlib.suppress(OSError, ValueError):
                total += process_cpu_s(pid)
        out[stage] = total
    return out


def _device_cpu(pipe) -> tuple[float, float]:
    """The ranking worker's device thread CPU seconds so far: (ranking jobs, pre-inference jobs)."""
    m = pipe.scrape("ranker-0")
    return m.value("relaygr_device_cpu_seconds", priority="rank"), m.value(
        "relaygr_device_cpu_seconds", priority="prefill"
    )


async def _load(
    settings: Settings, reg: TopicRegistry, pipe, plan: list[RecommendationRequest], rate: float,
    direct: bool = False,
) -> tuple[list[RankedResult], Window, float]:  # fmt: skip
    """Send ``plan`` at ``rate`` (``direct``: straight to the ranking worker) and
    read its results: the results, what the window cost the worker, and how late (s) the last
    result came after its request was due."""
    from relaygr.infra.kafka import consumer
    from relaygr.schemas import decode
    from relaygr.tools.sender import send_paced, send_to_worker

    pid = pipe.procs["ranker-0"].pid
    ids = {r.request_id for r in plan}
    cons = consumer(settings, reg.name("results"), group_id=None, auto_offset_reset="latest")
    await cons.start()
    got: dict[str, RankedResult] = {}
    try:
        await cons.seek_to_end()
        pids = stage_pids(pipe, settings)
        stages0 = stages_cpu_s(pids)
        (rank0, prefill0), cpu0, t0 = _device_cpu(pipe), process_cpu_s(pid), time.monotonic()
        if direct:
            sending = asyncio.create_task(asyncio.to_thread(send_to_worker, settings, reg, plan, rate))
        else:
            sending = asyncio.create_task(
                asyncio.to_thread(send_paced, settings, reg.name("requests"), plan, rate, "librdkafka")
            )
        due = t0 + len(plan) / rate
        deadline = due + max(30.0, len(plan) / rate)
        while not ids <= got.keys() and time.monotonic() < deadline:
            for msgs in (await cons.getmany(timeout_ms=100)).values():
                for m in msgs:
                    r = decode(RankedResult, m.value)
                    if r.request_id in ids:
                        got.setdefault(r.request_id, r)
        cpu1, t1 = process_cpu_s(pid), time.monotonic()
        stages1 = stages_cpu_s(pids)
        rank1, prefill1 = _device_cpu(pipe)
        await sending
    finally:
        await cons.stop()
    window = Window(
        cpu1 - cpu0, rank1 - rank0, prefill1 - prefill0, t1 - t0,
        stages_cpu_s={k: stages1[k] - stages0[k] for k in stages1},
    )  # fmt: skip
    return list(got.values()), window, max(0.0, t1 - due)


def _plan(requests: list[RecommendationRequest], n: int, tag: str) -> list[RecommendationRequest]:
    """``n`` visits, round-robin over the users, with ids of ``tag``."""
    return [requests[k % len(requests)].model_copy(update={"request_id": f"{tag}-{k}"}) for k in range(n)]


async def _prime(settings: Settings, reg: TopicRegistry, pipe, args, ml, say) -> list[RecommendationRequest]:
    """The users' histories published and applied, and two visits each (their prefixes cached)."""
    from relaygr.tools.long_users import long_users
    from relaygr.tools.traffic import publish

    # The users of the longest histories (the fewest copies each).
    behaviours, requests = long_users(ml, args.users, args.events, tag="host", longest_first=True)
    await publish(settings, reg, behaviours, [], wait_for_ingest=True, settle_s=0)
    for visit in (1, 2):
        results, _, _ = await _load(settings, reg, pipe, _plan(requests, len(requests), f"prime{visit}"), 2.0)
        say(
            f"visit {visit} of {len(requests)} users x {args.events} events: {dict(Counter(r.path.value for r in results))}"
        )
    return requests


async def _measure_mode(
    mode: str, settings: Settings, reg: TopicRegistry, pipe, args, ml, say, fetch_client: str
) -> dict:
    from relaygr.streams.config import PipelineSettings

    budget_ms = PipelineSettings().budget_ms
    requests = await _prime(settings, reg, pipe, args, ml, say)
    pid = pipe.procs["ranker-0"].pid
    cpu0 = process_cpu_s(pid)
    await asyncio.sleep(args.idle_s)
    idle_ms_per_s = (process_cpu_s(pid) - cpu0) * 1000 / args.idle_s

    async def point(i: int, rate: float) -> dict:
        plan = _plan(requests, max(1, round(rate * args.seconds)), f"{mode}{i}")
        results, window, late = await _load(settings, reg, pipe, plan, rate, direct=args.direct)
        window.idle_cpu_s_per_s = idle_ms_per_s / 1000
        fig = point_figures(rate, args.events, len(plan), results, window, late)
        fig["held"] = held(fig, budget_ms)
        say(f"{mode} at {rate:g}/s: {json.dumps(fig)}")
        return fig

    probe = await point(0, args.probe_rate)
    points = []
    if args.rates:
        rates = parse_fractions(args.rates, "--rates")
    else:
        rates = ladder(probe["cpu_ms_per_ranking"], parse_fractions(args.fractions))
    for i, rate in enumerate(rates, 1):
        points.append(await point(i, rate))
        if not points[-1]["held"]:
            break
    top = [p for p in [probe, *points] if p["held"]]
    if args.profile is not None:
        rate = args.profile_rate or (top[-1]["rate"] if top else args.probe_rate)
        out = args.profile / f"{mode}-{rate:g}.txt"
        with sampled(pipe.procs["ranker-0"].pid, out, args.seconds):
            profiled = await point(len(points) + 1, rate)
        say(
            f"{mode}: the worker's samples at {rate:g}/s in {out} (its CPU per ranking then {profiled['cpu_ms_per_ranking']} ms)"
        )
    return {
        "bench": "host_path",
        "mode": mode,
        "fetch_client": fetch_client,
        "events": args.events,
        "users": args.users,
        "budget_ms": budget_ms,
        "direct": args.direct,
        "idle_cpu_ms_per_s": round(idle_ms_per_s, 2),
        "probe": probe,
        "points": points,
        "held_rate": max((p["rate"] for p in top), default=0.0),
        "cpu_ms_per_ranking_at_held": top[-1]["cpu_ms_per_ranking"] if top else math.nan,
    }


def side_by_side(lines: list[dict]) -> dict:
    """Per mode (and fetch client, where several were measured): the highest rate held, the CPU per
    ranking there and at the probe, and its split."""
    out: dict[str, dict] = {}
    several = len({line.get("fetch_client") for line in lines}) > 1
    for line in lines:
        at = next((p for p in reversed(line["points"]) if p["held"]), line["probe"])
        name = f"{line['mode']}/{line['fetch_client']}" if several else line["mode"]
        out[name] = {
            "held_rate": line["held_rate"],
            "at_rate": at["rate"],
            "cpu_ms_per_ranking": at["cpu_ms_per_ranking"],
            "host_ms_per_ranking": at["host_ms_per_ranking"],
            "device_thread_ms_per_ranking": at["device_thread_ms_per_ranking"],
            "ranking_ms_p99": at["ranking_ms_p99"],
            "probe_rate": line["probe"]["rate"],
            "probe_cpu_ms_per_ranking": line["probe"]["cpu_ms_per_ranking"],
        }
    events = lines[0]["events"] if lines else None
    return {"bench": "host_path", "events": events, "side_by_side": out}


def run(args: argparse.Namespace) -> int:
    try:
        import confluent_kafka  # noqa: F401  the requests' producer: checked before minutes of set-up

        parse_fractions(args.fractions)
        if args.rates:
            parse_fractions(args.rates, "--rates")
        modes = [m.strip() for m in args.modes.split(",")]
        if set(modes) - set(MODES) or not modes:
            raise ValueError(f"--modes: {args.modes!r} (known: {', '.join(MODES)})")
        clients = [c.strip() for c in (args.fetch_clients or Settings().fetch_client).split(",")]
        if set(clients) - set(FETCH_CLIENTS) or not clients:
            raise ValueError(f"--fetch-clients: {args.fetch_clients!r} (known: {', '.join(FETCH_CLIENTS)})")
        if not Path("/proc/self/stat").exists():
            raise ValueError("the worker's CPU is read from /proc/<pid>/stat: Linux only")
    except (ImportError, ValueError) as e:
        print(f"relaygr bench host-path: {e}", file=sys.stderr)
        return 2
    from relaygr.infra.local.cluster import broker_for_run
    from relaygr.infra.settings import get_settings
    from relaygr.workers.training.movielens import load_movielens

    def say(msg: str) -> None:
        if not args.json:
            print(f"== {msg}", file=sys.stderr, flush=True)

    ml = load_movielens("ml-100k")
    lines = []
    with (
        broker_for_run(get_settings(), keep=args.keep_broker, progress=sys.stderr) as base,
        tiny_model_dir() as model_dir,
    ):
        for mode in modes:
            for client in clients:
                with deployment(base, mode, model_dir, say, client) as (s, reg, pipe):
                    line = asyncio.run(_measure_mode(mode, s, reg, pipe, args, ml, say, client))
                print(json.dumps(line), flush=True)
                lines.append(line)
    print(json.dumps(side_by_side(lines)))
    return 0
