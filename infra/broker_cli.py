"""Start, stop or inspect the local single-node Kafka broker (KRaft, loopback only).

`start` fetches the broker's jars once (Maven), formats a fresh data directory, starts the broker
on free ports of 127.0.0.1, waits until it accepts connections and prints `bootstrap=HOST:PORT`.
`stop` ends it (SIGTERM, then SIGKILL) and removes its data. `status` exits 0 only when it is up.
"""

from __future__ import annotations

import argparse
import sys
import time

from relaygr.infra import broker
from relaygr.infra.settings import get_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["start", "stop", "status", "fetch"], help="what to do")


def run(args: argparse.Namespace) -> int:
    settings = get_settings()
    try:
        if args.action == "fetch":
            print(f"jars={broker.ensure_jars(settings)}")
            return 0
        if args.action == "start":
            up, state = broker.status(settings)
            if up and state is not None:
                print(f"already running (pid {state.pid})", file=sys.stderr)
            else:
                t0 = time.monotonic()
                state = broker.start(settings)
                print(
                    f"broker up in {time.monotonic() - t0:.1f} s (pid {state.pid}, log {state.log_file})",
                    file=sys.stderr,
                )
            print(f"bootstrap={state.bootstrap}")
            return 0
        if args.action == "stop":
            state = broker.stop(settings)
            print("stopped" if state else "no broker recorded", file=sys.stderr)
            return 0
        up, state = broker.status(settings)
        if state is None:
            print("down (no broker recorded)")
            return 1
        print(f"{'up' if up else 'down'} bootstrap={state.bootstrap} pid={state.pid} log={state.log_file}")
        return 0 if up else 1
    except broker.BrokerError as e:
        print(f"relaygr broker {args.action}: {e}", file=sys.stderr)
        return 1
