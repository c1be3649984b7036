"""Start, stop or inspect the local single-node Kafka broker (KRaft, loopback only).

`start` fetches the broker's jars once (Maven), formats a fresh data directory, starts the broker
on free ports of 127.0.0.1, waits until it accepts connections and prints `bootstrap=HOST:PORT`.
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

from relaygr.infra import broker
from relaygr.infra.settings import get_settings

DESCRIPTION = """\
The local single-node Kafka broker (KRaft, 127.0.0.1 only, free ports).

  start            plaintext broker; prints bootstrap=HOST:PORT
  start --secure   SASL_SSL listener (SCRAM-SHA-512) with a throwaway CA, ACLs enforced, users
                   admin (the only super user), cascade, producer and results-consumer, each with
                   its role's ACLs for RELAYGR_TOPIC_PREFIX (see `relaygr acl show ROLE`); prints
                   the cascade's client settings as `export` lines:
                       eval "$(relaygr broker start --secure)"
                   Passwords live in files of mode 0600 in the broker's data folder; neither the
                   process list nor any log shows them.
  env [--user U]   the client settings of user U of the secure broker (default: cascade)
  status           exits 0 when the broker is up; prints where it listens and its log
  stop             stops it and removes its data (and, for a secure broker, its secrets)
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
            if up and state is not None and state.secure == args.secure:
                print(f"already running (pid {state.pid})", file=sys.stderr)
            else:
                t0 = time.monotonic()
                state = broker.start(settings, secure=args.secure)
                print(
                    f"broker up in {time.monotonic() - t0:.1f} s (pid {state.pid}, log {state.log_file})",
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
        line = f"{'up' if up else 'down'} bootstrap={state.bootstrap} pid={state.pid} log={state.log_file}"
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
