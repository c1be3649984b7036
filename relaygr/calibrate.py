"""Measure full-ranking latency on this machine and write the latency model the trigger uses.

Times `rank_full` of the trained model (RELAYGR_MODEL_DIR, or --model) at several history
lengths, fits ms ≈ a + b·n + c·n², and writes it as JSON (default: <model>/calibration.json).
Point RELAYGR_CALIBRATION_FILE at it; ranking workers otherwise calibrate at start.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from relaygr.tools.args import int_at_least
from relaygr.workers.engine.calibration import CALIBRATION_LENGTHS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: RELAYGR_MODEL_DIR)")
    parser.add_argument("--out", type=Path, help="output JSON (default: <model>/calibration.json)")
    parser.add_argument(
        "--lengths", default=",".join(map(str, CALIBRATION_LENGTHS)), help="history lengths to time"
    )
    parser.add_argument("--candidates", type=int, default=128)
    parser.add_argument("--device", help="cpu, cuda[:N] or npu[:N] (default: the checkpoint's)")
    parser.add_argument(
        "--threads",
        type=int_at_least(0),
        help="torch CPU threads to time with, 0 = torch's default (default: RELAYGR_TORCH_THREADS)",
    )
    parser.add_argument(
        "--tier-costs",
        type=Path,
        metavar="DIR",
        help="also measure the prefix store's promotion speeds (host copy, cold disk read) with a "
        "file in DIR, the disk tier's filesystem; workers then never serve from a slower tier",
    )
    parser.add_argument(
        "--no-paces",
        action="store_true",
        help="skip timing sliced pre-inference and relay ranking (the paces `relaygr plan` uses)",
    )


def run(args: argparse.Namespace) -> int:
    from relaygr.streams.config import PipelineSettings
    from relaygr.workers.engine.calibration import calibrate_and_save
    from relaygr.workers.model.model import HSTURanker
    from relaygr.workers.model.runner import ModelRunner

    model_dir = args.model or PipelineSettings().model_dir
    model = HSTURanker.load(model_dir, device=args.device)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    settings = PipelineSettings()
    threads = args.threads if args.threads is not None else settings.torch_threads
    out = args.out or Path(model_dir) / "calibration.json"
    paces = None
    if not args.no_paces:
        paces = settings.pace_settings()
    lat, samples = calibrate_and_save(
        ModelRunner(model),
        out,
        lengths=lengths,
        candidates=args.candidates,
        threads=threads,
        paces=paces,
        tier_costs_dir=args.tier_costs,
    )
    written = json.loads(out.read_text())
    print(
        json.dumps(
            {"calibration": str(out), "coeffs": lat.coeffs(), "samples": samples}
            | {k: written[k] for k in ("prefill_pace", "relay_pace", "tier_costs") if k in written}
        )
    )
    return 0
