"""The ranking engine's configuration, apart from the engine so that light modules can read its
defaults (the trigger, the pipeline settings) without loading the model.

Primitives: ``EngineConfig``: mode, ranking budget, pre-inference chunk, lease, truncation,
suffix retention, burst batching, batching several users' relay rankings (``batch_tokens``,
``batch_cached_events``, ``batch_wait_ms``), pre-inference's device share (``prefill_share``),
and relay rankings in bucketed forwards replayed from CUDA graphs (``cuda_graphs``, ``graph_pool_mb``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from relaygr.workers.store.leases import DEFAULT_LEASE_TTL_S


class EngineConfig(BaseModel):
    """How one worker's ranking engine serves; every default of the ranking path lives here."""

    cuda_graphs: bool | None = Field(
        default=None,
        description=(
            "Relay: rankings run as bucketed static forwards (users, suffix, candidates) that read "
            "the cached prefixes in place from the device tier's pages, each bucket captured once "
            "as a CUDA graph and replayed; off CUDA the same forward runs eagerly. Unset: on for a "
            "CUDA model, off elsewhere. Shapes outside every bucket take the eager path."
        ),
    )
    graph_pool_mb: float = Field(
        default=1024.0,
        gt=0,
        description="Relay with cuda_graphs: most device MiB of pages, beside the device tier's, that "
        "the buckets' new tokens take (their shared rows: the grid's largest bucket's, 12,288 tokens).",
    )

    mode: Literal["relay", "baseline"] = Field(
        default="relay", description="relay: cached prefixes; baseline: full inference, no trigger, no cache."
    )
    budget_ms: float = Field(default=50.0, gt=0, description="Ranking-stage latency budget (P99 target).")
    prefill_chunk: int = Field(default=512, ge=1, description="Tokens per pre-inference job on the device.")
    lease_ttl_s: float = Field(
        default=DEFAULT_LEASE_TTL_S, gt=0, description="Lease of a pre-inferred prefix."
    )
    truncate_to_budget: bool = Field(
        default=True, description="Full inference keeps only the most recent events that fit the budget."
    )
    min_truncated_len: int = Field(default=16, ge=0, description="Never truncate below this many events.")
    truncate_headroom: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description=(
            "A relay worker's full ranking (sliced by time) keeps the most recent events predicted "
            "to fill this share of the time left, at the pace of recent full rankings: it yields "
            "to short rankings at each slice, in a burst of ingestion the device slows down faster "
            "than its measured pace follows, and it starts over shorter only once. (One job, as "
            "in baseline mode: all of the time left.)"
        ),
    )
    ingest_slowdown: float = Field(
        default=2.0,
        ge=1,
        description=(
            "While the worker applies a burst of behaviours (``ingest_burst_events`` within "
            "``ingest_window_s``), a relay worker's full ranking plans for this factor on top of "
            "its measured pace: the applier shares the interpreter and the cores with the device "
            "thread, so the ranking slows down within itself, before any slice measures it "
            "(1.4-2.3x in ``bench noisy-neighbour``; a saturated applier takes about half)."
        ),
    )
    ingest_burst_events: int = Field(
        default=4096, ge=1, description="Behaviour events applied within ingest_window_s that make a burst."
    )
    ingest_window_s: float = Field(default=0.25, gt=0, description="Window of ingest_burst_events.")
    wait_margin_ms: float = Field(
        default=2.0, ge=0, description="Slack kept when deciding to wait for an in-flight prefix."
    )
    retain_suffix: bool = Field(
        default=True,
        description=(
            "A relay ranking keeps the keys and values it computed for the suffix: the cached "
            "prefix grows to the whole ranked history, so the user's next pre-inference is a hit "
            "and its ranking computes only the events that are new since."
        ),
    )
    burst_batch: int = Field(
        default=8,
        ge=1,
        description=(
            "Relay rankings of one user that wait for the device together (a burst of requests) "
            "run as one job of at most this many: the events new since the cached prefix are "
            "computed once. 1 = never."
        ),
    )
    batch_tokens: int = Field(
        default=2048,
        ge=0,
        description=(
            "Relay rankings of different users that wait for the device together run as one "
            "forward (one attention call per layer) of at most this many tokens: the events new "
            "since each cached prefix plus the candidates (about 8 rankings of 64 events and 128 "
            "candidates). 0 = each alone."
        ),
    )
    batch_cached_events: int = Field(
        default=4096,
        ge=0,
        description=(
            "A batch of different users' relay rankings reads at most this many cached events "
            "summed over their prefixes (and holds at least one ranking). On a CPU the batched "
            "forward pays off for short prefixes (8 users of 256-512 cached events: 1.1x) and "
            "loses against ranking one at a time for long ones (8 of 2,048: 0.8x; of 4,096: 0.7x)."
        ),
    )
    batch_wait_ms: float = Field(
        default=0.0,
        ge=0,
        description=(
            "How long the device waits for more relay rankings to batch with the one it took, "
            "while the batch has room. 0: batches form only from rankings already waiting (under "
            "load); on a CPU a forward's cost grows with its tokens, so waiting buys little and "
            "adds to every ranking's latency. An accelerator, whose forward costs about the same "
            "for 1 or 8 rankings, may gain from a millisecond or two."
        ),
    )
    abandon_backlog: int | None = Field(
        default=None,
        ge=0,
        description=(
            "None (the default): a pre-inference whose ranking went ahead without it finishes at "
            "pre-inference priority and serves the user's next visits. A number: the shedding "
            "policy, kept to compare against (``bench steady-load --policy shed``): such a "
            "pre-inference is dropped while more than this many pre-inference jobs are queued."
        ),
    )
    prefill_share: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description=(
            "While pre-inference has work queued, it gets at least this share of the recent device "
            "time, ahead of queued rankings (one chunk at a time): under a steady load of rankings "
            "pre-inference still progresses, and returning users reach the relay path."
        ),
    )
    slice_ms: float = Field(
        default=5.0,
        ge=0,
        description=(
            "Device time of one chunk of pre-inference, of a relay worker's full ranking, and of a "
            "long relay ranking, sized by the latency model (keys already cached included); 0 = "
            "prefill_chunk tokens a chunk, rankings in one piece."
        ),
    )
    burst_batch_events: int = Field(
        default=8192,
        ge=1,
        description=(
            "A burst batch holds at most this many cached events summed over its rankings (and "
            "at least one ranking). Batching saves each ranking's fixed costs, which dominate for "
            "short prefixes; a batch of long ones would make its first ranking wait for the rest."
        ),
    )
