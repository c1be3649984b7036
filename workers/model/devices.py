"""Device and dtype resolution for the model: cpu, cuda and (when ``torch_npu`` imports) npu.

Primitives:
- ``DTYPES``: config name -> torch dtype (``float32`` default, ``bfloat16``, ``float16``).
- ``resolve_dtype(name)``, ``resolve_device(name)``: validated torch objects; ``npu`` imports the
  optional ``torch_npu`` extension and fails with an explanation when it is not installed.
- ``synchronize(device)``: wait for queued device work (benchmarks time real work, not launches).
- ``device_name(device)``: what the device is, in words (the accelerator's name; on CPU, the processor's).
- ``keep_host_pages()``: make glibc's allocator keep freed memory for reuse (see its docstring);
  ``keep_all_host_pages()``: the same for blocks of every size (a CPU training process).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"unsupported dtype {name}; use one of {sorted(DTYPES)}")
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(DTYPES)}") from None


def _ensure_npu() -> None:
    try:
        importlib.import_module("torch_npu")  # registers the "npu" device type with torch
    except ImportError as exc:
        raise RuntimeError(
            "device 'npu' needs the Ascend extension torch_npu (pip install 'relaygr[npu]', with the "
            "CANN toolkit installed); it could not be imported: " + str(exc)
        ) from exc


def resolve_device(name: str | torch.device) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N``, ``npu`` or ``npu:N``, checked to be usable here."""
    if isinstance(name, str) and name.split(":")[0] == "npu":
        _ensure_npu()
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {str(device)!r} requested but CUDA is not available")
        return device
    if device.type == "npu":
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise RuntimeError(f"device {str(device)!r} requested but no NPU is available")
        return device
    raise ValueError(f"unsupported device {str(device)!r}; use cpu, cuda[:N] or npu[:N]")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return str(torch.npu.get_device_name(device))  # type: ignore[attr-defined]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # glibc mallopt parameters
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit


def _mallopt():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None


@functools.cache
def keep_host_pages() -> bool:
    """Tell glibc's malloc to serve CPU tensors of up to 32 MiB from its heap and never to return
    freed heap to the kernel. By default a block of a few hundred KiB is a fresh ``mmap``: every
    ranking call then page-faults on all of its scratch buffers (about 1,400 faults, a third of a
    2k-token relay ranking on CPU). Serving processes call this once at start; the cost is that
    the process keeps its peak heap. Returns False (and changes nothing) off glibc."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    return bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok)


@functools.cache
def keep_all_host_pages() -> bool:
    """``keep_host_pages`` for blocks of every size: malloc never maps memory of its own, so a
    block past 32 MiB comes from the heap too and is reused once freed. For a CPU training
    process, whose attention scores and their gradients are blocks of 80 MB and more allocated
    and freed every step: each fresh ``mmap`` of them is zeroed page by page by the kernel, which
    was 28 % of a long-history log's training time (31 of 110 s, 18.8 million page faults) and is
    now 2 % (1.6 s). The process keeps its peak heap; serving processes keep ``keep_host_pages``.
    Returns False (and changes nothing) off glibc."""
    mallopt = _mallopt()
    if mallopt is None or not keep_host_pages():
        return False
    return bool(mallopt(_M_MMAP_MAX, 0) == 1)
