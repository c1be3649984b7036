"""The events of RelayGR's data flow: one pydantic v2 model per message kind.

Primitives:
- ``BehaviorEvent``      — a user interacted with an item (``relaygr.behaviors``, key ``user_id``).
- ``BehaviorBatch``      — consecutive behaviours of one user as the ingress routed them, columnar
  (``relaygr.routed-behaviors``, key ``user_id``), each with the public record it came from.
- ``RecommendationRequest`` — a user needs a ranked list (``relaygr.requests``, key ``user_id``).
- ``RetrievedRequest``   — retrieval's candidates for a request (key ``user_id``).
- ``PrefillSignal``      — the trigger's order to pre-infer a user's long-term prefix (key ``user_id``).
- ``RankRequest``        — pre-processed candidates, ready for the ranking worker (key ``user_id``).
- ``RankedResult``       — the answer (``relaygr.results``, key ``request_id``).
- ``DeadLetter``         — a message a stage could not use: its original bytes and the reason.
- ``WorkerStats``        — a ranking worker's cache footprint, load and latency model.
- ``OnBehavioursClock``  — ``model_ts`` of the request-like events (their ``event_ts``, else ``ts``).
- ``ItemId``             — an item as the producer's catalogue names it: an integer or a string;
  ``is_item_id(value)`` says whether a value is one.

Every model is strict (no type coercion, unknown fields rejected), carries ``schema_version``, and
bounds its ids, counts, lengths and timestamps, so a hostile message fails validation instead of
exhausting a stage.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    Strict,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import CoreSchema

SCHEMA_VERSION = 1

MAX_ID_LEN = 128
MAX_ITEM_ID = 2**31 - 1
MAX_ITEM_ID_LEN = 256
MAX_CANDIDATES = 2000
MAX_SHORT_TERM = 4096
MAX_REASON_LEN = 2000

# Timestamps are float seconds since the epoch; the bounds reject NaN, inf and absurd values.
TS_MAX = 1e11

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN, pattern=r"^[^\x00-\x1f]+$")]

ITEM_ID_RULE = (
    f"an item id is an integer 0..{MAX_ITEM_ID} or a string of 1..{MAX_ITEM_ID_LEN} characters "
    "without control characters"
)


class _OneItemIdError:
    """Reports a failed item id as one error at the field itself (not one per union member), with
    the whole rule: the member tags of a union would otherwise be named as the faulty field."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        schema = handler(source)
        schema["custom_error_type"] = "item_id"  # type: ignore[typeddict-unknown-key]
        schema["custom_error_message"] = ITEM_ID_RULE  # type: ignore[typeddict-unknown-key]
        return schema


# A producer's catalogue names items by integers or by strings. Strict and left to right: a JSON
# number stays an int (3.0, 3.5 and true are refused) and a JSON string stays a string.
ItemId = Annotated[
    Annotated[int, Field(ge=0, le=MAX_ITEM_ID)]
    | Annotated[str, Field(min_length=1, max_length=MAX_ITEM_ID_LEN, pattern=r"^[^\x00-\x1f\x7f]+$")],
    Field(union_mode="left_to_right"),
    _OneItemIdError(),
]
_ITEM_ID = TypeAdapter(ItemId, config=ConfigDict(strict=True))


def is_item_id(value: object) -> bool:
    """Whether ``value`` is an item id the wire carries (``ItemId``, as every event checks it)."""
    try:
        _ITEM_ID.validate_python(value)
    except ValidationError:
        return False
    return True


Timestamp = Annotated[float, Field(ge=0.0, le=TS_MAX, allow_inf_nan=False)]
Millis = Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=10_000_000)]
Bytes = Annotated[int, Field(ge=0, le=1 << 50)]
EventTs = Annotated[
    Timestamp | None,
    Field(description="the request's time on the behaviours' clock (replays); None: same as ts"),
]
BehaviorsNeeded = Annotated[
    dict[str, Count] | None,
    Field(
        max_length=4096,
        description="public behaviours partition -> end offset when the ingress read the request: "
        "the history is complete once the routed behaviours cover it",
    ),
]


class Event(BaseModel):
    """Base of every message: strict, frozen, versioned."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    kind: ClassVar[str]

    #: The field that the message is keyed by on its topic.
    key_field: ClassVar[str] = "user_id"

    def key(self) -> bytes:
        return str(getattr(self, self.key_field)).encode()


class OnBehavioursClock:
    """A request-like event with ``ts`` (wall clock) and ``event_ts`` (the behaviours' clock, set
    by replays; ``EventTs``). Declares no field itself: the order of fields is each event's own."""

    @property
    def model_ts(self) -> float:
        """The request's time as the model sees it: histories are cut before it."""
        ts, event_ts = self.ts, self.event_ts  # type: ignore[attr-defined]
        return ts if event_ts is None else event_ts


class BehaviorEvent(Event):
    """A user's interaction with an item, as it happened."""

    kind: ClassVar[str] = "behavior"
    user_id: Id
    item_id: ItemId
    ts: Timestamp
    action: int = Field(default=0, ge=0, le=255, description="interaction type; MovieLens: the rating 1..5")


MAX_BATCH_EVENTS = 4096


class BehaviorBatch(Event):
    """One user's behaviours in the order the ingress forwarded them, one column per field.

    A burst of long histories becomes a few records per user instead of one per event, so every
    stage applies it at the cost of its events, not of Kafka records. ``source_partitions`` and
    ``source_offsets`` name the public record each event came from: a reader drops what it
    applied before (a copy forwarded twice), counting offsets of ``source_topic_id`` only."""

    kind: ClassVar[str] = "behavior_batch"
    user_id: Id
    item_ids: list[ItemId] = Field(min_length=1, max_length=MAX_BATCH_EVENTS)
    timestamps: list[Timestamp] = Field(min_length=1, max_length=MAX_BATCH_EVENTS)
    actions: list[Annotated[int, Field(ge=0, le=255)]] = Field(min_length=1, max_length=MAX_BATCH_EVENTS)
    source_partitions: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=MAX_BATCH_EVENTS)
    source_offsets: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=MAX_BATCH_EVENTS)
    source_topic_id: str | None = Field(
        default=None,
        max_length=64,
        description="id of the public topic the events were read from: offsets of a topic deleted "
        "and created again start over, so a reader's last applied offsets of another id do not count",
    )

    @model_validator(mode="after")
    def _same_lengths(self) -> BehaviorBatch:
        n = len(self.item_ids)
        cols = (self.timestamps, self.actions, self.source_partitions, self.source_offsets)
        if any(len(c) != n for c in cols):
            raise ValueError("item_ids, timestamps, actions and source columns must have the same length")
        return self

    def __len__(self) -> int:
        return len(self.item_ids)


class RecommendationRequest(OnBehavioursClock, Event):
    """A user's request for recommendations, as retrieval first sees it."""

    kind: ClassVar[str] = "request"
    request_id: Id
    user_id: Id
    ts: Timestamp
    event_ts: EventTs = None
    num_candidates: int = Field(default=128, ge=1, le=MAX_CANDIDATES, description="how many items to rank")
    top_k: int = Field(default=10, ge=1, le=MAX_CANDIDATES, description="how many ranked items to return")
    label_item_id: ItemId | None = Field(
        default=None, description="replay only: the item the user really chose next (ground truth)"
    )


class TriggerReason(StrEnum):
    """Why the sequence-aware trigger did or did not order a pre-inference."""

    ADMITTED = "admitted"
    NOT_AT_RISK = "not_at_risk"
    FOOTPRINT_BOUND = "footprint_bound"
    RATE_BOUND = "rate_bound"
    TOO_LONG = "too_long"  # its pre-inference would outlast the lease or the upstream window
    NO_HISTORY = "no_history"
    DISABLED = "disabled"


class RetrievedRequest(OnBehavioursClock, Event):
    """Retrieval's output: the request plus its candidates and the trigger's decision."""

    kind: ClassVar[str] = "retrieved"
    request_id: Id
    user_id: Id
    ts: Timestamp
    event_ts: EventTs = None
    candidates: list[ItemId] = Field(max_length=MAX_CANDIDATES)
    top_k: int = Field(default=10, ge=1, le=MAX_CANDIDATES)
    history_len: Count = 0
    trigger: Annotated[TriggerReason, Strict(False)] = TriggerReason.DISABLED
    received_at: Timestamp | None = Field(default=None, description="when retrieval read the request")
    routed_at: Timestamp | None = Field(default=None, description="when the ingress forwarded the request")
    retrieved_at: Timestamp
    label_item_id: ItemId | None = None
    behaviors_needed: BehaviorsNeeded = None


class PrefillSignal(OnBehavioursClock, Event):
    """Order to pre-infer the long-term prefix of ``user_id``'s history, ahead of its rank request."""

    kind: ClassVar[str] = "prefill"
    request_id: Id
    user_id: Id
    ts: Timestamp
    event_ts: EventTs = None
    history_len: Count = Field(description="events in the user's history when the trigger fired")
    prefix_len: Count = Field(
        description="events the prefix should cover (history minus the short-term tail)"
    )
    lease_ttl_s: float = Field(default=30.0, gt=0.0, le=3600.0, allow_inf_nan=False)
    issued_at: Timestamp
    behaviors_needed: BehaviorsNeeded = None


class RankRequest(OnBehavioursClock, Event):
    """Pre-processed request: unseen candidates, ready for ranking."""

    kind: ClassVar[str] = "rank"
    request_id: Id
    user_id: Id
    ts: Timestamp
    event_ts: EventTs = None
    candidates: list[ItemId] = Field(max_length=MAX_CANDIDATES)
    top_k: int = Field(default=10, ge=1, le=MAX_CANDIDATES)
    deadline_ts: Timestamp = Field(description="wall-clock time by which the result is due")
    prefill_expected: bool = Field(default=False, description="a prefill signal was sent for this request")
    trigger: Annotated[TriggerReason, Strict(False)] | None = Field(
        default=None, description="the trigger's decision for this request (from retrieval)"
    )
    produced_at: Timestamp
    upstream_ms: dict[str, Millis] = Field(default_factory=dict, max_length=16)
    label_item_id: ItemId | None = None
    behaviors_needed: BehaviorsNeeded = None


class ScoredItem(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    item_id: ItemId
    score: float = Field(allow_inf_nan=False)


class RankPath(StrEnum):
    """How a request was ranked."""

    RELAY = "relay"  # cached prefix was ready: suffix + candidates only
    RELAY_WAITED = "relay_waited"  # waited for an in-flight prefix, then relay
    RELAY_EXTENDED = "relay_extended"  # a shorter cached prefix was extended first
    FULL = "full"  # no cache: full inference over the whole history
    FULL_TRUNCATED = "full_truncated"  # full inference, history truncated to fit the budget
    BASELINE = "baseline"  # baseline mode: full inference by design
    COLD_START = "cold_start"  # the user has no history
    TIMEOUT = "timeout"  # the deadline passed before ranking could start


class RankedResult(Event):
    """The ranking worker's answer to one request."""

    kind: ClassVar[str] = "result"
    key_field: ClassVar[str] = "request_id"
    request_id: Id
    user_id: Id
    ts: Timestamp = Field(description="the request's timestamp")
    items: list[ScoredItem] = Field(max_length=MAX_CANDIDATES)
    path: Annotated[RankPath, Strict(False)]
    latency_ms: Millis = Field(description="end to end, from the request's ts to the result's production")
    worker_id: Id = "unknown"
    breakdown_ms: dict[str, Millis] = Field(default_factory=dict, max_length=32)
    history_len: Count = Field(default=0, description="events in the user's history at ranking")
    used_len: Count = Field(default=0, description="events the ranking read (less when truncated)")
    tokens_computed: Count = Field(default=0, description="tokens computed at ranking (suffix + candidates)")
    prefix_len: Count = Field(default=0, description="events served from a cached prefix")
    prefix_tier: Literal["device", "host", "disk", "inflight", "miss"] | None = Field(
        default=None, description="where the cached prefix came from (None: no cache involved)"
    )
    prefix_worker_id: Id | None = Field(
        default=None, description="the worker that computed the cached prefix"
    )
    history_complete: bool = Field(
        default=True,
        description="False when the wait for behaviours produced before the request ran out: the "
        "history may lack some of them",
    )
    path_reason: str | None = Field(
        default=None,
        max_length=MAX_REASON_LEN,
        description="why the request did not take a relay path (None on a relay path): the trigger's "
        "refusal (not_at_risk, footprint_bound, rate_bound, too_long, no_history, disabled), or, for "
        "an admitted request, what broke the relay (signal_not_seen, prefill_not_ready, "
        "prefill_<status>, prefix_evicted, prefix_invalidated, deadline_passed); baseline in the "
        "baseline mode",
    )
    unknown_candidates: Count = Field(
        default=0,
        description="candidates whose item id the model's vocabulary lacks: ranked as its "
        "out-of-vocabulary token (the result still names them by the id received)",
    )
    unknown_history: Count = Field(
        default=0, description="events of the ranked history whose item id the model's vocabulary lacks"
    )
    label_item_id: ItemId | None = None


class DeadLetter(Event):
    """A message that a stage could not use, with where it came from and why."""

    kind: ClassVar[str] = "dead_letter"
    source_topic: str = Field(min_length=1, max_length=249)
    partition: int = Field(ge=-1)
    offset: int = Field(ge=-1)
    key_b64: str | None = Field(default=None, max_length=4096)
    value_b64: str = Field(description="the original bytes, base64 (bounded by the stage's size limit)")
    reason: str = Field(min_length=1, max_length=MAX_REASON_LEN)
    stage: Id
    ts: Timestamp

    def key(self) -> bytes:
        return f"{self.source_topic}:{self.partition}:{self.offset}".encode()


class WorkerStats(Event):
    """A ranking worker's periodic report (compacted topic, key ``worker_id``)."""

    kind: ClassVar[str] = "worker_stats"
    key_field: ClassVar[str] = "worker_id"
    worker_id: Id
    ts: Timestamp
    partitions: list[int] = Field(default_factory=list, max_length=4096)
    cache_bytes: dict[str, Bytes] = Field(default_factory=dict, max_length=8)
    pinned_bytes: Bytes = 0
    queue_depth: Count = 0
    prefill_inflight: Count = 0
    # Pre-inferences since the worker started: admitted, finished, cached, late, refused,
    # dropped:<reason> (``RankingEngine.prefill_counts``).
    prefill_counts: dict[str, Count] = Field(default_factory=dict, max_length=32)
    # Predicted device ms of the admitted pre-inferences not finished yet (the trigger's backlog bound).
    prefill_backlog_ms: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    # Device seconds per priority since start (rank_s, prefill_s) and pre-inference's recent share.
    device_share: dict[str, float] = Field(default_factory=dict, max_length=8)
    # Full rankings' measured time over the latency model's (their truncation plans with it).
    full_pace: float = Field(default=1.0, gt=0, le=1000, allow_inf_nan=False)
    # Latency model of full ranking: ms ≈ a + b·n + c·n² for a history of n tokens.
    latency_coeffs: list[float] = Field(default_factory=list, max_length=4)
    mode: Literal["relay", "baseline"] = "relay"
    # Relay rankings' device turns since start by how many rankings each ran (a user's burst, or
    # several users' rankings in one forward): {"1": turns alone, "2": turns of two, ...; "64":
    # 64 or more}.
    rank_batch_sizes: dict[str, Count] = Field(default_factory=dict, max_length=64)

    @field_validator("latency_coeffs")
    @classmethod
    def _finite(cls, v: list[float]) -> list[float]:
        if not all(math.isfinite(x) for x in v):
            raise ValueError("coefficients must be finite")
        return v


ALL_EVENTS: tuple[type[Event], ...] = (
    BehaviorEvent,
    BehaviorBatch,
    RecommendationRequest,
    RetrievedRequest,
    PrefillSignal,
    RankRequest,
    RankedResult,
    DeadLetter,
    WorkerStats,
)
