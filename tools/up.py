"""Run every stage of the cascade locally, one process each, against the configured broker.

`relaygr up` starts the ingress, retrieval, pre-processing and N ranking workers, waits until a probe request
comes back ranked, then runs until Ctrl-C (or SIGTERM), which stops them all. Logs go to
$RELAYGR_HOME/logs/<stage>.log. The stages are supervised (``relaygr.infra.supervisor``): a stage
that dies is started again with backoff while the others keep running, each restart logged and
counted; only a crash loop (too many exits of one stage in a short window) stops the deployment.

With ``--pin-cores`` (off by default; experiments and benchmarks pin), each ranking worker's device
thread runs on a CPU core of its own and every other process on the other cores
(``workers.engine.cores``); otherwise the non-ranking stages run at a lower CPU priority (nice 10), so the
ranking workers get the shared cores first.

Rolling restart (``Pipeline.roll_worker``, ``rolling_restart``; SIGUSR1 to ``relaygr up``, or
``relaygr up --rolling-restart`` from another shell): each ranking worker in turn is replaced by a
standby of the same id that warmed up beside it and takes over its partitions when it hands over
(``streams.ranking.standby``), so no request waits for a process to start. A stop signal while a standby
warms up gives the restart up (``RollAbandoned``) rather than waiting for it.

Primitives: ``Pipeline`` (start, wait_ready, scrape, check, pause, resume, stop, roll_worker,
rolling_restart), ``complete_hand_over`` (its last step: signal, wait, and the old process ended whatever
fails; ``HandOverFailed``), ``Scrape`` (one stage's Prometheus samples, parsed by
``prometheus_client.parser``: ``value``, ``by_label``), ``signal_running_up`` (the operator's verb).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from relaygr.infra.local.broker import BrokerError, free_port
from relaygr.infra.settings import SECURITY_FIELDS, Settings, cluster_env, get_settings, settings_env
from relaygr.infra.supervisor import CrashLoop, RestartPolicy, Supervisor, end_process
from relaygr.streams.config import PipelineSettings
from relaygr.streams.ranking.standby import STANDBY_NICE
from relaygr.streams.ranking.worker_files import STANDBY_STATES, WorkerFiles
from relaygr.streams.state_lineage import deployment_dir
from relaygr.tools.args import float_above, int_at_least
from relaygr.workers.engine.cores import (
    CoreLayout,
    format_cores,
    may_renice_to,
    nice_tasks,
    pin_tasks,
    plan_cores,
)


@dataclass(frozen=True)
class Scrape:
    """The samples of one stage's /metrics page."""

    samples: tuple[Sample, ...]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        return cls(tuple(s for fam in text_string_to_metric_families(text) for s in fam.samples))

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """The samples called ``name``, summed per value of ``label``."""
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name == name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out


class Pipeline:
    """The stage processes of one local deployment (a context manager), kept running by a
    ``Supervisor``: ``restarts`` counts each stage's restarts, ``check()`` raises once a stage is
    in a crash loop."""

    def __init__(
        self,
        settings: Settings,
        *,
        ranking_workers: int = 2,
        mode: str | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        metrics_base_port: int = 0,
        metrics: bool = False,
        restart_policy: RestartPolicy | None = None,
        cores: CoreLayout | None = None,
    ) -> None:
        self.settings = settings
        self.cores = cores if cores is not None and cores.pinned else None
        self.stage_nice = cores.stage_nice if cores is not None and not cores.pinned else 0
        self.paused = False
        self.n = ranking_workers
        self.mode = mode
        # The model is this process's (resolved before RELAYGR_HOME is pointed at the deployment).
        model = PipelineSettings.to_env(model_dir=PipelineSettings().model_dir)
        self.env = {**os.environ, **model, **(env or {})}
        # Stages sign in as this process does, whatever the environment it inherited says.
        for name in SECURITY_FIELDS:
            self.env.pop(f"RELAYGR_{name.upper()}", None)
        self.env.update(cluster_env(settings))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.log_dir = log_dir or Path(settings.home) / "logs"
        self.metrics_base_port = metrics_base_port
        self.metrics = metrics
        self.metrics_ports: dict[str, int] = {}
        self.supervisor = Supervisor(self.log_dir, restart_policy)

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """The current process of every stage (a restart replaces it)."""
        return self.supervisor.processes()

    @property
    def restarts(self) -> Counter[str]:
        """Restarts per stage since start."""
        return self.supervisor.restarts

    def _spawn(self, name: str, args: list[str], port_index: int, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "relaygr.cli", "stage", *args]
        if self.mode:
            cmd += ["--mode", self.mode]
        if self.metrics_base_port or self.metrics:
            port = self.metrics_base_port + port_index if self.metrics_base_port else free_port()
            self.metrics_ports[name] = port
            cmd += ["--metrics-port", str(port)]
        placement: dict[str, object] = {}
        if self.cores is not None:
            placement["cpu_cores"] = format_cores(self.cores.cores_of(name))
            if name.startswith("ranker-"):
                placement["device_core"] = self.cores.device_core(port_index - 4)
        if self.stage_nice and not name.startswith("ranker-"):
            placement["cpu_nice"] = self.stage_nice
        p = self.supervisor.spawn(
            name, cmd, {**self.env, **(env or {}), **PipelineSettings.to_env(**placement)}
        )
        if self.cores is not None:  # at once, too: the child pins itself only once it has started up
            pin_tasks(p.pid, self.cores.cores_of(name))

    def start(self) -> Pipeline:
        # One ingress process per input: a behaviour burst never shares a CPU slice with requests.
        self._spawn("ingress-requests", ["ingress", "--inputs", "requests"], 0)
        self._spawn("ingress-behaviors", ["ingress", "--inputs", "behaviors"], 1)
        self._spawn("retrieval", ["retrieval"], 2)
        self._spawn("preprocess", ["preprocess"], 3)
        for i in range(self.n):
            self.start_worker(i)
        return self

    def start_worker(self, i: int, *, home: Path | None = None) -> None:
        """Start ranking worker ``ranker-{i}``; with ``home``, its local state lives there (its own
        ``RELAYGR_HOME``, as a worker on another host: it rebuilds its histories from Kafka)."""
        env = settings_env(self.settings.model_copy(update={"home": home}), ["home"]) if home else None
        self._spawn(f"ranker-{i}", ["ranking", "--worker-id", f"ranker-{i}"], 4 + i, env)

    def stop_worker(self, i: int, *, kill: bool = False) -> None:
        """Take ranking worker ``ranker-{i}`` out of the deployment, for good (not restarted).
        SIGTERM: it finishes and commits what it has in flight; its partitions move to the others
        once its session times out (a static member sends no leave). ``kill``: SIGKILL."""
        self.supervisor.release(f"ranker-{i}", kill=kill)

    def roll_worker(
        self,
        i: int,
        *,
        ready_timeout_s: float = 600.0,
        say=None,
        abandon: Callable[[], bool] | None = None,
    ) -> dict[str, float]:
        """Replace ranking worker ``ranker-{i}`` with no gap: start its standby, wait until it is
        warm, tell the old process to hand over (SIGUSR1), wait until the new one serves and has
        joined the group; the supervisor then keeps the new process running as ``ranker-{i}``.
        Returns seconds: ``warm`` (standby start to ready), ``serving`` (hand-over signal to
        ranking), ``joined`` (to group membership), ``old_exit`` (to the old process's exit).
        Once ``abandon()`` says so while the standby warms up (the deployment is stopping), the
        standby is ended and ``RollAbandoned`` raised: the old process never heard of it."""
        name = f"ranker-{i}"
        files = WorkerFiles(deployment_dir(self.settings, "workers") / name)
        files.clear_standby()
        t0 = time.monotonic()
        standby = self.supervisor.start_standby(name, ["--standby"])
        if may_renice_to(os.getpriority(os.PRIO_PROCESS, 0)):  # its start-up too, at the lowest
            nice_tasks(standby.pid, STANDBY_NICE)  # priority (it comes back once it serves)
        if self.cores is not None:
            pin_tasks(standby.pid, self.cores.shared)
        try:
            _wait_standby(files, standby, "ready", ready_timeout_s, abandon=abandon)
        except BaseException:
            end_process(standby, kill=True)
            raise
        took = {"warm": time.monotonic() - t0}
        if say is not None:
            say(f"{name}: standby pid {standby.pid} ready in {took['warm']:.1f} s; handing over")
        old = self.supervisor.adopt(name, standby)
        # The old process hands over under its stop grace; past that (and a margin) it is killed.
        grace = float(self.env.get("RELAYGR_STOP_GRACE_S") or PipelineSettings().stop_grace_s)
        return took | complete_hand_over(files, standby, old, name=name, old_grace_s=grace + 5.0)

    def rolling_restart(self, *, say=None) -> dict[str, dict[str, float]]:
        """``roll_worker`` for every running ranking worker, one at a time."""
        return {
            f"ranker-{i}": self.roll_worker(i, say=say) for i in range(self.n) if f"ranker-{i}" in self.procs
        }

    def crash(self, name: str) -> int:
        """SIGKILL stage ``name`` behind the supervisor's back, as a crash would; the supervisor
        restarts it. Returns the killed pid."""
        pid = self.procs[name].pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def scrape(self, name: str) -> Scrape:
        """The Prometheus samples of stage ``name``."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[name]}/metrics", timeout=5) as r:
            return Scrape.parse(r.read().decode())

    def check(self) -> None:
        """Raise (``CrashLoop``, a RuntimeError) once the supervisor gave up on a stage."""
        self.supervisor.check()

    def pause(self) -> None:
        """Stop every stage process (SIGSTOP): none of them takes CPU time until ``resume``."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.paused:
            self.resume()  # a stopped process would not act on SIGTERM
        self.supervisor.stop()

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def wait_ready(self, timeout_s: float = 180.0) -> float:
        """Send probe requests until one comes back ranked; returns seconds waited."""
        from relaygr.infra.kafka import consumer, producer
        from relaygr.schemas import RankedResult, RecommendationRequest, TopicRegistry, decode, encode

        reg = TopicRegistry(self.settings.topic_prefix, self.settings.partitions)
        t0 = time.monotonic()
        cons = consumer(self.settings, reg.name("results"), group_id=None, auto_offset_reset="latest")
        prod = producer(self.settings)
        await cons.start()
        await prod.start()
        try:
            await cons.seek_to_end()
            sent: set[str] = set()
            last = 0.0
            while time.monotonic() - t0 < timeout_s:
                self.check()
                if time.monotonic() - last > 2.0:
                    rid = f"probe-{uuid.uuid4().hex[:8]}"
                    req = RecommendationRequest(
                        request_id=rid, user_id=f"probe-{len(sent) % 8}", ts=time.time()
                    )
                    await prod.send_and_wait(reg.name("requests"), encode(req), key=req.key())
                    sent.add(rid)
                    last = time.monotonic()
                batch = await cons.getmany(timeout_ms=200)
                for msgs in batch.values():
                    for m in msgs:
                        if decode(RankedResult, m.value).request_id in sent:
                            return time.monotonic() - t0
            raise TimeoutError(
                f"the pipeline did not answer a probe within {timeout_s:.0f} s (logs in {self.log_dir})"
            )
        finally:
            await cons.stop()
            await prod.stop()


class RollAbandoned(RuntimeError):
    """A rolling restart given up before its hand-over because the deployment is stopping."""


class HandOverFailed(RuntimeError):
    """A rolling restart that failed after the old process was told to hand over: the standby,
    already adopted, is the supervised process of the worker's id, and the old one has ended."""


def complete_hand_over(
    files: WorkerFiles,
    standby: subprocess.Popen,
    old: subprocess.Popen,
    *,
    name: str,
    timeout_s: float = 60.0,
    old_grace_s: float = 30.0,
) -> dict[str, float]:
    """Tell ``old`` to hand over to the adopted ``standby`` (SIGUSR1) and wait until the standby
    serves and has joined, each within ``timeout_s``, then until ``old`` has exited. Returns seconds
    from the signal: ``serving``, ``joined``, ``old_exit``. Whatever fails, ``old`` does not outlive
    this call: it was told to leave, and nothing supervises it any more (SIGTERM, then SIGKILL after
    ``old_grace_s``, above a stage's stop grace, under which the hand-over runs)."""
    took: dict[str, float] = {}
    t1 = time.monotonic()
    try:
        old.send_signal(signal.SIGUSR1)
        _wait_standby(files, standby, "serving", timeout_s, old)
        took["serving"] = time.monotonic() - t1
        _wait_standby(files, standby, "joined", timeout_s, old)
        took["joined"] = time.monotonic() - t1
    except (RuntimeError, TimeoutError) as e:
        end_process(old, grace_s=old_grace_s)  # first, so that the message names how it ended
        raise HandOverFailed(
            f"{name}: {e}; pid {standby.pid} is {name} now (restarted as a plain worker if it exits), "
            f"the old pid {old.pid} was told to hand over and has exited (code {old.returncode})"
        ) from e
    finally:  # whatever happened; after a hand-over it exits on its own (ending it then only waits)
        end_process(old, grace_s=old_grace_s)
    took["old_exit"] = time.monotonic() - t1
    return took


def _wait_standby(
    files: WorkerFiles,
    proc: subprocess.Popen,
    state: str,
    timeout_s: float,
    old: subprocess.Popen | None = None,
    *,
    abandon: Callable[[], bool] | None = None,
) -> None:
    """Wait until the standby ``proc`` says it reached ``state`` (or a later one); meanwhile reap
    ``old`` once it exits (a process that crashed instead of handing over is seen gone). Raises
    ``RollAbandoned`` as soon as ``abandon()`` is true."""
    deadline = time.monotonic() + timeout_s
    want = STANDBY_STATES.index(state)
    while time.monotonic() < deadline:
        if abandon is not None and abandon():
            raise RollAbandoned(f"the standby (pid {proc.pid}) was given up before {state}: stopping")
        if old is not None:
            old.poll()
        seen = files.read_standby()
        if seen is not None and seen[1] == proc.pid and STANDBY_STATES.index(seen[0]) >= want:
            return
        if proc.poll() is not None:
            raise RuntimeError(
                f"the standby (pid {proc.pid}) exited with code {proc.returncode} before {state}"
            )
        time.sleep(0.02)
    raise TimeoutError(f"the standby (pid {proc.pid}) was not {state} within {timeout_s:.0f} s")


def _pid_file(settings: Settings) -> Path:
    return Path(settings.home) / "up.pid"


def signal_running_up(settings: Settings) -> int:
    """Ask the running ``relaygr up`` of this home for a rolling restart (SIGUSR1); its pid."""
    try:
        pid = int(_pid_file(settings).read_text())
        os.kill(pid, signal.SIGUSR1)
    except (FileNotFoundError, ValueError, ProcessLookupError) as e:
        raise RuntimeError(f"no running `relaygr up` in {settings.home} ({e})") from e
    return pid


DESCRIPTION = """\
Run every stage of the cascade on this machine, one process each: ingress-requests,
ingress-behaviors, retrieval, preprocess and ranker-0 .. ranker-N-1, against the configured broker
(RELAYGR_BOOTSTRAP, or the local one). Waits until a probe request comes back ranked, then runs
until Ctrl-C or SIGTERM. Logs: $RELAYGR_HOME/logs/<stage>.log, restarts in supervisor.log.

Supervision: a stage that exits (a crash, SIGKILL, an out-of-memory kill) is started again after
a backoff (0.5 s, doubling up to 10 s while it keeps failing) and the other stages keep running;
Kafka redelivers what it had not committed, and a ranking worker takes its partitions back
(static membership). Each restart is printed and counted. Only a crash loop, a stage exiting more
than --max-restarts times within --restart-window seconds, stops the whole deployment (exit 1).

Rolling restart (a deploy no request notices): SIGUSR1 to `relaygr up`, or `relaygr up
--rolling-restart` in another shell (same RELAYGR_HOME), restarts the ranking workers one at a
time. For each, a standby of the same worker id starts beside it, loads the model, warms up and
rebuilds the histories of its partitions (and pre-infers their prefill signals) without joining
the group; the old process then finishes and commits what it holds and hands over; the standby
ranks from the committed offsets at once and joins the group under the same static member id (no
rebalance). Each request is answered once; none waits for a process to start.

Several workers per device (--workers-per-device N): one Python process keeps one core busy with
Kafka, decoding and scheduling, while a GPU host has many cores and one accelerator. N worker
processes share it: the consumer group gives each its own partitions (a user's signal and request
still meet on one worker), and each takes 1/N of the device for its prefix tier and graph pool,
sized from the accelerator's memory (on a CPU: the RELAYGR_DEVICE_CACHE_MB and
RELAYGR_GRAPH_POOL_MB budgets, split). `relaygr plan --workers-per-device N` plans with it.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--ranking-workers",
        type=int_at_least(1),
        default=None,
        help="ranking worker processes (default 2, or --workers-per-device)",
    )
    parser.add_argument(
        "--workers-per-device",
        type=int_at_least(1),
        default=None,
        help="ranking workers that share one device (RELAYGR_WORKERS_PER_DEVICE): each owns its own "
        "partitions and takes 1/N of the device for its prefix tier and graph pool, sized from the "
        "device; on a CPU they share its cores (default 1)",
    )
    parser.add_argument("--mode", choices=["relay", "baseline"], help="override RELAYGR_MODE")
    parser.add_argument(
        "--metrics-base-port", type=int, default=0, help="Prometheus ports from here, one per stage"
    )
    parser.add_argument(
        "--max-restarts",
        type=int_at_least(0),
        default=RestartPolicy.max_restarts,
        help=f"restarts of one stage within --restart-window that still count as recovering "
        f"(default {RestartPolicy.max_restarts}); one more is a crash loop and stops everything",
    )
    parser.add_argument(
        "--restart-window",
        type=float_above(0),
        default=RestartPolicy.window_s,
        help=f"seconds over which a stage's exits are counted (default {RestartPolicy.window_s:g})",
    )
    parser.add_argument(
        "--pin-cores",
        action="store_true",
        help="each ranking worker's device thread on a core of its own, every other stage off it",
    )
    parser.add_argument(
        "--rolling-restart",
        action="store_true",
        help="do not start anything: ask the `relaygr up` running in this RELAYGR_HOME to restart "
        "its ranking workers one at a time, each replaced by a warm standby (same as SIGUSR1 to it)",
    )


def run(args: argparse.Namespace) -> int:
    settings = get_settings()
    if args.rolling_restart:
        try:
            pid = signal_running_up(settings)
        except RuntimeError as e:
            print(f"relaygr up: {e}", file=sys.stderr)
            return 1
        print(f"asked relaygr up (pid {pid}) for a rolling restart of its ranking workers; see its output")
        return 0
    try:
        workers, env = ranking_layout(args.ranking_workers, args.workers_per_device)
    except ValueError as e:
        print(f"relaygr up: {e}", file=sys.stderr)
        return 2
    args.ranking_workers = workers
    stop, roll = False, False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    def on_roll(*_: object) -> None:
        nonlocal roll
        roll = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)  # the stages run in sessions of their own
    signal.signal(signal.SIGUSR1, on_roll)
    pid_file = _pid_file(settings)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(str(os.getpid()))
    try:
        with Pipeline(
            settings,
            ranking_workers=args.ranking_workers,
            mode=args.mode,
            env=env,
            metrics_base_port=args.metrics_base_port,
            restart_policy=RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window),
            cores=plan_cores(args.ranking_workers, pin=args.pin_cores),
        ) as pipe:
            waited = asyncio.run(pipe.wait_ready())
            print(f"cores: {plan_cores(args.ranking_workers, pin=args.pin_cores).describe()}", flush=True)
            print(
                f"pipeline up in {waited:.1f} s: ingress, retrieval, preprocess, {args.ranking_workers} ranking worker(s); "
                f"logs in {pipe.log_dir}. Ctrl-C stops.",
                flush=True,
            )
            while not stop:
                pipe.check()
                if roll:
                    roll = False
                    _rolling_restart(pipe, lambda: stop)
                time.sleep(0.5)
            restarts = dict(pipe.restarts)
    except KeyboardInterrupt:
        return 0
    except (BrokerError, RuntimeError, TimeoutError) as e:
        print(f"relaygr up: {e}", file=sys.stderr)
        if isinstance(e, CrashLoop):
            print("relaygr up: stopped every stage", file=sys.stderr)
        return 1
    finally:
        pid_file.unlink(missing_ok=True)
    if restarts:
        print(
            "relaygr up: restarts " + ", ".join(f"{k} {v}" for k, v in sorted(restarts.items())),
            file=sys.stderr,
        )
    return 0


def ranking_layout(workers: int | None, per_device: int | None) -> tuple[int, dict[str, str]]:
    """How many ranking workers ``relaygr up`` starts, and the settings that tell each how many
    share its device: ``--workers-per-device N`` starts N on the one device the settings name
    (``RELAYGR_DEVICE``; one ``relaygr up`` a device)."""
    if per_device is None:
        return (workers if workers is not None else 2), {}
    if workers is not None and workers != per_device:
        raise ValueError(
            f"--ranking-workers {workers} with --workers-per-device {per_device}: the workers of one "
            "`relaygr up` share one device (run one per device)"
        )
    return per_device, PipelineSettings.to_env(workers_per_device=per_device)


def _rolling_restart(pipe: Pipeline, stopping: Callable[[], bool] = lambda: False) -> None:
    """The operator's rolling restart: every ranking worker in turn. A failure is reported: before
    the hand-over the old process keeps serving (its standby is ended); after it (``HandOverFailed``)
    the standby is the worker, and the old process has ended. Once ``stopping()`` (a stop signal
    came), the workers not replaced yet are left as they are, so that the stop does not wait for
    standbys to warm up."""
    print("relaygr up: rolling restart of the ranking workers", flush=True)
    for i in range(pipe.n):
        if stopping():
            print(
                f"relaygr up: stopping; rolling restart given up from ranker-{i} on",
                file=sys.stderr,
                flush=True,
            )
            return
        try:
            took = pipe.roll_worker(i, abandon=stopping)
        except RollAbandoned as e:
            print(f"relaygr up: rolling restart of ranker-{i} given up: {e}", file=sys.stderr, flush=True)
            return
        except (RuntimeError, TimeoutError) as e:
            print(f"relaygr up: rolling restart of ranker-{i} failed: {e}", file=sys.stderr, flush=True)
            continue
        print(
            f"relaygr up: ranker-{i} replaced: standby warm in {took['warm']:.1f} s, serving "
            f"{took['serving'] * 1000:.0f} ms after the hand-over, in the group after {took['joined']:.1f} s",
            flush=True,
        )
