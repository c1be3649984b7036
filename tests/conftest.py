"""Shared fixtures: one real Kafka broker per test session, isolated topics per test.

The broker is the project's own (``relaygr.infra.local.broker``): an already running one is reused
(as `.ci/run` starts it through the CLI), ``RELAYGR_BOOTSTRAP`` points at an external cluster,
and otherwise the session starts a fresh broker in a temporary folder and stops it at the end.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from relaygr.infra.local import broker
from relaygr.infra.settings import Settings, get_settings


@pytest.fixture(scope="session")
def kafka_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    settings = get_settings(reload=True)
    if settings.bootstrap:
        yield settings
        return
    up, state = broker.status(settings)
    if up and state is not None:
        yield settings.model_copy(update={"bootstrap": state.bootstrap})
        return
    own = settings.model_copy(update={"home": tmp_path_factory.mktemp("broker-home")})
    state = broker.start(own, quiet=True)
    try:
        yield own.model_copy(update={"bootstrap": state.bootstrap})
    finally:
        broker.stop(own)


@pytest.fixture
def topic_prefix() -> str:
    """A topic prefix of this test's own: tests never see each other's messages."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def registry(kafka_settings: Settings, topic_prefix: str) -> AsyncIterator:
    from relaygr.infra.kafka import admin, ensure_topics
    from relaygr.schemas import TopicRegistry

    reg = TopicRegistry(topic_prefix, partitions=4)
    await ensure_topics(reg, kafka_settings)
    yield reg
    client = admin(kafka_settings)
    await client.start()
    try:
        await client.delete_topics(reg.names)
    finally:
        await client.close()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny untrained ranker for pipeline tests, with a fixed latency model beside it (workers
    skip start-up calibration; the trigger needs no stats)."""
    import torch

    from relaygr.workers.engine.latency_model import LatencyModel
    from relaygr.workers.model.model import HSTUConfig, HSTURanker

    torch.manual_seed(7)
    d = tmp_path_factory.mktemp("model")
    m = HSTURanker(HSTUConfig(layers=2, heads=2, dim=32, attn_dim=16, linear_dim=16))
    m.refresh_version()
    m.save(d)
    LatencyModel(1.0, 0.01, 0.0).save(d / "calibration.json")
    return d


def pytest_report_header(config: pytest.Config) -> str:
    return f"relaygr: RELAYGR_BOOTSTRAP={os.environ.get('RELAYGR_BOOTSTRAP', '(local broker)')}"


@pytest.fixture(autouse=True)
def fresh_client_error_windows() -> None:
    """aiokafka's repeated errors are logged once per window and process: a test that looks for one
    must not find it held back by the same error of the test before."""
    from relaygr.infra.kafka import forget_repeated_errors

    forget_repeated_errors()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors: intra-op threads only add synchronisation (and stall on a busy machine)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# What a test marked ``slow`` without ``seconds=`` is expected to take in ``./dev test``.
DEFAULT_SLOW_S = 60.0


def expected_seconds(item: pytest.Item) -> float:
    """What ``item`` is expected to take in ``./dev test`` (set-up included, under the load of the
    parallel run): its ``slow`` mark's ``seconds``, ``DEFAULT_SLOW_S`` for a slow test that names
    none, 0 for the others (a fraction of a second to a few seconds each)."""
    mark = item.get_closest_marker("slow")
    if mark is None:
        return 0.0
    return float(mark.kwargs.get("seconds", DEFAULT_SLOW_S))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files in the order of the seconds they are expected to take, the longest first: ``./dev
    test`` hands whole files to its worker processes in this order (``--no-loadscope-reorder``;
    xdist would otherwise order them by their number of tests), so the longest ones start at once
    and the last ones handed out are short. ``RELAYGR_TEST_PHASE`` (``./dev test`` sets it) keeps
    the tests marked ``alone`` out of its parallel run (``parallel``) and runs only them afterwards
    (``alone``); whatever ``-m`` selects applies too."""
    phase = os.environ.get("RELAYGR_TEST_PHASE", "")
    if phase in ("parallel", "alone"):
        keep = [
            item for item in items if (item.get_closest_marker("alone") is not None) == (phase == "alone")
        ]
        if len(keep) != len(items):
            config.hook.pytest_deselected(items=[item for item in items if item not in keep])
            items[:] = keep
    per_file: dict[object, float] = {}
    for item in items:
        per_file[item.path] = per_file.get(item.path, 0.0) + expected_seconds(item)
    items.sort(key=lambda item: -per_file[item.path])  # stable: file order kept otherwise
