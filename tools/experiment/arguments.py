"""The arguments of ``relaygr experiment``: the experiments to run, how B is fixed, the trace's
window, the rule that says whether a point holds the SLO, isolation, and each kind's points.

Primitives: ``add_experiment_arguments(parser)``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from relaygr.tools.args import int_at_least, open_fraction
from relaygr.tools.experiment.kinds import KINDS
from relaygr.workers.training.train_args import add_source_arguments


def add_experiment_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "which",
        nargs="+",
        choices=sorted(KINDS),
        help="the experiment; several run one after the other on the same pipelines",
    )
    add_source_arguments(parser)
    parser.add_argument("--out", type=Path, help="report folder (default $RELAYGR_HOME/experiments/<run>)")
    parser.add_argument(
        "--model", type=Path, help="checkpoint (default RELAYGR_MODEL_DIR; trained if missing)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of each ranking worker (default 1)"
    )
    parser.add_argument(
        "--device",
        default=None,
        help="the ranking workers' device, cpu, cuda[:N] or npu[:N] (default: the checkpoint's); the "
        "latency model is calibrated there",
    )
    parser.add_argument("--theta", type=float, default=0.1, help="trigger threshold θ (default 0.1)")
    _add_slo_calibration_arguments(parser)
    _add_run_arguments(parser)
    _add_holding_arguments(parser)
    _add_isolation_arguments(parser)
    _add_kind_arguments(parser)


def _add_slo_calibration_arguments(parser: argparse.ArgumentParser) -> None:
    """How B is fixed: given, or measured on the baseline."""
    parser.add_argument("--slo-ms", type=float, help="fix B instead of measuring it")
    parser.add_argument(
        "--slo-tokens",
        type=int,
        default=None,
        help="history the baseline must serve within B (default: throughput's history; 1024 for seq-len)",
    )
    parser.add_argument("--slo-qps", type=float, default=10.0, help="reference load of the SLO calibration")
    parser.add_argument("--slo-requests", type=int, default=300, help="requests of the SLO calibration")
    parser.add_argument(
        "--slo-slices", type=int, default=3, help="B from the largest P99 of this many slices"
    )
    parser.add_argument("--slo-headroom", type=float, default=0.25, help="B = measured P99 × (1 + this)")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace's window, warm-up and seed, and what is kept and printed."""
    parser.add_argument(
        "--pipeline-warmup", type=int, default=100, help="unmeasured requests through each fresh pipeline"
    )
    parser.add_argument("--min-prior", type=int, default=20, help="real earlier interactions a request needs")
    parser.add_argument("--window-start", type=int, help="first request of the window (default: mid-trace)")
    parser.add_argument("--no-warmup", action="store_true", help="don't replay each user's previous visit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--patience", type=int, help="stop a mode after this many failing points in a row")
    parser.add_argument("--keep", action="store_true", help="keep the topics and the pipelines' state")
    parser.add_argument("--json", action="store_true", help="print the headline figures as one JSON line")
    parser.add_argument(
        "--repeat",
        type=int_at_least(1),
        default=1,
        help="run the whole experiment this many times (median, worst)",
    )


def _add_holding_arguments(parser: argparse.ArgumentParser) -> None:
    """The sequential rule that says whether a point holds the SLO."""
    g = parser.add_argument_group("holding the SLO")
    g.add_argument(
        "--max-requests",
        type=int_at_least(1),
        default=1000,
        help="cap of a point's requests (the rule decides first)",
    )
    g.add_argument("--min-round", type=int_at_least(1), default=50, help="fewest requests of a round")
    g.add_argument(
        "--max-round",
        type=int_at_least(1),
        default=100,
        help="most requests of a round (the rule is asked after each)",
    )
    g.add_argument(
        "--miss-rate", type=open_fraction, default=0.01, help="miss rate the bound must stay under"
    )
    g.add_argument("--confidence", type=open_fraction, default=0.95, help="one-sided confidence of the bound")


def _add_isolation_arguments(parser: argparse.ArgumentParser) -> None:
    """What shares the machine with a point: cores, the other mode's pipeline."""
    g = parser.add_argument_group("isolation")
    g.add_argument(
        "--no-pin",
        action="store_true",
        help="don't give the ranking workers' device threads cores of their own",
    )
    g.add_argument(
        "--no-isolate", action="store_true", help="keep the other mode's pipeline live during a point"
    )
    g.add_argument(
        "--core-per-stage",
        action="store_true",
        help="also a core of its own for each stage process, where the machine has enough (workers.cores)",
    )
    g.add_argument(
        "--first-point-once",
        action="store_true",
        help="run the first point once, not twice (short checks; the protocol records it)",
    )


def _add_kind_arguments(parser: argparse.ArgumentParser) -> None:
    """The points of each experiment kind."""
    g = parser.add_argument_group("seq-len")
    g.add_argument("--lengths", default="512,1024,2048,4096,8192", help="history lengths (events)")
    g.add_argument("--qps", type=float, default=10.0, help="request rate of every point")
    g = parser.add_argument_group("throughput")
    g.add_argument(
        "--history",
        type=int_at_least(1),
        default=None,
        help="history length in events (default: sized from the calibration, where full ranking at low load "
        "takes most of the budget; see tools.sizing)",
    )
    g.add_argument(
        "--qps-list",
        default="10,15,20,25,30,35,40,50,60,70,80,90,100,110,120,140",
        help="offered QPS of the points (steps of at most 25 %% past 20, so a ratio is read to that)",
    )
