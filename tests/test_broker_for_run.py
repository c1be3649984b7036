"""``broker_for_run``: a command that runs and ends stops the local broker it started, and only that
one. The broker itself is stubbed (starting a JVM is what the broker tests check); what is tested
is which broker is stopped, whatever way the run ends, and what is said."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import pytest

from relaygr.infra.local import broker, cluster
from relaygr.infra.settings import Settings


@dataclass
class FakeBroker:
    up: bool = False
    started: int = 0
    stopped: list[Settings] = field(default_factory=list)

    def status(self, settings: Settings):
        return self.up, (_State() if self.up else None)

    def start(self, settings: Settings):
        self.up, self.started = True, self.started + 1
        return _State()

    def stop(self, settings: Settings):
        self.up = False
        self.stopped.append(settings)


class _State:
    bootstrap = "127.0.0.1:39092"
    log_file = "broker.log"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeBroker:
    f = FakeBroker()
    for name in ("status", "start", "stop"):
        monkeypatch.setattr(broker, name, getattr(f, name))
    return f


def _settings(tmp_path, bootstrap: str | None = None) -> Settings:
    return Settings(home=tmp_path, bootstrap=bootstrap)


def test_a_broker_started_for_the_run_is_stopped_after_it(fake: FakeBroker, tmp_path) -> None:
    out = io.StringIO()
    with cluster.broker_for_run(_settings(tmp_path), progress=out) as up:
        assert up.bootstrap == _State.bootstrap and fake.up
    assert fake.started == 1 and len(fake.stopped) == 1 and not fake.up
    assert "stopping the local Kafka broker this run started" in out.getvalue()


def test_it_is_stopped_when_the_run_fails(fake: FakeBroker, tmp_path) -> None:
    with (
        pytest.raises(KeyboardInterrupt),
        cluster.broker_for_run(_settings(tmp_path), progress=io.StringIO()),
    ):
        raise KeyboardInterrupt
    assert len(fake.stopped) == 1 and not fake.up


def test_keep_leaves_it_up_and_says_how_to_stop_it(fake: FakeBroker, tmp_path) -> None:
    out = io.StringIO()
    with cluster.broker_for_run(_settings(tmp_path), keep=True, progress=out):
        pass
    assert fake.up and not fake.stopped
    assert "stays up at 127.0.0.1:39092" in out.getvalue() and "relaygr broker stop" in out.getvalue()


def test_a_broker_already_up_or_a_configured_cluster_is_never_stopped(fake: FakeBroker, tmp_path) -> None:
    fake.up = True
    with cluster.broker_for_run(_settings(tmp_path), progress=io.StringIO()):
        pass
    with cluster.broker_for_run(_settings(tmp_path, bootstrap="kafka:9092"), progress=io.StringIO()) as up:
        assert up.bootstrap == "kafka:9092"
    assert fake.up and fake.started == 0 and not fake.stopped


def test_its_lines_go_to_progress_not_to_standard_output(
    fake: FakeBroker, tmp_path, capsys: pytest.CaptureFixture
) -> None:
    out = io.StringIO()
    with cluster.broker_for_run(_settings(tmp_path), progress=out):
        pass
    assert capsys.readouterr().out == ""
    assert "starting the local Kafka broker" in out.getvalue()
