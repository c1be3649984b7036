"""Any interaction log as per-user behaviour sequences in model ids, with its item vocabulary.

Primitives:
- ``Columns``: which columns hold the user, the item, the timestamp and (optionally) the action.
  The defaults read MovieLens-style headers (``user_id``, ``item_id``, ``timestamp``, ``rating``).
- ``read_interactions(path, columns)``: a CSV, Parquet or JSON-lines file (by its suffix, or
  ``fmt``) read with pyarrow, as raw ``Interaction`` rows plus the ``BadRow``s it refused.
- ``build_log(rows)``: the rows as an ``InteractionLog``: the ``ItemVocab`` of their items, each
  user's ``Events`` in model ids (oldest first; ties by model item id, then input order), and
  the bad rows. The same events, from a file or from a topic, give the same log.
- ``InteractionLog``: what training and evaluation read (``histories``, ``num_items``, ``vocab``).

A bad row (a missing user, item or timestamp; a timestamp that is not a number; an action that is
not a number) is never silently dropped: it is counted, and the first few are kept with their row
number (1-based, header excluded) and reason. ``read_interactions(..., strict=True)`` raises on
the first one instead.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from relaygr.workers.model.vocab import ItemVocab, RawId
from relaygr.workers.prefix_kv import Events

FORMATS = ("csv", "parquet", "jsonl")
MAX_ACTION = 255  # the wire's action range
KEEP_BAD_EXAMPLES = 10


@dataclass(frozen=True)
class Columns:
    user: str = "user_id"
    item: str = "item_id"
    timestamp: str = "timestamp"
    action: str | None = "rating"
    """``None``: no action column (every event gets action 1)."""


@dataclass(frozen=True)
class Interaction:
    user: str
    item: RawId
    ts: float
    action: int


@dataclass(frozen=True)
class BadRow:
    row: int
    reason: str
    values: dict[str, object]

    def __str__(self) -> str:
        return f"row {self.row}: {self.reason} {self.values}"


@dataclass
class ReadResult:
    rows: list[Interaction]
    bad: list[BadRow] = field(default_factory=list)
    bad_count: int = 0
    total: int = 0


class MalformedLog(ValueError):
    """A log with a row that cannot be read (strict reading), or no readable row at all."""


@dataclass
class InteractionLog:
    """Users' histories in model ids, the vocabulary that maps them, and what was refused."""

    histories: dict[str, Events]
    vocab: ItemVocab
    num_actions: int
    bad_count: int = 0
    bad: list[BadRow] = field(default_factory=list)

    @property
    def num_items(self) -> int:
        return len(self.vocab)

    @property
    def num_events(self) -> int:
        return sum(len(h) for h in self.histories.values())


def _fmt_of(path: Path, fmt: str | None) -> str:
    if fmt:
        return fmt
    suffixes = [s.lower() for s in path.suffixes]
    if ".parquet" in suffixes or ".pq" in suffixes:
        return "parquet"
    if ".jsonl" in suffixes or ".json" in suffixes or ".ndjson" in suffixes:
        return "jsonl"
    if ".csv" in suffixes or ".tsv" in suffixes or ".inter" in suffixes:
        return "csv"
    raise MalformedLog(f"{path}: cannot tell the format from the name; pass --format ({', '.join(FORMATS)})")


def _read_table(path: Path, fmt: str, ragged: list[BadRow]):
    """The file as an Arrow table; CSV rows with the wrong number of fields go to ``ragged``."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.json as pjson
    import pyarrow.parquet as pq

    try:
        if fmt == "parquet":
            return pq.read_table(path)
        if fmt == "jsonl":
            return pjson.read_json(path)
        delimiter = "\t" if path.suffix.lower() in (".tsv", ".inter") else ","

        def skip_ragged(row) -> str:
            where = row.number - 1 if row.number is not None else 0  # a line number; the header is line 1
            ragged.append(
                BadRow(
                    where,
                    f"{row.actual_columns} fields, the header has {row.expected_columns}",
                    {"text": row.text},
                )
            )
            return "skip"

        table = pcsv.read_csv(
            path,
            parse_options=pcsv.ParseOptions(delimiter=delimiter, invalid_row_handler=skip_ragged),
            convert_options=pcsv.ConvertOptions(strings_can_be_null=True, auto_dict_encode=False),
            read_options=pcsv.ReadOptions(use_threads=False),  # ragged rows then know their line
        )
        # RecBole's atomic files annotate headers with types (``user_id:token``).
        return table.rename_columns([c.split(":")[0] for c in table.column_names])
    except (pa.ArrowInvalid, OSError) as exc:
        raise MalformedLog(f"{path}: not a readable {fmt} file: {exc}") from exc


def _number(value: object) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, datetime):  # a timestamp column; without a zone it is UTC
        return float((value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp())
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _item(value: object) -> RawId | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else str(value)
    text = str(value).strip()
    return text or None


def read_interactions(
    path: str | Path,
    columns: Columns = Columns(),
    *,
    fmt: str | None = None,
    strict: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ReadResult:
    """The rows of an interaction log, and the ones refused (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(path)
    ragged: list[BadRow] = []
    table = _read_table(path, _fmt_of(path, fmt), ragged)
    wanted = {"user": columns.user, "item": columns.item, "timestamp": columns.timestamp}
    missing = [f"{what} column {name!r}" for what, name in wanted.items() if name not in table.column_names]
    if columns.action and columns.action in table.column_names:
        wanted["action"] = columns.action
    elif columns.action and columns.action != Columns().action:  # only the default one is optional
        missing.append(f"action column {columns.action!r}")
    if missing:
        raise MalformedLog(f"{path}: no {', '.join(missing)}; columns are {table.column_names}")
    out = ReadResult(
        rows=[], bad=ragged[:KEEP_BAD_EXAMPLES], bad_count=len(ragged), total=table.num_rows + len(ragged)
    )
    cols = {k: table.column(v) for k, v in wanted.items()}
    done = 0
    # Data row numbers count the ragged rows the reader skipped, so each names its line - 1.
    skipped = sorted(b.row for b in ragged)
    shift = 0
    for batch_start in range(0, table.num_rows, 65536):
        n = min(65536, table.num_rows - batch_start)
        values = {k: c.slice(batch_start, n).to_pylist() for k, c in cols.items()}
        for i in range(n):
            row_no = batch_start + i + 1 + shift
            while shift < len(skipped) and skipped[shift] <= row_no:
                if strict:
                    raise MalformedLog(f"{path}: {ragged[shift]}")
                shift += 1
                row_no += 1
            user, item, ts_raw = values["user"][i], values["item"][i], values["timestamp"][i]
            act_raw = values["action"][i] if "action" in values else 1
            reason = None
            item_id = _item(item)
            ts = _number(ts_raw)
            action = _number(act_raw)
            if user is None or str(user).strip() == "":
                reason = f"missing {columns.user}"
            elif item_id is None:
                reason = f"missing {columns.item}"
            elif ts_raw is None:
                reason = f"missing {columns.timestamp}"
            elif ts is None or ts < 0:
                reason = f"timestamp {ts_raw!r} is not a number of seconds"
            elif action is None:
                reason = f"action {act_raw!r} is not a number"
            if reason is not None:
                bad = BadRow(row_no, reason, {wanted[k]: values[k][i] for k in values})
                if strict:
                    raise MalformedLog(f"{path}: {bad}")
                out.bad_count += 1
                if len(out.bad) < KEEP_BAD_EXAMPLES:
                    out.bad.append(bad)
                continue
            act = round(action)  # type: ignore[arg-type]
            out.rows.append(
                Interaction(str(user).strip(), item_id, float(ts), act if 0 <= act <= MAX_ACTION else 0)
            )  # type: ignore[arg-type]
        done += n
        if progress is not None:
            progress(done, table.num_rows)
    if strict and shift < len(ragged):  # after the last readable row
        raise MalformedLog(f"{path}: {ragged[shift]}")
    out.bad.sort(key=lambda b: b.row)
    if not out.rows:
        examples = "; ".join(str(b) for b in out.bad[:3])
        raise MalformedLog(
            f"{path}: no readable row ({out.bad_count} bad{': ' + examples if examples else ''})"
        )
    return out


def build_log(
    rows: Iterable[Interaction],
    *,
    bad: list[BadRow] | None = None,
    bad_count: int = 0,
    vocab: ItemVocab | None = None,
) -> InteractionLog:
    """Per-user histories in model ids (``vocab``, or the vocabulary of these rows' items)."""
    rows = list(rows)
    vocab = vocab or ItemVocab.build(r.item for r in rows)
    items, _ = vocab.to_model([r.item for r in rows])
    users = np.asarray([r.user for r in rows], dtype=object)
    ts = np.asarray([r.ts for r in rows], dtype=np.float64)
    actions = np.asarray([r.action for r in rows], dtype=np.int64)
    user_keys, user_idx = np.unique(users.astype(str), return_inverse=True)
    # Fixed order: user, timestamp, model item id, then input order (lexsort's last key is primary).
    order = np.lexsort((np.arange(len(rows)), items, ts, user_idx))
    user_idx, items, ts, actions = user_idx[order], items[order], ts[order], actions[order]
    bounds = np.flatnonzero(np.diff(user_idx)) + 1
    histories: dict[str, Events] = {}
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(rows)], strict=True):
        histories[str(user_keys[user_idx[lo]])] = Events(
            item_ids=torch.from_numpy(items[lo:hi].copy()),
            action_ids=torch.from_numpy(actions[lo:hi].copy()),
            timestamps=torch.from_numpy(ts[lo:hi].copy()),
        )
    num_actions = max(1, int(actions.max()) if len(actions) else 1)
    return InteractionLog(histories, vocab, num_actions, bad_count, list(bad or []))


def print_progress(what: str) -> Callable[[int, int], None]:
    """A progress callback writing ``what: done/total rows`` to stderr."""

    def show(done: int, total: int) -> None:
        print(f"{what}: {done}/{total} rows", file=sys.stderr, flush=True)

    return show
