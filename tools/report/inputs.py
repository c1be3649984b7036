"""What a report reads: the results topic, the trace's ground truth, the prefill signals, and the
ranking workers' event logs.

Primitives: ``read_results`` (the last result per request id), ``read_labels``,
``read_admitted``, ``read_admitted_ids``, ``prefill_statuses``, ``prefill_outcomes`` (the last
pre-inference outcome per request id), ``read_worker_stats`` (each worker's last report) and
``pre_inference_counts`` (the workers' pre-inference counts and device time, summed),
``rank_batch_counts`` (the workers' relay device turns by rankings batched, summed).
"""

from __future__ import annotations

import json
from pathlib import Path

from relaygr.infra.topic_reader import read_topic
from relaygr.schemas import RankedResult


async def read_results(settings, topic: str, start=None) -> dict[str, RankedResult]:
    """The last result per request id (results are idempotent by key)."""
    got = await read_topic(settings, topic, RankedResult, start, progress=True)
    return {r.value.request_id: r.value for r in got.records}


async def read_labels(settings, trace_topic: str, user_prefix: str = "") -> dict[str, int]:
    from relaygr.schemas import RecommendationRequest

    got = await read_topic(settings, trace_topic, RecommendationRequest, progress=True)
    return {
        user_prefix + r.value.request_id: r.value.label_item_id
        for r in got.records
        if r.value.label_item_id is not None
    }


async def read_admitted_ids(settings, topic: str, request_ids: set[str], progress: bool = True) -> set[str]:
    """The request ids among ``request_ids`` that the trigger admitted (a prefill signal exists)."""
    from relaygr.schemas import PrefillSignal

    got = await read_topic(settings, topic, PrefillSignal, progress=progress)
    return {r.value.request_id for r in got.records} & request_ids


async def read_admitted(settings, topic: str, request_ids: set[str]) -> int:
    return len(await read_admitted_ids(settings, topic, request_ids))


def _prefill_events(workers_dir: Path, request_ids: set[str] | None) -> list[dict]:
    """The ``prefill`` lines of the ranking workers' ``events.jsonl`` under ``workers_dir`` (a
    standby's, for signals the active process handles too, left out)."""
    out = []
    for f in sorted(Path(workers_dir).glob("**/events.jsonl")):
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if (
                e.get("event") == "prefill"
                and not e.get("standby")
                and (request_ids is None or e.get("request_id") in request_ids)
            ):
                out.append(e)
    return out


def prefill_statuses(workers_dir: Path, request_ids: set[str] | None = None) -> list[str]:
    """Pre-inference outcomes from the ranking workers' ``events.jsonl`` under ``workers_dir``."""
    return [str(e.get("status")) for e in _prefill_events(workers_dir, request_ids)]


def prefill_outcomes(workers_dir: Path, request_ids: set[str]) -> dict[str, str]:
    """The last pre-inference outcome of each of ``request_ids`` that has one."""
    return {str(e["request_id"]): str(e.get("status")) for e in _prefill_events(workers_dir, request_ids)}


async def read_worker_stats(settings, topic: str) -> dict:
    """Each ranking worker's last ``WorkerStats`` (by worker id) on the worker-stats topic."""
    from relaygr.schemas import WorkerStats

    got = await read_topic(settings, topic, WorkerStats, progress=False)
    return {r.value.worker_id: r.value for r in got.records}


def pre_inference_counts(stats) -> dict[str, float]:
    """What the workers' reports (``WorkerStats``, as ``read_worker_stats`` returns them, or a
    list) say of pre-inference: admitted, finished, cached, late, refused and dropped (in all
    and ``dropped:<reason>``), summed; ``prefill_s`` / ``rank_s`` device seconds and
    ``prefill_device_share``, pre-inference's share of them."""
    out: dict[str, float] = {k: 0 for k in ("admitted", "finished", "cached", "late", "refused", "dropped")}
    rank_s = prefill_s = 0.0
    for st in stats.values() if isinstance(stats, dict) else stats:
        for k, v in st.prefill_counts.items():
            out[k] = out.get(k, 0) + v
            if k.startswith("dropped:"):
                out["dropped"] += v
        rank_s += st.device_share.get("rank_s", 0.0)
        prefill_s += st.device_share.get("prefill_s", 0.0)
    out["rank_s"], out["prefill_s"] = round(rank_s, 3), round(prefill_s, 3)
    out["prefill_device_share"] = round(prefill_s / (rank_s + prefill_s), 4) if rank_s + prefill_s else 0.0
    return out


def rank_batch_counts(stats) -> dict[str, int]:
    """Relay rankings' device turns by how many rankings each ran (``WorkerStats.rank_batch_sizes``),
    summed over the workers' reports (as ``read_worker_stats`` returns them, or a list), by size."""
    out: dict[int, int] = {}
    for st in stats.values() if isinstance(stats, dict) else stats:
        for size, turns in st.rank_batch_sizes.items():
            out[int(size)] = out.get(int(size), 0) + turns
    return {str(k): out[k] for k in sorted(out)}
