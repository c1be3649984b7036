"""docker-compose.yml agrees with the code: image version, CLI commands, env vars, topics."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest
import yaml

from relaygr.cli import build_parser
from relaygr.infra.settings import Settings
from relaygr.streams.config import PipelineSettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_kafka_service_is_kraft_at_our_version(compose) -> None:
    kafka = compose["services"]["kafka"]
    assert kafka["image"] == f"apache/kafka:{Settings().kafka_version}"
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert all(p.startswith("127.0.0.1:") for p in kafka["ports"])  # loopback only


def test_one_service_per_stage_and_several_ranking_workers(compose) -> None:
    services = compose["services"]
    stages = {s: svc["command"][1] for s, svc in services.items() if svc.get("command", [None])[0] == "stage"}
    assert set(stages.values()) == {"ingress", "retrieval", "preprocess", "ranking"}
    ingress = [services[s]["command"] for s, st in stages.items() if st == "ingress"]
    # Requests and behaviours are routed by processes of their own.
    assert sorted(c[c.index("--inputs") + 1] for c in ingress) == ["behaviors", "requests"]
    rankers = [s for s, st in stages.items() if st == "ranking"]
    assert len(rankers) >= 2
    ids = [services[s]["command"][services[s]["command"].index("--worker-id") + 1] for s in rankers]
    assert len(set(ids)) == len(ids)  # static group membership needs distinct ids
    vols = [tuple(services[s]["volumes"]) for s in rankers]
    assert len(set(vols)) == len(vols)  # each worker keeps its own state


def test_every_command_parses_with_the_real_cli(compose) -> None:
    for name, svc in compose["services"].items():
        cmd = svc.get("command")
        if not cmd or name == "kafka":
            continue
        args = build_parser(cmd).parse_args(cmd)
        assert isinstance(args, argparse.Namespace) and callable(args._run), name


def test_env_vars_are_settings_fields(compose) -> None:
    fields = {f"RELAYGR_{f.upper()}" for f in (*Settings.model_fields, *PipelineSettings.model_fields)}
    for name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        for key in env:
            if key.startswith("RELAYGR_"):
                assert key in fields, f"{name}: {key} is not a setting"
        if name != "kafka":
            assert env["RELAYGR_BOOTSTRAP"] == "kafka:9092"
            assert env["RELAYGR_TOPIC_PREFIX"] == "relaygr"  # the public topic names


def test_dockerfile_installs_what_the_cli_imports() -> None:
    text = (ROOT / "infra" / "Dockerfile").read_text()
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in set(package_dirs.values()):  # every folder of the installed package
        assert f"COPY {folder} {folder}" in text
    assert "recbole==1.2.1" in text and 'ENTRYPOINT ["relaygr"]' in text
