"""Create (idempotently) or list RelayGR's topics on the configured broker.

`create` creates every topic of the registry that is missing and checks that existing ones have
the registry's partition count (co-partitioning depends on it). `list` prints the registry.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from relaygr.infra.kafka import TopicError, ensure_topics
from relaygr.infra.local.broker import BrokerError
from relaygr.infra.settings import get_settings
from relaygr.schemas.topics import TopicRegistry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["create", "list"], help="what to do")
    parser.add_argument("--prefix", help="topic prefix (default: RELAYGR_TOPIC_PREFIX or 'relaygr')")
    parser.add_argument(
        "--partitions", type=int, help="partitions per topic (default: RELAYGR_PARTITIONS or 4)"
    )


def run(args: argparse.Namespace) -> int:
    settings = get_settings()
    registry = TopicRegistry(args.prefix or settings.topic_prefix, args.partitions or settings.partitions)
    if args.action == "list":
        for s in registry:
            print(f"{s.name:40s} key={s.key:10s} partitions={s.partitions:<4d} cleanup={s.cleanup_policy}")
        return 0
    try:
        status = asyncio.run(ensure_topics(registry, settings))
    except (BrokerError, TopicError) as e:
        print(f"relaygr topics create: {e}", file=sys.stderr)
        return 1
    for s in registry:
        print(f"{s.name:40s} partitions={s.partitions:<4d} {status.get(s.name, '?')}")
    return 0
