"""While the broker is gone: aiokafka's repeated errors are logged once per window with a count,
a failed metadata update waits out the retry backoff, stopping clients never stops half-way, and
(against a broker of this test's own, stopped under running stages) every stage ends on SIGTERM,
and a ranking worker told to hand over on SIGUSR1, within its stop grace instead of waiting on the
broker without end."""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from pathlib import Path

import pytest
from aiokafka.client import AIOKafkaClient

from relaygr.infra.kafka import RepeatedClientErrors, ensure_topics, stop_clients
from relaygr.infra.local import broker
from relaygr.infra.settings import Settings
from relaygr.infra.stop_guard import STOP_OVERDUE_EXIT
from relaygr.schemas import TopicRegistry
from relaygr.tools.pipeline import Pipeline


def _record(msg: str, *args: object, level: int = logging.ERROR, name: str = "aiokafka") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_repeated_client_errors_pass_once_a_window_with_their_count() -> None:
    now = [0.0]
    f = RepeatedClientErrors(window_s=10.0, clock=lambda: now[0])
    connect = "Unable connect to node with id %s: %s"
    assert f.filter(_record(connect, 1, "refused"))
    for t in range(1, 10):  # the same failure at every retry in the window: held back
        now[0] = float(t)
        assert not f.filter(_record(connect, 1, "refused"))
    assert f.filter(_record(connect, 2, "refused"))  # another node: passes at once
    assert f.filter(_record(connect, 1, "CERTIFICATE_VERIFY_FAILED"))  # another reason: passes at once
    assert f.filter(_record("Failed", name="aiokafka.consumer.fetcher"))  # so does another logger
    assert f.filter(_record(connect, 1, "refused", level=logging.DEBUG))  # below WARNING: untouched
    now[0] = 10.5
    passed = _record(connect, 1, "refused")
    assert f.filter(passed)
    assert passed.getMessage() == (
        "Unable connect to node with id 1: refused [and 9 more like it in the 10 s before]"
    )
    now[0] = 30.0
    quiet = _record(connect, 1, "refused")
    assert f.filter(quiet) and quiet.getMessage().endswith("refused")  # nothing held back since
    assert not f.filter(_record(connect, 1, "refused"))
    f.forget()
    assert f.filter(_record(connect, 1, "refused"))  # a fresh window


async def test_a_failed_metadata_update_waits_out_the_retry_backoff() -> None:
    client = AIOKafkaClient(bootstrap_servers="127.0.0.1:1", retry_backoff_ms=200)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await client._metadata_update(client.cluster, set()) is False  # no broker known: fails at once
    assert loop.time() - started >= 0.2  # aiokafka's sender would ask again right away, and spin


class _Client:
    def __init__(self, fails_with: BaseException | None = None) -> None:
        self.fails_with, self.stopped = fails_with, False

    async def stop(self) -> None:
        self.stopped = True
        if self.fails_with is not None:
            raise self.fails_with


async def test_stopping_clients_goes_on_past_a_client_that_fails(caplog: pytest.LogCaptureFixture) -> None:
    # aiokafka's consumer, broker gone, lets the CancelledError of its own fetch retry escape stop().
    clients = [_Client(asyncio.CancelledError()), _Client(RuntimeError("closed")), _Client()]
    with caplog.at_level(logging.WARNING, logger="relaygr.infra.kafka"):
        await stop_clients(*clients)  # type: ignore[arg-type]
    assert all(c.stopped for c in clients)
    assert "fetch of its own cancelled" in caplog.text and "closed" in caplog.text


async def test_stopping_clients_still_lets_its_own_cancellation_through() -> None:
    entered = asyncio.Event()

    class Slow(_Client):
        async def stop(self) -> None:
            entered.set()
            await asyncio.sleep(60)

    after = _Client()
    task = asyncio.create_task(stop_clients(Slow(), after))  # type: ignore[arg-type]
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not after.stopped


def _env(model_dir: Path) -> dict[str, str]:
    return {
        "RELAYGR_MODEL_DIR": str(model_dir),
        "RELAYGR_CALIBRATION_FILE": str(model_dir / "calibration.json"),
        "RELAYGR_STOP_GRACE_S": "5",
        "RELAYGR_BUDGET_MS": "30000",
    }


@pytest.mark.slow(seconds=60)
async def test_every_stage_stops_within_its_grace_once_the_broker_is_gone(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> None:
    own = Settings(
        home=tmp_path_factory.mktemp("gone-home"),
        broker_heap="384m",
        bootstrap=None,
        topic_prefix=f"gone-{uuid.uuid4().hex[:8]}",
        partitions=2,
    )
    state = await asyncio.to_thread(broker.start, own, quiet=True)
    settings = own.model_copy(update={"bootstrap": state.bootstrap})
    # ranker-1 is told to hand over (to no standby) and then blocks after writing handover.json, as
    # a hand-over stuck on the broker would: only its stop grace can end it (the others get SIGTERM).
    env = {**_env(model_dir), "RELAYGR_HANDOVER_STALL_S": "600"}
    pipe = Pipeline(settings, ranking_workers=2, env=env)
    try:
        await ensure_topics(TopicRegistry(settings.topic_prefix, 2), settings)
        pipe.start()
        await pipe.wait_ready(timeout_s=240)
        procs = dict(pipe.procs)
        await asyncio.to_thread(broker.stop, own)  # the broker goes while every stage holds partitions
        await asyncio.sleep(2)
        pipe.supervisor._stopping.set()  # no restarts from here on
        for name, p in procs.items():
            p.send_signal(signal.SIGUSR1 if name == "ranker-1" else signal.SIGTERM)
        # Faust's stop and the ranking worker's producer wait on the broker without end: without the
        # grace these would still be running when the bound below ends them.
        codes = {}
        for name, p in procs.items():
            try:
                codes[name] = await asyncio.to_thread(p.wait, 120)
            except Exception:
                p.kill()
                codes[name] = "still running"
        assert set(codes) >= {
            "ingress-requests",
            "ingress-behaviors",
            "retrieval",
            "preprocess",
            "ranker-0",
            "ranker-1",
        }
        assert all(c in (0, STOP_OVERDUE_EXIT) for c in codes.values()), codes
        assert codes["ranker-1"] == STOP_OVERDUE_EXIT, codes  # a hand-over is a stop, under its grace
        overdue = [n for n, c in codes.items() if c == STOP_OVERDUE_EXIT]
        for name in overdue:  # a stage that gave up says why
            assert "still stopping 5 s after the stop signal" in (pipe.log_dir / f"{name}.log").read_text()
    finally:
        pipe.stop()
        await asyncio.to_thread(broker.stop, own)
