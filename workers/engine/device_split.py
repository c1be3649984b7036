"""Several ranking workers on one device: each process's share of the device's memory.

A GPU host has many cores and one accelerator, and one Python process a worker cannot use them:
its asyncio loop (Kafka, decoding, history, scheduling) is one core. ``relaygr up
--workers-per-device N`` runs N worker processes on each device, each owning its own partitions
(the consumer group's range assignor keeps a user's signal and request on one of them), and each
given 1/N of what the device offers for prefixes: its device tier and its graph pool.

Primitives:
- ``device_memory_bytes(device)``: the accelerator's total memory (None for a CPU, whose "device
  tier" is host memory, budgeted by the settings alone).
- ``DeviceShare``: one worker's device tier and graph pool, MiB.
- ``split_device(workers, cache_mb, graph_pool_mb, total_bytes)``: each of ``workers`` processes'
  share: on an accelerator, ``PREFIX_SHARE`` of its memory (the rest holds the weights, the
  activations and the allocator's slack of every process) split between device tier and graph pool
  as the configured budgets are, then by the workers; on a CPU, the configured budgets split by
  the workers (together they hold what one worker would).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX_SHARE = 0.6
"""Share of an accelerator's memory the workers on it give to cached prefixes, all together."""
MIB = 1 << 20


@dataclass(frozen=True)
class DeviceShare:
    workers: int
    cache_mb: float  # device tier of one worker
    graph_pool_mb: float  # paged pool its CUDA graphs read

    def env(self) -> dict[str, str]:
        """The ``RELAYGR_*`` settings that give a worker this share."""
        return {
            "RELAYGR_DEVICE_CACHE_MB": f"{self.cache_mb:.3f}",
            "RELAYGR_GRAPH_POOL_MB": f"{self.graph_pool_mb:.3f}",
        }


def device_memory_bytes(device: str | None) -> int | None:
    """Total memory of the accelerator ``device`` names (``cuda``, ``cuda:1``, ``npu:0``); None
    for a CPU or no device named."""
    if device is None or not device.startswith(("cuda", "npu")):
        return None
    import torch

    from relaygr.workers.model.devices import resolve_device

    dev = resolve_device(device)
    backend = torch.cuda if dev.type == "cuda" else getattr(torch, "npu", None)
    if backend is None or not backend.is_available():
        raise ValueError(f"device {device!r} is not available here")
    return int(backend.mem_get_info(dev)[1])


def split_device(workers: int, cache_mb: float, graph_pool_mb: float, total_bytes: int | None) -> DeviceShare:
    if workers < 1:
        raise ValueError(f"at least one worker a device, not {workers}")
    if cache_mb < 0 or graph_pool_mb <= 0:
        raise ValueError(
            f"budgets must be positive: device cache {cache_mb} MiB, graph pool {graph_pool_mb} MiB"
        )
    if total_bytes is None:
        return DeviceShare(workers, cache_mb / workers, graph_pool_mb / workers)
    if total_bytes <= 0:
        raise ValueError(f"a device of {total_bytes} bytes holds no prefixes")
    each = total_bytes * PREFIX_SHARE / workers / MIB
    cache_part = cache_mb / (cache_mb + graph_pool_mb)
    return DeviceShare(workers, each * cache_part, each * (1 - cache_part))
