"""The one command line: ``relaygr <command> ...``.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only maps names to modules and imports a module when its command runs, so that
``relaygr --help`` and ``relaygr broker ...`` stay fast and never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from relaygr.tools.experiment.scenarios import SCENARIOS

# name -> (module, one-line help). Groups map to nested commands.
COMMANDS: dict[str, tuple[str, str]] = {
    "broker": ("relaygr.infra.local.broker_cli", "start, stop or inspect the local Kafka broker or cluster"),
    "topics": ("relaygr.infra.topics_cli", "create (idempotently) or list RelayGR's topics"),
    "schemas": ("relaygr.schemas_cli", "export the public events as JSON Schema files for other stacks"),
    "settings": ("relaygr.tools.settings_doc", "every RELAYGR_* setting as the Markdown configuration page"),
    "results": ("relaygr.results_cli", "look up one request's result, or tail the results as they come"),
    "acl": ("relaygr.infra.local.acls_cli", "show, grant or list the Kafka ACLs of RelayGR's access roles"),
    "roundtrip": (
        "relaygr.infra.roundtrip",
        "send one event of every schema through the broker and read it back",
    ),
    "demo": ("relaygr.demo", "the main job: broker, topics and the pipeline on MovieLens, with a summary"),
    "up": (
        "relaygr.tools.up",
        "run and supervise every stage locally (retrieval, preprocess, N ranking workers)",
    ),
    "stage": ("relaygr.streams.stage_cli", "run one stage of the cascade in this process"),
    "calibrate": (
        "relaygr.calibrate",
        "measure full-ranking latency here and write the trigger's latency model",
    ),
    "train": (
        "relaygr.tools.train_source",
        "train the HSTU ranker on MovieLens, an interaction log file or the behaviors topic",
    ),
    "quality": (
        "relaygr.quality_cli",
        "several training runs of one log (seeds) pooled user by user: HR@10 by history length, all vs best",
    ),
    "plan": (
        "relaygr.plan",
        "capacity plan: bytes per cached user, users per GB per tier, device time and workers for a load",
    ),
    "trace": ("relaygr.tools.trace", "build a request trace of a dataset and publish it to a trace topic"),
    "replay": (
        "relaygr.tools.replay",
        "re-publish a trace or recorded requests topic into the pipeline at a QPS or a speed",
    ),
    "report": (
        "relaygr.tools.report.command",
        "latency, SLO, cache, path and quality report of a results topic",
    ),
    "experiment": (
        "relaygr.tools.experiment.command",
        "relay vs baseline on the trace: seq-len (longest history) or throughput (highest QPS) under the SLO",
    ),
}

GROUPS: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "bench": (
        "benchmarks that print one JSON line per measurement, relay and baseline side by side",
        {
            # The worker micro-benchmarks (bench/), the broker scenarios (experiment kinds that run
            # on fresh pipelines: tools/experiment/scenarios/) and the device check (device/).
            "model": (
                "relaygr.bench.model",
                "rank with a cached prefix vs full inference, per prefix length",
            ),
            "launches": (
                "relaygr.bench.launches",
                "device operations one relay and one full ranking dispatch, per history length (counted on CPU)",
            ),
            "store": ("relaygr.bench.store", "prefix store tiers vs recompute, per prefix length"),
            "kernels": (
                "relaygr.bench.kernels",
                "HSTU attention: PyTorch reference vs Triton kernel, relay and full calls, TFLOP/s",
            ),
            "cold-tiers": (
                "relaygr.bench.cold_tiers",
                "cold-tier formats (exact, bf16, int8): ranking error, users per GB, promotion from disk",
            ),
            "plan": (
                "relaygr.bench.plan_check",
                "relaygr plan's predicted bytes and device time next to a measured engine run",
            ),
            "device": (
                "relaygr.device.check",
                "the prepared device check: environment, kernels, exactness, model, store, profile and "
                "a short pipeline run on an accelerator, each step within its time budget, into "
                "report.json / report.md",
            ),
            "request-path": (
                "relaygr.tools.request_path",
                "the project files and lines one rank request runs through (relay or full path)",
            ),
            "host-path": (
                "relaygr.bench.host_path",
                "the ranking worker's CPU per ranking at a rate ladder (host path and device thread), "
                "and the highest rate it held, relay and baseline",
            ),
            "kafka-clients": (
                "relaygr.bench.kafka_clients",
                "CPU per message of aiokafka and confluent-kafka producers and consumers at given rates, "
                "side by side on the real broker (what a stage's round trips cost)",
            ),
            **SCENARIOS,
        },
    ),
}


def _add_module_command(sub: argparse._SubParsersAction, name: str, module: str, help_: str) -> None:
    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip().splitlines()[0])
    mod.add_arguments(p)
    p.set_defaults(_run=mod.run)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="relaygr",
        description=(
            "RelayGR: serve long-sequence generative recommendation on Kafka. Retrieval pre-infers "
            "the user's long-term history on the worker that will rank the request; ranking then "
            "computes only the short-term behaviours and the candidates against the cached prefix."
        ),
        epilog="Configuration: environment variables with the RELAYGR_ prefix (`relaygr settings`, docs/configuration.md).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the module of the command being run is imported; the others get a stub for --help.
    wanted = argv[0] if argv else None
    for name, (module, help_) in COMMANDS.items():
        if name == wanted:
            _add_module_command(sub, name, module, help_)
        else:
            sub.add_parser(name, help=help_)
    for group, (help_, members) in GROUPS.items():
        gp = sub.add_parser(group, help=help_, description=help_)
        gsub = gp.add_subparsers(dest="subcommand", metavar="WHAT")
        want_member = argv[1] if group == wanted and len(argv) > 1 else None
        for name, (module, mhelp) in members.items():
            if name == want_member:
                _add_module_command(gsub, name, module, mhelp)
            else:
                gsub.add_parser(name, help=mhelp)
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # signal handlers live only there


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    # Stopped from outside (a timeout, a service manager): unwind as on Ctrl-C, so that a command
    # stops what it started (a benchmark's pipeline, a demo's stages). Commands that run an
    # event loop of their own (``stage``, ``up``) install their own handler over this one.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if _in_main_thread() else None
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
