"""Process-wide settings, read from ``RELAYGR_*`` environment variables (pydantic-settings).

Primitives:
- ``Settings``: where the broker is, what the topics are called, where local state lives,
  and the client security settings passed through to aiokafka and faust.
- ``get_settings()``: the settings of this process (read once, re-read with ``reload=True``).
- ``sasl_password(settings)``: the SASL password, from ``RELAYGR_SASL_PASSWORD`` or the file that
  ``RELAYGR_SASL_PASSWORD_FILE`` names (a password kept in a file stays out of the environment of
  every process and of anything that prints it).
- ``kafka_client_kwargs(settings)``: the keyword arguments every aiokafka client gets.
- ``settings_env(settings, names)``: named settings as ``RELAYGR_*`` variables, the one way a parent
  configures a child process; ``cluster_env(settings)`` the deployment's (cluster, topic prefix,
  partitions, home, security); ``security_env(settings)`` the client security settings, for child
  processes that must sign in as this one does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_home() -> Path:
    """`$XDG_STATE_HOME/relaygr`, else `~/.local/state/relaygr`"""
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "relaygr"


def _default_cache() -> Path:
    """`$XDG_CACHE_HOME/relaygr`, else `~/.cache/relaygr`"""
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
    replication_factor: int | None = Field(
        default=None,
        ge=1,
        description="Replication factor of the topics the cascade creates (its own and the faust "
        "stages' changelogs). Default: follow the cluster, min(3, brokers), with min.insync.replicas 2 "
        "when there are 3 replicas.",
    )
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

    # Client security, passed through to aiokafka and faust (docs/operations.md, "Security").
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="Kafka client security protocol."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        default=None, description="SASL mechanism when security_protocol is SASL_*."
    )
    sasl_username: str | None = Field(default=None, description="SASL user name.")
    # A SecretStr prints as '**********': settings can be logged without leaking it.
    sasl_password: SecretStr | None = Field(default=None, description="SASL password.")
    sasl_password_file: Path | None = Field(
        default=None,
        description="File holding the SASL password (its first line), instead of RELAYGR_SASL_PASSWORD.",
    )
    ssl_cafile: Path | None = Field(
        default=None, description="CA bundle to verify the brokers (SSL/SASL_SSL)."
    )
    ssl_certfile: Path | None = Field(default=None, description="Client certificate (mutual TLS).")
    ssl_keyfile: Path | None = Field(default=None, description="Client private key (mutual TLS).")

    request_linger_ms: float = Field(
        default=2.0,
        ge=0,
        le=50,
        description="How long the stages' producers on the request path (routed requests, prefill "
        "signals, retrieved and rank requests, results) wait to fill a produce request: records "
        "produced within it share one request to the broker instead of one each, which is what a "
        "stage's CPU per request was mostly spent on. Adds at most this much to each hop.",
    )
    fetch_client: Literal["rdkafka", "aiokafka"] = Field(
        default="rdkafka",
        description="Which client fetches the records of the ranking worker and the ingress: librdkafka "
        "on threads of its own (group membership, rebalances and commits stay aiokafka's), or aiokafka "
        "on the event loop. librdkafka costs the loop less CPU per record and an idle consumer less "
        "(docs/host-path.md).",
    )
    metadata_max_age_ms: int = Field(
        default=30_000,
        ge=100,
        description="How often every Kafka client refreshes the cluster's metadata: how soon a running "
        "stage notices a topic deleted and created again.",
    )

    max_message_bytes: int = Field(
        default=1_048_576,
        ge=1024,
        description="Largest message a stage accepts; bigger input goes to the dead-letter topic.",
    )

    @model_validator(mode="after")
    def _one_password_source(self) -> Settings:
        if self.sasl_password is not None and self.sasl_password_file is not None:
            raise ValueError("set RELAYGR_SASL_PASSWORD or RELAYGR_SASL_PASSWORD_FILE, not both")
        return self

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
        kw["sasl_plain_password"] = sasl_password(settings)
    return kw


def sasl_password(settings: Settings) -> str | None:
    """The SASL password: ``sasl_password``, else the first line of ``sasl_password_file``."""
    if settings.sasl_password is not None:
        return settings.sasl_password.get_secret_value()
    if settings.sasl_password_file is None:
        return None
    try:
        lines = settings.sasl_password_file.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"RELAYGR_SASL_PASSWORD_FILE {settings.sasl_password_file}: {e.strerror}") from None
    return lines[0] if lines else ""


SECURITY_FIELDS = (
    "security_protocol",
    "sasl_mechanism",
    "sasl_username",
    "sasl_password",
    "sasl_password_file",
    "ssl_cafile",
    "ssl_certfile",
    "ssl_keyfile",
)


def env_value(value: object) -> str:
    """A setting's value as its environment variable spells it, read back to the same value
    (floats by their shortest exact form, booleans as true/false, secrets revealed)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def settings_env(settings: BaseSettings, names: Iterable[str]) -> dict[str, str]:
    """``{RELAYGR_<FIELD>: value}`` of the named fields of ``settings`` that are set (not None):
    the environment that makes a child process read them back. The one way a parent configures
    a child process (``PipelineSettings.to_env`` is the cascade's)."""
    env = {}
    for name in names:
        if name not in type(settings).model_fields:
            raise ValueError(f"{type(settings).__name__} has no setting {name!r}")
        value = getattr(settings, name)
        if value is not None:
            env[f"RELAYGR_{name.upper()}"] = env_value(value)
    return env


def cluster_env(settings: Settings) -> dict[str, str]:
    """The settings that put a child process on this deployment: its cluster, topic prefix,
    partitions and home, and its client security (``security_env``)."""
    return {
        **settings_env(settings, ("bootstrap", "topic_prefix", "partitions", "home")),
        **security_env(settings),
    }


def security_env(settings: Settings) -> dict[str, str]:
    """``{RELAYGR_<FIELD>: value}`` of every client security setting that is set. A password is
    passed only when it was given as one; a password file is passed as its path."""
    return settings_env(settings, SECURITY_FIELDS)
