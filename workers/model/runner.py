"""The model runner: one ``HSTURanker`` served on its device, as nano-vllm's model runner.

``ModelRunner(model, pages=None, pool_tokens=, page_tokens=)`` owns what serving needs and the
checkpoint's module does not: the weights in their serving form (``inference_state.Serving``,
rebuilt when the weights change), the paged KV it reads and writes (``kv_pages.KVPages``: the
prefix store's device tier, ``use_pages``, or pages of its own), the bucketed relay rankings and
their captured CUDA graphs (``graph_relay.GraphRelay``, ``use_graph_relay``) and the eager forward
for CPU and NPU (``inference.LayerPass``). The engine talks to it alone.

A prefix it computes is paged (``PrefixKV.paged``): its tokens' keys and values are written once,
into pages; a prefix that grows (a pre-inference's next chunk, a ranking's suffix kept) takes pages
after its own and writes only the new tokens, and a ranking reads a cached prefix from its pages
(gathered once per forward on the eager path, in place through a row index in a bucket). A dense
prefix (a colder tier's, promoted without room on the device) is read and grown as it is; so is
one when the pages run out (``PagesExhausted``).

Primitives (all under ``torch.inference_mode``, on the model's device and dtype):
- ``prefill`` / ``prefill_steps``: history -> ``PrefixKV``, optionally chunk by chunk (the device
  is free for other work between two chunks);
- ``extend``: ``PrefixKV`` + longer history -> ``PrefixKV``;
- ``rank``: cached prefix + suffix + candidates -> scores; ``score_steps``: candidates against a
  cached prefix, a layer at a time (time slices); ``rank_and_extend``: the same as ``rank``, plus
  the prefix grown by the suffix; ``rank_many``: a burst of one user's requests against one
  prefix, the new events computed once; ``rank_users``: several users' rankings in one forward;
  ``rank_full``: the no-cache baseline, the same code.
- ``use_graph_relay(...)`` / ``graph_relay``: when on, ``rank``, ``rank_and_extend`` and
  ``rank_users`` run as a bucketed static forward (a CUDA graph's replay on CUDA), falling back to
  the eager forward for what fits no bucket; ``serving()`` what both read of the weights.
- ``pages``, ``use_pages(pages)``, ``kv_layout()``: the paged KV.
- What the engine reads of the model: ``model``, ``config``, ``device``, ``dtype``,
  ``model_version``, ``vocab``, ``flops``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from relaygr.workers.kv_pages import DEFAULT_PAGE_TOKENS, KVLayout, KVPages, PagesExhausted
from relaygr.workers.model.graph_relay import GraphRelay
from relaygr.workers.model.graph_runner import NEW_ROWS
from relaygr.workers.model.inference import LayerPass, UserRanking
from relaygr.workers.model.inference_state import Serving, serving_state
from relaygr.workers.model.jagged import ForwardPlan, UserSlot
from relaygr.workers.model.model import HSTUConfig, HSTURanker
from relaygr.workers.model.vocab import ItemVocab
from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint

log = logging.getLogger(__name__)


class ModelRunner:
    """Serving of one ``HSTURanker`` (see the module docstring)."""

    def __init__(
        self,
        model: HSTURanker,
        pages: KVPages | None = None,
        *,
        pool_tokens: int | None = None,
        page_tokens: int = DEFAULT_PAGE_TOKENS,
    ) -> None:
        self.model = model
        self._params = list(model.parameters())
        self._serving_cache: Serving | None = None
        self._pool_tokens, self._page_tokens = pool_tokens, page_tokens
        self._pages: KVPages | None = None
        self._own_pages = True
        if pages is not None:
            self.use_pages(pages)
        # Bucketed relay rankings (``graph_relay.GraphRelay``), when on.
        self.graph_relay: GraphRelay | None = None

    # ------------------------------------------------------------------ the model, as serving reads it
    @property
    def config(self) -> HSTUConfig:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def model_version(self) -> str:
        return self.model.model_version

    @property
    def vocab(self) -> ItemVocab:
        return self.model.vocab

    def flops(self, cached: int, new: int, candidates: int) -> int:
        """``HSTURanker.flops``: what one call computes."""
        return self.model.flops(cached, new, candidates)

    # ------------------------------------------------------------------ the paged KV
    def kv_layout(self, page_tokens: int | None = None) -> KVLayout:
        """What one cached token of this model takes in pages of ``page_tokens`` tokens."""
        c = self.config
        pt = page_tokens or self._page_tokens
        return KVLayout(c.layers, c.heads, c.attn_dim, c.linear_dim, self.dtype, pt)

    @property
    def pages(self) -> KVPages:
        """The pages it reads and writes prefixes in: the prefix store's (``use_pages``), else its
        own of ``pool_tokens`` tokens (default: two of the longest history served and the buckets'
        shared rows; made when first needed, and again for new weights' shape)."""
        if self._pages is not None and not self._own_pages:
            return self._pages
        layout = self.kv_layout()
        if self._pages is None or self._pages.layout != layout or self._pages.device != self.device:
            tokens = self._pool_tokens or 2 * self.config.max_seq_len + NEW_ROWS
            self._pages = KVPages(layout, layout.pages_for(tokens) + 1, self.device)
        return self._pages

    def use_pages(self, pages: KVPages) -> None:
        """Read and write prefixes in ``pages`` (the prefix store's device tier) from now on;
        before the buckets are built (their graphs hold the pages' addresses)."""
        own = self.kv_layout(pages.page_tokens)
        device = torch.device(pages.device)
        same_device = device.type == self.device.type and (device.index or 0) == (self.device.index or 0)
        if pages.layout != own or not same_device:
            raise ValueError(
                f"pages of {pages.layout} on {pages.device} for a model of {own} on {self.device}"
            )
        if getattr(self, "graph_relay", None) is not None:
            raise ValueError("attach the pages before the buckets are built (use_graph_relay)")
        self._pages, self._own_pages = pages, False

    def use_graph_relay(
        self,
        enabled: bool | None = None,
        *,
        capture: bool | None = None,
        prefix_tokens: int | None = None,
        rows_tokens: int | None = None,
    ) -> GraphRelay | None:
        """Relay rankings (``rank``, ``rank_and_extend``, ``rank_users``) in bucketed static
        forwards that read the cached prefixes in place from the pages (``graph_relay``),
        captured as CUDA graphs when ``capture`` (default: on CUDA); what fits no bucket runs the
        eager path. ``enabled`` None: on for a CUDA model, off elsewhere; False turns it off.
        ``prefix_tokens``: the buckets' prefix capacity per user (default ``max_seq_len``);
        ``rows_tokens``: most pages' tokens the buckets' new tokens take (default: what the
        pages hold beyond one longest prefix, at most the grid's largest bucket's)."""
        if enabled is None:
            enabled = self.device.type == "cuda"
        if self.graph_relay is not None:
            self.graph_relay.close()
        self.graph_relay = (
            GraphRelay(self, capture=capture, prefix_tokens=prefix_tokens, rows_tokens=rows_tokens)
            if enabled
            else None
        )
        return self.graph_relay

    # ------------------------------------------------------------------ the forwards
    def _serving(self) -> Serving:
        """Derived weights for the current weights (``serving_state``)."""
        built = serving_state(self.model, self._params, self._serving_cache)
        self._serving_cache = built
        return built

    def serving(self) -> Serving:
        """What the serving forward reads of the weights, in eval mode (built once per weights)."""
        self._for_serving()
        return self._serving()

    def _for_serving(self) -> None:
        """Serving runs in eval mode; switching walks every module, so only when needed."""
        if self.model.training:
            self.model.eval()

    def _checked(self, prefix: PrefixKV | None) -> PrefixKV | None:
        """``prefix`` on the model's device (in its pages, or dense), or ``ValueError`` if another
        model computed it."""
        if prefix is None:
            return None
        if prefix.model_version != self.model_version:
            raise ValueError(
                f"prefix was computed by model {prefix.model_version!r}, this is {self.model_version!r}"
            )
        if prefix.num_layers != self.config.layers or (prefix.length and prefix.dtype != self.dtype):
            raise ValueError("prefix does not match this model's layers or dtype")
        if prefix.pages is not None and prefix.pages.pool is not self._pages:
            prefix = prefix.dense()  # in other pages (another runner's): read as a copy
        if prefix.length and prefix.device != self.device:
            prefix = prefix.to(self.device)
        return prefix if prefix.length else None

    def _pass(self, slots: list[UserSlot]) -> LayerPass:
        self._for_serving()
        plan = ForwardPlan.build(slots, (self.config.num_items, self.config.num_actions), self.device)
        return LayerPass(self, plan, self._serving())

    def _graphed(self, slots: list[UserSlot], keep_kv: bool = True) -> list | None:
        """The slots ranked by ``graph_relay`` (per slot its scores and, with ``keep_kv``, the run
        of its grown prefix, its events written there), or ``None``: off, or outside its buckets."""
        if self.graph_relay is None:
            return None
        self._for_serving()
        return self.graph_relay.rank(self._serving(), slots, keep_kv)

    def _slot(self, prefix: PrefixKV | None, events: Events, candidates, request_ts: float) -> UserSlot:
        return UserSlot(self._checked(prefix), events, _raw_ids(candidates), float(request_ts))

    def _grown(
        self,
        prefix: PrefixKV | None,
        new_kv: list[tuple[torch.Tensor, torch.Tensor]],
        history: Events,
        final: bool = True,
    ) -> PrefixKV:
        """The ``PrefixKV`` of all of ``history``: ``prefix`` (checked: in these pages, dense, or
        None) and then ``new_kv`` (per layer, ``[m, H, d]``: the events after the prefix). Paged:
        pages after ``prefix``'s, only the new tokens written. Not ``final``: a chunk of a
        pre-inference, which no one else sees (its fingerprint is left out)."""
        start = prefix.length if prefix is not None else 0
        if prefix is None or prefix.pages is not None:
            try:
                run = self.pages.extend(prefix.pages if prefix is not None else None, len(history) - start)
            except PagesExhausted as e:
                log.info("a grown prefix stays out of the pages: %s", e)
                prefix = prefix.dense() if prefix is not None else None
            else:
                if new_kv and len(history) > start:
                    keys = torch.stack([k for k, _ in new_kv])
                    values = torch.stack([v for _, v in new_kv])
                    self.pages.write(run, start, keys, values, history.timestamps[start:])
                return PrefixKV.paged(
                    run,
                    history_fingerprint(history) if final else b"",
                    self.model_version,
                    dict(prefix.meta) if prefix is not None else {},
                )
        return self._dense_grown(prefix, new_kv, history, final)

    def _dense_grown(
        self,
        prefix: PrefixKV | None,
        new_kv: list[tuple[torch.Tensor, torch.Tensor]],
        history: Events,
        final: bool,
    ) -> PrefixKV:
        """``_grown`` of a dense prefix (or with no pages left): tensors of its own, concatenated."""
        keys, values = [], []
        for li, (k, v) in enumerate(new_kv):
            k, v = k.transpose(0, 1), v.transpose(0, 1)
            if prefix is not None and prefix.length:
                pk, pv = prefix.keys[li], prefix.values[li]
                k, v = (torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)) if k.shape[1] else (pk, pv)
            keys.append(k.contiguous())
            values.append(v.contiguous())
        return PrefixKV(
            keys=keys,
            values=values,
            positions=torch.arange(len(history), device=self.device),
            timestamps=history.timestamps.to(self.device, torch.float64).clone(),
            length=len(history),
            fingerprint=history_fingerprint(history) if final else b"",
            model_version=self.model_version,
            # A grown prefix keeps who computed it (the worker that grows it is the same one).
            meta=dict(prefix.meta) if prefix is not None else {},
        )

    def _events_kv(self, done: LayerPass, user: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        a, b = done.plan.event_rows[user]
        return [(k[a:b], v[a:b]) for k, v in done.new_kv]

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
        (see ``extend``). Chunks are at most ``attn_block`` events (one chunk's scores are
        ``chunk x history``). Results equal one-shot ``prefill``."""
        start = 0
        if prefix is not None:
            if not prefix.matches(history):
                raise ValueError(
                    f"extend: the history's first {prefix.length} events are not the cached prefix "
                    "(different fingerprint) or the history is shorter"
                )
            start = prefix.length
        if not callable(chunk_size):
            self._step(chunk_size)  # rejects a size below 1
        size_at = chunk_size if callable(chunk_size) else (lambda _cached: chunk_size)
        current, n, block = prefix, len(history), self.config.attn_block
        c0 = start
        while True:
            c1 = min(n, c0 + max(1, int(size_at(c0))))
            for s0 in range(c0, max(c1, c0 + 1), block):  # one pass for an empty history
                s1 = min(c1, s0 + block)
                slot = self._slot(current, history.slice(s0, s1), [], 0.0)
                done = self._pass([slot]).run()
                current = self._grown(slot.prefix, self._events_kv(done, 0), history.slice(0, s1), s1 >= n)
            c0 = c1
            if c1 >= n:
                break
            yield None
        yield current

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
        device is moved to the model's. ``micro_batch`` is accepted for compatibility: the
        candidates are scored together (each sees the history and itself only, so the grouping
        never changed a score)."""
        slot = self._slot(prefix, suffix, candidates, request_ts)
        graphed = self._graphed([slot], keep_kv=False) if prefix is not None else None
        if graphed is not None:
            return graphed[0][0]
        return self._pass([slot]).run().scores[0].cpu()

    @torch.inference_mode()
    def score_steps(
        self,
        prefix: PrefixKV,
        candidates: torch.Tensor,
        request_ts: float,
        keys_per_step: Callable[[], int],
    ) -> Iterator[int | torch.Tensor]:
        """Scores of raw item ids ``candidates`` against the cached ``prefix`` alone (no new
        events), in steps of whole layers: a step ends after the layer with which its keys (the
        prefix's, per layer) reach ``keys_per_step()``, and yields how many keys it visited; the
        last yields the scores (float32, CPU). Equal to ``rank(prefix, <no events>, candidates,
        request_ts)`` (tested). Keys are counted once per layer and ``candidate_batch`` of
        candidates, the unit the engine's pacing spreads a scoring's cost over."""
        done = self._pass([self._slot(prefix, Events.empty(), candidates, request_ts)])
        groups = -(-len(done.plan.slots[0].candidates) // self.config.candidate_batch)
        per_layer = max(1, prefix.length * max(1, groups))
        visited = 0
        for _ in done.steps():
            visited += per_layer
            if visited >= keys_per_step():
                yield visited
                visited = 0
        yield done.scores[0].cpu()

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
        and keeping them lets the user's next request compute only what is new. ``grown`` writes
        the suffix's keys and values into pages after the prefix's (none of the prefix's is
        copied), so a caller runs it after the scores are out. ``prefix`` must be a prefix of
        ``history`` (``ValueError`` otherwise)."""
        ((scores, grown),) = self.rank_users([UserRanking(prefix, history, candidates, request_ts)])
        return scores, grown

    @torch.inference_mode()
    def rank_users(
        self, requests: Sequence[UserRanking]
    ) -> list[tuple[torch.Tensor, Callable[[], PrefixKV]]]:
        """Several users' relay rankings in one forward, as one jagged batch: each request
        ``(prefix, history, candidates, request_ts)`` scores its candidates against its own cached
        prefix and the events after it, exactly as ``rank_and_extend`` of that request alone.
        Returns, in request order, its scores (float32, CPU) and ``grown()``."""
        if not requests:
            raise ValueError("rank_users: no requests")
        slots = []
        for r in requests:
            start = 0
            if r.prefix is not None:
                if not r.prefix.matches(r.history):
                    raise ValueError("rank_and_extend: the prefix is not the start of this history")
                start = r.prefix.length
            slots.append(self._slot(r.prefix, r.history.slice(start), r.candidates, r.request_ts))
        graphed = self._graphed(slots)
        if graphed is not None:
            return [
                (scores, _paged_grower(self, run, s.prefix, r.history))
                for (scores, run), s, r in zip(graphed, slots, requests, strict=True)
            ]
        done = self._pass(slots).run()
        scores = _on_host(done.scores)
        out = []
        for user, (s, r) in enumerate(zip(slots, requests, strict=True)):
            kv = self._events_kv(done, user)
            out.append((scores[user], _grower(self, s.prefix, kv, r.history)))
        return out

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
        widest = max(range(len(requests)), key=lambda k: len(requests[k][0]))
        longest = requests[widest][0]
        start = prefix.length
        if not prefix.matches(longest):
            raise ValueError("rank_many: the prefix is not the start of the histories")
        _check_nested(requests, longest, start)
        order = [widest] + [i for i in range(len(requests)) if i != widest]
        slots = []
        for i in order:
            h, c, ts = requests[i]
            if i == widest:
                slots.append(self._slot(prefix, longest.slice(start), c, ts))
            else:
                slot = self._slot(prefix, Events.empty(), c, ts)
                slots.append(
                    UserSlot(slot.prefix, slot.events, slot.candidates, slot.request_ts, (0, len(h) - start))
                )
        done = self._pass(slots).run()
        scores = [torch.empty(0)] * len(requests)
        for i, got in zip(order, _on_host(done.scores), strict=True):  # i: the request's index
            scores[i] = got
        return scores, _grower(self, slots[0].prefix, self._events_kv(done, 0), longest)

    def rank_full(
        self, history: Events, candidates: torch.Tensor, request_ts: float, *, micro_batch: int | None = None
    ) -> torch.Tensor:
        """The no-cache baseline: the whole history and the candidates in one inference (the same
        code as ``rank``)."""
        return self.rank(None, history, candidates, request_ts)


def _on_host(scores: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every user's scores on the host in one device read (one wait, not one a user)."""
    if not scores or scores[0].device.type == "cpu":
        return scores
    return list(torch.cat(scores).cpu().split([int(s.shape[0]) for s in scores]))


def _raw_ids(candidates) -> np.ndarray:
    if isinstance(candidates, torch.Tensor):
        candidates = candidates.numpy() if candidates.device.type == "cpu" else candidates.cpu().numpy()
    return np.asarray(candidates, dtype=np.int64).reshape(-1)


def _grower(
    runner: ModelRunner,
    prefix: PrefixKV | None,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    history: Events,
) -> Callable[[], PrefixKV]:
    def grown() -> PrefixKV:
        with torch.inference_mode():
            return runner._grown(prefix, kv, history)

    return grown


def _paged_grower(
    runner: ModelRunner, run, prefix: PrefixKV | None, history: Events
) -> Callable[[], PrefixKV]:
    """``grown()`` of a bucketed ranking: its events' keys and values are in ``run`` already."""
    meta = dict(prefix.meta) if prefix is not None else {}

    def grown() -> PrefixKV:
        return PrefixKV.paged(run, history_fingerprint(history), runner.model_version, meta)

    return grown


def _check_nested(
    requests: Sequence[tuple[Events, torch.Tensor, float]], longest: Events, start: int
) -> None:
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
