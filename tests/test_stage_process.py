"""Process-level set-up of a stage: logging that costs nothing below its level, a frozen heap."""

from __future__ import annotations

import gc
import logging

import faust

from relaygr.streams.common import freeze_heap
from relaygr.streams.stage_cli import faust_worker


def test_faust_worker_keeps_the_root_logger_at_the_stage_level() -> None:
    app = faust.App("relaygr-test-logging", broker="kafka://127.0.0.1:1")
    worker = faust_worker(app, "warning")
    root = logging.getLogger("relaygr-test-root")
    root.addHandler(logging.StreamHandler())
    root.setLevel(logging.WARNING)
    worker.on_setup_root_logger(root, logging.WARNING)  # what faust calls when it sets up logging
    assert root.level == logging.WARNING and not root.isEnabledFor(logging.DEBUG)
    assert len(root.handlers) == 1  # no spinner handler


def test_freeze_heap_moves_survivors_out_of_collections() -> None:
    kept = [[i] for i in range(1000)]  # noqa: F841 - alive across the freeze
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= 1000
        assert all(gc.get_count()[g] < 1000 for g in range(3))
    finally:
        gc.unfreeze()


def test_after_the_freeze_every_collection_is_timed(caplog) -> None:
    from relaygr.streams import common

    def count(generation: str) -> float:
        samples = common.GC_PAUSE.collect()[0].samples
        return next(
            x.value for x in samples if x.name.endswith("_count") and x.labels["generation"] == generation
        )

    try:
        freeze_heap()
        before = count("2")
        gc.collect()
        assert count("2") == before + 1
        with caplog.at_level(logging.WARNING, logger="relaygr.streams.common"):
            common._gc_started[:] = [0.0]  # a collection that began long ago: a long pause
            common._time_collections("stop", {"generation": 1, "collected": 0})
        assert "garbage collection of generation 1 took" in caplog.text
    finally:
        gc.unfreeze()
        gc.callbacks.remove(common._time_collections)
