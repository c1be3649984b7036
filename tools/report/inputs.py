"""What a report reads: the results topic, the trace's ground truth, the prefill signals, and the
ranking workers' event logs.

Primitives: ``read_results`` (the last result per request id), ``read_labels``,
``read_admitted``, ``read_admitted_ids``, ``prefill_statuses``, ``prefill_outcomes`` (the last
pre-inference outcome per request id).
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
