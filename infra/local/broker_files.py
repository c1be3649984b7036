"""What a local Kafka broker is made of, apart from its running processes: its jars, each node's
configuration, the state record of what was started, and how a client signs in to it.

Primitives:
- ``ensure_jars(settings)`` / ``jars_dir(settings)``: the broker's jars, fetched once with Maven
  into the cache folder.
- ``server_properties(data_dir, port, cport, node_id=, voters=)``: one combined
  broker+controller node; ``voters`` makes it one node of a cluster whose controller quorum is
  all of them. ``secure_server_properties(...)``: the single node with every listener on SASL_SSL
  (SCRAM-SHA-512 for clients, PLAIN for the controller, both over TLS) and ACLs enforced.
  ``LOG4J_PROPERTIES``: the nodes' logging.
- ``java_cmd(jars, data_dir, heap, main)``: the JVM command line of a node or of the storage tool.
- ``replication_for(brokers)``: the replication factor and min ISR of topics on that many brokers.
- ``BrokerNode`` / ``BrokerState``: the record of a started broker (every node's process, ports
  and folders; a secure broker's CA and users), ``read_state`` / ``write_state`` its state file.
- ``node_status(state)`` / ``node_up(node)`` / ``port_open(port)``: each recorded node and whether it is up (its
  process alive, its client port open).
- ``resolve_bootstrap(settings)``: ``RELAYGR_BOOTSTRAP`` if set, else the running local broker
  (every node's address, so clients reach a cluster while one node is down).
- ``client_env(state, user)`` / ``client_settings(settings, state, user)``: the client settings
  of a user of the secure broker, as ``RELAYGR_*`` variables or as ``Settings``.
- ``BrokerError``: what went wrong, said plainly.

Starting, stopping and watching the processes is ``relaygr.infra.local.broker``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relaygr.infra.local import acls
from relaygr.infra.local.tls import BrokerTLS
from relaygr.infra.settings import Settings
from relaygr.infra.stop_guard import process_alive

POM = Path(__file__).with_name("pom.xml")
JAVA_HINT = (
    "install OpenJDK 17+ (Debian/Ubuntu: apt-get install openjdk-17-jre-headless) and Maven "
    "(apt-get install maven), or run the whole stack with `docker compose up`"
)


SCRAM_MECHANISM = "SCRAM-SHA-512"
ADMIN_USER = "admin"
# The secure broker's users: the admin (its only super user) and one user per access role, named
# after the role. Clients print as the cascade's unless told otherwise.
SECURE_USERS = (ADMIN_USER, *acls.ROLES)
DEFAULT_CLIENT_USER = "cascade"


class BrokerError(RuntimeError):
    """The local broker could not be fetched, started, found or stopped; the message says why."""


def replication_for(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of topics on a cluster of ``brokers`` brokers:
    three copies at most, and with three, an acknowledged write (acks=all) is on two of them, so
    the loss of any one broker neither loses it nor stops producers."""
    factor = max(1, min(3, brokers))
    return factor, 2 if factor >= 3 else 1


@dataclass
class BrokerNode:
    """One JVM of the local broker: a combined broker and controller."""

    node_id: int
    pid: int
    port: int
    controller_port: int
    data_dir: str  # its server.properties, log4j2.properties, logs/ and broker.log
    log_file: str

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class BrokerState:
    # Node 1's process, ports and log; ``data_dir`` is the folder of the whole broker (a single
    # node's own folder, or the parent of a cluster's node-N folders).
    pid: int
    port: int
    controller_port: int
    data_dir: str
    log_file: str
    cluster_id: str
    kafka_version: str
    started_at: float
    # Secure brokers only: the CA clients must trust, where each user's password file lies, and
    # the users that exist. No secret itself is ever recorded here.
    secure: bool = False
    ca_file: str | None = None
    secrets_dir: str | None = None
    users: list[str] = field(default_factory=list)
    # Every node, node 1 first (a single node's state file may predate this field).
    nodes: list[BrokerNode] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.nodes = [BrokerNode(**n) if isinstance(n, dict) else n for n in self.nodes]
        if not self.nodes:
            self.nodes = [
                BrokerNode(1, self.pid, self.port, self.controller_port, self.data_dir, self.log_file)
            ]

    @property
    def bootstrap(self) -> str:
        return ",".join(n.address for n in self.nodes)

    def node(self, node_id: int) -> BrokerNode:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise BrokerError(f"the local broker has no node {node_id} (nodes {[n.node_id for n in self.nodes]})")

    def password_file(self, user: str) -> Path:
        if not self.secure or self.secrets_dir is None or user not in self.users:
            raise BrokerError(
                f"the local broker has no user {user!r} (users: {', '.join(self.users) or 'none'})"
            )
        return Path(self.secrets_dir) / f"{user}.password"


def require_tool(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise BrokerError(f"`{tool}` not found: {JAVA_HINT}")
    return path


def jars_dir(settings: Settings) -> Path:
    return settings.cache_dir / f"kafka-{settings.kafka_version}"


def ensure_jars(settings: Settings, *, quiet: bool = False) -> Path:
    """The folder of broker jars; fetched with Maven on first use, reused afterwards."""
    target = jars_dir(settings)
    stamp = target / ".complete"
    if stamp.exists():
        return target
    mvn = require_tool("mvn")
    require_tool("java")
    tmp = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"fetching Kafka {settings.kafka_version} jars with Maven into {target} (once) ...", flush=True)
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(POM),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-Dkafka.version={settings.kafka_version}",
        f"-DoutputDirectory={tmp}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise BrokerError("Maven could not fetch the broker jars:\n" + "\n".join(tail))
    # A folder mixing two versions' jars breaks the classpath: replace it whole.
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(target)
    stamp.write_text(settings.kafka_version)
    return target


def new_cluster_id() -> str:
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def server_properties(
    data_dir: Path, port: int, cport: int, *, node_id: int = 1, voters: dict[int, int] | None = None
) -> str:
    """One combined broker+controller node. ``voters`` (node id -> controller port) is the
    cluster's controller quorum; without it the node is a cluster of its own."""
    voters = voters or {node_id: cport}
    factor, min_isr = replication_for(len(voters))
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": ",".join(f"{i}@127.0.0.1:{p}" for i, p in sorted(voters.items())),
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(data_dir / "logs"),
        "num.partitions": "1",
        "offsets.topic.replication.factor": str(factor),
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.replication.factor": str(factor),
        "transaction.state.log.min.isr": str(min_isr),
        "share.coordinator.state.topic.replication.factor": str(factor),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        "group.initial.rebalance.delay.ms": "0",
        # The cleaner's dedupe buffer sits on the heap (128 MiB by default).
        "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
        "auto.create.topics.enable": "false",
        "delete.topic.enable": "true",
        "message.max.bytes": str(8 * 1024 * 1024),
    }
    if len(voters) > 1:
        props.update(
            {
                # Topics created without an explicit factor (by any client) are replicated too.
                "default.replication.factor": str(factor),
                "min.insync.replicas": str(min_isr),
                # A crashed node is fenced, and its partitions' leadership moved, after 6 s
                # instead of 9 s of missed heartbeats.
                "broker.session.timeout.ms": "6000",
                "broker.heartbeat.interval.ms": "1000",
            }
        )
    return "".join(f"{k}={v}\n" for k, v in props.items())


def _jaas(module: str, **options: str) -> str:
    return f"{module} required " + " ".join(f'{k}="{v}"' for k, v in options.items()) + ";"


def secure_server_properties(
    data_dir: Path, port: int, cport: int, tls: BrokerTLS, admin_password: str
) -> str:
    """The single-node broker with every listener on SASL_SSL and ACLs enforced.

    Clients and the broker itself (inter-broker traffic, e.g. transaction markers) authenticate
    with SCRAM-SHA-512 on the CLIENTS listener. The controller listener uses PLAIN over TLS, since
    SCRAM credentials are metadata that the controller itself serves; the broker signs in there as
    the admin, the one super user, because the controller authorises the broker's own requests
    (registration, heartbeats) like any other."""
    base = dict(
        line.split("=", 1) for line in server_properties(data_dir, port, cport).splitlines() if "=" in line
    )
    scram_jaas = "org.apache.kafka.common.security.scram.ScramLoginModule"
    plain_jaas = "org.apache.kafka.common.security.plain.PlainLoginModule"
    base.update(
        {
            "listeners": f"CLIENTS://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
            "advertised.listeners": f"CLIENTS://127.0.0.1:{port}",
            "listener.security.protocol.map": "CLIENTS:SASL_SSL,CONTROLLER:SASL_SSL",
            "inter.broker.listener.name": "CLIENTS",
            "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.clients.sasl.enabled.mechanisms": SCRAM_MECHANISM,
            "listener.name.clients.scram-sha-512.sasl.jaas.config": _jaas(
                scram_jaas, username=ADMIN_USER, password=admin_password
            ),
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": _jaas(
                plain_jaas,
                username=ADMIN_USER,
                password=admin_password,
                **{f"user_{ADMIN_USER}": admin_password},
            ),
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(tls.keystore_file),
            "ssl.keystore.password": tls.keystore_password,
            "ssl.key.password": tls.keystore_password,
            # The broker is a TLS client of its own controller listener (and of itself).
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(tls.ca_file),
            "ssl.client.auth": "none",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{ADMIN_USER}",
            "allow.everyone.if.no.acl.found": "false",
        }
    )
    return "".join(f"{k}={v}\n" for k, v in base.items())


LOG4J_PROPERTIES = """\
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
"""


def java_cmd(jars: Path, data_dir: Path, heap: str, main: list[str]) -> list[str]:
    return [
        require_tool("java"),
        f"-Xmx{heap}",
        f"-Xms{heap}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:InitiatingHeapOccupancyPercent=35",
        "-XX:+ExplicitGCInvokesConcurrent",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={data_dir / 'log4j2.properties'}",
        f"-Dkafka.logs.dir={data_dir}",
        "-cp",
        f"{jars}/*",  # expanded by the JVM, not a shell
        *main,
    ]


def read_state(settings: Settings) -> BrokerState | None:
    try:
        return BrokerState(**json.loads(settings.state_file.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_state(settings: Settings, state: BrokerState) -> None:
    settings.state_file.write_text(json.dumps(asdict(state), indent=2))


def client_env(state: BrokerState, user: str = DEFAULT_CLIENT_USER) -> dict[str, str]:
    """The ``RELAYGR_*`` variables a client of the secure broker exports to sign in as ``user``."""
    return {
        "RELAYGR_BOOTSTRAP": state.bootstrap,
        "RELAYGR_SECURITY_PROTOCOL": "SASL_SSL",
        "RELAYGR_SASL_MECHANISM": SCRAM_MECHANISM,
        "RELAYGR_SASL_USERNAME": user,
        "RELAYGR_SASL_PASSWORD_FILE": str(state.password_file(user)),
        "RELAYGR_SSL_CAFILE": str(state.ca_file),
    }


def client_settings(settings: Settings, state: BrokerState, user: str = DEFAULT_CLIENT_USER) -> Settings:
    """``settings`` signed in to the secure broker as ``user``."""
    return settings.model_copy(
        update={
            "bootstrap": state.bootstrap,
            "security_protocol": "SASL_SSL",
            "sasl_mechanism": SCRAM_MECHANISM,
            "sasl_username": user,
            "sasl_password": None,
            "sasl_password_file": state.password_file(user),
            "ssl_cafile": Path(str(state.ca_file)),
        }
    )


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def node_up(node: BrokerNode) -> bool:
    """Whether a node's process is alive and its client port open."""
    return process_alive(node.pid) and port_open(node.port)


def node_status(state: BrokerState) -> list[tuple[BrokerNode, bool]]:
    """Every recorded node and whether it is up (its process alive, its client port open)."""
    return [(n, node_up(n)) for n in state.nodes]


def resolve_bootstrap(settings: Settings) -> str:
    if settings.bootstrap:
        return settings.bootstrap
    state = read_state(settings)
    # A cluster with a node down still serves: clients get every node's address and use those up.
    if state is not None and any(up for _, up in node_status(state)):
        if state.secure and settings.security_protocol != "SASL_SSL":
            raise BrokerError(
                "the local broker is secure (SASL_SSL): export the settings that `relaygr broker env` prints"
            )
        return state.bootstrap
    raise BrokerError(
        "no Kafka broker: run `relaygr broker start` (local) or set RELAYGR_BOOTSTRAP=host:port (external)"
    )
