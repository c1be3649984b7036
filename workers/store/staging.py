"""Copies between host memory and a CUDA device: disk reads headed to the device (one reusable
pinned staging buffer and per-layer async copies), and demoted prefixes headed to host memory.

Primitives:
- ``PinnedStaging(device)``: for a disk tier serving a CUDA device.
  - ``alloc(n) -> memoryview``: the staging buffer's first ``n`` bytes (pinned, page-aligned: a
    target for ``O_DIRECT``), grown when a larger blob arrives and reused otherwise.
  - ``to_device(prefix) -> PrefixKV``: ``prefix`` (whose tensors view into the staging buffer)
    copied to the device on a side stream, layer by layer, one event recorded per layer; the
    device's default stream waits on each event (work queued there after the lookup reads the
    copied tensors), and the call returns once the last layer's copy has completed, so that the
    buffer may be refilled and the caller's clock includes the copy.
- ``staging_for(device) -> PinnedStaging | None``: one for a CUDA device, None elsewhere (on a
  CPU the read's own fresh buffer becomes the prefix: nothing to copy).
- ``to_host(prefix, pin)``: ``prefix`` in host memory. From CUDA: every tensor copied into pinned
  memory (``pin``) on a side stream, a layer at a time without a wait per copy, after the work
  queued before it (the gather of its pages); the call returns once the last copy landed. On a CPU
  it is ``prefix`` itself.

``PinnedStaging``: one thread at a time (the store's disk reader); ``to_host``: the copy thread.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from relaygr.workers.prefix_kv import PrefixKV
from relaygr.workers.store.blob_files import ALIGN, round_up


class PinnedStaging:
    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"pinned staging serves a CUDA device, not {device}")
        self.device = device
        self._buf: torch.Tensor | None = None
        self._stream = torch.cuda.Stream(device)

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def alloc(self, n: int) -> memoryview:
        if self._buf is None or self._buf.numel() < n:
            self._buf = None  # release the smaller one first
            buf = torch.empty(round_up(n), dtype=torch.uint8, pin_memory=True)
            if buf.data_ptr() % ALIGN:  # pinned blocks are page-aligned; O_DIRECT relies on it
                raise RuntimeError("pinned staging buffer is not page-aligned")
            self._buf = buf
        return memoryview(self._buf[:n].numpy())

    def to_device(self, prefix: PrefixKV) -> PrefixKV:
        device, stream = self.device, self._stream
        default = torch.cuda.default_stream(device)
        stream.wait_stream(default)  # no copy may overtake work already queued on the device

        def move(t: torch.Tensor) -> torch.Tensor:
            out = t.to(device, non_blocking=True)
            out.record_stream(default)  # allocated on the side stream, used on the default one
            return out

        keys, values, events = [], [], []
        with torch.cuda.stream(stream):
            for k, v in zip(prefix.keys, prefix.values, strict=True):
                keys.append(move(k))
                values.append(move(v))
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
            scales = [move(s) for s in prefix.scales]
            positions, timestamps = move(prefix.positions), move(prefix.timestamps)
            last = torch.cuda.Event()
            last.record(stream)
        for event in events:
            default.wait_event(event)
        default.wait_event(last)
        last.synchronize()  # the staging buffer is free again, and the prefix is on the device
        return replace(
            prefix, keys=keys, values=values, scales=scales, positions=positions, timestamps=timestamps
        )


def staging_for(device: torch.device) -> PinnedStaging | None:
    return PinnedStaging(device) if device.type == "cuda" else None


def to_host(prefix: PrefixKV, *, pin: bool = True) -> PrefixKV:
    """``prefix`` in host memory (see the module docstring)."""
    device = prefix.device
    if device.type == "cpu":
        return prefix
    if device.type != "cuda":
        return prefix.to("cpu")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.default_stream(device))  # after its pages' gather

    def move(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        out.copy_(t, non_blocking=pin)
        t.record_stream(stream)  # read here: not reused before this copy is done
        return out

    with torch.cuda.stream(stream):
        keys, values = [], []
        for k, v in zip(prefix.keys, prefix.values, strict=True):
            keys.append(move(k))
            values.append(move(v))
        scales = [move(s) for s in prefix.scales]
        positions, timestamps = move(prefix.positions), move(prefix.timestamps)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    return replace(
        prefix, keys=keys, values=values, scales=scales, positions=positions, timestamps=timestamps
    )
