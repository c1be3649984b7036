"""Run RelayGR end to end on this machine: local broker, topics, a round trip of every event.

Starts the local Kafka broker unless one is running (or RELAYGR_BOOTSTRAP is set), creates the
topics, and shows one event of every schema travelling through the broker. The broker keeps
running afterwards for the next command; `relaygr broker stop` ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from relaygr.infra import broker
from relaygr.infra.kafka import TopicError, ensure_topics
from relaygr.infra.roundtrip import roundtrip
from relaygr.infra.settings import get_settings
from relaygr.schemas import TopicRegistry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stop-broker", action="store_true", help="stop the local broker at the end")


def _step(msg: str) -> None:
    print(f"== {msg}", flush=True)


def run(args: argparse.Namespace) -> int:
    settings = get_settings()
    started = False
    try:
        if settings.bootstrap:
            _step(f"using the external cluster at {settings.bootstrap}")
        else:
            up, state = broker.status(settings)
            if not (up and state):
                _step("starting the local Kafka broker")
                t0 = time.monotonic()
                state = broker.start(settings)
                started = True
                print(f"   up in {time.monotonic() - t0:.1f} s at {state.bootstrap} (log {state.log_file})")
            else:
                _step(f"local Kafka broker already up at {state.bootstrap}")
        registry = TopicRegistry(settings.topic_prefix, settings.partitions)
        _step("creating topics")
        for name, st in asyncio.run(ensure_topics(registry, settings)).items():
            print(f"   {name:40s} {st}")
        _step("round trip of every event type")
        for name, topic, partition, ms in asyncio.run(roundtrip(settings)):
            print(f"   {name:24s} -> {topic} p{partition} and back in {ms:.1f} ms")
    except (broker.BrokerError, TopicError, RuntimeError) as e:
        print(f"relaygr demo: {e}", file=sys.stderr)
        return 1
    finally:
        if args.stop_broker and started:
            broker.stop(settings)
    return 0
