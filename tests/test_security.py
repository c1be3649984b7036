"""Security basics: loopback by default, client security settings passed through, bounded input."""

from __future__ import annotations

import ssl

import pytest

from relaygr.infra.broker import _server_properties
from relaygr.infra.settings import Settings, kafka_client_kwargs
from relaygr.streams.common import faust_credentials


def test_local_broker_listens_on_loopback_only(tmp_path) -> None:
    props = dict(
        line.split("=", 1) for line in _server_properties(tmp_path, 1234, 1235).splitlines() if "=" in line
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
