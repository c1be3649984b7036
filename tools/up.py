"""``relaygr up``: run every stage of the cascade locally, one process each, until stopped.

`relaygr up` starts the ingress, retrieval, pre-processing and N ranking workers (``tools.pipeline``),
waits until a probe request comes back ranked, then runs until Ctrl-C (or SIGTERM), which stops
them all. Logs go to $RELAYGR_HOME/logs/<stage>.log; a stage that dies is restarted by the
supervisor, and only a crash loop stops the deployment.

With ``--pin-cores`` (off by default; experiments and benchmarks pin), each ranking worker's device
thread runs on a CPU core of its own and every other process on the other cores
(``workers.engine.cores``); otherwise the non-ranking stages run at a lower CPU priority (nice 10), so the
ranking workers get the shared cores first.

Rolling restart (SIGUSR1 to ``relaygr up``, or ``relaygr up --rolling-restart`` from another shell):
each ranking worker in turn is replaced by a warm standby (``Pipeline.roll_worker``). A stop signal
while a standby warms up gives the restart up (``RollAbandoned``) rather than waiting for it.

Primitives: ``signal_running_up`` (the operator's verb), ``ranking_layout`` (how many workers, and
how many share a device), ``add_arguments`` / ``run``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from relaygr.infra.local.broker import BrokerError
from relaygr.infra.settings import Settings, get_settings
from relaygr.infra.supervisor import CrashLoop, RestartPolicy
from relaygr.streams.config import PipelineSettings
from relaygr.tools.args import float_above, int_at_least
from relaygr.tools.hand_over import RollAbandoned
from relaygr.tools.pipeline import Pipeline
from relaygr.workers.engine.cores import plan_cores


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
