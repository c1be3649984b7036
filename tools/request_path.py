"""Which of the project's files one rank request runs through, and how many lines they hold.

The rank handler of a ranking worker (``streams.ranking.rank_handler.RankHandler``, without Kafka) handles
one request of a user whose behaviours are in a real history table (RocksDB), against a tiny
ranker on its device thread and a real prefix store. On the relay path (the default) the user's
prefill signal is handled first, as the worker would; ``--path full`` sends no signal. A warm-up
request of another user runs first, so that what is counted is the steady state, not first-call
set-up. The latency model is flat (full ranking always fits), so the path taken is the one asked
for on any machine: this counts code, not time. A profile hook on every thread (the event loop's and the device thread) records each
Python function of the project called during ``RankHandler.rank``; TorchScript functions called
from Python are counted by their source file (what runs inside them is not seen).

Prints one JSON line: the path taken, the history length, prefix length and candidates it was
measured at, the number of files and their lines, the lines of the functions that ran, and the
same per file.

Primitives: ``trace_request(args)`` (the record of one request), ``add_arguments``, ``run``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relaygr.tools.args import int_at_least

# The program's packages (subpackages included): a file is the project's if it lies in one of their
# folders.
PACKAGES = (
    "relaygr",
    "relaygr.schemas",
    "relaygr.streams",
    "relaygr.streams.ranking",
    "relaygr.workers",
    "relaygr.workers.kernels",
    "relaygr.workers.model",
    "relaygr.workers.store",
    "relaygr.workers.engine",
    "relaygr.workers.training",
    "relaygr.infra",
    "relaygr.infra.local",
    "relaygr.tools",
    "relaygr.bench",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", choices=["relay", "full"], default="relay", help="the request's path")
    parser.add_argument("--history", type=int_at_least(2), default=300, help="events in the user's history")
    parser.add_argument("--candidates", type=int_at_least(1), default=64)
    parser.add_argument(
        "--short-term", type=int_at_least(1), default=16, help="events left out of the prefix (< --history)"
    )
    parser.add_argument("--files", action="store_true", help="print the files one per line, not JSON")


def project_folders() -> dict[Path, str]:
    """Folder of each package -> its name as a path (``relaygr/streams``)."""
    out = {}
    for name in PACKAGES:
        module = importlib.import_module(name)
        out[Path(module.__file__ or "").resolve().parent] = name.replace(".", "/")
    return out


@dataclass
class CallRecorder:
    """A profile hook (``sys.setprofile``) that keeps the code objects called while ``on``, and
    the TorchScript functions called from Python (``watch_scripted``)."""

    on: bool = False
    codes: set[types.CodeType] = field(default_factory=set)
    scripted: set[Any] = field(default_factory=set)

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if self.on and event == "call":
            self.codes.add(frame.f_code)

    def clear(self) -> None:
        self.codes.clear()
        self.scripted.clear()


@contextlib.contextmanager
def watch_scripted(recorder: CallRecorder) -> Iterator[None]:
    """A profile hook does not see a call of a TorchScript function (a C++ object): each one the
    project's modules hold is swapped for a Python wrapper that notes the call, and put back after."""

    def noting(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if recorder.on:
                recorder.scripted.add(fn)
            return fn(*args, **kwargs)

        return call

    swapped = []
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("relaygr."):
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.jit.ScriptFunction):
                    swapped.append((module, name, value))
                    setattr(module, name, noting(value))
    try:
        yield
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


def _span(code: types.CodeType) -> int:
    """Lines of a function: from its first line to the last line of its body."""
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return last - code.co_firstlineno + 1


def _scripted_code(fn: Any) -> types.CodeType | None:
    """The Python function a TorchScript function was compiled from."""
    module, _, name = fn.qualified_name.removeprefix("__torch__.").rpartition(".")
    original = getattr(sys.modules.get(module), "_" + name, None) or getattr(
        sys.modules.get(module), name, None
    )
    return getattr(original, "__code__", None)


def summarise(recorder: CallRecorder, folders: dict[Path, str]) -> dict[str, dict[str, Any]]:
    """Per project file (``relaygr/streams/ranking/rank_handler.py``): its lines, the functions that ran
    and their lines."""
    codes = set(recorder.codes) | {c for f in recorder.scripted if (c := _scripted_code(f)) is not None}
    files: dict[str, dict[str, Any]] = {}
    me = Path(__file__).resolve()
    for code in codes:
        path = Path(code.co_filename).resolve()
        if path == me or path.parent not in folders or code.co_name == "<module>":
            continue
        name = f"{folders[path.parent]}/{path.name}"
        row = files.setdefault(name, {"lines": len(path.read_text().splitlines()), "functions": {}})
        row["functions"][code.co_qualname] = _span(code)
    return dict(sorted(files.items()))


async def _one_request(args: argparse.Namespace, recorder: CallRecorder, workdir: Path) -> dict[str, Any]:
    from relaygr.schemas import PrefillSignal, RankRequest, TriggerReason
    from relaygr.streams.config import PipelineSettings
    from relaygr.streams.history import HistoryTable
    from relaygr.streams.history_alignment import HistoryAlignment
    from relaygr.streams.ranking.rank_handler import RankHandler
    from relaygr.workers.engine.engine_config import EngineConfig
    from relaygr.workers.engine.latency_model import LatencyModel
    from relaygr.workers.engine.ranker import RankingEngine
    from relaygr.workers.engine.scheduler import DeviceScheduler
    from relaygr.workers.model.model import HSTUConfig, HSTURanker
    from relaygr.workers.model.runner import ModelRunner
    from relaygr.workers.store.prefix_store import PrefixStore, PrefixStoreConfig

    torch.manual_seed(0)
    model = HSTURanker(HSTUConfig(layers=2, heads=2, dim=32, attn_dim=16, linear_dim=16, num_items=500))
    model.refresh_version()
    store = PrefixStore(PrefixStoreConfig(device_budget_bytes=1 << 26), model.model_version)
    # A flat latency model: full ranking always fits, so the path is the one asked for.
    engine = RankingEngine(
        ModelRunner(model), store, DeviceScheduler("w0"), EngineConfig(), LatencyModel(1.0, 0.0, 0.0)
    )
    history = HistoryTable(workdir / "history")
    pipeline = PipelineSettings(short_term=args.short_term)
    handler = RankHandler(
        engine, history, HistoryAlignment(history), pipeline, "w0", lambda **_: None, lambda _p: None
    )
    now, n = time.time(), args.history
    needs = _seed_histories(history, ("warm", "u"), n, now)

    async def request(user: str) -> Any:
        relay = args.path == "relay"
        if relay:
            signal = PrefillSignal(
                request_id=f"r-{user}",
                user_id=user,
                ts=now,
                history_len=n,
                prefix_len=n - args.short_term,
                issued_at=time.time(),
                behaviors_needed=needs,
            )
            await handler.prefill(signal, 0)
        rank = RankRequest(
            request_id=f"r-{user}",
            user_id=user,
            ts=now,
            candidates=list(range(1, args.candidates + 1)),
            deadline_ts=time.time() + 60.0,
            prefill_expected=relay,
            trigger=TriggerReason.ADMITTED if relay else TriggerReason.NOT_AT_RISK,
            produced_at=time.time(),
            behaviors_needed=needs,
        )
        recorder.on = True
        try:
            return await handler.rank(rank, 0)
        finally:
            recorder.on = False

    with watch_scripted(recorder):
        await request("warm")
        recorder.clear()
        result = await request("u")
    engine.scheduler.close()
    history.close()
    return {
        "path": str(result.path),
        "history_len": n,
        "prefix_len": result.prefix_len,
        "candidates": args.candidates,
    }


def _seed_histories(history: Any, users: tuple[str, ...], n: int, now: float) -> dict[str, int]:
    """``n`` random behaviours of each user in partition 0 of ``history`` (a ``HistoryTable``),
    in the last hour; returns what a request must see applied (``behaviors_needed``)."""
    from relaygr.schemas import BehaviorBatch

    gen = torch.Generator().manual_seed(0)
    offset = 0
    for user in users:
        items = torch.randint(1, 500, (n,), generator=gen).tolist()
        batch = BehaviorBatch(
            user_id=user,
            item_ids=items,
            timestamps=[now - 3600 + i for i in range(n)],
            actions=[1] * n,
            source_partitions=[0] * n,
            source_offsets=list(range(offset, offset + n)),
        )
        offset += n
        history.append_many(0, [(offset, batch)], progress={0: offset})
    return {"0": offset}


def trace_request(args: argparse.Namespace) -> dict[str, Any]:
    """The record of one rank request: its path and the project files it ran through."""
    recorder = CallRecorder()
    threading.setprofile(recorder)  # threads started from here on: the device thread
    sys.setprofile(recorder)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            measured = asyncio.run(_one_request(args, recorder, Path(tmp)))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    files = summarise(recorder, project_folders())
    return {
        "bench": "request_path",
        **measured,
        "files": len(files),
        "file_lines": sum(f["lines"] for f in files.values()),
        "function_lines": sum(sum(f["functions"].values()) for f in files.values()),
        "by_file": {
            name: {
                "lines": f["lines"],
                "functions": len(f["functions"]),
                "function_lines": sum(f["functions"].values()),
            }
            for name, f in files.items()
        },
    }


def run(args: argparse.Namespace) -> int:
    if args.short_term >= args.history:
        print(f"--short-term ({args.short_term}) must be below --history ({args.history})", file=sys.stderr)
        return 2
    record = trace_request(args)
    if args.files:
        for name, f in record["by_file"].items():
            print(f"{f['lines']:>6} {f['functions']:>4} {f['function_lines']:>6}  {name}")
        print(f"{record['file_lines']:>6} {record['files']:>4} files  path={record['path']}")
    else:
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
