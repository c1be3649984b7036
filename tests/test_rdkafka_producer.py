"""The stages' librdkafka producer (``infra.rdkafka_producer``) on the real broker, and the faust
stages' outputs acknowledged together (``streams.common.PendingSends``)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from relaygr.infra.kafka import consumer, partition_for
from relaygr.infra.rdkafka_producer import DeliveryFailed, RdProducer, rdkafka_config
from relaygr.infra.settings import Settings
from relaygr.streams.common import PendingSends


@pytest.mark.broker
async def test_records_land_where_the_cascades_partitioner_puts_their_keys_once_acknowledged(
    kafka_settings: Settings,
) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"rdproducer-{uuid.uuid4().hex[:8]}"
    admin = AdminClient(rdkafka_config(kafka_settings))
    admin.create_topics([NewTopic(topic, 4, 1)])[topic].result(30)
    prod = RdProducer(kafka_settings, linger_ms=5)
    await prod.start()
    try:
        keys = [f"user-{i}".encode() for i in range(40)]
        acks = [
            prod.send(topic, b"explicit", key=k, partition=partition_for(k, 4), headers=[("h", k)])
            for k in keys
        ]
        acks += [prod.send(topic, b"by-key", key=k) for k in keys]  # librdkafka's murmur2: the same
        await asyncio.gather(*acks)
        assert len(prod) == 0  # every record acknowledged
    finally:
        await prod.stop()
    cons = consumer(kafka_settings, topic, group_id=None)
    await cons.start()
    got: list = []
    try:
        for _ in range(50):
            for msgs in (await cons.getmany(timeout_ms=200)).values():
                got += msgs
            if len(got) >= 80:
                break
    finally:
        await cons.stop()
        admin.delete_topics([topic])
    assert len(got) == 80
    assert all(m.partition == partition_for(m.key, 4) for m in got)
    assert all(dict(m.headers) == {"h": m.key} for m in got if m.value == b"explicit")


class FlakyOutputs:
    """Outputs whose first send of each record is given up by the producer."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    async def send(self, topic: str, key: bytes, value: bytes) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        first = (topic, key) not in self.sent
        self.sent.append((topic, key))
        if first:
            fut.set_exception(DeliveryFailed("_MSG_TIMED_OUT: Local: Message timed out"))
        else:
            fut.set_result(None)
        return fut


async def test_an_output_the_producer_gave_up_is_sent_again_before_the_event_is_acknowledged() -> None:
    outputs = FlakyOutputs()
    sends = PendingSends(outputs)  # type: ignore[arg-type]
    await sends.send("prefill", b"u1", b"{}", what="prefill signal")
    await sends.send("retrieved", b"u1", b"{}", what="retrieved request")
    assert len(sends) == 2
    await sends.acknowledged()
    assert sorted(outputs.sent) == sorted([("prefill", b"u1"), ("retrieved", b"u1")] * 2)
    assert len(sends) == 0


def test_the_librdkafka_settings_follow_the_deployments_security(tmp_path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    s = Settings(
        bootstrap="b:9093", security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
        sasl_username="relay", sasl_password_file=pw, ssl_cafile=tmp_path / "ca.pem",
    )  # fmt: skip
    conf = rdkafka_config(s)
    assert conf["bootstrap.servers"] == "b:9093" and conf["security.protocol"] == "sasl_ssl"
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512" and conf["sasl.username"] == "relay"
    assert conf["sasl.password"] == "s3cret" and conf["ssl.ca.location"] == str(tmp_path / "ca.pem")
    with pytest.raises(ValueError, match="SASL_MECHANISM"):
        rdkafka_config(Settings(bootstrap="b:9093", security_protocol="SASL_PLAINTEXT"))
