"""Pipeline settings shared by the stages, from ``RELAYGR_*`` environment variables.

Primitives:
- ``PipelineSettings``: the model, the ranking budget, the trigger's knobs, the upstream stages'
  emulated feature-fetch time, the worker's memory budgets, and one fault-injection knob
  (``handover_stall_s``).
- ``PipelineSettings.to_env(**settings)``: the ``RELAYGR_*`` variables that give a stage process
  these settings (validated here): the one way a launcher configures a stage.
- ``trigger_config(pipeline, bytes_per_token)`` / ``engine_config(pipeline)``: the typed configs they feed.

Each default lives in the typed config that uses it (``EngineConfig``, ``TriggerConfig``,
``PrefixStoreConfig``); a setting here reads it from there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from relaygr.infra.settings import default_home, settings_env
from relaygr.streams.trigger import TriggerConfig
from relaygr.workers.engine.engine_config import EngineConfig
from relaygr.workers.store.store_config import PrefixStoreConfig

MiB = 1 << 20


def _default(config: type[BaseModel], field: str, per: int = 1) -> Any:
    """The default of ``config.field`` (divided by ``per``: bytes to MiB)."""
    value = config.model_fields[field].default
    return value / per if per != 1 else value


def _default_model_dir() -> Path:
    """`$RELAYGR_HOME/model`"""
    home = os.environ.get("RELAYGR_HOME")
    return (Path(home) if home else default_home()) / "model"


class PipelineSettings(BaseSettings):
    """Every field is the env var ``RELAYGR_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="RELAYGR_", extra="ignore")

    mode: Literal["relay", "baseline"] = Field(
        default=_default(EngineConfig, "mode"),
        description="relay: trigger + prefix cache; baseline: full inference on every request.",
    )
    model_dir: Path = Field(
        default_factory=_default_model_dir, description="Checkpoint written by `relaygr train`."
    )
    device: str | None = Field(
        default=None, description="Model device (cpu, cuda, cuda:N, npu:N); default: the checkpoint's."
    )
    budget_ms: float = Field(
        default=_default(EngineConfig, "budget_ms"),
        gt=0,
        description="Ranking-stage latency budget (P99 SLO), ms.",
    )
    theta: float = Field(
        default=_default(TriggerConfig, "theta"),
        gt=0,
        description="Trigger: at risk when predicted full ranking > budget × theta.",
    )
    short_term: int = Field(
        default=_default(TriggerConfig, "short_term"),
        ge=0,
        description="Most recent events computed at ranking time (the suffix).",
    )
    retain_suffix: bool = Field(
        default=_default(EngineConfig, "retain_suffix"),
        description="Relay: a ranking keeps the suffix it computed in the prefix store, so the user's "
        "next ranking computes only the events new since.",
    )
    burst_batch: int = Field(
        default=_default(EngineConfig, "burst_batch"),
        ge=1,
        description="Relay: one user's rankings that wait for the device together run as one job "
        "of at most this many (their new events computed once); 1 = never.",
    )
    burst_batch_events: int = Field(
        default=_default(EngineConfig, "burst_batch_events"),
        ge=1,
        description="Relay: a burst batch holds at most this many cached events over its rankings "
        "(batching pays for short prefixes; with long ones the first ranking would wait for the rest).",
    )
    batch_tokens: int = Field(
        default=_default(EngineConfig, "batch_tokens"),
        ge=0,
        description="Relay: different users' rankings that wait for the device together run as one "
        "forward of at most this many tokens (new events plus candidates); 0 = each alone.",
    )
    batch_cached_events: int = Field(
        default=_default(EngineConfig, "batch_cached_events"),
        ge=0,
        description="Relay: a batch of different users' rankings reads at most this many cached "
        "events over their prefixes (on a CPU batching pays for short prefixes, not long ones).",
    )
    batch_wait_ms: float = Field(
        default=_default(EngineConfig, "batch_wait_ms"),
        ge=0,
        description="Relay: how long the device waits for more rankings to batch with the one it "
        "took (0: only those already waiting; on a CPU waiting buys little).",
    )
    cuda_graphs: bool | None = Field(
        default=_default(EngineConfig, "cuda_graphs"),
        description="Relay: rankings as bucketed static forwards that read the device tier's pages in "
        "place, replayed from CUDA graphs (off CUDA: the same forward, eagerly); unset: on for a CUDA model.",
    )
    graph_pool_mb: float = Field(
        default=_default(EngineConfig, "graph_pool_mb"),
        gt=0,
        description="Relay with cuda_graphs: most device MiB of pages, beside the device tier's, that "
        "the buckets' new tokens take (their shared rows: the grid's largest bucket's, 12,288 tokens).",
    )
    num_candidates: int = Field(default=128, ge=1, le=2000, description="Candidates retrieval returns.")
    max_rank_candidates: int = Field(default=128, ge=1, le=2000, description="Cap after pre-processing.")
    feature_fetch_ms: float = Field(
        default=0.0,
        ge=0,
        description="Emulated feature-fetch time in retrieval and in pre-processing each (W/2).",
    )
    footprint_bound_mb: float = Field(
        default=_default(TriggerConfig, "footprint_bound_bytes", MiB),
        ge=0,
        description="Trigger bound on live prefix MiB per partition.",
    )
    prefill_rate_per_s: float = Field(
        default=_default(TriggerConfig, "prefill_rate_per_s"),
        gt=0,
        description="Trigger bound on pre-inference rate.",
    )
    prefill_backlog_bound_ms: float = Field(
        default=_default(TriggerConfig, "backlog_bound_ms"),
        gt=0,
        description="Trigger bound on a worker's unfinished pre-inference (predicted device ms).",
    )
    prefill_share: float = Field(
        default=_default(EngineConfig, "prefill_share"),
        ge=0,
        lt=1,
        description="Relay: the least share of device time pre-inference gets while it has work queued.",
    )
    abandon_backlog: int | None = Field(
        default=_default(EngineConfig, "abandon_backlog"),
        ge=0,
        description="Relay: unset, a late pre-inference finishes; a number, the shedding policy (to "
        "compare against): it is dropped while more than this many pre-inference jobs are queued.",
    )
    lease_ttl_s: float = Field(
        default=_default(EngineConfig, "lease_ttl_s"), gt=0, description="Lease of a pre-inferred prefix."
    )
    prefill_chunk: int = Field(
        default=_default(EngineConfig, "prefill_chunk"),
        ge=1,
        description="Tokens per pre-inference job on the device.",
    )
    workers_per_device: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Ranking workers sharing this worker's device (``relaygr up --workers-per-device``): "
        "with more than one, each takes its share of the device for its tier and graph pool, sized "
        "from the accelerator's memory (on a CPU: the device cache and graph pool budgets, split).",
    )
    device_cache_mb: float = Field(
        default=_default(PrefixStoreConfig, "device_budget_bytes", MiB),
        ge=0,
        description="Prefix store: device tier MiB.",
    )
    host_cache_mb: float = Field(
        default=_default(PrefixStoreConfig, "host_budget_bytes", MiB),
        ge=0,
        description="Prefix store: host tier MiB.",
    )
    disk_cache_mb: float = Field(
        default=_default(PrefixStoreConfig, "disk_budget_bytes", MiB),
        ge=0,
        description="Prefix store: RocksDB tier MiB (0 = off).",
    )
    cold_kv_format: Literal["exact", "bf16", "int8"] = Field(
        default=_default(PrefixStoreConfig, "cold_kv_format"),
        description="Prefix store: how the host and disk tiers store keys and values (exact, bf16, or "
        "int8 with a float16 scale per token and head); the device tier stays exact.",
    )
    calibration_file: Path | None = Field(
        default=None,
        description="Latency model JSON from `relaygr calibrate`; default: calibrate at worker start.",
    )
    max_inflight: int = Field(
        default=256, ge=1, description="Ranking worker: requests in flight before it pauses fetching."
    )
    device_slice_ms: float = Field(
        default=_default(EngineConfig, "slice_ms"),
        ge=0,
        description="Ranking worker: longest device job between two scheduling decisions. Pre-inference "
        "and a relay worker's full rankings run in chunks sized by the latency model to take about "
        "this long (a chunk late in a long history attends to more keys, so it has fewer tokens); "
        "0 = chunks of RELAYGR_PREFILL_CHUNK tokens, full rankings in one piece.",
    )
    truncate_headroom: float = Field(
        default=_default(EngineConfig, "truncate_headroom"),
        gt=0,
        le=1,
        description="Ranking worker (relay): a full ranking keeps the most recent events predicted to "
        "fill this share of the time left, at the pace of recent full rankings (re-planned at most once).",
    )
    ingest_slowdown: float = Field(
        default=_default(EngineConfig, "ingest_slowdown"),
        ge=1,
        description="Ranking worker (relay): while it applies a burst of behaviours "
        "(RELAYGR_INGEST_BURST_EVENTS within RELAYGR_INGEST_WINDOW_S), a full ranking plans for "
        "this factor on its measured pace (its applier shares the interpreter with the device thread).",
    )
    ingest_burst_events: int = Field(
        default=_default(EngineConfig, "ingest_burst_events"),
        ge=1,
        description="Ranking worker: behaviour events applied within RELAYGR_INGEST_WINDOW_S that make a burst.",
    )
    ingest_window_s: float = Field(
        default=_default(EngineConfig, "ingest_window_s"),
        gt=0,
        description="Ranking worker: see RELAYGR_INGEST_BURST_EVENTS.",
    )
    history_retain_events: int | None = Field(
        default=None,
        ge=1,
        description="Ranking worker: events kept per user in its history table (the oldest dropped "
        "beyond it); default: twice the model's max_seq_len.",
    )
    too_long_ttl_factor: float = Field(
        default=_default(TriggerConfig, "too_long_ttl_factor"),
        gt=0,
        description="Trigger: refuse (too_long) a pre-inference predicted to outlast this × the lease TTL.",
    )
    too_long_window_factor: float = Field(
        default=_default(TriggerConfig, "too_long_window_factor"),
        ge=0,
        description="Trigger: refuse (too_long) a pre-inference predicted to take longer than this × the "
        "upstream window (2 × feature fetch + budget); 0 = no such bound.",
    )
    max_task_idle_ms: float = Field(
        default=2000.0,
        ge=0,
        description="Ranking worker: longest wait for the behaviours produced before a request to be "
        "applied (as Kafka Streams' max.task.idle.ms); a rank request also stops waiting once full "
        "ranking would miss its deadline. Past it, the result says history_complete: false.",
    )
    commit_interval_s: float = Field(
        default=0.2,
        gt=0,
        description="Ranking worker: seconds between two commits of the offsets it finished (as Kafka "
        "Streams' commit.interval.ms); a crash ranks again the requests after the last commit.",
    )
    stats_interval_s: float = Field(default=2.0, gt=0, description="Ranking worker: WorkerStats period.")
    standby_warm_s: float = Field(
        default=120.0,
        ge=0,
        description="Ranking worker standby (rolling restart): pre-infer the latest prefill signal of "
        "each user seen within this many seconds before it is ready (the users active lately), so "
        "that the hand-over finds their prefixes cached.",
    )
    standby_adopt_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="Ranking worker standby (rolling restart): once its histories are caught up, wait "
        "at most this long for the active process to write its cached prefixes to its disk tier, "
        "and adopt those still valid for the standby's histories (0 = adopt none: recompute all).",
    )
    handover_stall_s: float = Field(
        default=0.0,
        ge=0,
        description="Fault injection for tests and drills (0 = off, the default): a ranking worker "
        "told to hand over (rolling restart) blocks this many seconds right after it wrote its "
        "positions to handover.json, before it finishes, commits and answers what it holds; a kill "
        "in that time is a crash in the middle of a hand-over.",
    )
    torch_threads: int = Field(
        default=1,
        ge=0,
        description="Ranking worker: torch CPU threads (0 = torch's default). On CPU a worker shares "
        "cores with its Kafka client and the other stages; one thread keeps its tail steady.",
    )
    cpu_cores: str | None = Field(
        default=None,
        description="Cores every thread of this stage process runs on, e.g. '0' or '0-2' (the "
        "launcher's core layout, ``workers.engine.cores``); None = wherever the OS puts them.",
    )
    cpu_nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description="Nice level this stage process sets for itself at start (every thread inherits "
        "it); the local launcher gives the non-ranking stages ``workers.engine.cores.STAGE_NICE`` when "
        "they share cores with ranking workers.",
    )
    device_core: int | None = Field(
        default=None,
        ge=0,
        description="Ranking worker: the core of its own that the device thread runs on (an "
        "emulated accelerator on a CPU machine); None = not pinned.",
    )
    switch_interval_ms: float = Field(
        default=0.5,
        gt=0,
        description="Python's thread switch interval in every stage process. Each stage runs its "
        "Kafka loop next to another thread (the device thread; faust's consumer thread), and the "
        "default 5 ms would let that thread hold the loop up for 5 ms at a time.",
    )
    stop_grace_s: float = Field(
        default=25.0,
        gt=0,
        description="Most seconds a stage takes to stop after SIGTERM/SIGINT, or a ranking worker to "
        "hand over after SIGUSR1 (or once its supervisor is gone), before it exits without finishing: draining and committing wait on the broker, "
        "which may be gone. Below the launcher's 30 s before SIGKILL, so the stage says why.",
    )
    concurrency: int = Field(
        default=16, ge=1, description="Retrieval/pre-processing: requests processed concurrently."
    )

    def pace_settings(self) -> dict[str, Any]:
        """``calibration.measure_paces``' keyword arguments for workers run with these settings:
        pre-inference sliced and suffixes as long as theirs."""
        return {"slice_ms": self.device_slice_ms, "chunk": self.prefill_chunk, "suffix": self.short_term}

    @classmethod
    def to_env(cls, **settings: Any) -> dict[str, str]:
        """The ``RELAYGR_*`` variables that give a stage process these settings, and only these
        (the rest it reads from the environment it inherits). Validated here, so that a bad value
        fails in the launcher, not in a stage process."""
        unknown = set(settings) - set(cls.model_fields)
        if unknown:
            raise ValueError(f"no pipeline setting {sorted(unknown)}")
        return settings_env(cls.model_validate(settings), sorted(settings))


def trigger_config(
    pipeline: PipelineSettings, bytes_per_token: int, max_seq_len: int | None = None
) -> TriggerConfig:
    return TriggerConfig(
        max_seq_len=max_seq_len,
        window_ms=2 * pipeline.feature_fetch_ms + pipeline.budget_ms,
        too_long_ttl_factor=pipeline.too_long_ttl_factor,
        too_long_window_factor=pipeline.too_long_window_factor,
        enabled=pipeline.mode == "relay",
        budget_ms=pipeline.budget_ms,
        theta=pipeline.theta,
        short_term=pipeline.short_term,
        footprint_bound_bytes=int(pipeline.footprint_bound_mb * MiB),
        bytes_per_token=bytes_per_token,
        prefill_rate_per_s=pipeline.prefill_rate_per_s,
        backlog_bound_ms=pipeline.prefill_backlog_bound_ms,
        lease_ttl_s=pipeline.lease_ttl_s,
    )


def engine_config(pipeline: PipelineSettings) -> EngineConfig:
    return EngineConfig(
        mode=pipeline.mode,
        budget_ms=pipeline.budget_ms,
        prefill_chunk=pipeline.prefill_chunk,
        lease_ttl_s=pipeline.lease_ttl_s,
        retain_suffix=pipeline.retain_suffix,
        burst_batch=pipeline.burst_batch,
        burst_batch_events=pipeline.burst_batch_events,
        batch_tokens=pipeline.batch_tokens,
        batch_cached_events=pipeline.batch_cached_events,
        batch_wait_ms=pipeline.batch_wait_ms,
        cuda_graphs=pipeline.cuda_graphs,
        graph_pool_mb=pipeline.graph_pool_mb,
        slice_ms=pipeline.device_slice_ms,
        truncate_headroom=pipeline.truncate_headroom,
        ingest_slowdown=pipeline.ingest_slowdown,
        ingest_burst_events=pipeline.ingest_burst_events,
        ingest_window_s=pipeline.ingest_window_s,
        prefill_share=pipeline.prefill_share,
        abandon_backlog=pipeline.abandon_backlog,
    )
