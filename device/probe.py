"""The device check's first step: what this machine offers, as one JSON line.

``python -m relaygr.device.probe --device cuda`` prints the Python and torch in use (and
where they come from), the device's name, memory and compute capability, whether pinned host
memory works (a pinned tensor copied to the device and back, with its host-to-device GB/s), a
short matmul's TFLOP/s in fp32 and bf16, the CPU cores, the project's own Python dependencies
(present or missing) and the broker's prerequisites. Exits 1 when the requested device cannot be
used, with the reason in the line.

Primitives: ``probe(device) -> dict``, ``pinned_copy(device) -> dict``, ``matmul_tflops``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from typing import TYPE_CHECKING

try:  # a machine without torch still gets its line, saying so
    import torch
except ImportError as _e:
    if not TYPE_CHECKING:
        torch = None
    TORCH_ERROR = str(_e)

PROJECT_MODULES = (
    "numpy",
    "pydantic",
    "pydantic_settings",
    "safetensors",
    "rocksdict",
    "aiokafka",
    "faust",
    "pyarrow",
    "matplotlib",
    "prometheus_client",
    "recbole",
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def pinned_copy(device: torch.device, mib: int = 64) -> dict:
    """A pinned host tensor to the device and back: does it arrive whole, and how fast."""
    if device.type == "cpu":
        return {"pinned_memory": None, "why": "no accelerator: host and device are one memory"}
    host = torch.arange(mib * (1 << 20) // 4, dtype=torch.float32).pin_memory()
    assert host.is_pinned()
    on_dev = host.to(device, non_blocking=True)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        on_dev = host.to(device, non_blocking=True)
    _sync(device)
    secs = (time.perf_counter() - t0) / 5
    back = on_dev.cpu()
    return {
        "pinned_memory": bool(torch.equal(back, host)),
        "h2d_gb_per_s": round(host.numel() * 4 / secs / 1e9, 1),
        "copied_mib": mib,
    }


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 4096, repeats: int = 5) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return round(2 * n**3 * repeats / (time.perf_counter() - t0) / 1e12, 4)


def _device_facts(device: torch.device) -> dict:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        props = torch.cuda.get_device_properties(device)
        return {
            "name": torch.cuda.get_device_name(device),
            "memory_total_gib": round(total / 2**30, 1),
            "memory_free_gib": round(free / 2**30, 1),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
            "multiprocessors": props.multi_processor_count,
            "cuda": torch.version.cuda,
            "devices": torch.cuda.device_count(),
        }
    if device.type == "npu":
        return {"name": str(torch.npu.get_device_name(device)), "devices": torch.npu.device_count()}
    from relaygr.workers.model.devices import device_name

    return {"name": device_name(device)}


def probe(device_name: str) -> dict:
    out: dict = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "cpu_cores": len(os.sched_getaffinity(0)),
        "modules": {m: importlib.util.find_spec(m) is not None for m in PROJECT_MODULES},
        "java": shutil.which("java"),
        "mvn": shutil.which("mvn"),
        "bootstrap": os.environ.get("RELAYGR_BOOTSTRAP"),
        "installed_here": os.environ.get("RELAYGR_DEVICE_CHECK_INSTALLED", ""),
        "requested_device": device_name,
    }
    if torch is None:
        return {**out, "ok": False, "reason": f"torch does not import: {TORCH_ERROR}"}
    out |= {"torch": torch.__version__, "torch_path": os.path.dirname(torch.__file__)}
    out["cuda_available"] = torch.cuda.is_available()
    try:
        from relaygr.workers.model.devices import resolve_device

        device = resolve_device(device_name)
    except (RuntimeError, ValueError) as e:
        return {**out, "ok": False, "reason": str(e)}
    out["device"] = _device_facts(device)
    out |= pinned_copy(device)
    out["matmul_tflops"] = {
        name: matmul_tflops(device, dtype, n=4096 if device.type != "cpu" else 256)
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    ok = out.get("pinned_memory") is not False
    return {**out, "ok": ok, "reason": "" if ok else "a pinned copy did not arrive whole"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    row = {"bench": "device-probe", **probe(args.device)}
    print(json.dumps(row), flush=True)
    return 0 if row["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
