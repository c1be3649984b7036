"""Train the HSTU ranker on an interaction log (next item, target-aware sampled softmax) and write a checkpoint.

Primitives:
- ``make_batch``: a padded batch of training windows with cut points; at each cut the true next
  item and sampled negatives become candidate tokens (what ranking scores), so training fits the
  exact scoring path the worker serves.
- ``train_model``: AdamW over shuffled, length-bucketed batches; progress to stderr.
- ``evaluate``: leave-last-out. Each user's last event is the target; the candidates are every
  item the user has not seen; the history (all earlier events, or only the last N) is ranked
  through the serving API (``rank_full``). HR@10, NDCG@10, MRR, each with a 95 % bootstrap
  confidence interval over users.
- ``popularity_metrics``: the same protocol for a most-popular baseline.
- ``load_log``: the training data: MovieLens from recbole (``--dataset``, identity vocabulary) or
  any log file (``--interactions``, read by ``interactions.read_interactions``).
- ``add_arguments`` / ``run(args, log=None)``: ``relaygr train --dataset ml-100k --out DIR`` or
  ``--interactions PATH`` writes ``model.safetensors``, ``config.json``, ``vocab.json`` (raw item
  ids -> model ids) and ``metrics.json`` (quality against the history length used at inference).
  ``log``: events already read (from the ``behaviors`` topic, by ``relaygr.tools.train_source``),
  so this module never touches Kafka.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from relaygr.workers.dense import train_scores
from relaygr.workers.interactions import Columns, InteractionLog, build_log, print_progress, read_interactions
from relaygr.workers.model import HSTUConfig, HSTURanker
from relaygr.workers.movielens import DATASETS, MovieLens, load_movielens
from relaygr.workers.prefix_kv import Events
from relaygr.workers.vocab import ItemVocab

DEFAULT_LENGTHS: tuple[int | None, ...] = (16, 64, 256, None)  # None: the whole history
BOOTSTRAP_SAMPLES = 1000


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt_secs(s: float) -> str:
    s = max(0, round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@dataclass(frozen=True)
class Batch:
    items: torch.Tensor  # [B, T]
    actions: torch.Tensor  # [B, T]
    timestamps: torch.Tensor  # [B, T] float64
    lengths: torch.Tensor  # [B]
    cuts: torch.Tensor  # [B, S]
    cut_ts: torch.Tensor  # [B, S]
    candidates: torch.Tensor  # [B, S, K]; column 0 is the true next item
    weight: torch.Tensor  # [B, S] 1 for real cut points, 0 for padding


def make_batch(
    windows: Sequence[Events],
    cuts: int,
    negatives: int,
    num_items: int,
    rng: np.random.Generator,
    popularity: np.ndarray | None = None,
    popular_share: float = 0.0,
) -> Batch:
    """Pad ``windows`` (each >= 2 events) into a batch; pick up to ``cuts`` cut points per row
    (all of them for short rows) and ``negatives`` random negatives per cut: a ``popular_share``
    of them drawn by ``popularity`` (item probabilities, index = item id), the rest uniformly."""
    B = len(windows)
    T = max(len(w) for w in windows)
    S = min(cuts, T - 1)
    items = torch.zeros(B, T, dtype=torch.int64)
    actions = torch.zeros(B, T, dtype=torch.int64)
    ts = torch.zeros(B, T, dtype=torch.float64)
    lengths = torch.tensor([len(w) for w in windows])
    cut = np.ones((B, S), dtype=np.int64)
    weight = np.zeros((B, S), dtype=np.float32)
    for b, w in enumerate(windows):
        n = len(w)
        items[b, :n], actions[b, :n], ts[b, :n] = w.item_ids, w.action_ids, w.timestamps
        if n - 1 <= S:
            chosen = np.arange(1, n)
        else:
            chosen = np.sort(rng.choice(np.arange(1, n), size=S, replace=False))
        cut[b, : len(chosen)] = chosen
        weight[b, : len(chosen)] = 1.0
    cut_t = torch.from_numpy(cut)
    targets = torch.gather(items, 1, cut_t)
    cut_ts = torch.gather(ts, 1, cut_t)
    neg = rng.integers(1, num_items + 1, size=(B, S, negatives))
    n_pop = round(negatives * popular_share) if popularity is not None else 0
    if n_pop:
        neg[..., :n_pop] = rng.choice(len(popularity), size=(B, S, n_pop), p=popularity)
    neg = torch.from_numpy(neg)
    return Batch(
        items=items,
        actions=actions,
        timestamps=ts,
        lengths=lengths,
        cuts=cut_t,
        cut_ts=cut_ts,
        candidates=torch.cat([targets[..., None], neg], dim=-1),
        weight=torch.from_numpy(weight),
    )


def batch_loss(model: HSTURanker, batch: Batch, aux_weight: float = 0.0) -> torch.Tensor:
    """Sampled softmax over (true next item, negatives) at every cut point: the served scores.

    With ``aux_weight`` > 0, adds that times a full-softmax next-item loss on the history tokens'
    final states (``state_t . item_embedding``, predicting event ``t + 1``): a dense, cheap
    signal for the shared embeddings and layers. The ranking score itself is only ever the
    candidate-token path above."""
    out = train_scores(
        model,
        batch.items,
        batch.actions,
        batch.timestamps,
        batch.lengths,
        batch.cuts,
        batch.cut_ts,
        batch.candidates,
        history_states=aux_weight > 0,
    )
    scores, states = out if isinstance(out, tuple) else (out, None)
    scores = scores.float()
    cands = batch.candidates.to(scores.device)
    # A negative that happens to be the target is not a negative.
    clash = cands[..., 1:] == cands[..., :1]
    scores = torch.cat([scores[..., :1], scores[..., 1:].masked_fill(clash, float("-inf"))], dim=-1)
    zeros = torch.zeros(scores.shape[0] * scores.shape[1], dtype=torch.int64, device=scores.device)
    ce = F.cross_entropy(scores.flatten(0, 1), zeros, reduction="none")
    w = batch.weight.to(scores.device).flatten()
    loss = (ce * w).sum() / w.sum().clamp_min(1.0)
    if states is not None:
        items = model.vocab_items(batch.items)
        nxt = items[:, 1:]
        valid = (
            torch.arange(1, items.shape[1], device=items.device) < batch.lengths.to(items.device)[:, None]
        ) & (nxt > 0)
        logits = states[:, :-1][valid].float() @ model.item_emb.weight.float().t()
        logits[:, 0] = float("-inf")  # never predict the unknown id
        loss = loss + aux_weight * F.cross_entropy(logits, nxt[valid])
    return loss


def split_leave_last_out(log: InteractionLog | MovieLens) -> tuple[dict, dict]:
    """Per user: history without the last event (training and ranking input), and the last event."""
    train = {u: h.slice(0, len(h) - 1) for u, h in log.histories.items() if len(h) >= 2}
    test = {u: log.histories[u].slice(len(log.histories[u]) - 1) for u in train}
    return train, test


def movielens_log(name: str) -> InteractionLog:
    """A MovieLens dataset with the identity vocabulary (its raw ids are the model ids)."""
    ml = load_movielens(name)
    return InteractionLog(
        histories={str(u): h for u, h in ml.histories.items()},
        vocab=ItemVocab.identity_of(ml.num_items),
        num_actions=5,
    )


def train_model(
    model: HSTURanker,
    sequences: dict[str, Events],
    *,
    epochs: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    cuts: int = 16,
    negatives: int = 31,
    popular_share: float = 0.5,
    aux_weight: float = 1.0,
    seed: int = 0,
    max_steps: int | None = None,
    log: Callable[[str], None] = _log,
) -> list[float]:
    """Train in place; returns the mean loss of each epoch. Rows are random windows of at most
    ``config.max_len`` events; batches group rows of similar length."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    random.seed(seed)
    max_len = model.config.max_len
    seqs = [s for s in sequences.values() if len(s) >= 2]
    counts = np.zeros(model.config.num_items + 1)
    for s in seqs:
        np.add.at(counts, model.vocab_items(s.item_ids).cpu().numpy(), 1)
    counts[0] = 0
    popularity = counts / counts.sum()
    steps_per_epoch = math.ceil(len(seqs) / batch_size)
    total = steps_per_epoch * epochs if max_steps is None else min(max_steps, steps_per_epoch * epochs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / max(1, total // 20)) * max(0.05, 1 - step / max(1, total))
    )
    losses: list[float] = []
    step, t0 = 0, time.perf_counter()
    for epoch in range(epochs):
        model.train()
        windows = []
        for s in seqs:
            start = int(rng.integers(0, len(s) - max_len + 1)) if len(s) > max_len else 0
            windows.append(s.slice(start, start + max_len))
        order = np.argsort([len(w) + rng.random() for w in windows])  # length buckets, random ties
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        rng.shuffle(batches)
        ep_loss, ep_n = 0.0, 0
        for idx in batches:
            if max_steps is not None and step >= max_steps:
                break
            batch = make_batch(
                [windows[i] for i in idx],
                cuts,
                negatives,
                model.config.num_items,
                rng,
                popularity=popularity,
                popular_share=popular_share,
            )
            loss = batch_loss(model, batch, aux_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            ep_loss += float(loss.detach())
            ep_n += 1
            step += 1
        if ep_n == 0:
            break
        losses.append(ep_loss / ep_n)
        elapsed = time.perf_counter() - t0
        eta = elapsed / step * (total - step)
        log(
            f"epoch {epoch + 1}/{epochs}  loss {losses[-1]:.4f}  steps {step}/{total}  "
            f"elapsed {_fmt_secs(elapsed)}  eta {_fmt_secs(eta)}"
        )
    model.eval()
    model.refresh_version()
    return losses


def _per_user(ranks: np.ndarray) -> dict[str, np.ndarray]:
    hit = ranks <= 10
    return {
        "HR@10": hit.astype(np.float64),
        "NDCG@10": np.where(hit, 1.0 / np.log2(ranks + 1.0), 0.0),
        "MRR": 1.0 / ranks,
    }


def _metrics(ranks: np.ndarray, seed: int = 0) -> dict[str, float | list[float]]:
    """Means over users, each with a 95 % confidence interval (percentile bootstrap over users;
    one resampling shared by the three metrics)."""
    per_user = _per_user(ranks)
    rng = np.random.default_rng(seed)
    resample = rng.integers(0, len(ranks), size=(BOOTSTRAP_SAMPLES, len(ranks)))
    out: dict[str, float | list[float]] = {}
    for name, values in per_user.items():
        means = values[resample].mean(axis=1)
        out[name] = float(values.mean())
        out[f"{name}_ci95"] = [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]
    return out


def _rank_of_target(scores: np.ndarray, target_pos: int) -> float:
    """1-based rank of the target; ties with other candidates count half (random tie-break)."""
    s = scores[target_pos]
    greater = int((scores > s).sum())
    ties = int((scores == s).sum()) - 1
    return 1.0 + greater + ties // 2


def _candidates(num_items: int, history: Events, target: int) -> tuple[torch.Tensor, int]:
    keep = np.ones(num_items + 1, dtype=bool)
    keep[0] = False
    keep[history.item_ids.numpy()] = False
    keep[target] = True
    cands = np.flatnonzero(keep)
    return torch.from_numpy(cands), int(np.searchsorted(cands, target))


def evaluate(
    model: HSTURanker,
    history: dict[str, Events],
    test: dict[str, Events],
    *,
    lengths: Sequence[int | None] = DEFAULT_LENGTHS,
    max_users: int | None = None,
    micro_batch: int = 1024,
    log: Callable[[str], None] = _log,
) -> dict[str, dict[str, float]]:
    """Leave-last-out metrics per history length (``None``: all events), via ``rank_full``."""
    users = sorted(history)[:max_users]
    ranks: dict[str, list[float]] = {_length_key(n): [] for n in lengths}
    t0 = time.perf_counter()
    num_items = model.config.num_items
    for i, u in enumerate(users):
        target = int(test[u].item_ids[0])
        request_ts = float(test[u].timestamps[0])
        cands, tpos = _candidates(num_items, history[u], target)
        for n in lengths:
            h = history[u] if n is None else history[u].slice(max(0, len(history[u]) - n))
            scores = model.rank_full(h, cands, request_ts, micro_batch=micro_batch).numpy()
            ranks[_length_key(n)].append(_rank_of_target(scores, tpos))
        if (i + 1) % 200 == 0 or i + 1 == len(users):
            el = time.perf_counter() - t0
            log(
                f"eval {i + 1}/{len(users)} users  elapsed {_fmt_secs(el)}  eta {_fmt_secs(el / (i + 1) * (len(users) - i - 1))}"
            )
    return {k: {**_metrics(np.asarray(v)), "users": len(v)} for k, v in ranks.items()}


def _length_key(n: int | None) -> str:
    return "all" if n is None else str(n)


def popularity_metrics(
    history: dict[str, Events], test: dict[str, Events], num_items: int
) -> dict[str, float]:
    """Most popular items first (counts over the training histories), same protocol."""
    counts = np.zeros(num_items + 1)
    for h in history.values():
        np.add.at(counts, h.item_ids.numpy(), 1)
    ranks = []
    for u in sorted(history):
        target = int(test[u].item_ids[0])
        cands, tpos = _candidates(num_items, history[u], target)
        ranks.append(_rank_of_target(counts[cands.numpy()], tpos))
    return {**_metrics(np.asarray(ranks)), "users": len(ranks)}


def add_source_arguments(parser: argparse.ArgumentParser) -> argparse._MutuallyExclusiveGroup:
    """Where the interactions come from; returns the group so that a caller can add a source."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--dataset", choices=DATASETS, help="a dataset bundled with recbole (the default: ml-100k)"
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
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=200, help="training window (events)")
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
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--cuts", type=int, default=16, help="cut points (ranking requests) per row")
    parser.add_argument("--negatives", type=int, default=31, help="sampled negatives per cut point")
    parser.add_argument(
        "--popular-share",
        type=float,
        default=0.5,
        help="share of negatives drawn by item popularity (the rest uniformly)",
    )
    parser.add_argument(
        "--aux-weight", type=float, default=1.0, help="weight of the auxiliary next-item loss (0: off)"
    )
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--eval-users", type=int, default=None, help="evaluate on the first N users only")
    parser.add_argument(
        "--eval-lengths",
        default="16,64,256,all",
        help="history lengths used at inference for the quality table (comma separated, 'all')",
    )


def columns_of(args: argparse.Namespace) -> Columns:
    action = None if str(args.action_col).lower() in ("none", "") else args.action_col
    return Columns(user=args.user_col, item=args.item_col, timestamp=args.time_col, action=action)


def load_log(args: argparse.Namespace) -> tuple[InteractionLog, str]:
    """The log named by ``--interactions`` or ``--dataset``, and how to name it in the metrics."""
    if args.interactions is None:
        name = args.dataset or "ml-100k"
        return movielens_log(name), name
    read = read_interactions(
        args.interactions,
        columns_of(args),
        fmt=args.format,
        strict=args.strict,
        progress=print_progress(f"read {args.interactions}"),
    )
    log = build_log(read.rows, bad=read.bad, bad_count=read.bad_count)
    return log, str(args.interactions)


def report_bad_rows(log: InteractionLog, total: int | None = None) -> None:
    if not log.bad_count:
        return
    of = f" of {total}" if total is not None else ""
    _log(f"skipped {log.bad_count}{of} bad rows; first ones:")
    for bad in log.bad:
        _log(f"  {bad}")


def _fmt_metric(row: dict, name: str) -> str:
    lo, hi = row[f"{name}_ci95"]
    return f"{name} {row[name]:.4f} [{lo:.4f}, {hi:.4f}]"


def run(args: argparse.Namespace, log: InteractionLog | None = None, source: str | None = None) -> int:
    t0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if log is None:
        log, source = load_log(args)
    report_bad_rows(log)
    history, test = split_leave_last_out(log)
    if not history:
        raise SystemExit(f"{source}: no user has two interactions; nothing to train on")
    head = args.dim // args.heads
    config = HSTUConfig(
        num_items=log.num_items,
        num_actions=max(5, log.num_actions),
        layers=args.layers,
        heads=args.heads,
        dim=args.dim,
        attn_dim=head,
        linear_dim=head,
        max_len=args.max_len,
        max_seq_len=args.max_seq_len,
        dropout=args.dropout,
        dtype=args.dtype,
        device=args.device,
    )
    model = HSTURanker(config)
    model.set_vocab(log.vocab)
    _log(
        f"{source}: {len(history)} users, {log.num_items} items, {log.num_events} events; "
        f"model {sum(p.numel() for p in model.parameters())} parameters"
    )
    t_train = time.perf_counter()
    losses = train_model(
        model,
        history,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        cuts=args.cuts,
        negatives=args.negatives,
        popular_share=args.popular_share,
        aux_weight=args.aux_weight,
        seed=args.seed,
        max_steps=args.max_steps,
    )
    train_secs = time.perf_counter() - t_train
    out = model.save(args.out)
    lengths = [None if x.strip() == "all" else int(x) for x in args.eval_lengths.split(",") if x.strip()]
    if None not in lengths:
        lengths.append(None)
    t_eval = time.perf_counter()
    by_len = evaluate(model, history, test, lengths=lengths, max_users=args.eval_users)
    eval_secs = time.perf_counter() - t_eval
    metrics = {
        "dataset": source,
        "items": log.num_items,
        "users": len(history),
        "events": log.num_events,
        "bad_rows": log.bad_count,
        "bad_row_examples": [str(b) for b in log.bad],
        "protocol": "leave-last-out; candidates: every item the user has not seen; ranked via rank_full; "
        "95 % confidence intervals: percentile bootstrap over users",
        "model_version": model.model_version,
        **by_len["all"],
        "by_history_length": [{"history": k, **v} for k, v in by_len.items()],
        "popularity_baseline": popularity_metrics(
            {u: history[u] for u in sorted(history)[: args.eval_users]}, test, log.num_items
        ),
        "train": {
            "epochs": len(losses),
            "loss_per_epoch": losses,
            "seconds": round(train_secs, 1),
            "cuts": args.cuts,
            "negatives": args.negatives,
            "popular_share": args.popular_share,
            "aux_weight": args.aux_weight,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
        },
        "eval_seconds": round(eval_secs, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    for row in metrics["by_history_length"]:
        _log(
            f"history {row['history']:>4}: "
            + "  ".join(_fmt_metric(row, m) for m in ("HR@10", "NDCG@10", "MRR"))
        )
    pop = metrics["popularity_baseline"]
    _log("popularity  : " + "  ".join(_fmt_metric(pop, m) for m in ("HR@10", "NDCG@10", "MRR")))
    print(
        json.dumps({k: metrics[k] for k in ("HR@10", "NDCG@10", "MRR", "model_version")} | {"out": str(out)})
    )
    return 0
