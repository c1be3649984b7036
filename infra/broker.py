"""A real single-node Apache Kafka broker (KRaft) on loopback, without containers.

Primitives:
- ``ensure_jars(settings)``: the broker's jars, fetched once with Maven into the cache folder.
- ``start(settings, secure=False)``: format a fresh data directory, start broker+controller in one
  JVM on free loopback ports, wait until it accepts connections, record it in the state file.
  ``secure=True``: its only client listener is SASL_SSL (SCRAM-SHA-512, a throwaway CA), ACLs are
  enforced with ``admin`` as the only super user, and one SCRAM user per access role exists with
  that role's ACLs for the deployment's topic prefix (see ``relaygr.infra.acls``).
- ``client_env(state, user)`` / ``client_settings(settings, state, user)``: the client settings
  of a user of the secure broker, as ``RELAYGR_*`` variables or as ``Settings``.
- ``stop(settings)``: SIGTERM, wait, SIGKILL if needed; remove its data directory and state file.
- ``restart(settings)``: the same broker (ports, data) stopped and started again.
- ``status(settings)``: the recorded broker and whether it is up.
- ``resolve_bootstrap(settings)``: ``RELAYGR_BOOTSTRAP`` if set, else the running local broker.

Secrets of the secure broker (passwords, the keystore) live in files of mode 0600 inside its data
directory, never on a command line: the JVM reads the storage tool's arguments from an argument
file that is deleted right after, and the broker reads its JAAS settings from server.properties.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Coroutine, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from relaygr.infra import acls
from relaygr.infra.settings import Settings
from relaygr.infra.tls import BrokerTLS, issue_broker_tls, write_secret

T = TypeVar("T")
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


@dataclass
class BrokerState:
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

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def password_file(self, user: str) -> Path:
        if not self.secure or self.secrets_dir is None or user not in self.users:
            raise BrokerError(
                f"the local broker has no user {user!r} (users: {', '.join(self.users) or 'none'})"
            )
        return Path(self.secrets_dir) / f"{user}.password"


def _require(tool: str) -> str:
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
    mvn = _require("mvn")
    _require("java")
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster_id() -> str:
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def _server_properties(data_dir: Path, port: int, cport: int) -> str:
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{cport}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(data_dir / "logs"),
        "num.partitions": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        # The cleaner's dedupe buffer sits on the heap (128 MiB by default).
        "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
        "auto.create.topics.enable": "false",
        "delete.topic.enable": "true",
        "message.max.bytes": str(8 * 1024 * 1024),
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def _jaas(module: str, **options: str) -> str:
    return f"{module} required " + " ".join(f'{k}="{v}"' for k, v in options.items()) + ";"


def _secure_server_properties(
    data_dir: Path, port: int, cport: int, tls: BrokerTLS, admin_password: str
) -> str:
    """The single-node broker with every listener on SASL_SSL and ACLs enforced.

    Clients and the broker itself (inter-broker traffic, e.g. transaction markers) authenticate
    with SCRAM-SHA-512 on the CLIENTS listener. The controller listener uses PLAIN over TLS, since
    SCRAM credentials are metadata that the controller itself serves; the broker signs in there as
    the admin, the one super user, because the controller authorises the broker's own requests
    (registration, heartbeats) like any other."""
    base = dict(
        line.split("=", 1) for line in _server_properties(data_dir, port, cport).splitlines() if "=" in line
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


_LOG4J = """\
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


def _java_cmd(jars: Path, data_dir: Path, heap: str, main: list[str]) -> list[str]:
    return [
        _require("java"),
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (started by this very process) counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def read_state(settings: Settings) -> BrokerState | None:
    try:
        return BrokerState(**json.loads(settings.state_file.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def status(settings: Settings) -> tuple[bool, BrokerState | None]:
    state = read_state(settings)
    if state is None:
        return False, None
    return _alive(state.pid) and port_open(state.port), state


def start(settings: Settings, *, quiet: bool = False, secure: bool = False) -> BrokerState:
    """Start a fresh broker, or return the one already running (which must then be of the kind
    asked for: plaintext or ``secure``)."""
    up, state = status(settings)
    if up and state is not None:
        if state.secure != secure:
            running, asked = ("secure", "plaintext") if state.secure else ("plaintext", "secure")
            raise BrokerError(
                f"a {running} broker is already running (pid {state.pid}); "
                f"stop it with `relaygr broker stop` before starting a {asked} one"
            )
        return state
    if state is not None:  # stale record of a dead broker
        _cleanup(state, settings)
    jars = ensure_jars(settings, quiet=quiet)
    settings.home.mkdir(parents=True, exist_ok=True)
    data_dir = settings.home / f"broker-{int(time.time())}-{os.getpid()}"
    data_dir.mkdir(parents=True, mode=0o700)
    port, cport = free_port(), free_port()
    while cport == port:
        cport = free_port()
    props = data_dir / "server.properties"
    (data_dir / "log4j2.properties").write_text(_LOG4J)
    log_file = data_dir / "broker.log"
    cluster_id = _cluster_id()
    format_args = ["kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "--config", str(props)]
    passwords: dict[str, str] = {}
    ca_file: str | None = None
    secrets_dir: Path | None = None
    if secure:
        passwords = {user: secrets.token_urlsafe(24) for user in SECURE_USERS}
        secrets_dir = data_dir / "secrets"
        secrets_dir.mkdir(mode=0o700)
        for user, password in passwords.items():
            write_secret(secrets_dir / f"{user}.password", password + "\n")
        tls = issue_broker_tls(data_dir / "tls")
        write_secret(
            props,
            _secure_server_properties(data_dir, port, cport, tls, passwords[ADMIN_USER]),
        )
        # SCRAM users are created with the metadata at format time.
        for user, password in passwords.items():
            format_args += ["--add-scram", f"{SCRAM_MECHANISM}=[name={user},password={password}]"]
        ca_file = str(tls.ca_file)
    else:
        props.write_text(_server_properties(data_dir, port, cport))

    # The arguments reach the JVM through an argument file (mode 0600, removed right after), so the
    # passwords never show in the process list.
    args_file = write_secret(data_dir / "format.args", "\n".join(format_args) + "\n")
    try:
        fmt = subprocess.run(
            _java_cmd(jars, data_dir, "256m", [f"@{args_file}"]), capture_output=True, text=True
        )
    finally:
        args_file.unlink(missing_ok=True)
    if fmt.returncode != 0:
        shutil.rmtree(data_dir, ignore_errors=True)
        output = _redact((fmt.stdout + fmt.stderr)[-2000:], passwords.values())
        raise BrokerError("formatting the broker's data directory failed:\n" + output)

    proc = _launch(jars, data_dir, settings.broker_heap)
    state = BrokerState(
        pid=proc.pid,
        port=port,
        controller_port=cport,
        data_dir=str(data_dir),
        log_file=str(log_file),
        cluster_id=cluster_id,
        kafka_version=settings.kafka_version,
        started_at=time.time(),
        secure=secure,
        ca_file=ca_file,
        secrets_dir=str(secrets_dir) if secrets_dir else None,
        users=list(SECURE_USERS) if secure else [],
    )
    settings.state_file.write_text(json.dumps(asdict(state), indent=2))
    _wait_ready(proc, state, settings)
    if secure:
        try:
            _grant_roles(settings, state)
        except Exception:
            stop(settings)
            raise
    return state


def _redact(text: str, secret_values: Iterable[str]) -> str:
    for value in secret_values:
        text = text.replace(value, "********")
    return text


def _grant_roles(settings: Settings, state: BrokerState) -> None:
    """Give each role's user that role's ACLs for the deployment's topic prefix (as the admin)."""
    from relaygr.schemas.topics import TopicRegistry

    registry = TopicRegistry(settings.topic_prefix, settings.partitions)
    bindings = [b for role in acls.ROLES for b in acls.role_acls(role, role, registry)]
    admin_settings = client_settings(settings, state, ADMIN_USER)
    _run_blocking(acls.create_acls(admin_settings, bindings))


def _run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even when this thread has an event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


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


def _launch(jars: Path, data_dir: Path, heap: str) -> subprocess.Popen:
    with open(data_dir / "broker.log", "ab") as log:
        # Its own session: the broker outlives this command and gets SIGTERM from `stop` directly.
        return subprocess.Popen(
            _java_cmd(jars, data_dir, heap, ["kafka.Kafka", str(data_dir / "server.properties")]),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _wait_ready(proc: subprocess.Popen, state: BrokerState, settings: Settings) -> None:
    t0 = time.monotonic()
    while not port_open(state.port):
        if proc.poll() is not None:
            _cleanup(state, settings, keep_log=True)
            log = Path(state.log_file)
            raise BrokerError(f"the broker exited with code {proc.returncode}; see {log}:\n{_tail(log)}")
        if time.monotonic() - t0 > settings.broker_start_timeout_s:
            stop(settings)
            raise BrokerError(
                f"the broker did not accept connections within {settings.broker_start_timeout_s:.0f} s"
            )
        time.sleep(0.2)


def restart(settings: Settings, *, down_s: float = 0.0) -> BrokerState:
    """Stop the recorded broker and start it again on the same ports and data (its topics and
    committed offsets survive); ``down_s`` keeps it down that long. For fault-injection tests."""
    state = read_state(settings)
    if state is None:
        raise BrokerError("no broker recorded to restart")
    _terminate(state.pid)
    time.sleep(down_s)
    proc = _launch(jars_dir(settings), Path(state.data_dir), settings.broker_heap)
    state = BrokerState(**{**asdict(state), "pid": proc.pid, "started_at": time.time()})
    settings.state_file.write_text(json.dumps(asdict(state), indent=2))
    _wait_ready(proc, state, settings)
    return state


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _cleanup(state: BrokerState, settings: Settings, *, keep_log: bool = False) -> None:
    if keep_log:
        shutil.rmtree(Path(state.data_dir) / "logs", ignore_errors=True)
    else:
        shutil.rmtree(state.data_dir, ignore_errors=True)
    settings.state_file.unlink(missing_ok=True)


def stop(settings: Settings, *, grace_s: float = 30.0) -> BrokerState | None:
    """Stop the recorded broker (SIGTERM, then SIGKILL after ``grace_s``) and remove its data."""
    state = read_state(settings)
    if state is None:
        return None
    _terminate(state.pid, grace_s)
    _cleanup(state, settings)
    return state


def _terminate(pid: int, grace_s: float = 30.0) -> None:
    """SIGTERM (the broker's shutdown hook stops it cleanly), then SIGKILL after ``grace_s``."""
    if not _alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive(pid) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.2)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    _reap(pid)


def _reap(pid: int) -> None:
    """Collect our own child's exit status so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def resolve_bootstrap(settings: Settings) -> str:
    if settings.bootstrap:
        return settings.bootstrap
    up, state = status(settings)
    if up and state is not None:
        if state.secure and settings.security_protocol != "SASL_SSL":
            raise BrokerError(
                "the local broker is secure (SASL_SSL): export the settings that `relaygr broker env` prints"
            )
        return state.bootstrap
    raise BrokerError(
        "no Kafka broker: run `relaygr broker start` (local) or set RELAYGR_BOOTSTRAP=host:port (external)"
    )
