"""A real Apache Kafka broker (KRaft) on loopback, without containers: one node, or a cluster.

Primitives:
- ``start(settings, secure=False, brokers=1)``: format a fresh data directory, start broker+controller
  in one JVM on free loopback ports, wait until it accepts connections, record it in the state file.
  ``brokers=N``: N such combined nodes, one JVM each, forming one cluster whose controller quorum is
  all of them; internal topics are replicated min(3, N) times with a min ISR of 2 from 3 replicas
  (see ``replication_for``). A cluster recorded with some nodes down is revived instead.
  ``secure=True`` (one node only): its only client listener is SASL_SSL (SCRAM-SHA-512, a throwaway
  CA), ACLs are enforced with ``admin`` as the only super user, and one SCRAM user per access role
  exists with that role's ACLs for the deployment's topic prefix (see ``relaygr.infra.local.acls``).
- ``stop(settings)``: SIGTERM every node, wait, SIGKILL if needed; remove the data and state file.
- ``restart(settings)``: the same nodes (ports, data) stopped and started again.
- ``kill_node(settings, node_id)`` / ``start_node(settings, node_id)``: one node of a cluster
  killed (SIGKILL by default: a crash, for fault tests) and started again on its ports and data.
- ``status(settings)``: the recorded broker and whether every node is up.
- ``free_port()``: a loopback port for a listener.

What a broker is made of (jars, node properties, the state record and whether its nodes are up,
client sign-in: ``ensure_jars``, ``replication_for``, ``BrokerState``, ``read_state``,
``node_status``, ``port_open``, ``resolve_bootstrap``, ``client_env``, ``client_settings``,
``BrokerError``) is ``relaygr.infra.local.broker_files``; those names are importable from here too.

Secrets of the secure broker (passwords, the keystore) live in files of mode 0600 inside its data
directory, never on a command line: the JVM reads the storage tool's arguments from an argument
file that is deleted right after, and the broker reads its JAAS settings from server.properties.

One job in one module: the broker's processes. Starting (one node, a cluster, or reviving one),
waiting until they serve, restarting, killing and starting one node, and stopping them all share
the launch, the readiness wait and the termination below; what a broker is made of is
``broker_files``, its certificate ``tls``, its access roles ``acls``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

from relaygr.infra.kafka import started_admin
from relaygr.infra.local import acls
from relaygr.infra.local.broker_files import (
    ADMIN_USER,
    DEFAULT_CLIENT_USER,
    LOG4J_PROPERTIES,
    SCRAM_MECHANISM,
    SECURE_USERS,
    BrokerError,
    BrokerNode,
    BrokerState,
    client_env,
    client_settings,
    ensure_jars,
    jars_dir,
    java_cmd,
    new_cluster_id,
    node_status,
    node_up,
    port_open,
    read_state,
    replication_for,
    resolve_bootstrap,
    secure_server_properties,
    server_properties,
    write_state,
)
from relaygr.infra.local.tls import issue_broker_tls, write_secret
from relaygr.infra.settings import Settings
from relaygr.infra.stop_guard import process_alive

T = TypeVar("T")

# The processes, and what a broker is made of (relaygr.infra.local.broker_files) for this module's callers.
__all__ = [
    "DEFAULT_CLIENT_USER",
    "SCRAM_MECHANISM",
    "SECURE_USERS",
    "BrokerError",
    "BrokerNode",
    "BrokerState",
    "client_env",
    "client_settings",
    "ensure_jars",
    "free_port",
    "jars_dir",
    "kill_node",
    "node_status",
    "node_up",
    "port_open",
    "read_state",
    "replication_for",
    "resolve_bootstrap",
    "restart",
    "start",
    "start_node",
    "status",
    "stop",
]


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, for a listener started later, from below the kernel's ephemeral range:
    a port the kernel hands out itself may be taken meanwhile as the local end of an outgoing
    connection (a Kafka client's), and the listener then fails with "address already in use"
    at every restart. Never the same port twice in one process."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10_000, max(10_001, low))
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(settings: Settings) -> tuple[bool, BrokerState | None]:
    """The recorded broker and whether every one of its nodes is up."""
    state = read_state(settings)
    if state is None:
        return False, None
    return all(up for _, up in node_status(state)), state


def start(settings: Settings, *, quiet: bool = False, secure: bool = False, brokers: int = 1) -> BrokerState:
    """Start a fresh broker of ``brokers`` nodes, or return the one already running (which must then
    be of the kind asked for: plaintext or ``secure``, and as many nodes). A recorded cluster with
    some nodes down gets them started again on their own ports and data."""
    if brokers < 1:
        raise BrokerError("a broker needs at least one node")
    if secure and brokers > 1:
        raise BrokerError("--secure starts one node; a secure cluster is not supported locally")
    state = read_state(settings)
    nodes_up = node_status(state) if state is not None else []
    if state is not None and any(up for _, up in nodes_up):
        return _revive(settings, state, nodes_up, secure=secure, brokers=brokers)
    if state is not None:  # stale record of a dead broker
        _cleanup(state, settings)
    jars = ensure_jars(settings, quiet=quiet)
    settings.home.mkdir(parents=True, exist_ok=True)
    data_dir = settings.home / f"broker-{int(time.time())}-{os.getpid()}"
    data_dir.mkdir(parents=True, mode=0o700)
    if brokers > 1:
        return _start_cluster(settings, jars, data_dir, brokers)
    return _start_single(settings, jars, data_dir, secure)


def _revive(
    settings: Settings,
    state: BrokerState,
    nodes_up: list[tuple[BrokerNode, bool]],
    *,
    secure: bool,
    brokers: int,
) -> BrokerState:
    """The running broker, if it is of the kind asked for, its nodes that are down started again."""
    if state.secure != secure:
        running, asked = ("secure", "plaintext") if state.secure else ("plaintext", "secure")
        raise BrokerError(
            f"a {running} broker is already running (pid {state.pid}); "
            f"stop it with `relaygr broker stop` before starting a {asked} one"
        )
    if len(state.nodes) != brokers:
        raise BrokerError(
            f"a broker of {len(state.nodes)} node(s) is already running; stop it with "
            f"`relaygr broker stop` before starting one of {brokers}"
        )
    for node, up in nodes_up:
        if not up:
            state = start_node(settings, node.node_id)
    return state


def _start_single(settings: Settings, jars: Path, data_dir: Path, secure: bool) -> BrokerState:
    """One node in the fresh ``data_dir``: configured, formatted, launched, recorded, ready (and,
    ``secure``, each role's user granted its ACLs)."""
    port, cport = _free_ports(2)
    props = data_dir / "server.properties"
    (data_dir / "log4j2.properties").write_text(LOG4J_PROPERTIES)
    cluster_id = new_cluster_id()
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
        write_secret(props, secure_server_properties(data_dir, port, cport, tls, passwords[ADMIN_USER]))
        # SCRAM users are created with the metadata at format time.
        for user, password in passwords.items():
            format_args += ["--add-scram", f"{SCRAM_MECHANISM}=[name={user},password={password}]"]
        ca_file = str(tls.ca_file)
    else:
        props.write_text(server_properties(data_dir, port, cport))
    _format_data_dir(jars, data_dir, format_args, passwords)
    proc = _launch(jars, data_dir, settings.broker_heap)
    state = BrokerState(
        pid=proc.pid,
        port=port,
        controller_port=cport,
        data_dir=str(data_dir),
        log_file=str(data_dir / "broker.log"),
        cluster_id=cluster_id,
        kafka_version=settings.kafka_version,
        started_at=time.time(),
        secure=secure,
        ca_file=ca_file,
        secrets_dir=str(secrets_dir) if secrets_dir else None,
        users=list(SECURE_USERS) if secure else [],
    )
    write_state(settings, state)
    _wait_ready({1: proc}, state, settings)
    if secure:
        try:
            _grant_roles(settings, state)
        except Exception:
            stop(settings)
            raise
    return state


def _format_data_dir(jars: Path, data_dir: Path, format_args: list[str], passwords: dict[str, str]) -> None:
    """Run the storage tool's format on ``data_dir``; on failure the folder is removed."""
    # The arguments reach the JVM through an argument file (mode 0600, removed right after), so the
    # passwords never show in the process list.
    args_file = write_secret(data_dir / "format.args", "\n".join(format_args) + "\n")
    try:
        fmt = subprocess.run(
            java_cmd(jars, data_dir, "256m", [f"@{args_file}"]), capture_output=True, text=True
        )
    finally:
        args_file.unlink(missing_ok=True)
    if fmt.returncode != 0:
        shutil.rmtree(data_dir, ignore_errors=True)
        output = _redact((fmt.stdout + fmt.stderr)[-2000:], passwords.values())
        raise BrokerError("formatting the broker's data directory failed:\n" + output)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _start_cluster(settings: Settings, jars: Path, data_dir: Path, brokers: int) -> BrokerState:
    """``brokers`` combined nodes in node-N folders under ``data_dir``, one controller quorum."""
    ports = _free_ports(2 * brokers)
    ids = list(range(1, brokers + 1))
    voters = {i: ports[2 * (i - 1) + 1] for i in ids}
    cluster_id = new_cluster_id()
    nodes: list[BrokerNode] = []
    for i in ids:
        node_dir = data_dir / f"node-{i}"
        node_dir.mkdir(mode=0o700)
        (node_dir / "log4j2.properties").write_text(LOG4J_PROPERTIES)
        port = ports[2 * (i - 1)]
        props = server_properties(node_dir, port, voters[i], node_id=i, voters=voters)
        (node_dir / "server.properties").write_text(props)
        nodes.append(BrokerNode(i, 0, port, voters[i], str(node_dir), str(node_dir / "broker.log")))
    # Every node's storage is formatted with the one cluster id (static quorum: no --standalone);
    # the formats run side by side, each a short JVM.
    formats = {
        n.node_id: subprocess.Popen(
            java_cmd(
                jars,
                Path(n.data_dir),
                "256m",
                [
                    "kafka.tools.StorageTool",
                    "format",
                    f"--cluster-id={cluster_id}",
                    "--config",
                    str(Path(n.data_dir) / "server.properties"),
                ],
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in nodes
    }
    outputs = {i: proc.communicate()[0] for i, proc in formats.items()}
    for i, proc in formats.items():
        if proc.returncode != 0:
            shutil.rmtree(data_dir, ignore_errors=True)
            raise BrokerError(f"formatting node {i}'s data directory failed:\n{outputs[i][-2000:]}")
    procs = {n.node_id: _launch(jars, Path(n.data_dir), settings.broker_heap) for n in nodes}
    for n in nodes:
        n.pid = procs[n.node_id].pid
    first = nodes[0]
    state = BrokerState(
        pid=first.pid,
        port=first.port,
        controller_port=first.controller_port,
        data_dir=str(data_dir),
        log_file=first.log_file,
        cluster_id=cluster_id,
        kafka_version=settings.kafka_version,
        started_at=time.time(),
        nodes=nodes,
    )
    write_state(settings, state)
    _wait_ready(procs, state, settings)
    _wait_registered(settings, state, len(nodes))
    return state


def _wait_registered(settings: Settings, state: BrokerState, expected: int) -> None:
    """Wait until the cluster's metadata lists ``expected`` brokers: topics created right after
    start then get their full replication factor (it follows the brokers the cluster knows)."""
    from aiokafka.admin import AIOKafkaAdminClient

    async def brokers_known() -> int:
        client = AIOKafkaAdminClient(bootstrap_servers=state.bootstrap)
        await client.start()
        try:
            return len((await client.describe_cluster())["brokers"])
        finally:
            await client.close()

    deadline = time.monotonic() + settings.broker_start_timeout_s
    known = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            known = _run_blocking(brokers_known())
            if known >= expected:
                return
        time.sleep(0.5)
    stop(settings)
    raise BrokerError(
        f"the cluster knew {known} of its {expected} brokers after {settings.broker_start_timeout_s:.0f} s"
    )


def _redact(text: str, secret_values: Iterable[str]) -> str:
    for value in secret_values:
        text = text.replace(value, "********")
    return text


def _grant_roles(settings: Settings, state: BrokerState) -> None:
    """Give each role's user that role's ACLs for the deployment's topic prefix (as the admin)."""
    from relaygr.schemas.topics import TopicRegistry

    registry = TopicRegistry(settings.topic_prefix, settings.partitions)
    bindings = [b for role in acls.ROLES for b in acls.role_acls(role, role, registry)]

    async def grant() -> None:
        async with started_admin(client_settings(settings, state, ADMIN_USER)) as client:
            await acls.create_acls(client, bindings)

    _run_blocking(grant())


def _run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even when this thread has an event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _launch(jars: Path, data_dir: Path, heap: str) -> subprocess.Popen:
    with open(data_dir / "broker.log", "ab") as log:
        # Its own session: the broker outlives this command and gets SIGTERM from `stop` directly.
        return subprocess.Popen(
            java_cmd(jars, data_dir, heap, ["kafka.Kafka", str(data_dir / "server.properties")]),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _wait_ready(procs: dict[int, subprocess.Popen], state: BrokerState, settings: Settings) -> None:
    """Wait until the client port of each node in ``procs`` (node id -> its process) is open."""
    t0 = time.monotonic()
    waiting = dict(procs)
    while waiting:
        for node_id, proc in list(waiting.items()):
            node = state.node(node_id)
            if port_open(node.port):
                del waiting[node_id]
            elif proc.poll() is not None:
                log = Path(node.log_file)
                tail = _tail(log)
                if len(state.nodes) == 1:
                    _cleanup(state, settings, keep_log=True)
                else:
                    stop(settings)
                name = "the broker" if len(state.nodes) == 1 else f"node {node_id}"
                raise BrokerError(f"{name} exited with code {proc.returncode}; see {log}:\n{tail}")
        if waiting and time.monotonic() - t0 > settings.broker_start_timeout_s:
            stop(settings)
            raise BrokerError(
                f"the broker did not accept connections within {settings.broker_start_timeout_s:.0f} s"
            )
        if waiting:
            time.sleep(0.2)


def restart(settings: Settings, *, down_s: float = 0.0) -> BrokerState:
    """Stop every node of the recorded broker and start them again on the same ports and data
    (topics and committed offsets survive); ``down_s`` keeps it down that long. For fault tests."""
    state = read_state(settings)
    if state is None:
        raise BrokerError("no broker recorded to restart")
    _terminate_all([n.pid for n in state.nodes])
    time.sleep(down_s)
    return _relaunch(settings, state, [n.node_id for n in state.nodes])


def kill_node(settings: Settings, node_id: int, *, sig: signal.Signals = signal.SIGKILL) -> BrokerNode:
    """Send ``sig`` (SIGKILL: a crash, no controlled shutdown) to one node and wait until it is
    gone; its data and the record stay, for ``start_node``."""
    state = read_state(settings)
    if state is None:
        raise BrokerError("no broker recorded")
    node = state.node(node_id)
    if sig == signal.SIGKILL:
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGKILL)
        while process_alive(node.pid):
            _reap(node.pid)
            time.sleep(0.05)
        _reap(node.pid)
    else:
        _terminate(node.pid)
    return node


def start_node(settings: Settings, node_id: int) -> BrokerState:
    """Start one recorded node again on its own ports and data (after a crash or ``kill_node``);
    it rejoins the cluster, and its replicas catch up from the leaders."""
    state = read_state(settings)
    if state is None:
        raise BrokerError("no broker recorded")
    node = state.node(node_id)
    if node_up(node):
        return state
    _terminate(node.pid)  # a process that is alive but not serving
    return _relaunch(settings, state, [node_id])


def _relaunch(settings: Settings, state: BrokerState, node_ids: list[int]) -> BrokerState:
    jars = jars_dir(settings)
    procs = {i: _launch(jars, Path(state.node(i).data_dir), settings.broker_heap) for i in node_ids}
    for i, proc in procs.items():
        state.node(i).pid = proc.pid
    state.pid = state.nodes[0].pid
    state.started_at = time.time()
    write_state(settings, state)
    _wait_ready(procs, state, settings)
    return state


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _cleanup(state: BrokerState, settings: Settings, *, keep_log: bool = False) -> None:
    if keep_log:
        for node in state.nodes:
            shutil.rmtree(Path(node.data_dir) / "logs", ignore_errors=True)
    else:
        shutil.rmtree(state.data_dir, ignore_errors=True)
    settings.state_file.unlink(missing_ok=True)


def stop(settings: Settings, *, grace_s: float = 30.0) -> BrokerState | None:
    """Stop every node of the recorded broker (SIGTERM, then SIGKILL after ``grace_s``) and remove
    its data."""
    state = read_state(settings)
    if state is None:
        return None
    _terminate_all([n.pid for n in state.nodes], grace_s)
    _cleanup(state, settings)
    return state


def _terminate_all(pids: list[int], grace_s: float = 30.0) -> None:
    """SIGTERM to all at once (nodes of one cluster shut down together: one at a time, the last
    ones would wait for a controller quorum that is already gone), then SIGKILL after ``grace_s``."""
    for pid in pids:
        if process_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for pid in pids:
        while process_alive(pid) and time.monotonic() < deadline:
            _reap(pid)
            time.sleep(0.2)
    for pid in pids:
        _terminate(pid, 0.0)


def _terminate(pid: int, grace_s: float = 30.0) -> None:
    """SIGTERM (the broker's shutdown hook stops it cleanly), then SIGKILL after ``grace_s``."""
    if not process_alive(pid):
        _reap(pid)
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while process_alive(pid) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.2)
    if process_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    _reap(pid)


def _reap(pid: int) -> None:
    """Collect our own child's exit status so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
