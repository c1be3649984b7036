"""Access roles of a RelayGR deployment as Kafka ACLs, and their requests to a broker.

Primitives:
- ``AclBinding``: one ALLOW rule: principal, resource (type, name, literal or prefixed), operation.
- ``ROLES``: the access roles, ``cascade``, ``producer`` and ``results-consumer``.
- ``role_acls(role, user, registry)``: what a role needs, derived from the deployment's topic
  registry rather than from a list of stages, so that a new stage or topic needs no new rule:
  - ``cascade`` (every stage, and the tools that create, replay and clean up topics): everything
    whose name starts with the topic prefix, as PREFIXED patterns: topics (read, write, create,
    delete, describe, describe configs), consumer groups (faust apps and the ranking group are
    ``<prefix>-<stage>``) and transactional ids.
  - ``producer``: write (and describe) the public input topics, ``behaviors`` and ``requests``.
  - ``results-consumer``: read ``results``, in consumer groups named ``<results topic>.<anything>``.
- ``create_acls(client, bindings)`` / ``describe_acls(client, user)``: on the broker, through a
  started admin client signed in as an admin (a super user, or one allowed to ALTER the cluster).
  (The command line, ``relaygr acl``, is ``infra.local.acls_cli``.)

aiokafka's admin client has no ACL calls, so the requests are aiokafka's own protocol structs
(CreateAcls v1+, DescribeAcls v1+: the versions that know prefixed patterns), sent through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from aiokafka.admin import AIOKafkaAdminClient

from relaygr.schemas.topics import TopicRegistry


class ResourceType(IntEnum):
    """Kafka's resource type codes (``org.apache.kafka.common.resource.ResourceType``)."""

    ANY = 1
    TOPIC = 2
    GROUP = 3
    CLUSTER = 4
    TRANSACTIONAL_ID = 5


class PatternType(IntEnum):
    ANY = 1
    LITERAL = 3
    PREFIXED = 4


class Operation(IntEnum):
    ANY = 1
    ALL = 2
    READ = 3
    WRITE = 4
    CREATE = 5
    DELETE = 6
    ALTER = 7
    DESCRIBE = 8
    CLUSTER_ACTION = 9
    DESCRIBE_CONFIGS = 10
    ALTER_CONFIGS = 11
    IDEMPOTENT_WRITE = 12


ALLOW = 3  # Kafka's AclPermissionType.ALLOW
ANY_PERMISSION = 1


class AclError(RuntimeError):
    """The broker refused to create or list ACLs; the message carries its error."""


@dataclass(frozen=True, order=True)
class AclBinding:
    principal: str
    resource_type: ResourceType
    resource_name: str
    pattern: PatternType
    operation: Operation
    host: str = "*"

    def __str__(self) -> str:
        match = "prefixed" if self.pattern == PatternType.PREFIXED else "literal"
        return (
            f"{self.principal:24s} ALLOW {self.operation.name:16s} "
            f"{self.resource_type.name:16s} {match:8s} {self.resource_name}"
        )


def _grants(
    principal: str, rtype: ResourceType, name: str, pattern: PatternType, ops: tuple[Operation, ...]
) -> list[AclBinding]:
    return [AclBinding(principal, rtype, name, pattern, op) for op in ops]


def cascade_acls(user: str, registry: TopicRegistry) -> list[AclBinding]:
    p, prefix, pre = f"User:{user}", registry.prefix, PatternType.PREFIXED
    topic_ops = (
        Operation.READ,
        Operation.WRITE,
        Operation.CREATE,  # `topics create`, and faust's changelog and leader topics
        Operation.DELETE,  # tools that remove their per-run topics (demo, experiments)
        Operation.DESCRIBE,
        Operation.DESCRIBE_CONFIGS,
    )
    return [
        *_grants(p, ResourceType.TOPIC, prefix, pre, topic_ops),
        *_grants(p, ResourceType.GROUP, prefix, pre, (Operation.READ, Operation.DESCRIBE)),
        *_grants(p, ResourceType.TRANSACTIONAL_ID, prefix, pre, (Operation.WRITE, Operation.DESCRIBE)),
    ]


def producer_acls(user: str, registry: TopicRegistry) -> list[AclBinding]:
    p = f"User:{user}"
    return [
        b
        for role in ("behaviors", "requests")
        for b in _grants(
            p,
            ResourceType.TOPIC,
            registry.name(role),
            PatternType.LITERAL,
            (Operation.WRITE, Operation.DESCRIBE),
        )
    ]


def results_consumer_acls(user: str, registry: TopicRegistry) -> list[AclBinding]:
    p, results = f"User:{user}", registry.name("results")
    return [
        *_grants(p, ResourceType.TOPIC, results, PatternType.LITERAL, (Operation.READ, Operation.DESCRIBE)),
        *_grants(p, ResourceType.GROUP, f"{results}.", PatternType.PREFIXED, (Operation.READ,)),
    ]


ROLES = {
    "cascade": cascade_acls,
    "producer": producer_acls,
    "results-consumer": results_consumer_acls,
}


def role_acls(role: str, user: str, registry: TopicRegistry) -> list[AclBinding]:
    try:
        return ROLES[role](user, registry)
    except KeyError:
        raise ValueError(f"unknown role {role!r} (roles: {', '.join(ROLES)})") from None


def _error_text(code: int, message: str | None) -> str:
    """The broker's error by name; its message only when short (some dump the whole request)."""
    from aiokafka.errors import ClusterAuthorizationFailedError, for_code

    name = for_code(code).__name__
    if for_code(code) is ClusterAuthorizationFailedError:
        return f"{name} (error {code}): only an admin (super user, or ALTER on the cluster) manages ACLs"
    detail = f": {message}" if message and len(message) <= 200 else ""
    return f"{name} (error {code}){detail}"


async def create_acls(client: AIOKafkaAdminClient, bindings: list[AclBinding]) -> None:
    """Create ``bindings`` on the broker (idempotent: an existing binding is left as it is)."""
    from aiokafka.protocol.admin import CreateAclsRequest

    for b in bindings:
        # One binding per request (aiokafka's builder); a role has a handful.
        resp = await client._send_request(
            CreateAclsRequest(
                b.resource_type, b.resource_name, b.pattern, b.principal, b.host, b.operation, ALLOW
            )
        )
        for code, message in resp.creation_responses:
            if code:
                raise AclError(f"creating the ACL [{b}] failed: {_error_text(code, message)}")


async def describe_acls(client: AIOKafkaAdminClient, user: str | None = None) -> list[AclBinding]:
    """Every ALLOW binding on the broker (of ``user`` only, if given), sorted."""
    from aiokafka.protocol.admin import DescribeAclsRequest

    resp = await client._send_request(
        DescribeAclsRequest(
            ResourceType.ANY,
            None,
            PatternType.ANY,
            f"User:{user}" if user else None,
            None,
            Operation.ANY,
            ANY_PERMISSION,
        )
    )
    if resp.error_code:
        raise AclError(f"listing ACLs failed: {_error_text(resp.error_code, resp.error_message)}")
    out = []
    for rtype, name, pattern, entries in resp.resources:
        for principal, host, op, permission in entries:
            if permission == ALLOW:
                out.append(
                    AclBinding(
                        principal, ResourceType(rtype), name, PatternType(pattern), Operation(op), host
                    )
                )
    return sorted(out)
