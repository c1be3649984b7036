"""Security basics: loopback by default, client security settings passed through, bounded input,
the secure broker's configuration and the access roles' ACLs (no broker needed here; the secure
broker itself is exercised in test_secure_broker.py)."""

from __future__ import annotations

import ssl

import pytest

from relaygr.infra.local.acls import Operation, PatternType, ResourceType, role_acls
from relaygr.infra.local.broker_files import secure_server_properties, server_properties
from relaygr.infra.local.tls import BrokerTLS
from relaygr.infra.settings import Settings, kafka_client_kwargs, security_env
from relaygr.schemas.topics import TopicRegistry
from relaygr.streams.stage_app import faust_credentials


def test_local_broker_listens_on_loopback_only(tmp_path) -> None:
    props = dict(
        line.split("=", 1) for line in server_properties(tmp_path, 1234, 1235).splitlines() if "=" in line
    )
    for url in props["listeners"].split(",") + props["advertised.listeners"].split(","):
        assert "//127.0.0.1:" in url


def test_plaintext_by_default() -> None:
    assert kafka_client_kwargs(Settings()) == {"security_protocol": "PLAINTEXT"}
    assert faust_credentials(Settings()) is None


def test_sasl_ssl_settings_reach_aiokafka_and_faust(monkeypatch) -> None:
    monkeypatch.setenv("RELAYGR_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("RELAYGR_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("RELAYGR_SASL_USERNAME", "ranker")
    monkeypatch.setenv("RELAYGR_SASL_PASSWORD", "s3cret")
    s = Settings()
    kw = kafka_client_kwargs(s)
    assert kw["security_protocol"] == "SASL_SSL" and kw["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kw["sasl_plain_username"] == "ranker" and kw["sasl_plain_password"] == "s3cret"
    assert isinstance(kw["ssl_context"], ssl.SSLContext)
    creds = faust_credentials(s)
    assert creds.username == "ranker" and str(creds.mechanism.value) == "SCRAM-SHA-512"
    assert creds.ssl_context is not None


def test_sasl_without_mechanism_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("RELAYGR_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    with pytest.raises(ValueError, match="RELAYGR_SASL_MECHANISM"):
        kafka_client_kwargs(Settings())


def test_settings_reject_bad_values(monkeypatch) -> None:
    monkeypatch.setenv("RELAYGR_PARTITIONS", "0")
    with pytest.raises(ValueError, match="partitions"):
        Settings()
    monkeypatch.setenv("RELAYGR_PARTITIONS", "4")
    monkeypatch.setenv("RELAYGR_TOPIC_PREFIX", "bad prefix!")
    with pytest.raises(ValueError, match="topic_prefix"):
        Settings()


def test_password_file_is_read_and_never_printed(monkeypatch, tmp_path) -> None:
    secret = tmp_path / "cascade.password"
    secret.write_text("s3cret-from-file\n")
    monkeypatch.setenv("RELAYGR_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("RELAYGR_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("RELAYGR_SASL_USERNAME", "cascade")
    monkeypatch.setenv("RELAYGR_SASL_PASSWORD_FILE", str(secret))
    s = Settings()
    assert kafka_client_kwargs(s)["sasl_plain_password"] == "s3cret-from-file"
    assert faust_credentials(s).password == "s3cret-from-file"
    # Child processes get the file's path, not its content.
    assert security_env(s)["RELAYGR_SASL_PASSWORD_FILE"] == str(secret)
    assert "s3cret" not in "".join(security_env(s).values())
    monkeypatch.setenv("RELAYGR_SASL_PASSWORD", "s3cret-inline")
    with pytest.raises(ValueError, match="not both"):
        Settings()
    monkeypatch.delenv("RELAYGR_SASL_PASSWORD_FILE")
    assert "s3cret" not in repr(Settings()) and "s3cret" not in str(Settings().model_dump())


def test_secure_broker_config_enforces_acls_on_loopback(tmp_path) -> None:
    tls = BrokerTLS(tmp_path / "ca.pem", tmp_path / "broker.p12", "ks-pass")
    props = dict(
        line.split("=", 1)
        for line in secure_server_properties(tmp_path, 1234, 1235, tls, "admin-pass").splitlines()
    )
    for url in props["listeners"].split(",") + props["advertised.listeners"].split(","):
        assert "//127.0.0.1:" in url
    assert set(props["listener.security.protocol.map"].split(",")) == {
        "CLIENTS:SASL_SSL",
        "CONTROLLER:SASL_SSL",
    }
    assert props["super.users"] == "User:admin"
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert props["allow.everyone.if.no.acl.found"] == "false"


def test_roles_come_from_the_prefix_and_the_registry() -> None:
    reg = TopicRegistry("shop", 4)
    cascade = role_acls("cascade", "svc", reg)
    # Every stage, present or future, is covered by the prefix: no rule names a topic or a stage.
    assert {(b.pattern, b.resource_name) for b in cascade} == {(PatternType.PREFIXED, "shop")}
    assert {b.resource_type for b in cascade} == {
        ResourceType.TOPIC,
        ResourceType.GROUP,
        ResourceType.TRANSACTIONAL_ID,
    }
    producer = role_acls("producer", "app", reg)
    assert {(b.resource_name, b.operation) for b in producer} == {
        (name, op)
        for name in ("shop.behaviors", "shop.requests")
        for op in (Operation.WRITE, Operation.DESCRIBE)
    }
    reader = role_acls("results-consumer", "dash", reg)
    assert {(b.resource_type, b.resource_name, b.operation) for b in reader} == {
        (ResourceType.TOPIC, "shop.results", Operation.READ),
        (ResourceType.TOPIC, "shop.results", Operation.DESCRIBE),
        (ResourceType.GROUP, "shop.results.", Operation.READ),
    }
    assert all(b.principal == "User:dash" for b in reader)
