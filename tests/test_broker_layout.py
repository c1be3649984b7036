"""The local broker's layout without starting it: one node's configuration is what it always was,
a cluster's nodes share one controller quorum and replicate what they create, and a state file
written before clusters existed still reads as one node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relaygr.infra.local import broker, broker_files
from relaygr.infra.settings import Settings


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


@pytest.mark.parametrize(("brokers", "expected"), [(1, (1, 1)), (2, (2, 1)), (3, (3, 2)), (5, (3, 2))])
def test_replication_follows_the_cluster_size(brokers: int, expected: tuple[int, int]) -> None:
    assert broker.replication_for(brokers) == expected


def test_a_single_node_is_unreplicated_and_its_own_quorum(tmp_path: Path) -> None:
    props = _props(broker_files.server_properties(tmp_path, 9101, 9102))
    assert props["node.id"] == "1" and props["controller.quorum.voters"] == "1@127.0.0.1:9102"
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["transaction.state.log.min.isr"] == "1"
    assert "min.insync.replicas" not in props and "default.replication.factor" not in props


def test_cluster_nodes_share_one_quorum_and_replicate(tmp_path: Path) -> None:
    voters = {1: 9102, 2: 9104, 3: 9106}
    nodes = [
        _props(
            broker_files.server_properties(tmp_path, 9101 + 2 * (i - 1), voters[i], node_id=i, voters=voters)
        )
        for i in voters
    ]
    assert {n["controller.quorum.voters"] for n in nodes} == {
        "1@127.0.0.1:9102,2@127.0.0.1:9104,3@127.0.0.1:9106"
    }
    assert [n["node.id"] for n in nodes] == ["1", "2", "3"]
    assert len({n["listeners"] for n in nodes}) == 3
    for n in nodes:
        assert n["process.roles"] == "broker,controller"
        assert n["listeners"].startswith("PLAINTEXT://127.0.0.1:")  # loopback only
        assert n["default.replication.factor"] == n["offsets.topic.replication.factor"] == "3"
        assert n["min.insync.replicas"] == n["transaction.state.log.min.isr"] == "2"


def test_a_state_file_from_before_clusters_reads_as_one_node(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    old = {
        "pid": 4242,
        "port": 9101,
        "controller_port": 9102,
        "data_dir": str(tmp_path / "broker-1"),
        "log_file": str(tmp_path / "broker-1" / "broker.log"),
        "cluster_id": "x" * 22,
        "kafka_version": "4.1.2",
        "started_at": 0.0,
    }
    settings.state_file.write_text(json.dumps(old))
    state = broker.read_state(settings)
    assert state is not None and state.bootstrap == "127.0.0.1:9101"
    assert [(n.node_id, n.pid, n.port) for n in state.nodes] == [(1, 4242, 9101)]


def test_a_cluster_state_round_trips_with_every_node(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    nodes = [
        broker.BrokerNode(i, 100 + i, 9100 + i, 9200 + i, f"/d/node-{i}", f"/d/node-{i}/broker.log")
        for i in (1, 2, 3)
    ]
    state = broker.BrokerState(
        pid=101,
        port=9101,
        controller_port=9201,
        data_dir="/d",
        log_file=nodes[0].log_file,
        cluster_id="y" * 22,
        kafka_version="4.1.2",
        started_at=0.0,
        nodes=nodes,
    )
    broker_files.write_state(settings, state)
    back = broker.read_state(settings)
    assert back is not None and back.nodes == nodes
    assert back.bootstrap == "127.0.0.1:9101,127.0.0.1:9102,127.0.0.1:9103"
    assert back.node(2).port == 9102
    with pytest.raises(broker.BrokerError, match="no node 4"):
        back.node(4)


def test_a_secure_cluster_is_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(broker.BrokerError, match="secure cluster"):
        broker.start(Settings(home=tmp_path), secure=True, brokers=3)
