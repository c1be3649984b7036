"""Building a ranking worker's engine: the one place that turns settings into a model, a
device thread, a prefix store and a latency model (the Kafka shell, ``ranking_worker``, only
uses what this returns).

Primitives: ``build_engine(pipeline, worker_id, state_dir)``; ``device_shared(pipeline, device)``
(the settings of one of ``workers_per_device`` workers sharing a device); ``latency_model`` and
``tier_choice`` (what the engine and the store plan with, from the calibration file).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from relaygr.streams.config import PipelineSettings, engine_config
from relaygr.workers.engine.calibration import calibrate
from relaygr.workers.engine.cores import pin_this_thread
from relaygr.workers.engine.device_split import device_memory_bytes, split_device
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.engine.ranker import RankingEngine
from relaygr.workers.engine.scheduler import DeviceScheduler
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig
from relaygr.workers.store.tier_costs import TierChoice, TierCosts

log = logging.getLogger(__name__)


def build_engine(
    pipeline: PipelineSettings, worker_id: str, state_dir: Path
) -> tuple[RankingEngine, PipelineSettings]:
    """The model on its device thread (a core of its own when emulating an accelerator), the
    prefix store of a relay worker, and the latency model they plan with; and ``pipeline`` as
    this worker runs it (its share of the device, ``device_shared``)."""
    model = HSTURanker.load(pipeline.model_dir, device=pipeline.device)
    runner = ModelRunner(model)
    pipeline = device_shared(pipeline, str(model.device))
    threads, core = pipeline.torch_threads, pipeline.device_core

    def device_thread_setup() -> None:
        if core is not None:  # the emulated accelerator: a core of its own (``workers.engine.cores``)
            pin_this_thread(core)
        if threads:
            torch.set_num_threads(threads)

    scheduler = DeviceScheduler(worker_id, on_start=device_thread_setup)
    store: PrefixStore | None = None
    if pipeline.mode == "relay":
        mib = 1 << 20
        store = PrefixStore(
            PrefixStoreConfig(
                device=str(model.device),
                device_budget_bytes=int(pipeline.device_cache_mb * mib),
                host_budget_bytes=int(pipeline.host_cache_mb * mib),
                disk_path=str(state_dir / "prefix-store") if pipeline.disk_cache_mb > 0 else None,
                disk_budget_bytes=int(pipeline.disk_cache_mb * mib),
                cold_kv_format=pipeline.cold_kv_format,
                default_lease_ttl_s=pipeline.lease_ttl_s,
            ),
            model_version=model.model_version,
            clock=time.time,
        )
    latency = latency_model(pipeline, runner)
    if store is not None:
        store.set_tier_choice(tier_choice(pipeline, latency))
    return RankingEngine(runner, store, scheduler, engine_config(pipeline), latency), pipeline


def latency_model(pipeline: PipelineSettings, runner: ModelRunner) -> LatencyModel:
    """The calibration file's latency model of full ranking, else one measured here now."""
    calibration = pipeline.calibration_file
    if calibration is not None and calibration.exists():
        return LatencyModel.load(calibration)
    fitted, samples = calibrate(runner, repeats=2)
    log.info("calibrated full ranking on this machine: %s -> %s", samples, fitted)
    return fitted


def tier_choice(pipeline: PipelineSettings, latency: LatencyModel) -> TierChoice | None:
    """The store's tier choice when the calibration file holds measured tier costs
    (``relaygr calibrate --tier-costs``): recomputing n events costs ``predict(n) - predict(0)``."""
    calibration = pipeline.calibration_file
    costs = TierCosts.from_calibration(calibration) if calibration and calibration.exists() else None
    if costs is None:
        return None
    return TierChoice(costs, lambda n: latency.predict_ms(n) - latency.predict_ms(0))


def device_shared(pipeline: PipelineSettings, device: str) -> PipelineSettings:
    """``pipeline`` with this worker's share of its device (``workers_per_device`` > 1: the device
    tier and graph pool budgets of one of the workers that share it)."""
    if pipeline.workers_per_device == 1:
        return pipeline
    share = split_device(
        pipeline.workers_per_device,
        pipeline.device_cache_mb,
        pipeline.graph_pool_mb,
        device_memory_bytes(device),
    )
    log.info(
        "one of %d workers on %s: device tier %.0f MiB, graph pool %.0f MiB",
        share.workers, device, share.cache_mb, share.graph_pool_mb,
    )  # fmt: skip
    return pipeline.model_copy(
        update={"device_cache_mb": share.cache_mb, "graph_pool_mb": share.graph_pool_mb}
    )
