"""A launcher configures its child processes one way: ``PipelineSettings.to_env`` (and
``settings_env`` for the deployment's ``Settings``), and a child reads back exactly those values."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from relaygr.infra.settings import Settings, cluster_env, settings_env
from relaygr.streams.config import PipelineSettings


def read_back(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], cls=PipelineSettings):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return cls()


def test_every_kind_of_value_reads_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    given = {
        "model_dir": tmp_path / "model",
        "calibration_file": tmp_path / "calibration.json",
        "theta": 0.1 + 0.2,  # a float with no short decimal form
        "budget_ms": 1234567.0,  # which "%g" would round
        "short_term": 64,
        "retain_suffix": False,
        "mode": "baseline",
        "device_core": 1,
        "cpu_cores": "0-1",
    }
    env = PipelineSettings.to_env(**given)
    assert set(env) == {f"RELAYGR_{k.upper()}" for k in given}
    child = read_back(monkeypatch, env)
    assert {k: getattr(child, k) for k in given} == given


def test_only_the_named_settings_are_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAYGR_THETA", "0.7")  # the launcher's own: the child inherits it anyway
    assert PipelineSettings.to_env(short_term=32) == {"RELAYGR_SHORT_TERM": "32"}


def test_a_bad_setting_fails_in_the_launcher() -> None:
    with pytest.raises(ValueError, match="thetta"):
        PipelineSettings.to_env(thetta=0.3)
    with pytest.raises(ValidationError):
        PipelineSettings.to_env(theta=-1)
    with pytest.raises(ValidationError):
        PipelineSettings.to_env(mode="fast")


def test_the_deployment_settings_read_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    s = Settings(bootstrap="127.0.0.1:1", topic_prefix="t-x", partitions=6, home=tmp_path, sasl_password="pw")
    env = cluster_env(s)
    assert env["RELAYGR_SASL_PASSWORD"] == "pw"
    child = read_back(monkeypatch, env, Settings)
    assert (child.bootstrap, child.topic_prefix, child.partitions, child.home) == (
        "127.0.0.1:1",
        "t-x",
        6,
        tmp_path,
    )
    assert child.sasl_password is not None and child.sasl_password.get_secret_value() == "pw"
    with pytest.raises(ValueError, match="no setting"):
        settings_env(s, ["nope"])
