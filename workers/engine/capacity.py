"""Capacity arithmetic of the prefix cache: bytes per cached user, device time per second, workers.

Primitives:
- ``lognormal_lengths(p50, p99, cap, points)``: a representative sample of history lengths (equally
  spaced quantiles of a log-normal through the given median and 99th percentile, capped at the
  model's ``max_seq_len``: what a ranking serves).
- ``ModelShape``: the model's KV shape and dtype; ``token_bytes(fmt)`` per cached event in a cold
  format, ``device_bytes(length)`` per cached prefix in the device tier's pages.
- ``WorkerShape``: what one ranking worker brings (tier budgets) and the load it may carry.
- ``Workload``: users, requests per second, the trigger's settings, the target hit rate.
- ``capacity_plan(model_shape, latency, lengths, workload, worker, formats) -> dict``: per cold
  format the bytes per cached user on device, host and disk, users per GB of each tier, the
  pre-inference and ranking device milliseconds per second at that load and the ranking workers
  needed for the target hit rate.
- ``device_ms_per_request(latency, served, workload)``: per history length, the pre-inference and
  ranking device ms of one request; ``pace_at(table, n)``: a measured pace at lengths ``n``;
  ``relay_ranking_ms(latency, cached, new, candidates, relay_pace)``: one relay ranking's.
- ``disk_overhead_bytes(model_shape, length, fmt)``: what a blob adds to its tensors on disk
  (header, alignment, checksum, sequence number), measured by encoding one.

The models behind the figures, stated so that they can be checked:
- A user is cached only when the trigger would pre-infer them: full ranking of the served history
  (``min(history, max_seq_len)``) is predicted over ``budget × theta`` and the prefix (history
  minus the short-term suffix) is at least ``min_prefix`` long. A relay ranking keeps the suffix
  it computed (``retain_suffix``), so a cached user holds the whole served history.
- Bytes: the device tier holds the model's dtype in pages (``kv_pages.KVLayout.bytes_for``: whole
  pages of keys, values and a timestamp per event, as a paged ``PrefixKV.nbytes``), the host tier
  the cold format, the disk tier the cold format plus the blob's overhead.
- Device time (the latency model's own arithmetic, as ``workers.engine.pacing`` plans with it): a
  pre-inference of p events costs ``(predict(p) - predict(0)) × prefill_pace``; a relay ranking
  of s new events and C candidates against p cached ones ``(predict(p + s + C) - predict(p)) ×
  relay_pace``; a full ranking of n events ``predict(n)``. The paces are measured by calibration
  (``calibration.measure_paces``: sliced chunks and skinny queries against many cached keys run
  slower than the full-ranking fit says). As the engine does, a suffix whose computation would
  take more than a slice is pre-inferred with the prefix. A request of a cached user (a hit, share
  = hit rate) pre-infers nothing beyond the events new since its last ranking (``new_events``, if
  more than the suffix).
- Hit rate: LRU under independent requests of equally active users keeps the most recent users,
  so the hit rate is the share of at-risk users the workers' tiers hold together. Skewed activity
  only raises it; this is the conservative bound.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.kv_pages import KVLayout
from relaygr.workers.prefix_kv import FINGERPRINT_BYTES, PrefixKV
from relaygr.workers.store.kv_codec import encode
from relaygr.workers.store.kv_formats import COLD_FORMATS, to_cold, token_bytes

GB = 1e9


@dataclass(frozen=True)
class ModelShape:
    layers: int
    heads: int
    attn_dim: int
    linear_dim: int
    dtype: torch.dtype
    max_seq_len: int

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.dtype]
        return cls(config.layers, config.heads, config.attn_dim, config.linear_dim, dtype, config.max_seq_len)

    def token_bytes(self, fmt: str) -> int:
        return token_bytes(self.layers, self.heads, self.attn_dim, self.linear_dim, self.dtype, fmt)

    def device_bytes(self, length: int) -> int:
        """Bytes a prefix of ``length`` events takes in the device tier's pages."""
        return KVLayout(self.layers, self.heads, self.attn_dim, self.linear_dim, self.dtype).bytes_for(length)


@dataclass(frozen=True)
class Workload:
    users: int
    qps: float
    budget_ms: float
    theta: float
    short_term: int
    min_prefix: int
    candidates: int
    hit_rate: float = 0.9
    new_events: int = 0
    slice_ms: float = 0.0  # the workers' device slice (0: pre-inference not sliced by time)
    # Measured time over the model's marginal time, per cached length ([[n, pace], ...], linear
    # in between, flat beyond): sliced pre-inference, and relay ranking.
    prefill_pace: tuple[tuple[float, float], ...] = ((0.0, 1.0),)
    relay_pace: tuple[tuple[float, float], ...] = ((0.0, 1.0),)


@dataclass(frozen=True)
class WorkerShape:
    device_bytes: int
    host_bytes: int
    disk_bytes: int
    max_utilisation: float = 0.7
    workers_per_device: int = 1  # workers sharing one device (its time; each its own budgets)


def lognormal_lengths(p50: float, p99: float, cap: int, points: int = 2000) -> np.ndarray:
    """History lengths at ``points`` equally spaced quantiles of the log-normal with median
    ``p50`` and 99th percentile ``p99``, each capped at ``cap`` and at least 1."""
    if not 1 <= p50 <= p99:
        raise ValueError(f"need 1 <= history p50 <= history p99, got {p50} and {p99}")
    sigma = (math.log(p99) - math.log(p50)) / statistics.NormalDist().inv_cdf(0.99)
    z = np.array([statistics.NormalDist().inv_cdf((i + 0.5) / points) for i in range(points)])
    return np.clip(np.rint(p50 * np.exp(sigma * z)), 1, cap).astype(np.int64)


def _dummy_prefix(shape: ModelShape, length: int) -> PrefixKV:
    zeros = [torch.zeros(shape.heads, length, shape.attn_dim, dtype=shape.dtype) for _ in range(shape.layers)]
    return PrefixKV(
        keys=zeros,
        values=[torch.zeros(shape.heads, length, shape.linear_dim, dtype=shape.dtype) for _ in zeros],
        positions=torch.arange(length, dtype=torch.int64),
        timestamps=torch.zeros(length, dtype=torch.float64),
        length=length,
        fingerprint=bytes(FINGERPRINT_BYTES),
        model_version="0" * 16,
    )


def disk_overhead_bytes(shape: ModelShape, length: int, fmt: str) -> int:
    """Bytes a disk entry of ``length`` events holds beyond its tensors in ``fmt``."""
    blob = encode(to_cold(_dummy_prefix(shape, length), fmt))
    return len(blob) - shape.token_bytes(fmt) * length  # a blob file holds the blob alone


def _at_risk(latency: LatencyModel, served: np.ndarray, w: Workload) -> np.ndarray:
    predicted = _predict(latency, served)
    return (predicted > w.budget_ms * w.theta) & (served - w.short_term >= w.min_prefix)


def _predict(latency: LatencyModel, n: np.ndarray | float) -> np.ndarray:
    return (
        latency.a
        + latency.b * np.asarray(n, dtype=np.float64)
        + latency.c * np.asarray(n, dtype=np.float64) ** 2
    )


def pace_at(table: tuple[tuple[float, float], ...] | list, n: np.ndarray) -> np.ndarray:
    """The pace of ``table`` at lengths ``n`` (linear between its points, flat beyond)."""
    xs, ys = zip(*sorted((float(a), float(b)) for a, b in table), strict=True)
    return np.interp(np.asarray(n, dtype=np.float64), xs, ys)


def relay_ranking_ms(
    latency: LatencyModel,
    cached: np.ndarray | float,
    new: np.ndarray | float,
    candidates: int,
    relay_pace: tuple[tuple[float, float], ...] | list = ((0.0, 1.0),),
) -> np.ndarray:
    """Device ms of a relay ranking of ``new`` events and ``candidates`` against ``cached`` cached
    ones: ``(predict(cached + new + candidates) - predict(cached)) × relay_pace(cached)``. Without a
    measured pace (1) it leaves out that each candidate reads every cached key, which the
    full-ranking fit spreads over all tokens: at 6,080 cached events the demo's model ranked in
    several times the marginal time."""
    cached = np.asarray(cached, dtype=np.float64)
    marginal = _predict(latency, cached + new + candidates) - _predict(latency, cached)
    return marginal * pace_at(relay_pace, cached)


def device_ms_per_request(latency: LatencyModel, served: np.ndarray, w: Workload) -> dict[str, np.ndarray]:
    """Per history length: pre-inference and ranking device ms of one request (see the module)."""
    risk = _at_risk(latency, served, w)
    prefix = np.maximum(served - w.short_term, 0)
    # As the engine does: a suffix that would cost the ranking more than a slice is pre-inferred too.
    suffix_ms = (_predict(latency, served) - _predict(latency, prefix)) * pace_at(w.prefill_pace, prefix)
    extends = (w.slice_ms > 0) & (suffix_ms > w.slice_ms)
    cached = np.where(extends, served, prefix)
    prefill_pace = pace_at(w.prefill_pace, cached)
    prefill = (_predict(latency, cached) - latency.a) * prefill_pace
    extend_by = max(0, w.new_events - w.short_term)
    extended_from = np.maximum(cached - extend_by, 0)
    extension = (_predict(latency, cached) - _predict(latency, extended_from)) * prefill_pace
    pre = np.where(risk, (1 - w.hit_rate) * prefill + w.hit_rate * extension, 0.0)
    relay = relay_ranking_ms(latency, cached, served - cached, w.candidates, w.relay_pace)
    rank = np.where(risk, relay, _predict(latency, served))
    return {"at_risk": risk, "preinfer_ms": pre, "rank_ms": rank, "prefill_ms": np.where(risk, prefill, 0.0)}


def capacity_plan(
    shape: ModelShape,
    latency: LatencyModel,
    lengths: np.ndarray,
    workload: Workload,
    worker: WorkerShape,
    formats: tuple[str, ...] = COLD_FORMATS,
) -> dict[str, Any]:
    """The capacity figures of ``workload`` on workers of ``worker``'s shape (module docstring)."""
    served = np.minimum(np.asarray(lengths, dtype=np.int64), shape.max_seq_len)
    per = device_ms_per_request(latency, served, workload)
    risk = per["at_risk"]
    share = float(risk.mean()) if len(served) else 0.0
    cached_len = served[risk]
    mean_len = float(cached_len.mean()) if len(cached_len) else 0.0
    preinfer_ms_s = workload.qps * float(per["preinfer_ms"].mean())
    rank_ms_s = workload.qps * float(per["rank_ms"].mean())
    # The device's time is shared by the workers on it: devices for the load, then their workers.
    devices_for_time = math.ceil((preinfer_ms_s + rank_ms_s) / (1000.0 * worker.max_utilisation))
    device_workers = devices_for_time * worker.workers_per_device
    at_risk_users = workload.users * share
    cached_users = workload.hit_rate * at_risk_users
    device_user = float(np.mean([shape.device_bytes(int(n)) for n in cached_len])) if len(cached_len) else 0.0
    out_formats: dict[str, Any] = {}
    for fmt in formats:
        host_user = shape.token_bytes(fmt) * mean_len
        overhead = disk_overhead_bytes(shape, max(1, round(mean_len)), fmt) if mean_len else 0
        disk_user = host_user + overhead
        per_worker = sum(
            budget / b
            for budget, b in (
                (worker.device_bytes, device_user),
                (worker.host_bytes, host_user),
                (worker.disk_bytes, disk_user),
            )
            if b > 0
        )
        cache_workers = math.ceil(cached_users / per_worker) if per_worker > 0 else 0
        out_formats[fmt] = {
            "bytes_per_cached_user": {"device": device_user, "host": host_user, "disk": disk_user},
            "users_per_gb": {
                tier: (GB / b if b > 0 else None)
                for tier, b in (("device", device_user), ("host", host_user), ("disk", disk_user))
            },
            "cached_users_per_worker": per_worker,
            "workers_for_cache": cache_workers,
            "workers": (workers := max(1, cache_workers, device_workers)),
            "devices": math.ceil(workers / worker.workers_per_device),
        }
    return {
        "users": workload.users,
        "qps": workload.qps,
        "at_risk_share": share,
        "cached_users_for_hit_rate": cached_users,
        "hit_rate": workload.hit_rate,
        "mean_cached_len": mean_len,
        "preinfer_device_ms_per_s": preinfer_ms_s,
        "rank_device_ms_per_s": rank_ms_s,
        "workers_for_device_time": device_workers,
        "devices_for_device_time": devices_for_time,
        "workers_per_device": worker.workers_per_device,
        "formats": out_formats,
    }
