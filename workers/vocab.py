"""The item vocabulary of a checkpoint: raw item ids (integers or strings) <-> model ids.

Primitives:
- ``OOV``: model id 0, the out-of-vocabulary token (its embedding row is also padding). Every raw
  id the vocabulary does not hold maps to it; the callers count how many did.
- ``ItemVocab``: the catalogue a model was trained on. Model ids ``1..len(vocab)`` are the raw ids
  in sorted order (numbers numerically, strings lexically), so an integer vocabulary maps with one
  ``searchsorted``. ``ItemVocab.identity(n)`` is the mapping of checkpoints written before
  vocabularies existed: raw id ``i`` in ``1..n`` is model id ``i``.
- ``ItemVocab.build(raw_ids)``: the vocabulary of a log's items; ids that all read as integers
  make an integer vocabulary.
- ``to_model(raw) -> (model_ids, unknown)`` and ``to_raw(model_ids)``: the two directions;
  ``unknown`` is how many raw ids fell on ``OOV``.
- ``save(directory)`` / ``ItemVocab.load(directory)``: ``vocab.json`` next to the weights; a
  checkpoint without one loads as the identity of its ``num_items``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

VOCAB_FILE = "vocab.json"
OOV = 0

RawId = int | str


def _as_int(value: RawId) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class ItemVocab:
    """Raw item ids <-> model ids ``1..size``; anything else is ``OOV``."""

    def __init__(self, raw_ids: Sequence[RawId], *, identity: bool = False) -> None:
        self.identity = identity
        self.is_int = identity or all(isinstance(r, int) and not isinstance(r, bool) for r in raw_ids)
        if identity:
            self._size = len(raw_ids)
            self._ints = np.arange(1, self._size + 1, dtype=np.int64)
            self._strs: list[str] = []
            self._index: dict[str, int] = {}
            return
        if self.is_int:
            self._ints = np.asarray(sorted(set(int(r) for r in raw_ids)), dtype=np.int64)
            self._size = len(self._ints)
            self._strs, self._index = [], {}
        else:
            self._strs = sorted(set(str(r) for r in raw_ids))
            self._index = {s: i + 1 for i, s in enumerate(self._strs)}
            self._size = len(self._strs)
            self._ints = np.empty(0, dtype=np.int64)
        if len(raw_ids) != self._size:
            raise ValueError("vocabulary ids must be unique")

    # ------------------------------------------------------------------------ construction
    @classmethod
    def identity_of(cls, num_items: int) -> ItemVocab:
        """Raw id ``i`` is model id ``i`` for ``i`` in ``1..num_items`` (checkpoints without a vocabulary)."""
        return cls(range(1, num_items + 1), identity=True)  # type: ignore[arg-type]

    @classmethod
    def build(cls, raw_ids: Iterable[RawId]) -> ItemVocab:
        """The vocabulary of these ids (duplicates allowed): integers if every id reads as one."""
        unique = set(raw_ids)
        ints = [_as_int(r) for r in unique]
        if all(i is not None for i in ints):
            return cls(sorted(set(ints)))  # type: ignore[arg-type]
        return cls(sorted(set(str(r) for r in unique)))

    def __len__(self) -> int:
        return self._size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ItemVocab) and self.raw_ids() == other.raw_ids()

    def raw_ids(self) -> list[RawId]:
        """Raw ids in model id order (model id ``i`` is ``raw_ids()[i - 1]``)."""
        return [int(i) for i in self._ints] if self.is_int else list(self._strs)

    # ----------------------------------------------------------------------------- mapping
    def to_model(self, raw: Sequence[RawId] | np.ndarray | torch.Tensor) -> tuple[np.ndarray, int]:
        """Model ids of ``raw`` (``OOV`` for ids not in the vocabulary) and how many were unknown."""
        if self.is_int:
            if isinstance(raw, torch.Tensor):
                arr = raw.detach().cpu().numpy().astype(np.int64, copy=False)
            elif isinstance(raw, np.ndarray) and raw.dtype.kind in "iu":
                arr = raw.astype(np.int64, copy=False)
            else:  # a string that is no integer cannot be in an integer vocabulary
                arr = np.asarray([-1 if (i := _as_int(r)) is None else i for r in raw], dtype=np.int64)
            if len(self._ints) == 0:
                out = np.zeros(len(arr), dtype=np.int64)
            else:
                pos = np.searchsorted(self._ints, arr)
                found = self._ints[np.minimum(pos, len(self._ints) - 1)] == arr
                out = np.where(found, pos + 1, OOV).astype(np.int64)
        else:
            values = raw.tolist() if isinstance(raw, torch.Tensor | np.ndarray) else raw
            out = np.asarray([self._index.get(str(r), OOV) for r in values], dtype=np.int64)
        return out, int((out == OOV).sum())

    def to_model_tensor(self, raw: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``to_model`` for a tensor of integer raw ids; the identity vocabulary is a no-op."""
        if self.identity:
            known = (raw >= 1) & (raw <= self._size)
            return torch.where(known, raw, 0), int((~known).sum())
        ids, unknown = self.to_model(raw)
        return torch.from_numpy(ids).to(raw.device), unknown

    def to_raw(self, model_ids: Sequence[int] | np.ndarray) -> list[RawId]:
        """Raw ids of model ids ``1..size`` (``OOV`` has no raw id: ``ValueError``)."""
        ids = np.asarray(model_ids, dtype=np.int64)
        if ids.size and (ids.min() < 1 or ids.max() > self._size):
            raise ValueError("model id outside the vocabulary")
        if self.is_int:
            return [int(x) for x in self._ints[ids - 1]]
        return [self._strs[i - 1] for i in ids.tolist()]

    # --------------------------------------------------------------------------- storage
    def save(self, directory: str | Path) -> Path | None:
        """Write ``vocab.json`` (nothing for the identity: the checkpoint's ``num_items`` says it)."""
        if self.identity:
            return None
        path = Path(directory) / VOCAB_FILE
        kind = "int" if self.is_int else "str"
        path.write_text(json.dumps({"kind": kind, "items": self.raw_ids()}) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path, num_items: int) -> ItemVocab:
        """The vocabulary saved with a checkpoint; the identity of ``num_items`` if there is none."""
        path = Path(directory) / VOCAB_FILE
        if not path.exists():
            return cls.identity_of(num_items)
        data = json.loads(path.read_text())
        items = data["items"]
        vocab = cls([int(i) for i in items] if data.get("kind") == "int" else [str(i) for i in items])
        if len(vocab) != num_items:
            raise ValueError(f"{path}: {len(vocab)} items, the model has {num_items}")
        return vocab
