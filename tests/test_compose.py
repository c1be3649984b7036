"""docker-compose.yml agrees with the code: image version, CLI commands, env vars, topics, and the
3-broker "cluster" profile (one quorum, replicated topics)."""

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
    # The host's ranking workers share its device: each takes its share of the device memory.
    shares = {services[s]["environment"]["RELAYGR_WORKERS_PER_DEVICE"] for s in rankers}
    assert shares == {f"${{RELAYGR_WORKERS_PER_DEVICE:-{len(rankers)}}}"}


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
        if not name.startswith("kafka"):
            # The single broker by default; the cluster's nodes when RELAYGR_COMPOSE_BOOTSTRAP says so.
            assert env["RELAYGR_BOOTSTRAP"] == "${RELAYGR_COMPOSE_BOOTSTRAP:-kafka:9092}"
            assert env["RELAYGR_TOPIC_PREFIX"] == "relaygr"  # the public topic names


def test_the_default_runs_one_broker_and_the_cluster_profile_three(compose) -> None:
    services = compose["services"]
    brokers = {n: svc for n, svc in services.items() if svc.get("image", "").startswith("apache/kafka")}
    assert [n for n, svc in brokers.items() if not svc.get("profiles")] == ["kafka"]
    nodes = {n: svc for n, svc in brokers.items() if "cluster" in svc.get("profiles", [])}
    assert sorted(nodes) == ["kafka-1", "kafka-2", "kafka-3"]
    # Nothing but brokers sits in a profile: the cascade runs in both set-ups.
    assert all(not svc.get("profiles") for n, svc in services.items() if n not in brokers)


def test_cluster_profile_is_a_replicated_kraft_quorum_of_three(compose) -> None:
    services = compose["services"]
    envs = {n: services[n]["environment"] for n in ("kafka-1", "kafka-2", "kafka-3")}
    assert {n: e["KAFKA_NODE_ID"] for n, e in envs.items()} == {
        "kafka-1": "1",
        "kafka-2": "2",
        "kafka-3": "3",
    }
    voters = {e["KAFKA_CONTROLLER_QUORUM_VOTERS"] for e in envs.values()}
    assert voters == {"1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"}  # one quorum, every node in it
    assert len({e["CLUSTER_ID"] for e in envs.values()}) == 1  # formatted as one cluster
    for name, e in envs.items():
        assert services[name]["image"] == f"apache/kafka:{Settings().kafka_version}"
        assert e["KAFKA_PROCESS_ROLES"] == "broker,controller"
        assert f"PLAINTEXT://{name}:9092" in e["KAFKA_ADVERTISED_LISTENERS"].split(",")
        assert e["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
        # Three replicas, and acks=all waits for two of them: one node may fail.
        for key in (
            "KAFKA_DEFAULT_REPLICATION_FACTOR",
            "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
            "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR",
        ):
            assert e[key] == "3", (name, key)
        for key in (
            "KAFKA_MIN_INSYNC_REPLICAS",
            "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR",
        ):
            assert e[key] == "2", (name, key)
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"])  # loopback only
        assert services[name]["healthcheck"]["test"]
    host_ports = [p for n in envs for p in services[n]["ports"]] + services["kafka"]["ports"]
    assert len(set(host_ports)) == len(host_ports)  # both set-ups' ports can coexist
    # Topics are created once whichever brokers run; an absent (profile off) node is not waited for.
    deps = services["topics"]["depends_on"]
    assert deps["kafka"]["condition"] == "service_healthy"
    for name in envs:
        assert deps[name] == {"condition": "service_healthy", "required": False}


def test_the_documented_cluster_bootstrap_names_every_node(compose) -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    line = next(ln for ln in text.splitlines() if "RELAYGR_COMPOSE_BOOTSTRAP=" in ln)
    documented = line.split("RELAYGR_COMPOSE_BOOTSTRAP=")[1].split()[0]
    nodes = [n for n, svc in compose["services"].items() if "cluster" in svc.get("profiles", [])]
    assert documented == ",".join(f"{n}:9092" for n in nodes)
    assert documented in (ROOT / "docs" / "operations.md").read_text()


def test_dockerfile_installs_what_the_cli_imports() -> None:
    text = (ROOT / "infra" / "Dockerfile").read_text()
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in set(package_dirs.values()):  # every folder of the installed package
        assert f"COPY {folder} {folder}" in text
    assert "recbole==1.2.1" in text and 'ENTRYPOINT ["relaygr"]' in text


def test_stages_get_their_stop_grace_before_compose_kills_them(compose) -> None:
    grace = PipelineSettings.model_fields["stop_grace_s"].default
    for name, svc in compose["services"].items():
        if svc.get("command", [None])[0] == "stage":
            period = svc.get("stop_grace_period", "10s")  # Compose's default
            assert period.endswith("s") and float(period[:-1]) > grace, name
