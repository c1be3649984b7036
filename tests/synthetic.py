"""Small synthetic inputs several test modules share: a tiny ranker, a random history, and an
interaction log written as CSV or Parquet."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from relaygr.workers.model.model import HSTUConfig, HSTURanker
from relaygr.workers.prefix_kv import Events


def tiny_model(seed: int) -> HSTURanker:
    torch.manual_seed(seed)
    m = HSTURanker(HSTUConfig(layers=2, heads=2, dim=32, attn_dim=16, linear_dim=16, num_items=500))
    m.refresh_version()
    return m


def history(n: int, seed: int = 0) -> Events:
    g = torch.Generator().manual_seed(seed)
    return Events(
        torch.randint(1, 500, (n,), generator=g),
        torch.randint(1, 6, (n,), generator=g),
        torch.cumsum(torch.rand(n, generator=g, dtype=torch.float64) * 3600, 0) + 1e9,
    )


def write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
