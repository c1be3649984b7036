"""``relaygr acl``: show, grant or list the Kafka ACLs of RelayGR's access roles (``infra.local.acls``).

Primitives: ``add_arguments(parser)``, ``run(args)``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiokafka.admin import AIOKafkaAdminClient

from relaygr.infra.kafka import started_admin
from relaygr.infra.local.acls import ROLES, AclError, create_acls, describe_acls, role_acls
from relaygr.infra.local.broker import BrokerError
from relaygr.infra.settings import Settings, get_settings
from relaygr.schemas.topics import TopicRegistry

T = TypeVar("T")


async def _on_broker(settings: Settings, request: Callable[[AIOKafkaAdminClient], Awaitable[T]]) -> T:
    """``request`` through an admin client of ``settings``, started for it and closed after."""
    async with started_admin(settings) as client:
        return await request(client)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Kafka ACLs of RelayGR's access roles. `show ROLE` prints what a role needs for the topic prefix "
        "(no broker needed); `grant ROLE --user NAME` creates those ACLs (run it with an admin's "
        "RELAYGR_SASL_* settings); `list` prints the ACLs the broker holds. Roles: cascade (every stage "
        "and the topic tools: all topics, groups and transactional ids starting with the prefix), "
        "producer (write behaviors and requests), results-consumer (read results)."
    )
    parser.add_argument("action", choices=["show", "grant", "list"], help="what to do")
    parser.add_argument("role", nargs="?", choices=list(ROLES), help="the access role (show, grant)")
    parser.add_argument("--user", help="SCRAM/SASL user name to grant to (default: the role's name)")
    parser.add_argument("--prefix", help="topic prefix (default: RELAYGR_TOPIC_PREFIX or 'relaygr')")


def run(args: argparse.Namespace) -> int:
    from aiokafka.errors import KafkaError

    settings = get_settings()
    registry = TopicRegistry(args.prefix or settings.topic_prefix, settings.partitions)
    if args.action in ("show", "grant") and args.role is None:
        print(f"relaygr acl {args.action}: name a role ({', '.join(ROLES)})", file=sys.stderr)
        return 2
    try:
        if args.action == "list":
            for b in asyncio.run(_on_broker(settings, lambda client: describe_acls(client, args.user))):
                print(b)
            return 0
        bindings = role_acls(args.role, args.user or args.role, registry)
        if args.action == "grant":
            asyncio.run(_on_broker(settings, lambda client: create_acls(client, bindings)))
        for b in bindings:
            print(b)
        return 0
    except (AclError, BrokerError, KafkaError, ValueError) as e:
        print(f"relaygr acl {args.action}: {e}", file=sys.stderr)
        return 1
