"""Send one event of every schema through the broker and read each back, checking equality.

Uses throw-away topics (prefix `relaygr-roundtrip-<random>`, deleted afterwards), so it never
writes into a running pipeline's topics.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid

from relaygr.infra.kafka import admin, consumer, ensure_topics, producer
from relaygr.infra.local.broker import BrokerError, resolve_bootstrap
from relaygr.infra.settings import Settings, get_settings
from relaygr.schemas import TopicRegistry, decode, encode
from relaygr.schemas.examples import examples


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep", action="store_true", help="keep the round-trip topics")


async def roundtrip(settings: Settings, *, keep: bool = False) -> list[tuple[str, str, int, float]]:
    """Returns (event type, topic, partition, ms) per event; raises on any mismatch."""
    registry = TopicRegistry(f"relaygr-roundtrip-{uuid.uuid4().hex[:8]}", settings.partitions)
    await ensure_topics(registry, settings)
    by_type = {spec.event_type: spec for spec in registry}
    rows = []
    prod = producer(settings)
    await prod.start()
    try:
        sent = []
        for ev in examples():
            spec = by_type[type(ev)]
            t0 = time.perf_counter()
            md = await prod.send_and_wait(spec.name, encode(ev), key=ev.key())
            sent.append((ev, spec, md.partition, t0))
        cons = consumer(settings, *registry.names, group_id=None)
        await cons.start()
        try:
            got: dict[str, tuple] = {}
            deadline = time.monotonic() + 30
            while len(got) < len(sent) and time.monotonic() < deadline:
                batch = await cons.getmany(timeout_ms=500)
                for tp, msgs in batch.items():
                    for m in msgs:
                        got[tp.topic] = (m, time.perf_counter())
        finally:
            await cons.stop()
        for ev, spec, partition, t0 in sent:
            if spec.name not in got:
                raise RuntimeError(f"{type(ev).__name__}: nothing came back from {spec.name}")
            msg, t1 = got[spec.name]
            back = decode(spec.event_type, msg.value)
            if back != ev or msg.key != ev.key() or msg.partition != partition:
                raise RuntimeError(f"{type(ev).__name__}: read back {back!r}, sent {ev!r}")
            rows.append((type(ev).__name__, spec.name, partition, (t1 - t0) * 1000))
    finally:
        await prod.stop()
        if not keep:
            client = admin(settings)
            await client.start()
            try:
                await client.delete_topics(registry.names)
            finally:
                await client.close()
    return rows


def run(args: argparse.Namespace) -> int:
    settings = get_settings()
    try:
        bootstrap = resolve_bootstrap(settings)
        rows = asyncio.run(roundtrip(settings, keep=args.keep))
    except (BrokerError, RuntimeError) as e:
        print(f"relaygr roundtrip: {e}", file=sys.stderr)
        return 1
    print(f"round trip through {bootstrap}: every event type written, read back and equal")
    for name, topic, partition, ms in rows:
        print(f"  {name:24s} {topic:48s} p{partition}  {ms:7.1f} ms")
    return 0
