"""CPU per message of the Kafka clients a stage could use, side by side on the real broker.

A stage's host cost at hundreds of requests a second is mostly its Kafka client's round trips
(``docs/host-path.md``). This measures, for records the size of a ranked result, what producing and
consuming one costs a process, at each of ``--rates``:

- producers (acks=all, idempotent, keyed onto a 4-partition topic): aiokafka awaiting each
  acknowledgement (``send_and_wait``), aiokafka enqueuing each and awaiting the acknowledgements
  together (``send``), both at ``--linger-ms`` lingers; confluent-kafka (librdkafka: its I/O on C
  threads) with ``produce`` and the asyncio loop polling delivery reports, at the same lingers;
- consumers of records produced at the rate: aiokafka's ``getmany`` with the ranking worker's
  fetch settings (a 20 ms fetch wait, any byte returns) and with a byte minimum (the broker holds
  a fetch until ``--min-fetch-bytes`` or 5 ms), and confluent-kafka's ``consume`` in batches.

Each client runs in a child process of its own for ``--seconds``; its CPU (user + system, every
thread, ``os.times``) over the window, per message, is the figure, with how many messages it moved.
One JSON line per rate.

Primitives: ``PRODUCERS``, ``CONSUMERS``, ``measure(settings, role, client, rate, seconds, ...)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

from relaygr.tools.args import float_above, int_at_least

PRODUCERS = ("aiokafka-wait-each", "aiokafka-pipelined", "confluent")
CONSUMERS = ("aiokafka-20ms", "aiokafka-min-bytes", "confluent")
VALUE_BYTES = 900  # a ranked result of ten items with its latency breakdown


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _paced(rate: float, seconds: float):
    """Send times: ``rate`` a second for ``seconds``, as offsets from the start."""
    n = max(1, round(rate * seconds))
    return [i / rate for i in range(n)]


async def _aiokafka_produce(
    bootstrap: str, topic: str, rate: float, seconds: float, linger: float, wait: bool
):
    from aiokafka import AIOKafkaProducer

    prod = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=linger
    )
    await prod.start()
    value = b"x" * VALUE_BYTES
    pending: list[asyncio.Future] = []
    try:
        await prod.send_and_wait(topic, value, key=b"warm")
        t0, c0 = time.monotonic(), _cpu_s()
        for k, at in enumerate(_paced(rate, seconds)):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if wait:  # one task per record, as the worker's handlers each await their result
                pending.append(asyncio.ensure_future(prod.send_and_wait(topic, value, key=str(k).encode())))
            else:
                pending.append(await prod.send(topic, value, key=str(k).encode()))
        await asyncio.gather(*pending)
        return _cpu_s() - c0, len(pending)
    finally:
        await prod.stop()


async def _confluent_produce(bootstrap: str, topic: str, rate: float, seconds: float, linger: float):
    from confluent_kafka import Producer

    prod = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": linger})
    value = b"x" * VALUE_BYTES
    acked = [0]

    def on_delivery(err, _msg) -> None:
        if err is None:
            acked[0] += 1

    prod.produce(topic, value, key=b"warm")
    prod.flush(10)
    sends = _paced(rate, seconds)
    t0, c0 = time.monotonic(), _cpu_s()
    for k, at in enumerate(sends):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        prod.produce(topic, value, key=str(k).encode(), on_delivery=on_delivery)
        prod.poll(0)  # delivery reports of what was acknowledged meanwhile, never a wait
    while acked[0] < len(sends):
        await asyncio.sleep(0.001)
        prod.poll(0)
    return _cpu_s() - c0, acked[0]


def _consume(client: str, bootstrap: str, topic: str, expect: int, seconds: float, min_bytes: int):
    """Consume ``expect`` records (at most ``seconds`` + 10 s); CPU from the first record on."""
    deadline = time.monotonic() + seconds + 10
    got, c0 = 0, None
    if client == "confluent":
        from confluent_kafka import Consumer

        cons = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:6]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})  # fmt: skip
        cons.subscribe([topic])
        while got < expect and time.monotonic() < deadline:
            msgs = cons.consume(500, 0.02)
            if msgs and c0 is None:
                c0 = _cpu_s()
            got += sum(1 for m in msgs if m.error() is None)
        cons.close()
        return _cpu_s() - (c0 or _cpu_s()), got

    async def run():
        from aiokafka import AIOKafkaConsumer

        nonlocal got, c0
        kw = (
            {"fetch_max_wait_ms": 20}
            if client == "aiokafka-20ms"
            else {"fetch_max_wait_ms": 5, "fetch_min_bytes": min_bytes}
        )
        cons = AIOKafkaConsumer(
            topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest", **kw
        )
        await cons.start()
        try:
            while got < expect and time.monotonic() < deadline:
                batch = await cons.getmany(timeout_ms=20, max_records=500)
                n = sum(len(v) for v in batch.values())
                if n and c0 is None:
                    c0 = _cpu_s()
                got += n
        finally:
            await cons.stop()
        return _cpu_s() - (c0 or _cpu_s()), got

    return asyncio.run(run())


def child(spec: dict) -> None:
    """One client's window, in this process: prints ``{"cpu_s": ..., "messages": ...}``."""
    where = (spec["bootstrap"], spec["topic"], spec["rate"], spec["seconds"])
    if spec["role"] == "consume":
        cpu, n = _consume(spec["client"], spec["bootstrap"], spec["topic"], spec["expect"], spec["seconds"],
                          spec["min_fetch_bytes"])  # fmt: skip
    elif spec["client"] == "confluent":
        cpu, n = asyncio.run(_confluent_produce(*where, spec["linger_ms"]))
    else:
        cpu, n = asyncio.run(
            _aiokafka_produce(*where, spec["linger_ms"], spec["client"] == "aiokafka-wait-each")
        )
    print(json.dumps({"cpu_s": cpu, "messages": n}))


def measure(bootstrap: str, role: str, client: str, rate: float, seconds: float, *, linger_ms: float = 0.0,
            min_fetch_bytes: int = 16384) -> dict:  # fmt: skip
    """One client's CPU per message at ``rate`` (a topic of its own; for a consumer, records
    produced at ``rate`` by confluent-kafka from this process meanwhile)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"bench-clients-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 4, 1)])[topic].result(30)
    spec = {"role": role, "client": client, "bootstrap": bootstrap, "topic": topic, "rate": rate,
            "seconds": seconds, "linger_ms": linger_ms, "expect": max(1, round(rate * seconds)),
            "min_fetch_bytes": min_fetch_bytes}  # fmt: skip
    try:
        cmd = [sys.executable, "-m", "relaygr.bench.kafka_clients", "--child", json.dumps(spec)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        if role == "consume":
            time.sleep(2.0)  # the consumer connected and positioned
            asyncio.run(_confluent_produce(bootstrap, topic, rate, seconds, 5.0))
        out, _ = proc.communicate(timeout=seconds + 120)
        got = json.loads(out.strip().splitlines()[-1])
    finally:
        admin.delete_topics([topic])
    n = max(1, got["messages"])
    return {"role": role, "client": client, "rate": rate, "linger_ms": linger_ms if role == "produce" else None,
            "messages": got["messages"], "cpu_ms_per_message": round(got["cpu_s"] * 1000 / n, 4)}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="200,1000", help="messages per second, comma-separated")
    parser.add_argument("--seconds", type=float_above(0), default=5.0, help="each client's window")
    parser.add_argument("--linger-ms", default="2,5", help="producer lingers to compare, comma-separated")
    parser.add_argument("--min-fetch-bytes", type=int_at_least(1), default=16384,
                        help="the byte minimum of the aiokafka-min-bytes consumer")  # fmt: skip
    parser.add_argument("--keep-broker", action="store_true",
                        help="leave the local broker this run starts up (default: stopped at the end)")  # fmt: skip
    parser.add_argument("--child", type=json.loads, help=argparse.SUPPRESS)  # one client's window


def run(args: argparse.Namespace) -> int:
    if args.child:
        child(args.child)
        return 0
    from relaygr.infra.kafka import resolve_bootstrap
    from relaygr.infra.local.cluster import broker_for_run
    from relaygr.infra.settings import get_settings

    try:
        rates = [float(r) for r in args.rates.split(",")]
        lingers = [float(x) for x in args.linger_ms.split(",")]
        if any(r <= 0 for r in rates) or any(x < 0 for x in lingers):
            raise ValueError
    except ValueError:
        print("relaygr bench kafka-clients: --rates are positive numbers, --linger-ms non-negative ones",
              file=sys.stderr)  # fmt: skip
        return 2
    # stdout holds the JSON lines only
    with broker_for_run(get_settings(), keep=args.keep_broker, progress=sys.stderr) as settings:
        bootstrap = resolve_bootstrap(settings)
        for rate in rates:
            rows = [
                measure(bootstrap, "produce", c, rate, args.seconds, linger_ms=x)
                for c in PRODUCERS
                for x in lingers
            ]
            rows += [measure(bootstrap, "consume", c, rate, args.seconds, min_fetch_bytes=args.min_fetch_bytes)
                     for c in CONSUMERS]  # fmt: skip
            print(json.dumps({"bench": "kafka_clients", "rate": rate, "value_bytes": VALUE_BYTES, "clients": rows}),
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
