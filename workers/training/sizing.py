"""Training defaults sized from the interaction log itself, each with the reason it was chosen.

Primitives:
- ``Choice``: one chosen value and the sentence that explains it.
- ``size_training(num_items, history_lengths)``: the defaults for a log with this catalogue and
  these per-user history lengths, as ``{name: Choice}``:
  - ``dim`` (embedding and model width) grows with the fourth root of the catalogue, a power of
    two in [32, 256]; ``heads`` keep 32 dimensions each;
  - ``negatives`` (sampled per target) grow with the square root of the catalogue, a power of
    two in [16, 256] and never more than the catalogue holds; ``cuts`` (scored targets per
    training row) shrink as negatives grow, so one row always scores about ``CANDIDATE_TOKENS``
    candidate tokens (the cost of a step stays put);
  - ``max_len`` (the training window) covers the 95th percentile of history lengths, rounded up
    to a multiple of 32, in [32, ``MAX_WINDOW``], and ``attn_normaliser`` equals it: a constant
    of the checkpoint, so a prefix cache stays exact, sized so that a full window's attention sum
    is of order one;
  - ``epochs`` is a cap; training stops earlier on the validation NDCG@10 (``patience``);
    ``decay_epochs``: the learning rate decays to its floor over the cap (or the ``--epochs``
    given); ``min_epochs``: the first epoch early stopping may keep.
  - ``aux_negatives``: the next-item loss is a softmax over the whole catalogue up to
    ``AUX_FULL_ITEMS`` items, beyond that over ``AUX_NEGATIVES`` draws a step.
- ``describe(choices)``: the lines ``relaygr train`` prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CANDIDATE_TOKENS = 512
"""Candidate tokens one training row scores (cuts x (negatives + 1)): a step's fixed cost."""
MAX_WINDOW = 1024
"""Longest training window: dense training attention is quadratic in it."""
AUX_FULL_ITEMS = 16384
"""Largest catalogue the next-item loss scores whole. The whole softmax learns better than a pool:
on Instacart (14,190 items) a pool of 2,048 uniform draws made a step 2.5-2.9 times faster, but
the whole-history HR@10 fell from 0.142 to 0.123. Beyond this size the logits of a long batch (32 rows x
736 events x items x 4 bytes: 1.5 GB at 16,384 items) outgrow a small machine."""
AUX_NEGATIVES = 2048
"""Negatives the next-item loss draws a step on a larger catalogue (half uniform, half by popularity)."""
MAX_EPOCHS = 30
PATIENCE = 3
MIN_EPOCHS = 16
"""First epoch early stopping may keep: before it, at a high learning rate, validation swings (on
ML-100K a peak at epoch 8 was kept once and scored HR@10 0.064 on the test targets)."""


@dataclass(frozen=True)
class Choice:
    value: int | float
    reason: str


def _pow2(x: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, 2 ** round(math.log2(max(x, 1.0))))))


def size_training(num_items: int, history_lengths: Sequence[int]) -> dict[str, Choice]:
    """Defaults for a log of ``num_items`` items whose users have these history lengths."""
    lengths = np.asarray(history_lengths, dtype=np.float64)
    if num_items < 1 or lengths.size == 0:
        raise ValueError("sizing needs at least one item and one history")
    dim = _pow2(8 * num_items**0.25, 32, 256)
    negatives = min(_pow2(2 * math.sqrt(num_items), 16, 256), max(1, num_items - 1))
    cuts = max(4, CANDIDATE_TOKENS // (negatives + 1))
    p95 = float(np.percentile(lengths, 95))
    window = int(min(MAX_WINDOW, max(32, 32 * math.ceil(p95 / 32))))
    return {
        "dim": Choice(dim, f"catalogue of {num_items} items: 8 x items^(1/4) = {8 * num_items**0.25:.0f}"),
        "heads": Choice(max(1, dim // 32), f"32 dimensions per head at width {dim}"),
        "negatives": Choice(
            negatives, f"catalogue of {num_items} items: 2 x sqrt(items) = {2 * math.sqrt(num_items):.0f}"
        ),
        "cuts": Choice(cuts, f"{CANDIDATE_TOKENS} candidate tokens per row / ({negatives} negatives + 1)"),
        "max_len": Choice(
            window,
            f"95th percentile of history lengths is {p95:.0f} (longest {int(lengths.max())}, "
            f"median {float(np.median(lengths)):.0f})",
        ),
        "attn_normaliser": Choice(
            float(window), "the training window: a full window's attention sum is O(1)"
        ),
        "aux_negatives": Choice(
            0 if num_items <= AUX_FULL_ITEMS else AUX_NEGATIVES,
            f"catalogue of {num_items} items: "
            + (
                f"at most {AUX_FULL_ITEMS}, the next-item loss scores all of them (0)"
                if num_items <= AUX_FULL_ITEMS
                else f"over {AUX_FULL_ITEMS}, the next-item loss scores {AUX_NEGATIVES} draws a step, half of them by popularity"
            ),
        ),
        "epochs": Choice(
            MAX_EPOCHS,
            f"a cap: once the learning rate has decayed, training stops when validation NDCG@10 "
            f"has not improved for {PATIENCE} epochs",
        ),
        "decay_epochs": Choice(
            MAX_EPOCHS,
            "the cap: the learning rate falls over the whole run (on ML-100K a decay over 16 "
            "epochs scored HR@10 0.105, over 30 0.126)",
        ),
        "min_epochs": Choice(
            MIN_EPOCHS,
            "validation picks among later epochs, not among the swings of the first ones",
        ),
    }


def describe(choices: dict[str, Choice], given: dict[str, object] | None = None) -> list[str]:
    """One line per choice; ``given`` values (set on the command line) replace the sized ones and
    say so instead of a reason."""
    given = given or {}
    return [
        f"  {name:<15} {given.get(name, c.value)!s:>6}  "
        f"({'set on the command line' if name in given else c.reason})"
        for name, c in choices.items()
    ]
