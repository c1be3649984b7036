"""Ports for the listeners a deployment starts later (broker, stage metrics) come from below the
kernel's ephemeral range, where no outgoing connection takes them meanwhile, and never twice."""

from __future__ import annotations

import socket

from relaygr.infra.local import broker


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low = broker._ephemeral_low()
    ports = [broker.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(10_000 <= p < low for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))


class _Draws:
    """Stands in for ``random.Random``: draws the given ports in order."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = iter(ports)

    def randrange(self, start: int, stop: int) -> int:
        return next(self.ports)


def _unused() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_port_in_use_or_handed_out_before_is_skipped(monkeypatch) -> None:
    monkeypatch.setattr(broker, "_HANDED_OUT", set())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        first = _unused()
        monkeypatch.setattr(broker.random, "Random", lambda: _Draws([taken, first]))
        assert broker.free_port() == first  # the listener's port was skipped
        second = _unused()
        monkeypatch.setattr(broker.random, "Random", lambda: _Draws([first, taken, second]))
        assert broker.free_port() == second  # handed out before, then in use
