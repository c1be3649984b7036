"""Run one stage of the cascade in this process: ingress, retrieval, preprocess or ranking.

Every stage reads the broker, topic and pipeline settings from RELAYGR_* environment variables
(docs/configuration.md). Run several `ranking` processes with different --worker-id to scale out: Kafka's
consumer group gives each a share of the partitions, the same share of every co-partitioned topic.
The ingress stage needs no model: it re-keys the public input topics onto the routed ones.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from relaygr.infra.local.broker import BrokerError
from relaygr.infra.settings import get_settings
from relaygr.infra.stop_guard import StopDeadline, watch_supervisor_from_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "stage", choices=["ingress", "retrieval", "preprocess", "ranking"], help="which stage"
    )
    parser.add_argument(
        "--worker-id", default="0", help="this process's id (ranking: also its static group member id)"
    )
    parser.add_argument("--mode", choices=["relay", "baseline"], help="override RELAYGR_MODE")
    parser.add_argument(
        "--standby",
        action="store_true",
        help="ranking only: start as the replacement of the running worker of this id: build its "
        "state beside it, and take over its partitions when it hands over (SIGUSR1 to it)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus endpoint on 127.0.0.1 (0 = off)"
    )
    parser.add_argument("--log-level", default="warning", help="python log level")
    parser.add_argument(
        "--inputs",
        choices=["requests", "behaviors", "both"],
        default="both",
        help="ingress only: which public topics this process routes (default both)",
    )


def place_this_process(pipeline) -> None:
    """The launcher's core layout for this stage (``workers.engine.cores``): its nice level and its
    cores, set before any thread starts, so that every thread inherits them (the ranking worker's
    device thread re-pins itself)."""
    if pipeline.cpu_nice:
        os.nice(pipeline.cpu_nice)
    if pipeline.cpu_cores:
        from relaygr.workers.engine.cores import parse_cores, pin_tasks

        pin_tasks(os.getpid(), parse_cores(pipeline.cpu_cores))


def run(args: argparse.Namespace) -> int:
    from relaygr.streams.config import PipelineSettings

    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.stage}[{args.worker_id}] %(levelname)s %(message)s",
    )
    handover_asked: list[bool] = []
    if args.stage == "ranking":  # a hand-over asked for while starting up: not the default (exit)
        signal.signal(signal.SIGUSR1, lambda *_: handover_asked.append(True))
    settings = get_settings()
    pipeline = PipelineSettings()
    if args.mode:
        pipeline = pipeline.model_copy(update={"mode": args.mode})
    sys.setswitchinterval(pipeline.switch_interval_ms / 1000)
    place_this_process(pipeline)
    deadline = StopDeadline(pipeline.stop_grace_s, f"relaygr stage {args.stage}[{args.worker_id}]")
    # A supervisor that died (even by SIGKILL) stops its stages as a SIGTERM would.
    watch_supervisor_from_env(lambda: os.kill(os.getpid(), signal.SIGTERM))
    if args.stage == "ingress":
        from relaygr.streams.ingress import main as ingress_main

        try:
            inputs = ("requests", "behaviors") if args.inputs == "both" else (args.inputs,)
            return ingress_main(settings, args.worker_id, args.metrics_port, inputs, deadline)
        except BrokerError as e:
            print(f"relaygr stage ingress: {e}", file=sys.stderr)
            return 1
    if not (pipeline.model_dir / "config.json").exists():
        print(
            f"relaygr stage: no trained model in {pipeline.model_dir}: run `relaygr train --out {pipeline.model_dir}`",
            file=sys.stderr,
        )
        return 1
    try:
        if args.stage == "ranking":
            from relaygr.streams.ranking.ranking_worker import main

            return main(
                settings,
                pipeline,
                f"ranker-{args.worker_id}" if args.worker_id.isdigit() else args.worker_id,
                args.metrics_port,
                standby=args.standby,
                handover_asked=lambda: bool(handover_asked),
                stop_deadline=deadline,
            )
        from relaygr.streams.common import freeze_heap, serve_metrics

        if args.stage == "retrieval":
            from relaygr.streams.retrieval import build
        else:
            from relaygr.streams.preprocess import build
        app = build(settings, pipeline, args.worker_id)
        serve_metrics(args.metrics_port)
        freeze_heap()
        faust_worker(app, args.log_level, deadline).execute_from_commandline()
        return 0
    except BrokerError as e:
        print(f"relaygr stage {args.stage}: {e}", file=sys.stderr)
        return 1


def faust_worker(app, log_level: str, stop_deadline: StopDeadline | None = None):
    """The faust worker of a stage, logging at ``log_level`` and without its terminal spinner:
    the spinner puts the root logger at DEBUG, so every debug call of faust and aiokafka (several
    per message) would build and handle a record that no handler prints. A stop signal arms
    ``stop_deadline``: faust's own stop waits on the broker as long as it takes."""
    from faust.worker import Worker

    class StageWorker(Worker):
        def _on_sigterm(self) -> None:
            if stop_deadline is not None:
                stop_deadline.arm()
            super()._on_sigterm()

        def _on_sigint(self) -> None:
            if stop_deadline is not None:
                stop_deadline.arm()
            super()._on_sigint()

    level = {"warning": "warn", "critical": "crit"}.get(log_level.lower(), log_level.lower())
    worker = StageWorker(app, loglevel=level, quiet=True, redirect_stdouts=False)
    worker.spinner = None
    return worker
