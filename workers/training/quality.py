"""Quality of a trained ranker: leave-last-out ranking metrics with bootstrap intervals.

Primitives:
- ``split_leave_last_out``: per user, the history without its last event and the last event
  (leave-last-out); with ``test_events`` K, the last K events are the test targets
  (leave-last-K-out: K ranking requests per user, each after all the events before it).
- ``split_validation``: the same one step earlier: training histories without the last two
  events, the one before the test item as the validation target.
- ``spread_users``: a sample of users evenly spread over their sorted ids (what ``--eval-users``
  and validation rank).
- ``rank_targets`` / ``summarise`` / ``evaluate``: each test target is ranked among every item
  the user has not seen, after the history (all earlier events, or only the last N), through the
  serving API (``rank_full``), or (``dense``, what ``relaygr train`` validates and evaluates
  with) the dense path it is tested against: the same scores, several times faster. HR@10, NDCG@10, MRR: per user the mean over its targets, then the
  mean over users with a 95 % bootstrap confidence interval over users.
- ``head_ranks``: a diagnostic, not what is served: the same targets ranked by the next-item
  head that training's auxiliary loss fits (the last history token's final state dotted with the
  item embedding table), one forward of the history per user and length. It shows how much the
  backbone knows that the candidate path (the served score) has not learned to use.
- ``paired_differences``: the whole history's metrics minus each truncation's, per user, with a
  paired bootstrap interval (the same resampled users for both).
- ``popularity_metrics``: the same protocol for a most-popular baseline.
- ``PROTOCOLS``: ``leave-last-out`` (candidates: every item the user has not seen) or ``hstu``
  (Meta's HSTU MovieLens evaluation: every catalogue item but those of the history read, whose
  published input is the last ``HSTU_INPUT`` events).
- ``save_ranks`` / ``load_ranks``: every test target's rank per history length, per user
  (``test_ranks.npz`` beside ``metrics.json``), so that runs can be compared user by user later.
- ``pooled``: several runs (seeds) that ranked the same users' targets: each metric per user
  averaged over the runs, per length, and the whole history minus each truncation, paired, with
  bootstrap intervals over users (the users are the sample; the runs are repeated measurements).
- ``format_row``: one line of the quality table.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from relaygr.workers.model.dense import dense_rank_full, train_scores
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training.interactions import InteractionLog
from relaygr.workers.training.movielens import MovieLens

DEFAULT_LENGTHS: tuple[int | None, ...] = (16, 64, 256, None)  # None: the whole history
BOOTSTRAP_SAMPLES = 1000


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fmt_secs(s: float) -> str:
    s = max(0, round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def spread_users(users: Sequence[str], most: int | None) -> list[str]:
    """At most ``most`` of ``users`` (all when ``None``), evenly spread over their sorted order:
    a sample of the log rather than the first ids (ids often follow sign-up order)."""
    ordered = sorted(users)
    if most is None or most >= len(ordered):
        return ordered
    return ordered[:: max(1, len(ordered) // max(1, most))][:most]


def split_leave_last_out(log: InteractionLog | MovieLens, test_events: int = 1) -> tuple[dict, dict]:
    """Per user: the history without its last ``test_events`` events (training and ranking input;
    at least one event stays), and those events (the test targets, oldest first)."""
    train, test = {}, {}
    for u, h in log.histories.items():
        if len(h) < 2:
            continue
        cut = len(h) - min(test_events, len(h) - 1)
        train[u], test[u] = h.slice(0, cut), h.slice(cut)
    return train, test


def split_validation(histories: dict[str, Events]) -> tuple[dict[str, Events], dict[str, Events]]:
    """From leave-last-out training histories: each history less its last event (what training
    sees) and that last event (the validation target: the one before the test item). Users with
    fewer than two events keep their history for training and are not validated."""
    train = {u: h.slice(0, len(h) - 1) if len(h) >= 3 else h for u, h in histories.items()}
    valid = {u: h.slice(len(h) - 1) for u, h in histories.items() if len(h) >= 3}
    return train, valid


def _per_user(ranks: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Each metric per user: the mean over that user's test targets (one under leave-last-out)."""
    out: dict[str, list[float]] = {"HR@10": [], "NDCG@10": [], "MRR": []}
    for r in ranks:
        hit = r <= 10
        out["HR@10"].append(float(hit.mean()))
        out["NDCG@10"].append(float(np.where(hit, 1.0 / np.log2(r + 1.0), 0.0).mean()))
        out["MRR"].append(float((1.0 / r).mean()))
    return {k: np.asarray(v) for k, v in out.items()}


def _resample(users: int, seed: int = 0) -> np.ndarray:
    """The bootstrap's user indices: one resampling shared by every metric and history length, so
    differences between lengths are paired."""
    return np.random.default_rng(seed).integers(0, users, size=(BOOTSTRAP_SAMPLES, users))


def _with_ci(values: dict[str, np.ndarray], resample: np.ndarray) -> dict[str, float | list[float]]:
    out: dict[str, float | list[float]] = {}
    for name, v in values.items():
        means = v[resample].mean(axis=1)
        out[name] = float(v.mean())
        out[f"{name}_ci95"] = [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]
    return out


def _metrics(ranks: Sequence[np.ndarray]) -> dict[str, float | list[float]]:
    """Means over users, each with a 95 % confidence interval (percentile bootstrap over users)."""
    return _with_ci(_per_user(ranks), _resample(len(ranks)))


def paired_differences(ranks: dict[str, list[np.ndarray]], reference: str = "all") -> dict[str, dict]:
    """For every other history length: the ``reference`` length's metrics minus that length's, per
    user, with a paired bootstrap 95 % interval (the same users resampled for both). An interval
    above zero says the reference is better beyond the users' sampling noise."""
    base = _per_user(ranks[reference])
    resample = _resample(len(ranks[reference]))
    return {
        key: _with_ci({m: base[m] - v for m, v in _per_user(r).items()}, resample)
        for key, r in ranks.items()
        if key != reference
    }


def _rank_of_target(scores: np.ndarray, target_pos: int) -> float:
    """1-based rank of the target; ties with other candidates count half (random tie-break)."""
    s = scores[target_pos]
    greater = int((scores > s).sum())
    ties = int((scores == s).sum()) - 1
    return 1.0 + greater + ties // 2


PROTOCOLS = ("leave-last-out", "hstu")
"""How a test target is ranked. ``leave-last-out``: against every catalogue item the user has
not seen in the whole history, whatever history the model reads. ``hstu``: as Meta's HSTU
publishes its MovieLens figures (generative-recommenders' evaluation): against every catalogue
item except those of the history the model reads (the truncated input: an item seen before it
stays a candidate), with ``HSTU_INPUT`` events as the input of its published figures."""
DENSE_EVENTS = 4096
"""Longest history ranked through the dense path (its pair tensors grow with the square
of the length)."""
HSTU_INPUT = 200
"""Meta's HSTU MovieLens input: the last 200 events before the target (``max_sequence_length``)."""


def _candidates(num_items: int, history: Events, target: int) -> tuple[torch.Tensor, int]:
    keep = np.ones(num_items + 1, dtype=bool)
    keep[0] = False
    keep[history.item_ids.numpy()] = False
    keep[target] = True
    cands = np.flatnonzero(keep)
    return torch.from_numpy(cands), int(np.searchsorted(cands, target))


def _requests(history: Events, test: Events):
    """Each test target with what precedes it: the history, then the earlier test targets (as
    serving would see them: a history keeps growing), and the request time."""
    for j in range(len(test)):
        yield history.concat(test.slice(0, j)), int(test.item_ids[j]), float(test.timestamps[j])


def _requests_read(
    history: Events, test: Events, lengths: Sequence[int | None], protocol: str, num_items: int
):
    """Each test target's request time and, per history length (``None``: all), the history read
    and its candidates under ``protocol`` with the target's position among them."""
    for seen, target, request_ts in _requests(history, test):
        every = _candidates(num_items, seen, target)
        reads = []
        for n in lengths:
            h = seen if n is None else seen.slice(max(0, len(seen) - n))
            hstu_read = protocol == "hstu" and len(h) < len(seen)
            reads.append((n, h, *(_candidates(num_items, h, target) if hstu_read else every)))
        yield request_ts, reads


def rank_targets(
    model: HSTURanker | ModelRunner,
    history: dict[str, Events],
    test: dict[str, Events],
    *,
    lengths: Sequence[int | None] = DEFAULT_LENGTHS,
    max_users: int | None = None,
    micro_batch: int = 1024,
    protocol: str = "leave-last-out",
    dense: bool = False,
    log: Callable[[str], None] = _log,
) -> dict[str, list[np.ndarray]]:
    """Per history length (``None``: all events), per user, the rank of each test target among
    every item the user has not seen (``protocol`` "hstu": has not seen in the history read at
    that length), via ``rank_full`` (of ``model``'s runner); with ``dense``, via the dense path
    training differentiates (``dense_rank_full``: the same scores to float rounding, several times
    faster on a CPU), for histories of at most ``DENSE_EVENTS`` events."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; one of {', '.join(PROTOCOLS)}")
    users = spread_users(list(history), max_users)
    ranks: dict[str, list[np.ndarray]] = {_length_key(n): [] for n in lengths}
    t0 = time.perf_counter()
    num_items = model.config.num_items
    runner = ModelRunner(model) if isinstance(model, HSTURanker) else model  # served as the workers do
    module = model if isinstance(model, HSTURanker) else getattr(model, "model", None)  # the dense path's
    for i, u in enumerate(users):
        got: dict[str, list[float]] = {k: [] for k in ranks}
        for request_ts, reads in _requests_read(history[u], test[u], lengths, protocol, num_items):
            for n, h, cands, tpos in reads:
                if dense and module is not None and len(h) <= DENSE_EVENTS:
                    scores = dense_rank_full(module, h, cands, request_ts).numpy()
                else:
                    scores = runner.rank_full(h, cands, request_ts, micro_batch=micro_batch).numpy()
                got[_length_key(n)].append(_rank_of_target(scores, tpos))
        for k, v in got.items():
            ranks[k].append(np.asarray(v))
        if (i + 1) % 200 == 0 or i + 1 == len(users):
            el = time.perf_counter() - t0
            log(
                f"eval {i + 1}/{len(users)} users  elapsed {fmt_secs(el)}  eta {fmt_secs(el / (i + 1) * (len(users) - i - 1))}"
            )
    return ranks


@torch.no_grad()
def head_ranks(
    model: HSTURanker,
    history: dict[str, Events],
    test: dict[str, Events],
    *,
    lengths: Sequence[int | None] = (None,),
    max_users: int | None = None,
    protocol: str = "leave-last-out",
) -> dict[str, list[np.ndarray]]:
    """``rank_targets``' ranks (same users, targets, candidates and protocol) by the next-item
    head instead of the candidate path: a diagnostic of what the backbone knows, never a served
    score. A history longer than ``DENSE_EVENTS`` is read as its last ``DENSE_EVENTS`` events."""
    users = spread_users(list(history), max_users)
    ranks: dict[str, list[np.ndarray]] = {_length_key(n): [] for n in lengths}
    num_items = model.config.num_items
    was_training = model.training
    model.eval()
    table = model.item_emb.weight.float()
    try:
        for u in users:
            got: dict[str, list[float]] = {k: [] for k in ranks}
            for request_ts, reads in _requests_read(history[u], test[u], lengths, protocol, num_items):
                for n, h, cands, tpos in reads:
                    h = h.slice(max(0, len(h) - DENSE_EVENTS))
                    k = len(h)
                    _, states = train_scores(
                        model,
                        h.item_ids[None],
                        h.action_ids[None],
                        h.timestamps[None],
                        torch.tensor([k]),
                        torch.tensor([[k]]),
                        torch.tensor([[request_ts]], dtype=torch.float64),
                        torch.zeros(1, 1, 1, dtype=torch.int64),  # a dummy candidate: the history's states
                        history_states=True,
                    )
                    scores = (table @ states[0, k - 1].float()).cpu().numpy()
                    got[_length_key(n)].append(_rank_of_target(scores[cands.numpy()], tpos))
            for k, v in got.items():
                ranks[k].append(np.asarray(v))
    finally:
        model.train(was_training)
    return ranks


def summarise(ranks: dict[str, list[np.ndarray]]) -> dict[str, dict[str, float]]:
    """The quality table of ``rank_targets``' ranks: metrics with intervals per history length."""
    return {
        k: {**_metrics(v), "users": len(v), "targets": int(sum(len(r) for r in v))} for k, v in ranks.items()
    }


def evaluate(
    model: HSTURanker,
    history: dict[str, Events],
    test: dict[str, Events],
    **kwargs,
) -> dict[str, dict[str, float]]:
    """Metrics per history length (``None``: all events): ``summarise(rank_targets(...))``."""
    return summarise(rank_targets(model, history, test, **kwargs))


def _length_key(n: int | None) -> str:
    return "all" if n is None else str(n)


def popularity_metrics(
    history: dict[str, Events], test: dict[str, Events], num_items: int, window: int | None = None
) -> dict[str, float]:
    """Most popular items first (counts over the training histories), same protocol; ``window``:
    the items of only the last ``window`` events are excluded (``hstu``)."""
    counts = np.zeros(num_items + 1)
    for h in history.values():
        np.add.at(counts, h.item_ids.numpy(), 1)
    ranks = []
    for u in sorted(history):
        got = []
        for seen, target, _ in _requests(history[u], test[u]):
            read = seen if window is None else seen.slice(max(0, len(seen) - window))
            cands, tpos = _candidates(num_items, read, target)
            got.append(_rank_of_target(counts[cands.numpy()], tpos))
        ranks.append(np.asarray(got))
    return {**_metrics(ranks), "users": len(ranks), "targets": int(sum(len(r) for r in ranks))}


RANKS_FILE = "test_ranks.npz"


def save_ranks(path, users: Sequence[str], ranks: dict[str, list[np.ndarray]]) -> None:
    """``rank_targets``' ranks of ``users`` (in its order) to ``path`` (an ``.npz``): the users, the
    number of targets of each, and per history length every rank, users one after another."""
    per_length = list(ranks.values())
    if any(len(v) != len(users) for v in per_length):
        raise ValueError(f"ranks of {[len(v) for v in per_length]} users for {len(users)} users")
    counts = np.asarray([len(r) for r in per_length[0]] if per_length else [], dtype=np.int64)
    arrays = {f"ranks_{k}": np.concatenate(v) if v else np.zeros(0) for k, v in ranks.items()}
    np.savez_compressed(path, users=np.asarray(list(users), dtype=str), targets=counts, **arrays)


def load_ranks(path) -> tuple[list[str], dict[str, list[np.ndarray]]]:
    """What ``save_ranks`` wrote: the users and, per history length, each user's ranks."""
    with np.load(path) as z:
        users = [str(u) for u in z["users"]]
        bounds = np.cumsum(z["targets"])[:-1]
        ranks = {n[len("ranks_") :]: np.split(z[n], bounds) for n in z.files if n.startswith("ranks_")}
    return users, ranks


def pooled(runs: Sequence[dict[str, list[np.ndarray]]], reference: str = "all") -> dict[str, dict]:
    """Runs that ranked the same users' test targets (same users, same order; seeds of one log):
    per history length, each metric per user averaged over the runs, with its mean and interval
    (``by_history_length``); and ``reference`` minus each other length, per user, paired
    (``all_minus_truncation``). Users are resampled, the runs never: they are one model's repeated
    measurements, and a user's mean over them is that user's value."""
    if not runs:
        raise ValueError("no runs to pool")
    lengths = [k for k in runs[0] if all(k in r for r in runs)]
    if reference not in lengths:
        raise ValueError(f"every run needs the {reference!r} history length")
    users = {len(r[reference]) for r in runs}
    if len(users) != 1:
        raise ValueError(f"the runs ranked different numbers of users: {sorted(users)}")
    per_user = {k: [_per_user(r[k]) for r in runs] for k in lengths}
    mean = {k: {m: np.mean([u[m] for u in v], axis=0) for m in v[0]} for k, v in per_user.items()}
    resample = _resample(users.pop())
    ref = mean[reference]
    return {
        "by_history_length": {k: _with_ci(v, resample) for k, v in mean.items()},
        "all_minus_truncation": {
            k: _with_ci({m: ref[m] - v[m] for m in ref}, resample) for k, v in mean.items() if k != reference
        },
    }


def format_row(row: dict) -> str:
    """``HR@10 x [lo, hi]  NDCG@10 ...  MRR ...`` of one row of the quality table."""

    def one(name: str) -> str:
        lo, hi = row[f"{name}_ci95"]
        return f"{name} {row[name]:.4f} [{lo:.4f}, {hi:.4f}]"

    return "  ".join(one(m) for m in ("HR@10", "NDCG@10", "MRR"))
