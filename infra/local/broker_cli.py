"""Start, stop or inspect the local Kafka broker (KRaft, loopback only): one node, or a cluster.

`start` fetches the broker's jars once (Maven), formats a fresh data directory, starts the broker
on free ports of 127.0.0.1, waits until it accepts connections and prints `bootstrap=HOST:PORT`.
`start --brokers N` starts N nodes forming one cluster (each a broker and a controller) and prints
every node's address; `status` and `stop` cover every node, and `start` again revives nodes that
are down.
`start --secure` starts it with SASL_SSL (SCRAM-SHA-512, a throwaway CA) and ACLs instead, and
prints the client settings to export (`eval "$(relaygr broker start --secure)"`); `env` prints
them again, for any of its users. `stop` ends it (SIGTERM, then SIGKILL) and removes its data.
`status` exits 0 only when it is up.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from relaygr.infra.local import broker
from relaygr.infra.settings import get_settings

DESCRIPTION = """\
The local Kafka broker (KRaft, 127.0.0.1 only, free ports): one node, or a cluster of several.

  start            plaintext broker; prints bootstrap=HOST:PORT
  start --brokers 3
                   a 3-node cluster (each node a broker and a controller: a quorum of 3), from
                   the same jars; prints bootstrap=HOST:PORT,HOST:PORT,HOST:PORT. Topics get
                   min(3, nodes) replicas and, with 3, min.insync.replicas=2: any one node can
                   crash without losing an acknowledged write or stopping the cascade. Run
                   `start` again (same --brokers) to bring back nodes that are down.
  start --secure   SASL_SSL listener (SCRAM-SHA-512) with a throwaway CA, ACLs enforced, users
                   admin (the only super user), cascade, producer and results-consumer, each with
                   its role's ACLs for RELAYGR_TOPIC_PREFIX (see `relaygr acl show ROLE`); prints
                   the cascade's client settings as `export` lines:
                       eval "$(relaygr broker start --secure)"
                   Passwords live in files of mode 0600 in the broker's data folder; neither the
                   process list nor any log shows them.
  env [--user U]   the client settings of user U of the secure broker (default: cascade)
  status           exits 0 when every node is up; prints where it listens and its log (one
                   line per node for a cluster)
  stop             stops every node and removes the data (and, for a secure broker, its secrets)
  fetch            only fetch the broker's jars (Maven, once)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("action", choices=["start", "stop", "status", "env", "fetch"], help="what to do")
    parser.add_argument(
        "--secure", action="store_true", help="start: SASL_SSL + SCRAM-SHA-512 + ACLs instead of plaintext"
    )
    parser.add_argument(
        "--brokers",
        type=int,
        default=1,
        help="start: nodes of the local cluster (default 1; 3 gives replication factor 3, min ISR 2)",
    )
    parser.add_argument(
        "--user",
        default=broker.DEFAULT_CLIENT_USER,
        choices=list(broker.SECURE_USERS),
        help="env: whose client settings to print (default: cascade)",
    )


def _exports(env: dict[str, str]) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


def run(args: argparse.Namespace) -> int:
    settings = get_settings()
    try:
        if args.action == "fetch":
            print(f"jars={broker.ensure_jars(settings)}")
            return 0
        if args.action == "start":
            up, state = broker.status(settings)
            if up and state is not None and state.secure == args.secure and len(state.nodes) == args.brokers:
                print(f"already running (pid {state.pid})", file=sys.stderr)
            else:
                t0 = time.monotonic()
                state = broker.start(settings, secure=args.secure, brokers=args.brokers)
                what = "broker" if len(state.nodes) == 1 else f"cluster of {len(state.nodes)} nodes"
                print(
                    f"{what} up in {time.monotonic() - t0:.1f} s (pid {state.pid}, log {state.log_file})",
                    file=sys.stderr,
                )
            if state.secure:
                print(
                    f"# secure broker: users {', '.join(state.users)}; client settings of cascade:",
                    file=sys.stderr,
                )
                print(_exports(broker.client_env(state)))
            else:
                print(f"bootstrap={state.bootstrap}")
            return 0
        if args.action == "stop":
            state = broker.stop(settings)
            print("stopped" if state else "no broker recorded", file=sys.stderr)
            return 0
        if args.action == "env":
            up, state = broker.status(settings)
            if state is None or not up:
                raise broker.BrokerError(
                    "no local broker is running: `relaygr broker start --secure` starts one"
                )
            if not state.secure:
                print(f"export RELAYGR_BOOTSTRAP={state.bootstrap}")
                return 0
            print(_exports(broker.client_env(state, args.user)))
            return 0
        up, state = broker.status(settings)
        if state is None:
            print("down (no broker recorded)")
            return 1
        nodes = broker.node_status(state)
        verdict = "up" if up else ("degraded" if any(ok for _, ok in nodes) else "down")
        line = f"{verdict} bootstrap={state.bootstrap} pid={state.pid} log={state.log_file}"
        if len(nodes) > 1:
            line = f"{verdict} bootstrap={state.bootstrap} nodes={len(nodes)} data={state.data_dir}"
            for node, ok in nodes:
                line += (
                    f"\n  node {node.node_id} {'up' if ok else 'down'} bootstrap={node.address}"
                    f" pid={node.pid} log={node.log_file}"
                )
        if state.secure:
            line += (
                f" security=SASL_SSL/{broker.SCRAM_MECHANISM} ca={state.ca_file}"
                f" users={','.join(state.users)} password_files={state.secrets_dir}"
            )
        print(line)
        return 0 if up else 1
    except broker.BrokerError as e:
        print(f"relaygr broker {args.action}: {e}", file=sys.stderr)
        return 1
