"""Inference of the HSTU ranker: pre-inference of a prefix, its extension, and ranking against it.

Primitives (methods of ``HSTURanker``, through ``RelayInference``; all under
``torch.inference_mode``, on the model's device and dtype):
- ``prefill`` / ``prefill_steps``: history -> ``PrefixKV``, optionally chunk by chunk (the device
  is free for other work between two chunks);
- ``extend``: ``PrefixKV`` + longer history -> ``PrefixKV``;
- ``rank``: cached prefix + suffix + candidates -> scores; ``score_steps``: candidates against a
  cached prefix in steps of keys (time slices); ``rank_and_extend``: the same as ``rank``, plus the
  prefix grown by the suffix; ``rank_many``: a burst of one user's requests against one prefix,
  the new events computed once; ``rank_full``: the no-cache baseline, the same code.
- ``reference_path(model)``: a debug surface: inside it the model runs op by op in Python, the
  reference that the fused TorchScript paths (``fused_scoring``) are tested against.

How a call runs: keys and values the new tokens attend to are a ``Context`` of segments (the
cached prefix, then the tokens being computed); history tokens go through the layers in query
chunks planned by ``hstu_attention.plan_attention``; candidates attend to the whole context and to
themselves. Candidate scoring and history chunks of at most ``FUSED_MAX_ROWS`` tokens (a ranking's
new events) run as single TorchScript calls; longer chunks (pre-inference) run layer by layer.
What the calls derive from the weights (bias tables, the fused functions' weights) is built once
per set of weights (``Serving``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from relaygr.workers.model.fused_scoring import (
    advance_tokens,
    candidate_index,
    rank_relay,
    score_candidates,
    score_final,
    score_key_range,
    score_layer_begin,
    score_layer_end,
    unspecialised,
)
from relaygr.workers.model.hstu_attention import (
    SELF_BIAS_INDEX,
    Segment,
    candidate_far,
    far_queries,
    key_block_size,
    plan_attention,
    run_attention,
)
from relaygr.workers.model.inference_state import Context, Pending, Serving, serving_state
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint

FUSED_MAX_ROWS = 256
"""History chunks up to this many tokens run fused: a ranking's short-term suffix and the events
new since its prefix. Pre-inference chunks are longer, run off the ranking path and are
matmul-bound anyway."""


class RelayInference:
    """The inference paths of ``HSTURanker`` (see the module docstring). The model provides the
    modules (``config``, ``layers``, ``item_emb``, ``action_emb``, ``final_norm``) and calls
    ``_init_inference`` once its parameters are in place."""

    # The reference path instead of the fused calls (``reference_path``); never set when serving.
    _op_by_op = False

    def _init_inference(self) -> None:
        self._params = list(self.parameters())
        self._serving_cache: Serving | None = None

    def _fused(self, history_rows: int = 0) -> bool:
        """Whether candidate scoring (``history_rows`` = 0), or a history chunk of that many
        tokens, runs as one TorchScript call."""
        return not self._op_by_op and history_rows <= FUSED_MAX_ROWS

    def _open(self, ctx: Context, events: Events) -> Pending:
        """Append a segment for ``events`` (positions ``ctx.length`` on) with empty K/V buffers."""
        cfg, n, dev = self.config, len(events), self.device
        pending = Pending(
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

    def _advance(self, ctx: Context, pending: Pending, c0: int, c1: int, step: int, sv: Serving) -> None:
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
                near_keys=cfg.near_keys,
                cache=pending.plan_cache,
            )
            far_scale = far_queries(pending.start + q0, q1 - q0, sv.far, self.device)
            if self._fused(q1 - q0):
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
                        [t.far for t in tasks],
                        sv.tables,
                        sv.weights,
                        [kv[0] for kv in pending.kv],
                        [kv[1] for kv in pending.kv],
                        q0,
                        sv.far[0],
                        far_scale,
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
                far = (far_scale, sv.far[0]) if far_scale.numel() else None
                attn = run_attention(q, tasks, ctx.kv[li], sv.tables[li], cfg.linear_dim, far)
                x = layer.finish(x, u, attn.div_(cfg.attn_normaliser))

    def _score(
        self,
        ctx: Context,
        candidates: torch.Tensor,
        request_ts: float,
        micro_batch: int | None,
        sv: Serving,
    ) -> torch.Tensor:
        """Scores of candidate tokens at position ``ctx.length`` and time ``request_ts``."""
        cfg = self.config
        ids = self.vocab_items(torch.as_tensor(candidates).reshape(-1))
        out = torch.empty(ids.shape[0], dtype=torch.float32, device=self.device)
        mb = micro_batch or cfg.candidate_batch
        when = torch.tensor([float(request_ts)], dtype=torch.float64, device=self.device)
        cand_action = sv.cand_action
        if self._fused():
            seg_index = candidate_index(ctx.length, when, ctx.segments, num_pos=cfg.position_buckets)
            seg_far, far_factor = self._candidate_far(ctx, sv)
            for c0 in range(0, ids.shape[0], mb):
                e = self.item_emb(ids[c0 : c0 + mb])
                with unspecialised():
                    out[c0 : c0 + mb] = score_candidates(
                        e + cand_action,
                        e,
                        [kv[0] for layer_kv in ctx.kv for kv in layer_kv],
                        [kv[1] for layer_kv in ctx.kv for kv in layer_kv],
                        seg_index,
                        seg_far,
                        far_factor,
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
            near_keys=cfg.near_keys,
        )
        far_scale = far_queries(ctx.length, 1, sv.far, self.device)
        far = (far_scale, sv.far[0]) if far_scale.numel() else None
        for c0 in range(0, ids.shape[0], mb):
            e = self.item_emb(ids[c0 : c0 + mb])
            x = x0 = e + cand_action
            for li, layer in enumerate(self.layers):
                u, q, k, v = layer.project(x)
                attn = run_attention(q, tasks, ctx.kv[li], sv.tables[li], cfg.linear_dim, far)
                own = F.silu((q * k).sum(-1, keepdim=True) + sv.tables[li][SELF_BIAS_INDEX])
                x = layer.finish(x, u, attn.add_(own * v).div_(cfg.attn_normaliser))
            out[c0 : c0 + mb] = (self.final_norm(x - x0) * e).sum(-1).float()
        return out.cpu()

    def _rank_fused(
        self,
        ctx: Context,
        events: Events,
        requests: Sequence[tuple[torch.Tensor, float, int]],
        micro_batch: int | None,
        sv: Serving,
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
                sv.far,
            )
        return [x.cpu() for x in scores], list(zip(keys, values, strict=True))

    def _serving(self) -> Serving:
        """Bias tables, fused weights and shapes for the current weights (``serving_state``)."""
        built = serving_state(self, self._serving_cache)
        self._serving_cache = built
        return built

    def _candidate_far(self, ctx: Context, sv: Serving) -> tuple[list[int], float]:
        """``fused_scoring.candidate_far`` of candidates after the context's keys."""
        starts = [seg.start for seg in ctx.segments]
        return candidate_far(starts, [seg.stop - seg.start for seg in ctx.segments], ctx.length, sv.far)

    def _for_serving(self) -> None:
        """Serving runs in eval mode; switching walks every module, so only when needed."""
        if self.training:
            self.eval()

    def _context(self, prefix: PrefixKV | None) -> Context:
        ctx = Context(kv=[[] for _ in self.layers])
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
        ctx: Context,
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
            # A grown prefix keeps who computed it (the worker that grows it is the same one).
            meta=dict(prefix.meta) if prefix is not None else {},
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
        if self._fused(len(suffix)):
            scores, _ = self._rank_fused(
                ctx, suffix, [(candidates, request_ts, len(suffix))], micro_batch, sv
            )
            return scores[0]
        if len(suffix):
            pending = self._open(ctx, suffix)
            self._advance(ctx, pending, 0, len(suffix), self.config.attn_block, sv)
        return self._score(ctx, candidates, request_ts, micro_batch, sv)

    @torch.inference_mode()
    def score_steps(
        self,
        prefix: PrefixKV,
        candidates: torch.Tensor,
        request_ts: float,
        keys_per_step: Callable[[], int],
    ) -> Iterator[int | torch.Tensor]:
        """Scores of raw item ids ``candidates`` against the cached ``prefix`` alone (no new
        events), in steps: each step adds the candidates' attention to about ``keys_per_step()``
        keys of one layer (whole key blocks, at least one), and yields how many keys it visited;
        the last yields the scores (float32, CPU). Slicing by keys, not by candidates, reads each
        key once per layer and micro-batch however many steps there are (a heavy user's cached
        keys do not fit a core's cache: a pass over them per slice of candidates costs more than
        the scoring). Equal to ``rank(prefix, <no events>, candidates, request_ts)`` (tested)."""
        self._for_serving()
        cfg, sv = self.config, self._serving()
        ctx = self._context(prefix)
        ids = self.vocab_items(torch.as_tensor(candidates).reshape(-1))
        c = ids.shape[0]
        mb = cfg.candidate_batch
        block = key_block_size(cfg.attn_block, min(mb, max(1, c)))
        when = torch.tensor([float(request_ts)], dtype=torch.float64, device=self.device)
        seg_index = candidate_index(ctx.length, when, ctx.segments, num_pos=cfg.position_buckets)
        seg_far, far_factor = self._candidate_far(ctx, sv)
        ranges = [
            (si, k0) for si, seg in enumerate(ctx.segments) for k0 in range(0, seg.stop - seg.start, block)
        ]
        out = torch.empty(c, dtype=torch.float32, device=self.device)
        visited = 0
        with unspecialised():
            for c0 in range(0, c, mb):
                e = self.item_emb(ids[c0 : c0 + mb])
                x = x0 = e + sv.cand_action
                for li in range(len(self.layers)):
                    w = sv.weights[8 * li : 8 * li + 8]
                    u, q, k, v = score_layer_begin(x, w, sv.dims, sv.consts)
                    acc = torch.zeros(sv.dims[0], x.shape[0], sv.dims[2], dtype=x.dtype, device=x.device)
                    far_acc = torch.zeros_like(acc) if seg_far else acc
                    bias = [sv.tables[li].index_select(0, idx) for idx in seg_index]
                    for si, k0 in ranges:
                        keys, values = ctx.kv[li][si]
                        k1 = min(keys.shape[1], k0 + block)
                        far_until = seg_far[si] if seg_far else 0
                        score_key_range(acc, far_acc, q, keys, values, bias[si], far_until, k0, k1, block)
                        visited += k1 - k0
                        if visited >= max(block, keys_per_step()):
                            yield visited
                            visited = 0
                    if seg_far:
                        acc.add_(far_acc, alpha=far_factor)
                    x = score_layer_end(x, acc, u, q, k, v, sv.tables[li], w, sv.consts)
                out[c0 : c0 + mb] = score_final(
                    x, x0, e, self.final_norm.weight, self.final_norm.bias, sv.consts
                )
        yield out.cpu()

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
        if self._fused(len(suffix)):
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
        if not self._fused(len(suffix)):
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


@contextlib.contextmanager
def reference_path(model: RelayInference) -> Iterator[None]:
    """Debug: within this block ``model`` runs every inference op by op in Python (no TorchScript
    call), the reference the fused paths are tested against. Never used when serving."""
    model._op_by_op = True
    try:
        yield
    finally:
        del model._op_by_op  # back to the class default
