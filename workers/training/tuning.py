"""``relaygr train --tune N``: a bounded search of N configurations on the validation split.

Primitives:
- ``candidates(base, n, seed)``: the sized defaults first, then N - 1 distinct configurations
  drawn without replacement from a small grid around them (width, dropout, learning rate,
  negatives and their in-batch share, the window, cut points drawn toward long contexts, far
  keys on or off): a fixed, bounded set for a given seed.
- ``tune(base, n, train, args)``: trains each (early stopping on validation NDCG@10) under a
  progress bar, keeps the model with the best validation NDCG@10, and writes ``tune.csv`` and
  ``tune.md`` (one row per configuration, the kept one marked) into ``args.out``.

Only the validation split picks the winner; the test targets are never seen by the search.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

GRID: dict[str, Callable[[Any], list]] = {
    "dim": lambda s: sorted({max(16, s.dim // 2), s.dim, min(512, s.dim * 2)}),
    "dropout": lambda s: [0.1, 0.2, 0.3],
    "lr": lambda s: [1e-3, 3e-3, 6e-3],
    "negatives": lambda s: sorted({max(8, s.negatives // 2), s.negatives, s.negatives * 2}),
    "in_batch_share": lambda s: [0.0, 0.5],
    "max_len": lambda s: sorted({max(32, s.max_len // 2), s.max_len}),
    "long_cuts": lambda s: sorted({0.0, 1.0, s.long_cuts}),
    # Far keys on (the default) and off: whether old events as one summary help this log.
    "near_keys": lambda s: sorted({0, s.near_keys}),
}
"""Values tried for each setting, as functions of the sized defaults."""
COLUMNS = ("rank", "kept", *GRID, "epochs_run", "best_epoch", "valid_ndcg10", "seconds")


def _with(base, changes: dict[str, Any]):
    """``base`` with ``changes``; heads follow the width, the normaliser follows the window, and
    the cut points keep a row's candidate tokens where the sizing put them."""
    s = dataclasses.replace(base, **changes)
    tokens = base.cuts * (base.negatives + 1)
    return dataclasses.replace(
        s,
        heads=max(1, s.dim // 32) if s.dim % 32 == 0 else 1,
        attn_normaliser=float(s.max_len),
        cuts=max(4, tokens // (s.negatives + 1)),
    )


def candidates(base, n: int, seed: int = 0) -> list:
    """``base`` and ``n - 1`` other grid points, distinct, in a seeded random order."""
    grid = [
        dict(zip(GRID, values, strict=True))
        for values in itertools.product(*(f(base) for f in GRID.values()))
    ]
    random.Random(seed).shuffle(grid)
    out, seen = [base], {tuple(getattr(base, k) for k in GRID)}
    for point in grid:
        if len(out) >= n:
            break
        key = tuple(point[k] for k in GRID)
        if key not in seen:
            seen.add(key)
            out.append(_with(base, point))
    return out


def _write_tables(out: Path, rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "tune.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    (out / "tune.md").write_text(
        "Configurations tried by `relaygr train --tune`, best validation NDCG@10 first "
        "(validation target: each user's event before the test event).\n\n" + "\n".join(lines) + "\n"
    )


def tune(base, n: int, train: Callable, args) -> tuple[Any, Any]:
    """Train ``n`` configurations with ``train(settings, log)``; the best trained run and its settings."""
    configs = candidates(base, max(1, n), args.seed)
    results: list[tuple[Any, Any]] = []
    console = Console(stderr=True)
    columns = (
        TextColumn("tune"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("", total=len(configs))
        for s in configs:
            trained = train(s, lambda _msg: None)
            results.append((s, trained))
            best = max(t.stopping.best for _, t in results)
            bar.update(task, advance=1, description=f"best valid NDCG@10 {best:.4f}")
    order = sorted(range(len(results)), key=lambda i: -results[i][1].stopping.best)
    rows = []
    for rank, i in enumerate(order, 1):
        s, t = results[i]
        rows.append(
            {
                "rank": rank,
                "kept": "yes" if rank == 1 else "",
                **{k: getattr(s, k) for k in GRID},
                "epochs_run": len(t.losses),
                "best_epoch": t.stopping.best_epoch + 1,
                "valid_ndcg10": round(t.stopping.best, 5),
                "seconds": round(t.seconds, 1),
            }
        )
    _write_tables(Path(args.out), rows)
    best_settings, best = results[order[0]]
    console.print(f"kept configuration 1 of {len(results)} (tune.md in {args.out}): {rows[0]}")
    return best, best_settings
