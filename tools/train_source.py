"""``relaygr train``: the trainer's command line, with the cascade's own ``behaviors`` topic as a source.

Primitives:
- ``behaviour_rows(events)``: ``BehaviorEvent``s as the trainer's ``Interaction`` rows.
- ``read_behaviours(settings, start)``: the public ``behaviors`` topic from ``start`` (the
  beginning, or a time) up to its end when reading starts, as rows, with the records that did not
  decode counted as bad rows.
- ``add_arguments`` / ``run``: ``relaygr.workers.training.train``'s flags plus ``--preset`` (a named model
  shape, ``workers.model.presets``; explicit ``--layers`` / ``--heads`` / ``--dim`` / ``--max-seq-len``
  win), ``--from-topic`` and ``--from-timestamp``; without ``--from-topic`` it is
  ``relaygr.workers.training.train.run`` on the resolved shape.

The trainer itself (``relaygr.workers.training.train``) never imports Kafka: it takes the events read here.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterable

from relaygr.infra.settings import Settings, get_settings
from relaygr.infra.topic_reader import Start, read_topic
from relaygr.schemas import BehaviorEvent, TopicRegistry
from relaygr.workers.model.presets import PRESETS, SHAPE_FIELDS, resolve_shape
from relaygr.workers.training import train
from relaygr.workers.training.interactions import BadRow, Interaction, InteractionLog, build_log


def behaviour_rows(events: Iterable[BehaviorEvent]) -> list[Interaction]:
    return [Interaction(e.user_id, e.item_id, float(e.ts), e.action) for e in events]


async def read_behaviours(settings: Settings, start: Start | None = None) -> tuple[InteractionLog, str]:
    topic = TopicRegistry(settings.topic_prefix, settings.partitions).name("behaviors")
    got = await read_topic(settings, topic, BehaviorEvent, start, progress=True)
    # Partition by partition in offset order: the log's own fixed order then sorts by time.
    records = sorted(got.records, key=lambda r: (r.partition, r.offset))
    bad = (
        [BadRow(0, f"{got.undecodable} records of {topic} are no BehaviorEvent", {})]
        if got.undecodable
        else []
    )
    log = build_log(behaviour_rows(r.value for r in records), bad=bad, bad_count=got.undecodable)
    return log, f"topic {topic}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    train.add_arguments(parser)
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model shape: "
        + "; ".join(
            f"{p.name}: {p.layers} layers, d={p.dim}, {p.heads} heads, {p.max_seq_len} events ({p.note})"
            for p in PRESETS.values()
        )
        + " (default: small's layers and serving cap, width and heads sized from the log; --layers, "
        "--heads, --dim, --max-seq-len given explicitly win)",
    )
    # None = not given: the preset decides (workers.training.train's own defaults are the small preset).
    parser.set_defaults(**dict.fromkeys(SHAPE_FIELDS))
    topic = parser.add_argument_group("training from the cascade's behaviours topic")
    topic.add_argument(
        "--from-topic",
        action="store_true",
        help="read the public behaviors topic (RELAYGR_ settings name the broker and prefix) "
        "instead of --dataset or --interactions",
    )
    topic.add_argument(
        "--from-timestamp",
        default=None,
        metavar="TS",
        help="with --from-topic: start at this time (epoch seconds or ISO 8601) instead of the beginning",
    )


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the model shape resolved: explicit flags, else the preset."""
    given = {k: getattr(args, k, None) for k in SHAPE_FIELDS}
    if args.preset is None:
        # No preset: the small one's depth and serving cap; width and heads stay for training to
        # size from the log (``workers.training.sizing``) unless given.
        small = PRESETS["small"].shape()
        return argparse.Namespace(
            **{**vars(args), **{k: small[k] for k in ("layers", "max_seq_len") if given[k] is None}}
        )
    shape = resolve_shape(args.preset, fallback={}, **given)
    return argparse.Namespace(**{**vars(args), **shape})


def run(args: argparse.Namespace) -> int:
    args = apply_preset(args)
    if not args.from_topic:
        if args.from_timestamp is not None:
            raise SystemExit("--from-timestamp needs --from-topic")
        return train.run(args)
    if args.dataset or args.interactions:
        raise SystemExit("--from-topic reads the behaviors topic: give no --dataset or --interactions")
    log, source = asyncio.run(read_behaviours(get_settings(), Start.parse(timestamp=args.from_timestamp)))
    if not log.histories:
        raise SystemExit(f"{source}: no behaviour to train on")
    return train.run(args, log=log, source=source)
