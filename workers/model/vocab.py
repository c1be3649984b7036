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
- ``canonical(raw)``: an id as vocabularies compare it: an integer, or a string that is the plain
  decimal form of one (``"17"``, not ``"017"``), is that integer; any other string is itself.
- ``item_key(raw)`` / ``item_keys(raws)``: a raw id as one int64, for state that stores ids in
  fixed-width integer columns (the ranking worker's history, tensors of a history): an integer is
  its own key; any other string is a 64-bit BLAKE2b hash with the top bit set, i.e. a negative
  key, which no integer id has. ``to_model`` and ``to_model_tensor`` take keys as well as raw ids.
  A vocabulary refuses two of its own ids with one key; an unknown string whose hash equals a
  catalogue item's key (odds about ``len(vocab) / 2**63`` per id) would read as that item.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where tensors are used: the stages before ranking never do
    import torch

VOCAB_FILE = "vocab.json"
OOV = 0

RawId = int | str


# Decimal strings up to this many digits fit an int64 key (19 digits might not).
_MAX_DIGITS = 18


def canonical(raw: RawId) -> RawId:
    """``raw`` as a vocabulary compares it: integers, and strings that are the plain decimal form
    of a non-negative integer, are that integer; other strings stay themselves."""
    if isinstance(raw, bool):
        raise TypeError("an item id is an integer or a string, not a bool")
    if isinstance(raw, int | np.integer):
        return int(raw)
    text = str(raw)
    if text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS and (text == "0" or text[0] != "0"):
        return int(text)
    return text


def _string_key(text: str) -> int:
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return (h | (1 << 63)) - (1 << 64)  # top bit set: negative as int64, never an integer's key


def item_key(raw: RawId) -> int:
    """The int64 that stands for ``raw`` in integer columns (an integer stands for itself)."""
    c = canonical(raw)
    return c if isinstance(c, int) else _string_key(c)


def item_keys(raws: Sequence[RawId]) -> np.ndarray:
    """``item_key`` of each id, as an int64 array (a list of integers converts at once)."""
    try:
        if all(type(r) is int for r in raws):
            return np.asarray(raws, dtype=np.int64).reshape(-1)
    except OverflowError:
        pass
    return np.fromiter((item_key(r) for r in raws), dtype=np.int64, count=len(raws))


class ItemVocab:
    """Raw item ids <-> model ids ``1..size``; anything else is ``OOV``."""

    def __init__(self, raw_ids: Sequence[RawId], *, identity: bool = False) -> None:
        self.identity = identity
        self.is_int = identity or all(isinstance(r, int) and not isinstance(r, bool) for r in raw_ids)
        self._strs: list[str] = []
        if identity:
            self._size = len(raw_ids)
            self._ints = np.arange(1, self._size + 1, dtype=np.int64)
        elif self.is_int:
            self._ints = np.asarray(sorted(set(int(r) for r in raw_ids)), dtype=np.int64)
            self._size = len(self._ints)
        else:
            self._strs = sorted(set(str(r) for r in raw_ids))
            self._size = len(self._strs)
            self._ints = np.empty(0, dtype=np.int64)
        if len(raw_ids) != self._size:
            raise ValueError("vocabulary ids must be unique")
        # Lookup by key: sorted keys and the model id of each. An integer vocabulary's raw ids are
        # already its sorted keys, model ids 1..size in order.
        if self.is_int:
            self._keys, self._key_ids = self._ints, None
        else:
            keys = item_keys(self._strs)
            order = np.argsort(keys, kind="stable")
            self._keys, self._key_ids = keys[order], (order + 1).astype(np.int64)
            if len(np.unique(self._keys)) != self._size:
                raise ValueError("two item ids of the vocabulary have the same key (e.g. '17' and 17)")

    # ------------------------------------------------------------------------ construction
    @classmethod
    def identity_of(cls, num_items: int) -> ItemVocab:
        """Raw id ``i`` is model id ``i`` for ``i`` in ``1..num_items`` (checkpoints without a vocabulary)."""
        return cls(range(1, num_items + 1), identity=True)  # type: ignore[arg-type]

    @classmethod
    def build(cls, raw_ids: Iterable[RawId]) -> ItemVocab:
        """The vocabulary of these ids (duplicates allowed): integers if every id is one or is the
        plain decimal form of one (``canonical``); strings otherwise, named as given."""
        unique = {canonical(r) for r in raw_ids}
        if all(isinstance(c, int) for c in unique):
            return cls(sorted(unique))  # type: ignore[arg-type]
        return cls(sorted({str(c) for c in unique}))

    def __len__(self) -> int:
        return self._size

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ItemVocab) and self.raw_ids() == other.raw_ids()

    def raw_ids(self) -> list[RawId]:
        """Raw ids in model id order (model id ``i`` is ``raw_ids()[i - 1]``)."""
        return [int(i) for i in self._ints] if self.is_int else list(self._strs)

    # ----------------------------------------------------------------------------- mapping
    def to_model(self, raw: Sequence[RawId] | np.ndarray | torch.Tensor) -> tuple[np.ndarray, int]:
        """Model ids of ``raw`` (``OOV`` for ids not in the vocabulary) and how many were unknown.
        ``raw`` holds raw ids, or keys (``item_key``) in an integer array or tensor."""
        torch = sys.modules.get("torch")  # a tensor exists only where torch is imported
        if torch is not None and isinstance(raw, torch.Tensor):
            keys = raw.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
        elif isinstance(raw, np.ndarray) and raw.dtype.kind in "iu":
            keys = raw.astype(np.int64, copy=False).reshape(-1)
        else:
            keys = item_keys(list(raw))
        if len(self._keys) == 0:
            out = np.zeros(len(keys), dtype=np.int64)
        else:
            pos = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
            found = self._keys[pos] == keys
            ids = pos + 1 if self._key_ids is None else self._key_ids[pos]
            out = np.where(found, ids, OOV).astype(np.int64)
        return out, int((out == OOV).sum())

    def to_model_tensor(self, keys: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``to_model`` for a tensor of keys (``item_key``); the identity vocabulary is a no-op."""
        import torch

        if self.identity:
            if keys.device.type == "cpu":  # numpy: a few microseconds, not a torch dispatch per op
                a = keys.numpy()
                known_np = (a >= 1) & (a <= self._size)
                return torch.from_numpy(np.where(known_np, a, 0)), int(a.size - np.count_nonzero(known_np))
            known = (keys >= 1) & (keys <= self._size)
            return torch.where(known, keys, 0), int((~known).sum())
        ids, unknown = self.to_model(keys)
        return torch.from_numpy(ids).to(keys.device), unknown

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
