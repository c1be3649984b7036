"""What a ranking worker reports of itself: the ``WorkerStats`` it publishes every few seconds (its
partitions, cache bytes, queue depths, pre-inference counts and backlog, device share, refitted
latency model, pace) for the trigger's feedback, and the Prometheus gauges read from the same
figures (the prefix store's counters, the device's pace, the device thread's CPU).

Primitives: ``worker_stats(engine, worker_id, partitions, mode)``; ``watch_device_cpu(engine)``.
"""

from __future__ import annotations

import time

from prometheus_client import Gauge

from relaygr.schemas import WorkerStats
from relaygr.workers.engine.prefill_ledger import device_share
from relaygr.workers.engine.ranker import RankingEngine
from relaygr.workers.engine.scheduler import Priority

STORE = Gauge("relaygr_prefix_store", "Prefix store counters and gauges", ["name"])
PACE = Gauge(
    "relaygr_device_pace",
    "Measured device time over the latency model's prediction (slices are sized by it)",
    ["work"],
)
# Read at scrape time: the device thread's CPU (what the model work costs the host) by priority.
DEVICE_CPU = Gauge("relaygr_device_cpu_seconds", "Device thread CPU seconds spent on jobs", ["priority"])


def watch_device_cpu(engine: RankingEngine) -> None:
    """Serve the device thread's CPU seconds per priority, read when scraped."""
    for prio in Priority:
        DEVICE_CPU.labels(prio.name.lower()).set_function(lambda p=prio, d=engine.scheduler: d.cpu_s[p])


def worker_stats(engine: RankingEngine, worker_id: str, partitions: list[int], mode: str) -> WorkerStats:
    """This worker's report now (the latency model refitted from its latest timings); the gauges
    of its store and pace set on the way."""
    latency = engine.refit_latency()
    pacing = engine.pacing
    PACE.labels("extend").set(pacing.extend.factor)
    PACE.labels("score").set(pacing.score.factor)
    PACE.labels("full").set(pacing.full.factor)
    m = engine.store_metrics()
    for k, v in m.items():
        STORE.labels(k).set(v)
    return WorkerStats(
        worker_id=worker_id,
        ts=time.time(),
        partitions=partitions,
        cache_bytes={t: int(m.get(f"bytes_{t}", 0)) for t in ("device", "host", "disk")},
        # Device bytes only: leases reserve device memory; spilled prefixes do not count.
        pinned_bytes=int(m.get("bytes_reserved", 0)),
        queue_depth=engine.queue_depth(),
        prefill_inflight=engine.queue_depth(Priority.PREFILL),
        prefill_counts=dict(engine.prefills.counts),
        prefill_backlog_ms=round(engine.prefill_backlog_ms(), 3),
        device_share={k: round(v, 4) for k, v in device_share(engine.scheduler).items()},
        latency_coeffs=latency.coeffs(),
        full_pace=min(1000.0, max(1e-3, pacing.full.factor)),
        mode=mode,
        rank_batch_sizes={str(k): v for k, v in engine.batch_sizes().items()},
    )
