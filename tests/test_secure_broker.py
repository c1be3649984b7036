"""The secure local broker (SASL_SSL, SCRAM-SHA-512, ACLs): the cascade works on it with the
settings `relaygr broker start --secure` prints, and nobody else gets in.

One broker for the whole module, started and stopped through the CLI. Refusals: a client without
TLS or without credentials, with a wrong password or trusting another CA cannot connect; the
producers' role writes the public inputs and nothing else. The pipeline answers a request sent by
the producers' role to the results consumers' role, and no secret shows in the logs, the dead
letters, `relaygr broker status` or a command line.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka.errors import GroupAuthorizationFailedError, KafkaConnectionError, TopicAuthorizationFailedError

from relaygr.infra.kafka import TopicError, consumer, ensure_topics, producer
from relaygr.infra.local import broker
from relaygr.infra.local.tls import issue_broker_tls, write_secret
from relaygr.infra.settings import SECURITY_FIELDS, Settings
from relaygr.schemas import BehaviorEvent, DeadLetter, RecommendationRequest, TopicRegistry, decode, encode
from relaygr.tools.pipeline import Pipeline
from relaygr.tools.traffic import collect_results, publish

pytestmark = pytest.mark.broker


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relaygr.cli", *args], capture_output=True, text=True, env=env, timeout=240
    )


@dataclass
class SecureBroker:
    env: dict[str, str]  # the CLI's environment: this module's RELAYGR_HOME and topic prefix
    printed: dict[str, str]  # what `broker start --secure` printed to export
    state: broker.BrokerState
    registry: TopicRegistry

    def settings(self, **update: object) -> Settings:
        """The printed settings, as a client that exported them reads them."""
        fields = {k.removeprefix("RELAYGR_").lower(): v for k, v in self.printed.items()}
        return Settings(topic_prefix=self.registry.prefix, **fields).model_copy(update=update)

    def as_user(self, user: str) -> Settings:
        return broker.client_settings(self.settings(), self.state, user)

    def secrets(self) -> list[str]:
        """Every password of the broker's users and its keystore's."""
        out = [self.state.password_file(u).read_text().strip() for u in self.state.users]
        props = (Path(self.state.data_dir) / "server.properties").read_text().splitlines()
        out += [line.split("=", 1)[1] for line in props if line.startswith("ssl.keystore.password=")]
        assert len(out) == len(self.state.users) + 1 and all(len(s) >= 16 for s in out)
        return out


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    home = tmp_path_factory.mktemp("secure-home")
    prefix = f"sec-{uuid.uuid4().hex[:8]}"
    # A small heap: this broker may run beside the test session's own.
    env = {
        **os.environ,
        "RELAYGR_HOME": str(home),
        "RELAYGR_TOPIC_PREFIX": prefix,
        "RELAYGR_BROKER_HEAP": "512m",
    }
    for name in ("bootstrap", *SECURITY_FIELDS):
        env.pop(f"RELAYGR_{name.upper()}", None)
    started = _cli(["broker", "start", "--secure"], env)
    assert started.returncode == 0, started.stderr
    try:
        printed = dict(
            shlex.split(line.removeprefix("export "))[0].split("=", 1)
            for line in started.stdout.splitlines()
            if line.startswith("export ")
        )
        state = broker.read_state(Settings(home=home))
        assert state is not None and state.secure
        # `topics create` with the printed settings (the cascade's role creates them).
        created = _cli(["topics", "create"], {**env, **printed})
        assert created.returncode == 0, created.stderr
        yield SecureBroker(env, printed, state, TopicRegistry(prefix, 4))
    finally:
        _cli(["broker", "stop"], env)


def test_printed_settings_sign_in_as_the_cascade(secure: SecureBroker) -> None:
    assert secure.printed["RELAYGR_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert secure.printed["RELAYGR_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert secure.printed["RELAYGR_SASL_USERNAME"] == "cascade"
    assert secure.printed["RELAYGR_BOOTSTRAP"] == secure.state.bootstrap
    password_file = Path(secure.printed["RELAYGR_SASL_PASSWORD_FILE"])
    assert password_file.stat().st_mode & 0o777 == 0o600
    assert (Path(secure.state.data_dir) / "server.properties").stat().st_mode & 0o777 == 0o600


def _wrong_password(s: Settings, tmp: Path) -> Settings:
    return s.model_copy(update={"sasl_password_file": write_secret(tmp / "wrong.password", "guess\n")})


def _untrusted_ca(s: Settings, tmp: Path) -> Settings:
    return s.model_copy(update={"ssl_cafile": issue_broker_tls(tmp / "other-ca").ca_file})


# (how the client differs from the cascade's printed settings, what aiokafka says about the refusal)
REFUSALS: dict[str, tuple[Callable[[Settings, Path], Settings], str]] = {
    "no TLS, no credentials": (
        lambda s, _: s.model_copy(update={"security_protocol": "PLAINTEXT"}),
        "closed",
    ),
    "TLS, no credentials": (lambda s, _: s.model_copy(update={"security_protocol": "SSL"}), "closed"),
    "wrong password": (_wrong_password, "invalid credentials"),
    "untrusted CA": (_untrusted_ca, "CERTIFICATE_VERIFY_FAILED"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
async def test_strangers_are_refused(
    secure: SecureBroker, case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make, reason = REFUSALS[case]
    client = producer(make(secure.settings(), tmp_path))
    with caplog.at_level(logging.WARNING, logger="aiokafka"), pytest.raises(KafkaConnectionError):
        try:
            await client.start()
        finally:
            await client.stop()
    assert reason in caplog.text


async def test_producers_write_the_inputs_and_nothing_else(secure: SecureBroker) -> None:
    reg = secure.registry
    s = secure.as_user("producer")
    prod = producer(s)
    await prod.start()
    try:
        b = BehaviorEvent(user_id="role-check", item_id=1, ts=1.0, action=1)
        r = RecommendationRequest(request_id="role-check-1", user_id="role-check", ts=time.time())
        await prod.send_and_wait(reg.name("behaviors"), encode(b), key=b.key())
        await prod.send_and_wait(reg.name("requests"), encode(r), key=r.key())
        for spec in reg:
            if spec.role not in ("behaviors", "requests"):
                with pytest.raises(TopicAuthorizationFailedError):
                    await prod.send_and_wait(spec.name, b"{}", key=b"role-check")
    finally:
        await prod.stop()
    for topic, group, refused in (
        (reg.name("results"), None, TopicAuthorizationFailedError),
        (reg.name("behaviors"), f"{reg.prefix}-ranking", GroupAuthorizationFailedError),
    ):
        cons = consumer(s, topic, group_id=group)
        try:
            with pytest.raises(refused):
                await cons.start()
        finally:
            await cons.stop()
    with pytest.raises(TopicError, match="error 29"):  # TOPIC_AUTHORIZATION_FAILED
        await ensure_topics(TopicRegistry(f"{reg.prefix}-rogue", 1), s, timeout_s=5)
    # ... and the results consumers' role cannot send requests (not idempotent: an idempotent
    # producer with no topic to write to is refused even earlier, at its producer id).
    reader = producer(secure.as_user("results-consumer"), enable_idempotence=False)
    await reader.start()
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            await reader.send_and_wait(reg.name("requests"), encode(r), key=r.key())
    finally:
        await reader.stop()


async def _dead_letters(settings: Settings, reg: TopicRegistry, timeout_s: float = 60.0) -> list[DeadLetter]:
    cons = consumer(settings, reg.name("dead_letters"), group_id=None)
    await cons.start()
    out: list[DeadLetter] = []
    try:
        deadline = time.monotonic() + timeout_s
        while not out and time.monotonic() < deadline:
            for msgs in (await cons.getmany(timeout_ms=200)).values():
                out += [decode(DeadLetter, m.value) for m in msgs]
    finally:
        await cons.stop()
    return out


@pytest.mark.slow(seconds=110)  # the secure broker's start included
async def test_pipeline_answers_over_the_secure_broker_without_leaking_secrets(
    secure: SecureBroker, model_dir: Path, tmp_path: Path
) -> None:
    reg = secure.registry
    cascade = secure.settings(home=tmp_path / "deploy")
    env = {
        "RELAYGR_MODEL_DIR": str(model_dir),
        "RELAYGR_CALIBRATION_FILE": str(model_dir / "calibration.json"),
        "RELAYGR_BUDGET_MS": "30000",  # no timeouts on a loaded machine
    }
    pipe = Pipeline(cascade, ranking_workers=1, env=env)
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        cmdlines = [Path(f"/proc/{p.pid}/cmdline").read_bytes() for p in pipe.procs.values()]
        producers = secure.as_user("producer")
        bad = producer(producers)
        await bad.start()
        try:
            await bad.send_and_wait(reg.name("requests"), b"{not json", key=b"bad")
        finally:
            await bad.stop()
        req = RecommendationRequest(request_id=f"sec-{uuid.uuid4().hex[:8]}", user_id="u-1", ts=0.0)
        history = [BehaviorEvent(user_id="u-1", item_id=i, ts=float(i), action=1) for i in range(1, 30)]
        sent = await publish(producers, reg, history, [req])
        results = await collect_results(
            secure.as_user("results-consumer"), reg, {sent[0].request_id}, timeout_s=120
        )
        assert set(results) == {sent[0].request_id}
        assert results[sent[0].request_id].items
        dead = await _dead_letters(cascade, reg)
        assert any("invalid JSON" in d.reason for d in dead)
        pipe.check()
        stages = set(pipe.procs)
    finally:
        pipe.stop()
    logs = {log.stem: log.read_text(errors="replace") for log in pipe.log_dir.glob("*.log")}
    assert stages <= logs.keys()
    status = _cli(["broker", "status"], secure.env)
    assert status.returncode == 0 and "security=SASL_SSL" in status.stdout
    cmdlines.append(Path(f"/proc/{secure.state.pid}/cmdline").read_bytes())
    seen = [
        status.stdout + status.stderr,
        Path(secure.state.log_file).read_text(errors="replace"),
        *logs.values(),
        *(d.model_dump_json() for d in dead),
        *(c.decode(errors="replace") for c in cmdlines),
    ]
    for secret in secure.secrets():
        for text in seen:
            assert secret not in text
