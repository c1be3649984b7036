"""The contract: event models, wire codec and topic registry. Imports neither Kafka nor torch."""

from relaygr.schemas.codec import SchemaError, decode, encode
from relaygr.schemas.events import (
    ALL_EVENTS,
    SCHEMA_VERSION,
    BehaviorBatch,
    BehaviorEvent,
    DeadLetter,
    Event,
    PrefillSignal,
    RankedResult,
    RankPath,
    RankRequest,
    RecommendationRequest,
    RetrievedRequest,
    ScoredItem,
    TriggerReason,
    WorkerStats,
)
from relaygr.schemas.topics import TopicRegistry, TopicSpec

__all__ = [
    "ALL_EVENTS",
    "SCHEMA_VERSION",
    "BehaviorBatch",
    "BehaviorEvent",
    "DeadLetter",
    "Event",
    "PrefillSignal",
    "RankPath",
    "RankRequest",
    "RankedResult",
    "RecommendationRequest",
    "RetrievedRequest",
    "SchemaError",
    "ScoredItem",
    "TopicRegistry",
    "TopicSpec",
    "TriggerReason",
    "WorkerStats",
    "decode",
    "encode",
]
