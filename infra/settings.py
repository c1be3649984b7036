"""Process-wide settings, read from ``RELAYGR_*`` environment variables (pydantic-settings).

Primitives:
- ``Settings``: where the broker is, what the topics are called, where local state lives,
  and the client security settings passed through to aiokafka and faust.
- ``get_settings()``: the settings of this process (read once, re-read with ``reload=True``).
- ``kafka_client_kwargs(settings)``: the keyword arguments every aiokafka client gets.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "relaygr"


def _default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "relaygr"


class Settings(BaseSettings):
    """RelayGR configuration. Every field is the env var ``RELAYGR_<FIELD>`` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="RELAYGR_", extra="ignore")

    bootstrap: str | None = Field(
        default=None,
        description="Kafka bootstrap servers (host:port[,host:port]). Overrides the local broker's state file.",
    )
    topic_prefix: str = Field(
        default="relaygr",
        pattern=r"^[A-Za-z0-9._-]{1,100}$",
        description="Prefix of every topic name: '<prefix>.behaviors', '<prefix>.requests', ...",
    )
    partitions: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="Partition count of every co-partitioned topic (the unit of affinity).",
    )
    replication_factor: int = Field(default=1, ge=1, description="Replication factor of created topics.")
    home: Path = Field(
        default_factory=default_home,
        description="Local state: the broker's state file, data directories and logs.",
    )
    cache_dir: Path = Field(
        default_factory=_default_cache,
        description="Downloaded artefacts kept across runs (the broker's jars).",
    )
    kafka_version: str = Field(default="4.1.2", description="Version of the local broker's jars.")
    broker_heap: str = Field(default="768m", description="JVM heap (-Xmx/-Xms) of the local broker.")
    broker_start_timeout_s: float = Field(
        default=90.0, gt=0, description="How long `broker start` waits for the broker to accept connections."
    )

    # Client security, passed through to aiokafka and faust (see README, "Security").
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="Kafka client security protocol."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        default=None, description="SASL mechanism when security_protocol is SASL_*."
    )
    sasl_username: str | None = Field(default=None, description="SASL user name.")
    sasl_password: str | None = Field(default=None, description="SASL password.")
    ssl_cafile: Path | None = Field(
        default=None, description="CA bundle to verify the brokers (SSL/SASL_SSL)."
    )
    ssl_certfile: Path | None = Field(default=None, description="Client certificate (mutual TLS).")
    ssl_keyfile: Path | None = Field(default=None, description="Client private key (mutual TLS).")

    max_message_bytes: int = Field(
        default=1_048_576,
        ge=1024,
        description="Largest message a stage accepts; bigger input goes to the dead-letter topic.",
    )

    @property
    def state_file(self) -> Path:
        return self.home / "broker.json"


@lru_cache(maxsize=1)
def _cached() -> Settings:
    return Settings()


def get_settings(*, reload: bool = False) -> Settings:
    if reload:
        _cached.cache_clear()
    return _cached()


def kafka_client_kwargs(settings: Settings) -> dict[str, Any]:
    """Security keyword arguments for any aiokafka client, from the settings."""
    kw: dict[str, Any] = {"security_protocol": settings.security_protocol}
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        import ssl

        ctx = ssl.create_default_context(cafile=str(settings.ssl_cafile) if settings.ssl_cafile else None)
        if settings.ssl_certfile:
            ctx.load_cert_chain(
                str(settings.ssl_certfile), str(settings.ssl_keyfile) if settings.ssl_keyfile else None
            )
        kw["ssl_context"] = ctx
    if settings.security_protocol.startswith("SASL"):
        if not settings.sasl_mechanism:
            raise ValueError("RELAYGR_SASL_MECHANISM is required with a SASL security protocol")
        kw["sasl_mechanism"] = settings.sasl_mechanism
        kw["sasl_plain_username"] = settings.sasl_username
        kw["sasl_plain_password"] = settings.sasl_password
    return kw
