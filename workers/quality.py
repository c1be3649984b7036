"""Quality of a trained ranker: leave-last-out ranking metrics with bootstrap intervals.

Primitives:
- ``split_leave_last_out``: per user, the history without its last event and the last event.
- ``split_validation``: the same one step earlier: training histories without the last two
  events, the one before the test item as the validation target.
- ``evaluate``: leave-last-out. Each user's last event is the target; the candidates are every
  item the user has not seen; the history (all earlier events, or only the last N) is ranked
  through the serving API (``rank_full``). HR@10, NDCG@10, MRR, each with a 95 % bootstrap
  confidence interval over users.
- ``popularity_metrics``: the same protocol for a most-popular baseline.
- ``format_row``: one line of the quality table.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from relaygr.workers.interactions import InteractionLog
from relaygr.workers.model import HSTURanker
from relaygr.workers.movielens import MovieLens
from relaygr.workers.prefix_kv import Events

DEFAULT_LENGTHS: tuple[int | None, ...] = (16, 64, 256, None)  # None: the whole history
BOOTSTRAP_SAMPLES = 1000


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt_secs(s: float) -> str:
    s = max(0, round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def split_leave_last_out(log: InteractionLog | MovieLens) -> tuple[dict, dict]:
    """Per user: history without the last event (training and ranking input), and the last event."""
    train = {u: h.slice(0, len(h) - 1) for u, h in log.histories.items() if len(h) >= 2}
    test = {u: log.histories[u].slice(len(log.histories[u]) - 1) for u in train}
    return train, test


def split_validation(histories: dict[str, Events]) -> tuple[dict[str, Events], dict[str, Events]]:
    """From leave-last-out training histories: each history less its last event (what training
    sees) and that last event (the validation target: the one before the test item). Users with
    fewer than two events keep their history for training and are not validated."""
    train = {u: h.slice(0, len(h) - 1) if len(h) >= 3 else h for u, h in histories.items()}
    valid = {u: h.slice(len(h) - 1) for u, h in histories.items() if len(h) >= 3}
    return train, valid


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
                f"eval {i + 1}/{len(users)} users  elapsed {fmt_secs(el)}  eta {fmt_secs(el / (i + 1) * (len(users) - i - 1))}"
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


def format_row(row: dict) -> str:
    """``HR@10 x [lo, hi]  NDCG@10 ...  MRR ...`` of one row of the quality table."""

    def one(name: str) -> str:
        lo, hi = row[f"{name}_ci95"]
        return f"{name} {row[name]:.4f} [{lo:.4f}, {hi:.4f}]"

    return "  ".join(one(m) for m in ("HR@10", "NDCG@10", "MRR"))
