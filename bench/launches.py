"""Device operations per ranking, relay and full side by side, counted on any machine.

A ranking's cost on an accelerator is set as much by how many operations it dispatches (each one a
kernel launch) as by its arithmetic. This benchmark counts the aten operations one ranking
dispatches, views and metadata aside, with the model on the meta device: the model's very code
runs, dispatching the same operations as on a CPU, but no tensor is computed or allocated, so a
32k-event full ranking counts on a laptop. Copies between the host and the device (the request's
ids, positions and timestamps in, the scores out) are transfers, not kernels, and are not counted. One JSON line per model shape and history length: ``relay_ops`` (a
cached prefix of ``events - suffix`` events, the suffix and the candidates) and ``full_ops`` (the
whole history and the candidates), ``relay_graphed_ops`` (the bucketed relay forward that a CUDA
graph captures: one launch when replayed), their limits, and the counts per layer.

Primitives:
- ``DispatchCounter``: a ``TorchDispatchMode`` that counts operations by name (``counts``, ``total``);
  the scores' copy off the meta device comes back as an empty host tensor.
- ``count_ranking(model, events, suffix, candidates, path)``: the counter after one ranking of a
  synthetic history (``path`` ``relay`` or ``full``).
- ``count_graphed(model, events, suffix, candidates, users, backend)``: the counter of one bucketed
  relay forward (``graph_runner.BucketRunner``, over pages on the meta device), what a CUDA graph captures; ``backend`` ``triton``
  (``stubbed_launches``): as on CUDA, the Triton attention's host side run and each of its kernel
  launches counted as one operation (``relay_graphed_cuda_ops``; ``None`` without Triton).
- ``graphed_bytes(config, prefix, suffix, candidates, users, elem_bytes)``: the key and value bytes
  one graphed relay ranking moves, computed: ``paged`` (the attention reads each user's real keys
  in place through a row index) beside ``gathered`` (the earlier scheme: per layer every key slot
  of a power-of-two prefix bucket copied out of the pool, then read again by the attention).
  Each key row counted once per layer (the other query blocks of a program find it in cache).
- ``relay_limit(layers)``, ``full_limit(layers)``: the bounds the suite holds the counts to.
- ``add_arguments`` / ``run``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from relaygr.workers.model.graph_runner import BucketRunner, bucket_for, pool_tokens_for
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.presets import PRESETS, preset
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.prefix_kv import Events, PrefixKV

DEFAULT_LENGTHS = "1024,8192,32768"
GATHERED_BLOCK_TOKENS = 256
"""Tokens of a block of the earlier, gathered scheme (``graphed_bytes``)."""
DEFAULT_PRESETS = "small,large"
_aten = torch.ops.aten
METADATA_OPS = frozenset(
    {
        _aten._unsafe_view.default,
        _aten.lift_fresh.default,
        _aten.detach_.default,
        _aten.sym_size.int,
        _aten.sym_stride.int,
        _aten.sym_numel.default,
        _aten.sym_storage_offset.default,
        _aten.is_contiguous.default,
    }
)
"""Operations that only read or relabel a tensor's metadata (shape, strides, autograd flag)."""


class DispatchCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, views and ``METADATA_OPS`` aside."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.transfers = 0  # copies between the host and the device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copy = func.overloadpacket in (_aten._to_copy, _aten.to)
        if copy and _transfer(args, kwargs):
            self.transfers += 1
            if args[0].device.type == "meta":  # the scores out: nothing to copy
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        # ``to`` is an alias when it changes nothing (not counted), a conversion kernel otherwise.
        converts = func.overloadpacket is _aten.to and out is not args[0]
        if converts or (not func.is_view and func not in METADATA_OPS):
            self.counts[str(func.overloadpacket.__name__)] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _transfer(args: tuple, kwargs: dict) -> bool:
    """Whether a copy (``to``, ``_to_copy``) moves its tensor between the host and the device."""
    targets = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, torch.device | str)]
    return any(torch.device(t).type != args[0].device.type for t in targets)


def relay_limit(layers: int) -> int:
    """The most operations a relay ranking may dispatch: 12 per layer and 40."""
    return 12 * layers + 40


def full_limit(layers: int) -> int:
    """The most operations a full ranking may dispatch: 16 per layer and 60."""
    return 16 * layers + 60


def _history(n: int, num_items: int) -> Events:
    gen = torch.Generator().manual_seed(n)
    return Events(
        item_ids=torch.randint(1, num_items + 1, (n,), generator=gen),
        action_ids=torch.randint(1, 6, (n,), generator=gen),
        timestamps=8.8e8 + torch.cumsum(torch.randint(0, 4000, (n,), generator=gen).double(), 0),
    )


def _meta_prefix(runner: ModelRunner, history: Events) -> PrefixKV:
    """A prefix of ``history``'s length in the runner's pages on the meta device, as the prefix
    store's device tier holds one: nothing is computed or allocated."""
    return PrefixKV.paged(runner.pages.allocate(len(history)), b"", runner.model_version)


def count_ranking(model: HSTURanker, events: int, suffix: int, candidates: int, path: str) -> DispatchCounter:
    """The operations one ranking of an ``events``-event history dispatches (``path``: ``relay``,
    the last ``suffix`` events after a cached prefix; ``full``: no cache), ``model`` on the meta
    device (``on_meta``)."""
    if path not in ("relay", "full"):
        raise ValueError(f"path must be relay or full, got {path!r}")
    if not 0 <= suffix <= events:
        raise ValueError(f"suffix {suffix} must be within the {events} events")
    history = _history(events, model.config.num_items)
    cands = torch.randint(1, model.config.num_items + 1, (candidates,), generator=torch.Generator())
    when = float(history.timestamps[-1]) + 30.0
    if model.device.type != "meta":
        raise ValueError("count_ranking needs a model on the meta device (on_meta)")
    cut = events - suffix
    runner = ModelRunner(model, pool_tokens=pool_tokens_for(cut))
    prefix = _meta_prefix(runner, history.slice(0, cut))

    def rank() -> None:
        if path == "relay":
            runner.rank(prefix, history.slice(cut), cands, when)
        else:
            runner.rank_full(history, cands, when)

    with DispatchCounter():
        rank()  # once first: the weights' derived form and the position table are built and kept
    counter = DispatchCounter()
    with counter:
        rank()
    return counter


class _Launch:
    """A Triton kernel whose launch dispatches one placeholder operation instead of running."""

    def __getitem__(self, grid: tuple) -> object:
        def launch(*args: object, **kwargs: object) -> None:
            torch.empty(0, device="meta").add_(0)

        return launch


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Inside, the Triton attention runs its host side (on the meta device) and each kernel
    launch counts as one operation (an ``add_``): what a CUDA graph of it holds."""
    from relaygr.workers.kernels import triton_hstu, use_backend

    names = ("_hstu_fwd_kernel", "_hstu_fwd_grouped_kernel", "_finish_kernel")
    kept = {name: getattr(triton_hstu, name) for name in names}
    try:
        for name in names:
            setattr(triton_hstu, name, _Launch())
        with use_backend("triton"):
            yield
    finally:
        for name, kernel in kept.items():
            setattr(triton_hstu, name, kernel)


def count_graphed(
    model: HSTURanker, events: int, suffix: int, candidates: int, users: int = 1, backend: str = "cpu"
) -> DispatchCounter:
    """The operations of one bucketed relay forward (``graph_runner.BucketRunner.forward``, what
    a CUDA graph captures) for ``users`` users of ``events - suffix`` cached events, ``suffix`` new
    ones and ``candidates``, ``model`` on the meta device: the request's inputs are written before
    it and the scores read after it, so it has no transfer at all."""
    if model.device.type != "meta":
        raise ValueError("count_graphed needs a model on the meta device (on_meta)")
    cfg = model.config
    bucket = bucket_for(users, suffix, candidates)
    if bucket is None:
        raise ValueError(f"{users} users of {suffix} events and {candidates} candidates fit no bucket")
    prefix = max(events - suffix, cfg.max_seq_len)  # the buckets' capacity (``GraphRelay``)
    served = ModelRunner(model, pool_tokens=pool_tokens_for(prefix, users))
    pages = served.pages
    runner = BucketRunner(served, served.serving(), pages, bucket, -(-prefix // pages.page_tokens))
    if backend not in ("cpu", "triton"):
        raise ValueError(f"backend must be cpu or triton, got {backend!r}")
    with stubbed_launches() if backend == "triton" else contextlib.nullcontext():
        with DispatchCounter():
            runner.forward()  # once first, as ``count_ranking``
        counter = DispatchCounter()
        with counter:
            runner.forward()
    return counter


def graphed_bytes(
    config, prefix: int, suffix: int, candidates: int, users: int = 1, elem_bytes: int = 2
) -> dict[str, int]:
    """Bytes one graphed relay ranking of ``users`` users (``prefix`` cached tokens, ``suffix``
    new events, ``candidates`` candidates each) moves for its keys and values, over all layers:
    ``paged`` and ``gathered`` (see the module docstring); 16-bit keys by default."""
    bucket = bucket_for(users, suffix, candidates)
    if bucket is None:
        raise ValueError(f"{users} users of {suffix} events and {candidates} candidates fit no bucket")
    rows = bucket.suffix + bucket.candidates
    row = config.heads * (config.attn_dim + config.linear_dim) * elem_bytes  # a key and its value
    blocks = max(1, -(-prefix // GATHERED_BLOCK_TOKENS))
    padded = users * ((1 << (blocks - 1).bit_length()) * GATHERED_BLOCK_TOKENS + rows)
    real = users * (prefix + rows)
    new_rows = 2 * users * rows * row  # each layer's new keys and values into the pool (both)
    # Per key: gathered, the copy's read and write, its index twice, the attention's read and
    # position, timestamp and relative position; paged, the read, its row index and the same three.
    gathered = padded * (3 * row + 2 * 8 + 20) + new_rows
    paged = real * (row + 8 + 20) + new_rows
    return {"paged": paged * config.layers, "gathered": gathered * config.layers}


def on_meta(model: HSTURanker) -> HSTURanker:
    """``model`` moved to the meta device (its version kept: prefixes are checked against it)."""
    return model.to("meta")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="history lengths, comma separated")
    parser.add_argument(
        "--presets",
        default=DEFAULT_PRESETS,
        help=f"model shapes ({', '.join(sorted(PRESETS))}), comma separated",
    )
    parser.add_argument("--suffix", type=int, default=64, help="events after the cached prefix (relay)")
    parser.add_argument("--candidates", type=int, default=128)
    parser.add_argument("--by-op", action="store_true", help="also the count of each operation")


def run(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    names = [x.strip() for x in args.presets.split(",") if x.strip()]
    shapes = [preset(name) for name in names]  # an unknown name fails before anything is counted
    has_triton = importlib.util.find_spec("triton") is not None
    if any(n < args.suffix or n < 1 for n in lengths):
        raise SystemExit(f"--lengths: every length must be at least --suffix ({args.suffix}) and 1")
    for shape in shapes:
        torch.manual_seed(0)
        model = on_meta(HSTURanker(shape.config(dropout=0.0)).eval())
        layers = model.config.layers
        for n in lengths:
            relay = count_ranking(model, n, args.suffix, args.candidates, "relay")
            full = count_ranking(model, n, args.suffix, args.candidates, "full")
            graphed = count_graphed(model, n, args.suffix, args.candidates)
            cuda = (
                count_graphed(model, n, args.suffix, args.candidates, backend="triton")
                if has_triton
                else None
            )
            row = {
                "bench": "launches",
                "preset": shape.name,
                "layers": layers,
                "events": n,
                "suffix": args.suffix,
                "candidates": args.candidates,
                "relay_ops": relay.total,
                "full_ops": full.total,
                # The bucketed forward a CUDA graph replays as one launch (its operations inside).
                "relay_graphed_ops": graphed.total,
                # The same forward as CUDA captures it: Triton attention, a launch one operation.
                "relay_graphed_cuda_ops": None if cuda is None else cuda.total,
                # Key and value bytes of that forward (16-bit), computed: in place and as copied.
                **{
                    f"relay_graphed_{k}_bytes": v
                    for k, v in graphed_bytes(
                        model.config, n - args.suffix, args.suffix, args.candidates
                    ).items()
                },
                "relay_limit": relay_limit(layers),
                "full_limit": full_limit(layers),
                "relay_ops_per_layer": round(relay.total / layers, 2),
                "full_ops_per_layer": round(full.total / layers, 2),
            }
            if args.by_op:
                row["relay_by_op"] = dict(relay.counts.most_common())
                row["full_by_op"] = dict(full.counts.most_common())
            print(json.dumps(row), flush=True)
    return 0
