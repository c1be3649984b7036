"""The HSTU ranker RelayGR serves: config, layers, prefix KV cache, target-aware scoring.

Primitives:
- ``HSTUConfig``: the typed model config (shape, buckets, normaliser, dtype, device, block sizes).
- ``HSTULayer``: one HSTU block. ``U, Q, K, V = silu(W x_norm)`` from one projection;
  pointwise attention ``silu(q.k / sqrt(d) + bias) v / N`` (no softmax, fixed ``N``) with a
  relative bias from the position difference and time gap of each token pair; the normalised
  attention output is gated by ``U`` and projected back into the residual stream.
- ``HSTURanker``: token = item embedding + action embedding. History tokens attend causally.
  A candidate is one more token (its item, the reserved candidate action) placed right after
  the history at the request's timestamp; it attends to every history token and to itself, never
  to another candidate. Its score is what the layers added to it (final residual stream minus
  its input embedding: the answer of the history to "how about this item?"), normalised and
  dotted with its item embedding. Leaving the input out keeps the item's own embedding norm
  from swamping the history's contribution.
  Inference API (all under ``torch.inference_mode``, on the config's device and dtype):
  ``prefill`` / ``prefill_steps`` (history -> ``PrefixKV``, optionally chunk by chunk),
  ``extend`` (``PrefixKV`` + longer history -> ``PrefixKV``), ``rank`` (cached prefix + suffix +
  candidates -> scores), ``rank_and_extend`` (the same, plus the prefix grown by the suffix),
  ``rank_many`` (a burst of one user's requests against one prefix, the new events computed
  once), ``rank_full`` (the no-cache baseline, same code and same care),
  ``item_embeddings``, ``save`` / ``load``, ``flops`` (what one call computes).
  Training: ``train_scores`` scores candidates at many cut points of a padded batch with the
  dense reference attention; it is the same function as the serving path (tests hold them equal).

Relay exactness: every history token's keys and values depend only on the tokens before it
(causal), the bias depends only on absolute positions and timestamps of the pair, and ``N`` is a
constant. So the cache of the first ``n`` events is the same whichever longer history they start,
and ``rank(prefill(h[:n]), h[n:], c) == rank_full(h, c)`` up to float rounding.

The last layer's history tokens only provide keys and values (no later layer reads their
outputs, and scores come from candidate tokens), so that layer computes just K and V for them,
on the cached and the full path alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from torch import nn

from relaygr.workers.devices import resolve_device, resolve_dtype
from relaygr.workers.fused_scoring import (
    advance_tokens,
    candidate_index,
    layer_weights,
    rank_relay,
    score_candidates,
    unspecialised,
)
from relaygr.workers.hstu_attention import (
    Segment,
    dense_attention,
    key_block_size,
    pair_index,
    plan_attention,
    run_attention,
    wide_bias_table,
)
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SELF_BIAS_INDEX = 0
"""Bias index of a token with itself: position bucket 0 and time bucket 0."""
FUSED_MAX_ROWS = 256
"""History chunks up to this many tokens run fused: a ranking's short-term suffix and the events
new since its prefix. Pre-inference chunks are longer, run off the ranking path and are
matmul-bound anyway."""


class HSTUConfig(BaseModel):
    """Shape and runtime settings of an ``HSTURanker``; saved next to its weights."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    num_items: int = Field(1682, ge=1)
    """Largest raw item id. Ids 1..num_items have embeddings; 0 and any other id share the
    padding/unknown embedding (row 0), so an unseen id never raises."""
    num_actions: int = Field(5, ge=1)
    """Behaviour types, ids 1..num_actions (MovieLens: the rating). 0 means none/unknown and
    num_actions + 1 is reserved for candidate tokens."""
    layers: int = Field(2, ge=1)
    """Number of HSTU layers."""
    heads: int = Field(2, ge=1)
    """Attention heads per layer."""
    dim: int = Field(64, ge=1)
    """Model (embedding and residual stream) dimension."""
    attn_dim: int = Field(32, ge=1)
    """Query/key dimension per head."""
    linear_dim: int = Field(32, ge=1)
    """Value/gate (U) dimension per head."""
    position_buckets: int = Field(64, ge=1)
    """Buckets of the position difference i - j: exact below 16, then four per doubling
    (64 buckets distinguish distances up to 65536)."""
    time_buckets: int = Field(64, ge=1)
    """Buckets of the time gap ts_i - ts_j in seconds: two per doubling, gaps under 1.5 s in
    bucket 0 (64 buckets cover about 70 years)."""
    max_len: int = Field(256, ge=2)
    """Training window in events. Inference takes histories of any length."""
    max_seq_len: int = Field(8192, ge=16)
    """Most events of a user's history that serving reads: the most recent ones, in a window
    whose start moves in steps of an eighth of it (see ``relaygr.workers.history_window``)."""
    dropout: float = Field(0.2, ge=0.0, lt=1.0)
    """Dropout on embeddings and layer outputs during training."""
    attn_normaliser: float = Field(256.0, gt=0.0)
    """Fixed divisor of every attention sum. It never depends on a sequence's length, so a
    prefix's keys, values and outputs do not change when the history grows."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and activation dtype at inference (timestamps stay float64)."""
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?|npu(:\d+)?)$")
    """Device the model runs on: cpu, cuda[:N] or npu[:N] (npu needs torch_npu)."""
    attn_block: int = Field(512, ge=8)
    """Block size of the blockwise attention: history is computed in query chunks of at most
    this many tokens, against key blocks of this size (wider for skinny query chunks)."""
    candidate_batch: int = Field(128, ge=1)
    """Candidates scored together in one micro-batch."""


class HSTULayer(nn.Module):
    """One HSTU layer: fused U/Q/K/V projection, pointwise attention with relative bias, gating."""

    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        self.heads, self.dqk, self.dv = cfg.heads, cfg.attn_dim, cfg.linear_dim
        self.num_pos, self.num_time = cfg.position_buckets, cfg.time_buckets
        self.normaliser = cfg.attn_normaliser
        self.scale = cfg.attn_dim**-0.5
        hv, hk = cfg.heads * cfg.linear_dim, cfg.heads * cfg.attn_dim
        self.splits = [hv, hk, hk, hv]  # u, q, k, v: k and v last so K/V-only projection is a slice
        self.norm = nn.LayerNorm(cfg.dim)
        self.uqkv = nn.Linear(cfg.dim, sum(self.splits))
        self.pos_bias = nn.Parameter(torch.zeros(cfg.position_buckets))
        self.time_bias = nn.Parameter(torch.zeros(cfg.time_buckets))
        self.attn_norm = nn.LayerNorm(hv)
        self.out = nn.Linear(hv, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def bias_table(self) -> torch.Tensor:
        """Flattened ``[position_buckets * time_buckets]`` relative bias."""
        return (self.pos_bias[:, None] + self.time_bias[None, :]).reshape(-1)

    def wide_bias_table(self) -> torch.Tensor:
        """The same biases laid out for the blockwise path (``hstu_attention.wide_bias_table``)."""
        return wide_bias_table(self.pos_bias, self.time_bias)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # [..., T, H*d] -> [..., H, T, d]
        return t.unflatten(-1, (self.heads, -1)).transpose(-2, -3)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [..., T, dim]`` -> ``u [..., T, H*dv]``, ``q`` (scaled), ``k``, ``v`` as ``[..., H, T, d]``."""
        u, q, k, v = F.silu(self.uqkv(self.norm(x))).split(self.splits, dim=-1)
        return u, self._heads(q) * self.scale, self._heads(k), self._heads(v)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Only ``k`` and ``v`` (what the last layer needs from history tokens)."""
        off = self.splits[0] + self.splits[1]
        kv = F.silu(F.linear(self.norm(x), self.uqkv.weight[off:], self.uqkv.bias[off:]))
        k, v = kv.split(self.splits[2:], dim=-1)
        return self._heads(k), self._heads(v)

    def finish(self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual update from the normalised attention output ``attn [..., H, T, dv]``."""
        a = attn.transpose(-2, -3).flatten(-2)
        return x + self.drop(self.out(self.attn_norm(a) * u))


@dataclass
class _Context:
    """Keys/values the next tokens attend to: segments of consecutive positions from 0."""

    segments: list[Segment] = field(default_factory=list)
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)  # [layer][segment]

    @property
    def length(self) -> int:
        return self.segments[-1].stop if self.segments else 0


@dataclass(frozen=True)
class _Serving:
    """What the serving paths derive from the weights, built once per set of weights."""

    key: tuple
    tables: list[torch.Tensor]  # per layer: wide_bias_table
    weights: list[torch.Tensor]  # the fused functions' layer weights
    dims: tuple[int, int, int]
    consts: tuple[float, float, float]
    cand_action: torch.Tensor  # the candidate action's embedding
    embeddings: list[torch.Tensor]  # item and action tables, final norm weight and bias


@dataclass
class _Pending:
    """A segment being computed: its events (vocabulary ids), K/V buffers and index cache."""

    start: int
    items: torch.Tensor
    actions: torch.Tensor
    timestamps: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer
    plan_cache: dict = field(default_factory=dict)


class HSTURanker(nn.Module):
    """HSTU ranker with a relay-exact prefix KV cache and target-aware candidate scoring."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        self.item_emb = nn.Embedding(config.num_items + 1, d)
        self.action_emb = nn.Embedding(config.num_actions + 2, d)
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(d)
        self.emb_drop = nn.Dropout(config.dropout)
        nn.init.normal_(self.item_emb.weight, std=d**-0.5)
        nn.init.normal_(self.action_emb.weight, std=d**-0.5)
        self.to(device=resolve_device(config.device), dtype=resolve_dtype(config.dtype))
        self.model_version = ""
        self.refresh_version()
        self._params = list(self.parameters())
        self._serving_cache: _Serving | None = None
        # Candidates, and history chunks of at most FUSED_MAX_ROWS tokens (a ranking's new events),
        # run as single TorchScript calls (fused_scoring); False: op by op in Python, the reference
        # the fused paths are tested against.
        self.fused = True

    # ----------------------------------------------------------------------------- basics
    @property
    def device(self) -> torch.device:
        return self.item_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.item_emb.weight.dtype

    @property
    def candidate_action(self) -> int:
        """Action id of candidate tokens."""
        return self.config.num_actions + 1

    def refresh_version(self) -> str:
        """Recompute ``model_version``: a short stable hash of the config (less the device) and
        the weights. Call after changing weights; ``load`` and training do."""
        h = hashlib.blake2b(digest_size=6)
        h.update(self.config.model_dump_json(exclude={"device"}).encode())
        for name, t in sorted(self.state_dict().items()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        self.model_version = h.hexdigest()
        return self.model_version

    def vocab_items(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw item ids -> embedding rows; ids outside 1..num_items map to 0 (unknown)."""
        raw = raw.to(self.device, torch.int64)
        return torch.where((raw >= 1) & (raw <= self.config.num_items), raw, 0)

    def vocab_actions(self, raw: torch.Tensor) -> torch.Tensor:
        raw = raw.to(self.device, torch.int64)
        return torch.where((raw >= 1) & (raw <= self.config.num_actions), raw, 0)

    def item_embeddings(self) -> torch.Tensor:
        """The ``[num_items + 1, dim]`` item embedding table (row 0: unknown), for retrieval by
        inner product."""
        return self.item_emb.weight.detach()

    # ---------------------------------------------------------------------------- serving
    def _open(self, ctx: _Context, events: Events) -> _Pending:
        """Append a segment for ``events`` (positions ``ctx.length`` on) with empty K/V buffers."""
        cfg, n, dev = self.config, len(events), self.device
        pending = _Pending(
            start=ctx.length,
            items=self.vocab_items(events.item_ids),
            actions=self.vocab_actions(events.action_ids),
            timestamps=events.timestamps.to(dev, torch.float64),
        )
        ctx.segments.append(Segment(pending.start, pending.timestamps))
        for layer_kv in ctx.kv:
            kbuf = torch.empty(cfg.heads, n, cfg.attn_dim, device=dev, dtype=self.dtype)
            vbuf = torch.empty(cfg.heads, n, cfg.linear_dim, device=dev, dtype=self.dtype)
            layer_kv.append((kbuf, vbuf))
            pending.kv.append((kbuf, vbuf))
        return pending

    def _advance(self, ctx: _Context, pending: _Pending, c0: int, c1: int, step: int, sv: _Serving) -> None:
        """Run the pending segment's events ``[c0, c1)`` through every layer in query chunks of at
        most ``step`` tokens, filling their keys and values (earlier ones must be filled)."""
        cfg = self.config
        last = len(self.layers) - 1
        no_mask = torch.empty(0, dtype=torch.bool, device=self.device)
        for q0 in range(c0, c1, step):
            q1 = min(c1, q0 + step)
            x = self.item_emb(pending.items[q0:q1]) + self.action_emb(pending.actions[q0:q1])
            tasks = plan_attention(
                pending.start + q0,
                pending.timestamps[q0:q1],
                ctx.segments,
                rows=q1 - q0,
                causal=True,
                block=cfg.attn_block,
                num_pos=cfg.position_buckets,
                cache=pending.plan_cache,
            )
            if self.fused and q1 - q0 <= FUSED_MAX_ROWS:
                with unspecialised():
                    advance_tokens(
                        x,
                        [kv[0] for layer_kv in ctx.kv for kv in layer_kv],
                        [kv[1] for layer_kv in ctx.kv for kv in layer_kv],
                        [t.segment for t in tasks],
                        [t.k0 for t in tasks],
                        [t.k1 for t in tasks],
                        [t.index for t in tasks],
                        [no_mask if t.hidden is None else t.hidden for t in tasks],
                        sv.tables,
                        sv.weights,
                        [kv[0] for kv in pending.kv],
                        [kv[1] for kv in pending.kv],
                        q0,
                        sv.dims,
                        sv.consts,
                    )
                continue
            for li, layer in enumerate(self.layers):
                kbuf, vbuf = pending.kv[li]
                if li == last:
                    k, v = layer.project_kv(x)
                    kbuf[:, q0:q1], vbuf[:, q0:q1] = k, v
                    break
                u, q, k, v = layer.project(x)
                kbuf[:, q0:q1], vbuf[:, q0:q1] = k, v
                attn = run_attention(q, tasks, ctx.kv[li], sv.tables[li], cfg.linear_dim)
                x = layer.finish(x, u, attn.div_(cfg.attn_normaliser))

    def _score(
        self,
        ctx: _Context,
        candidates: torch.Tensor,
        request_ts: float,
        micro_batch: int | None,
        sv: _Serving,
    ) -> torch.Tensor:
        """Scores of candidate tokens at position ``ctx.length`` and time ``request_ts``."""
        cfg = self.config
        ids = self.vocab_items(torch.as_tensor(candidates).reshape(-1))
        out = torch.empty(ids.shape[0], dtype=torch.float32, device=self.device)
        mb = micro_batch or cfg.candidate_batch
        when = torch.tensor([float(request_ts)], dtype=torch.float64, device=self.device)
        cand_action = sv.cand_action
        if self.fused:
            seg_index = candidate_index(ctx.length, when, ctx.segments, num_pos=cfg.position_buckets)
            for c0 in range(0, ids.shape[0], mb):
                e = self.item_emb(ids[c0 : c0 + mb])
                with unspecialised():
                    out[c0 : c0 + mb] = score_candidates(
                        e + cand_action,
                        e,
                        [kv[0] for layer_kv in ctx.kv for kv in layer_kv],
                        [kv[1] for layer_kv in ctx.kv for kv in layer_kv],
                        seg_index,
                        sv.tables,
                        sv.weights,
                        self.final_norm.weight,
                        self.final_norm.bias,
                        sv.dims,
                        sv.consts,
                        key_block_size(cfg.attn_block, min(mb, max(1, ids.shape[0]))),
                    )
            return out.cpu()
        tasks = plan_attention(
            ctx.length,
            when,
            ctx.segments,
            rows=min(mb, max(1, ids.shape[0])),
            causal=False,
            block=cfg.attn_block,
            num_pos=cfg.position_buckets,
        )
        for c0 in range(0, ids.shape[0], mb):
            e = self.item_emb(ids[c0 : c0 + mb])
            x = x0 = e + cand_action
            for li, layer in enumerate(self.layers):
                u, q, k, v = layer.project(x)
                attn = run_attention(q, tasks, ctx.kv[li], sv.tables[li], cfg.linear_dim)
                own = F.silu((q * k).sum(-1, keepdim=True) + sv.tables[li][SELF_BIAS_INDEX])
                x = layer.finish(x, u, attn.add_(own * v).div_(cfg.attn_normaliser))
            out[c0 : c0 + mb] = (self.final_norm(x - x0) * e).sum(-1).float()
        return out.cpu()

    def _rank_fused(
        self,
        ctx: _Context,
        events: Events,
        requests: Sequence[tuple[torch.Tensor, float, int]],
        micro_batch: int | None,
        sv: _Serving,
    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """``events`` after the context's segments, then each request's candidates, in one
        scripted call (``fused_scoring.rank_relay``); a request ``(candidates, request_ts, m)``
        sees the first ``m`` events. Returns each request's scores (float32, CPU) and the events'
        keys and values per layer."""
        cfg = self.config
        with unspecialised():
            scores, keys, values = rank_relay(
                events.item_ids,
                events.action_ids,
                events.timestamps,
                [torch.as_tensor(c).reshape(-1) for c, _, _ in requests],
                [float(ts) for _, ts, _ in requests],
                [m for _, _, m in requests],
                [kv[0] for layer_kv in ctx.kv for kv in layer_kv],
                [kv[1] for layer_kv in ctx.kv for kv in layer_kv],
                [seg.start for seg in ctx.segments],
                [seg.timestamps for seg in ctx.segments],
                sv.embeddings,
                sv.tables,
                sv.weights,
                sv.dims,
                sv.consts,
                (cfg.num_items, cfg.num_actions, self.candidate_action),
                (cfg.position_buckets, cfg.attn_block, micro_batch or cfg.candidate_batch),
            )
        return [x.cpu() for x in scores], list(zip(keys, values, strict=True))

    def _serving(self) -> _Serving:
        """Bias tables, fused weights and shapes for the current weights. Rebuilt only when a
        parameter changes (its storage or version), so a ranking does not rebuild them."""
        params = self._params
        key = tuple((p.data_ptr(), p._version) for p in params)
        cached = self._serving_cache
        if cached is not None and cached.key == key:
            return cached
        cfg, first = self.config, self.layers[0]
        with torch.inference_mode():
            built = _Serving(
                key=key,
                tables=[layer.wide_bias_table() for layer in self.layers],
                weights=[w.detach() for layer in self.layers for w in layer_weights(layer)],
                dims=(cfg.heads, cfg.attn_dim, cfg.linear_dim),
                consts=(first.scale, cfg.attn_normaliser, first.norm.eps),
                cand_action=self.action_emb.weight[self.candidate_action].detach(),
                embeddings=[
                    self.item_emb.weight.detach(),
                    self.action_emb.weight.detach(),
                    self.final_norm.weight.detach(),
                    self.final_norm.bias.detach(),
                ],
            )
        self._serving_cache = built
        return built

    def _for_serving(self) -> None:
        """Serving runs in eval mode; switching walks every module, so only when needed."""
        if self.training:
            self.eval()

    def _context(self, prefix: PrefixKV | None) -> _Context:
        ctx = _Context(kv=[[] for _ in self.layers])
        if prefix is None:
            return ctx
        if prefix.model_version != self.model_version:
            raise ValueError(
                f"prefix was computed by model {prefix.model_version!r}, this is {self.model_version!r}"
            )
        if prefix.num_layers != len(self.layers) or (prefix.length and prefix.dtype != self.dtype):
            raise ValueError("prefix does not match this model's layers or dtype")
        if prefix.length and prefix.device != self.device:
            prefix = prefix.to(self.device)
        ctx.segments.append(Segment(0, prefix.timestamps.to(self.device, torch.float64)))
        for li in range(len(self.layers)):
            ctx.kv[li].append((prefix.keys[li], prefix.values[li]))
        return ctx

    def _step(self, chunk_size: int | None) -> int:
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        return min(chunk_size or self.config.attn_block, self.config.attn_block)

    @torch.inference_mode()
    def prefill_steps(
        self, history: Events, chunk_size: int | Callable[[int], int], prefix: PrefixKV | None = None
    ) -> Iterator[PrefixKV | None]:
        """Chunked pre-inference: yields ``None`` after each chunk of ``chunk_size`` new events
        but the last, then the finished ``PrefixKV`` of the whole ``history``. Between two steps
        the device is free for other work (a ranking job waits at most one chunk). A callable
        ``chunk_size(cached)`` sizes each chunk by the keys already computed (chunks sliced by
        device time: later chunks attend to more keys). With ``prefix``, it extends that prefix
        (see ``extend``). Results equal one-shot ``prefill``."""
        self._for_serving()
        start = 0
        if prefix is not None:
            if not prefix.matches(history):
                raise ValueError(
                    f"extend: the history's first {prefix.length} events are not the cached prefix "
                    "(different fingerprint) or the history is shorter"
                )
            start = prefix.length
        ctx = self._context(prefix)
        sv = self._serving()
        n = len(history)
        pending = self._open(ctx, history.slice(start))
        if not callable(chunk_size):
            self._step(chunk_size)  # rejects a size below 1
        size_at = chunk_size if callable(chunk_size) else (lambda _cached: chunk_size)
        c0 = 0
        while c0 < n - start:
            size = max(1, int(size_at(start + c0)))
            c1 = min(n - start, c0 + size)
            self._advance(ctx, pending, c0, c1, self._step(size), sv)
            c0 = c1
            if c1 < n - start:
                yield None
        yield self._prefix_kv(ctx, pending.kv, prefix, history)

    def _prefix_kv(
        self,
        ctx: _Context,
        new_kv: list[tuple[torch.Tensor, torch.Tensor]],
        prefix: PrefixKV | None,
        history: Events,
    ) -> PrefixKV:
        """The ``PrefixKV`` of all of ``history``: ``prefix``'s keys and values, then the pending
        segment's (which must hold ``history``'s events after the prefix, all computed)."""
        keys, values = [], []
        for li, (k, v) in enumerate(new_kv):
            if prefix is not None:
                pk, pv = ctx.kv[li][0]
                grown = len(history) > prefix.length  # else nothing new: no copy
                k, v = (torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)) if grown else (pk, pv)
            keys.append(k)
            values.append(v)
        return PrefixKV(
            keys=keys,
            values=values,
            positions=torch.arange(len(history), device=self.device),
            timestamps=history.timestamps.to(self.device, torch.float64).clone(),
            length=len(history),
            fingerprint=history_fingerprint(history),
            model_version=self.model_version,
        )

    def prefill(self, history: Events, chunk_size: int | None = None) -> PrefixKV:
        """Per-layer K/V of ``history`` (positions 0..n-1). ``chunk_size`` computes it
        ``chunk_size`` events at a time with identical results (up to float rounding)."""
        out = None
        for out in self.prefill_steps(history, chunk_size or max(1, len(history))):  # noqa: B007
            pass
        assert out is not None
        return out

    def extend(self, prefix: PrefixKV, history: Events, chunk_size: int | None = None) -> PrefixKV:
        """``prefix`` extended to the full, longer ``history`` (whose first ``prefix.length``
        events must be the cached ones: ``ValueError`` otherwise). Equals ``prefill(history)``
        and carries ``history_fingerprint(history)``."""
        out = None
        for out in self.prefill_steps(history, chunk_size or max(1, len(history)), prefix=prefix):  # noqa: B007
            pass
        assert out is not None
        return out

    @torch.inference_mode()
    def rank(
        self,
        prefix: PrefixKV | None,
        suffix: Events,
        candidates: torch.Tensor,
        request_ts: float,
        *,
        micro_batch: int | None = None,
    ) -> torch.Tensor:
        """Scores (float32, CPU, one per candidate) of raw item ids ``candidates`` for the history
        ``prefix events + suffix`` at time ``request_ts``. Only the suffix and the candidates are
        computed; ``prefix=None`` means the suffix is the whole history. A prefix on another
        device is moved to the model's."""
        self._for_serving()
        ctx = self._context(prefix)
        sv = self._serving()
        if self.fused and len(suffix) <= FUSED_MAX_ROWS:
            return self._rank_fused(ctx, suffix, [(candidates, request_ts, len(suffix))], micro_batch, sv)[0][
                0
            ]
        if len(suffix):
            pending = self._open(ctx, suffix)
            self._advance(ctx, pending, 0, len(suffix), self.config.attn_block, sv)
        return self._score(ctx, candidates, request_ts, micro_batch, sv)

    @torch.inference_mode()
    def rank_and_extend(
        self,
        prefix: PrefixKV | None,
        history: Events,
        candidates: torch.Tensor,
        request_ts: float,
        *,
        micro_batch: int | None = None,
    ) -> tuple[torch.Tensor, Callable[[], PrefixKV]]:
        """``rank(prefix, history[prefix.length:], ...)``, plus ``grown()``, which returns the
        ``PrefixKV`` of all of ``history``: ranking computes the suffix's keys and values anyway,
        and keeping them lets the user's next request compute only what is new. ``grown`` copies
        the prefix's keys and values, so a caller runs it after the scores are out. ``prefix`` must
        be a prefix of ``history`` (``ValueError`` otherwise)."""
        self._for_serving()
        start = 0
        if prefix is not None:
            if not prefix.matches(history):
                raise ValueError("rank_and_extend: the prefix is not the start of this history")
            start = prefix.length
        ctx = self._context(prefix)
        sv = self._serving()
        suffix = history.slice(start)
        if self.fused and len(suffix) <= FUSED_MAX_ROWS:
            (scores,), kv = self._rank_fused(
                ctx, suffix, [(candidates, request_ts, len(suffix))], micro_batch, sv
            )
        else:
            pending = self._open(ctx, suffix)
            if len(suffix):
                self._advance(ctx, pending, 0, len(suffix), self.config.attn_block, sv)
            scores, kv = self._score(ctx, candidates, request_ts, micro_batch, sv), pending.kv

        def grown() -> PrefixKV:
            with torch.inference_mode():
                return self._prefix_kv(ctx, kv, prefix, history)

        return scores, grown

    @torch.inference_mode()
    def rank_many(
        self,
        prefix: PrefixKV,
        requests: Sequence[tuple[Events, torch.Tensor, float]],
        *,
        micro_batch: int | None = None,
    ) -> tuple[list[torch.Tensor], Callable[[], PrefixKV]]:
        """``rank_and_extend`` for several requests ``(history, candidates, request_ts)`` of one
        user at once. Each history must start with ``prefix`` and be a prefix of the longest one,
        as a user's histories are when requests come in a burst (``ValueError`` otherwise). The
        events after ``prefix`` are computed once, for the longest history, and each request
        scores its candidates against its own part of them. Returns the scores in request order
        and ``grown()`` for the longest history."""
        if not requests:
            raise ValueError("rank_many: no requests")
        longest = max((h for h, _, _ in requests), key=len)
        start = prefix.length
        if not prefix.matches(longest):
            raise ValueError("rank_many: the prefix is not the start of the histories")
        for h, _, _ in requests:
            n = len(h)
            if n < start or not all(
                torch.equal(a[start:], b[start:n])
                for a, b in (
                    (h.item_ids, longest.item_ids),
                    (h.action_ids, longest.action_ids),
                    (h.timestamps, longest.timestamps),
                )
            ):
                raise ValueError("rank_many: the histories do not nest (one is not a prefix of the longest)")
        suffix = longest.slice(start)
        if not (self.fused and len(suffix) <= FUSED_MAX_ROWS):
            # Long suffixes: one request at a time (each computes its own events).
            done = [self.rank_and_extend(prefix, h, c, ts, micro_batch=micro_batch) for h, c, ts in requests]
            widest = max(range(len(requests)), key=lambda k: len(requests[k][0]))
            return [scores for scores, _ in done], done[widest][1]
        self._for_serving()
        ctx = self._context(prefix)
        sv = self._serving()
        todo = [(c, ts, len(h) - start) for h, c, ts in requests]
        scores, kv = self._rank_fused(ctx, suffix, todo, micro_batch, sv)

        def grown() -> PrefixKV:
            with torch.inference_mode():
                return self._prefix_kv(ctx, kv, prefix, longest)

        return scores, grown

    def rank_full(
        self, history: Events, candidates: torch.Tensor, request_ts: float, *, micro_batch: int | None = None
    ) -> torch.Tensor:
        """The no-cache baseline: the whole history and the candidates in one inference (the same
        blockwise code as ``rank``)."""
        return self.rank(None, history, candidates, request_ts, micro_batch=micro_batch)

    def flops(self, cached: int, new: int, candidates: int) -> int:
        """FLOPs (projections and attention) of computing ``new`` history tokens after ``cached``
        cached ones and scoring ``candidates`` candidates (``rank``: cached=prefix, new=suffix;
        ``rank_full``: cached=0; ``prefill``/``extend``: candidates=0)."""
        c = self.config
        hk, hv = c.heads * c.attn_dim, c.heads * c.linear_dim
        proj, proj_kv, out = 2 * c.dim * (2 * hk + 2 * hv), 2 * c.dim * (hk + hv), 2 * hv * c.dim
        pair = 2 * (hk + hv)  # q.k and s*v per visible (query, key) pair
        layers = len(self.layers)
        hist_pairs = new * cached + new * (new + 1) // 2
        total = new * ((layers - 1) * (proj + out) + proj_kv) + (layers - 1) * hist_pairs * pair
        return total + candidates * layers * (proj + out + (cached + new + 1) * pair)

    # ------------------------------------------------------------------------- checkpoints
    def save(self, directory: str | Path) -> Path:
        """Write ``model.safetensors`` (weights, with the model version in its metadata) and
        ``config.json``. Raw item ids are the embedding rows, so there is no id mapping to save."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: t.detach().to("cpu").contiguous() for k, t in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_FILE), metadata={"model_version": self.model_version})
        (out / CONFIG_FILE).write_text(self.config.model_dump_json(indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path, device: str | None = None, dtype: str | None = None) -> HSTURanker:
        """A model from ``save``'s files, optionally on another device or in another dtype."""
        src = Path(directory)
        config = HSTUConfig.model_validate(json.loads((src / CONFIG_FILE).read_text()))
        updates = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        if updates:
            config = HSTUConfig.model_validate({**config.model_dump(), **updates})
        model = cls(config)
        state = load_file(str(src / WEIGHTS_FILE), device="cpu")
        model.load_state_dict({k: t.to(model.dtype) for k, t in state.items()})
        model.eval()
        model.refresh_version()
        return model

    # --------------------------------------------------------------------------- training
    def train_scores(
        self,
        items: torch.Tensor,
        actions: torch.Tensor,
        timestamps: torch.Tensor,
        lengths: torch.Tensor,
        cuts: torch.Tensor,
        cut_ts: torch.Tensor,
        candidates: torch.Tensor,
        *,
        history_states: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Differentiable candidate scores on a padded batch, with the dense reference attention.

        ``items``/``actions`` ``[B, T]`` raw ids, ``timestamps [B, T]`` float64, ``lengths [B]``
        valid events per row. For each cut point ``cuts[b, s]`` (``1..lengths[b]``), the
        candidates ``candidates[b, s, :]`` are scored as at a request at time ``cut_ts[b, s]``
        after history ``events[b, :cut]``: exactly what ``rank_full`` computes, batched.
        Returns ``[B, S, K]``; with ``history_states`` also the final normalised hidden states of
        the history tokens ``[B, T, dim]`` (for an auxiliary next-item loss; serving never needs
        them, so there the last layer computes only keys and values of history tokens).
        """
        cfg = self.config
        dev = self.device
        B, T = items.shape
        _, S, K = candidates.shape
        pos = torch.arange(T, device=dev)
        ts = timestamps.to(dev, torch.float64)
        valid = pos[None, :] < lengths.to(dev)[:, None]  # [B, T]
        cuts = cuts.to(dev)
        cut_ts = cut_ts.to(dev, torch.float64)
        np_, nt = cfg.position_buckets, cfg.time_buckets
        # Bias indices and visibility, shared by layers and heads (a cut's K candidates share them).
        hist_index = pair_index(pos[:, None] - pos[None, :], ts[:, :, None] - ts[:, None, :], np_, nt)
        hist_vis = (pos[:, None] >= pos[None, :])[None] & valid[:, None, :]  # [B, T, T]
        cand_index = pair_index(cuts[..., None] - pos, cut_ts[..., None] - ts[:, None, :], np_, nt)
        cand_vis = (pos < cuts[..., None]) & valid[:, None, :]  # [B, S, T]
        cand_index, cand_vis = cand_index.unsqueeze(-2), cand_vis.unsqueeze(-2)  # [B, S, 1, T]
        cand_ids = self.vocab_items(candidates.reshape(B, S * K))
        x = self.emb_drop(
            self.item_emb(self.vocab_items(items)) + self.action_emb(self.vocab_actions(actions))
        )
        e = self.item_emb(cand_ids)  # [B, S*K, dim]
        xc = xc0 = self.emb_drop(e + self.action_emb.weight[self.candidate_action])
        last = len(self.layers) - 1
        for li, layer in enumerate(self.layers):
            table = layer.bias_table()
            u, q, k, v = layer.project(x)  # [B, H, T, d]
            uc, qc, kc, vc = layer.project(xc)  # [B, H, S*K, d]
            H = q.shape[1]
            qs = qc.unflatten(2, (S, K)).transpose(1, 2)  # [B, S, H, K, d]
            ac = dense_attention(qs, k[:, None], v[:, None], cand_index, cand_vis, table, 1.0)
            ac = ac.transpose(1, 2).reshape(B, H, S * K, -1)
            own = F.silu((qc * kc).sum(-1, keepdim=True) + table[SELF_BIAS_INDEX]) * vc
            xc_next = layer.finish(xc, uc, (ac + own) / cfg.attn_normaliser)
            if li < last or history_states:
                a = dense_attention(q, k, v, hist_index, hist_vis, table, cfg.attn_normaliser)
                x = layer.finish(x, u, a)
            xc = xc_next
        scores = (self.final_norm(xc - xc0) * e).sum(-1).view(B, S, K)
        return (scores, self.final_norm(x)) if history_states else scores

    @torch.no_grad()
    def reference_scores(self, history: Events, candidates: torch.Tensor, request_ts: float) -> torch.Tensor:
        """``rank_full`` computed by the dense training path (one row, one cut): the oracle the
        blockwise serving path is tested against."""
        was_training = self.training
        self.eval()
        try:
            n = len(history)
            cands = torch.as_tensor(candidates).reshape(1, 1, -1)
            scores = self.train_scores(
                history.item_ids[None],
                history.action_ids[None],
                history.timestamps[None],
                torch.tensor([n]),
                torch.tensor([[n]]),
                torch.tensor([[float(request_ts)]], dtype=torch.float64),
                cands,
            )
        finally:
            self.train(was_training)
        return scores.reshape(-1).float().cpu()
