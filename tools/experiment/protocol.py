"""What an experiment fixes before measuring, and what one point of it measured.

Primitives:
- ``Protocol``: everything fixed before measuring, identical in both modes; ``markdown()`` is
  its table at the top of the report.
- ``PointRun``: one mode at one point: its summary (``tools.report.figures.summarize``), trigger
  decisions and ranking latencies; ``holds`` says whether it held the SLO.
- ``best(points, mode)``: the largest point at which ``mode`` holds the SLO; ``plain_number(x)``:
  a point as an int when it is one (4096, not 4096.0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from relaygr.tools.report.markdown import table
from relaygr.tools.report.summary import RunSummary

MODES = ("relay", "baseline")
EXPERIMENT_SHORT_TERM = 64
"""Short-term suffix of every experiment (RELAYGR_SHORT_TERM of both modes' pipelines)."""


class Protocol(BaseModel):
    """Everything that is fixed before measuring (identical in both modes)."""

    experiment: str
    model_dir: str
    model: dict
    model_version: str
    threads: int
    ranking_workers: int
    partitions: int
    latency_model: dict
    slo_ms: float
    slo_method: str
    upstream_ms: float
    feature_fetch_ms: float
    theta: float
    short_term: int
    dataset: str
    min_prior: int
    window_start: int
    warmup: bool
    pipeline_warmup: int
    arrivals: str
    seed: int
    points: list[float]
    point_label: str
    requests_per_point: str
    history: str
    synthesis: str
    criterion: str
    core_layout: str = "not pinned"
    isolation: str = "both modes' pipelines live at once"

    def markdown(self) -> str:
        rows = [
            ["experiment", self.experiment],
            ["model", f"`{self.model_dir}` (version {self.model_version[:12]}): " + _arch(self.model)],
            ["ranking workers", f"{self.ranking_workers} per mode, {self.threads} torch thread(s) each"],
            ["latency model (full ranking, ms)", self.latency_model["text"]],
            ["SLO", f"P99 of ranking latency ≤ **B = {self.slo_ms:g} ms** ({self.slo_method})"],
            [
                "upstream time W",
                f"{self.upstream_ms:g} ms = B (retrieval and pre-processing each "
                f"emulate feature fetching for {self.feature_fetch_ms:g} ms)",
            ],
            [
                "trigger",
                f"θ = {self.theta:g}, short-term suffix {self.short_term} events (relay: a ranking keeps "
                "the suffix it computed cached, so a returning user's ranking computes only the events "
                "new since; a user's rankings that wait for the device together share one job)",
            ],
            [
                "trace",
                f"{self.dataset}, interactions with ≥ {self.min_prior} real earlier ones, in time "
                f"order, window from #{self.window_start}; warm-up: "
                + ("each user's previous interaction, replayed unmeasured" if self.warmup else "none"),
            ],
            [
                "pipeline warm-up",
                f"{self.pipeline_warmup} unmeasured requests through each fresh pipeline before measuring",
            ],
            ["arrivals", self.arrivals],
            [self.point_label, ", ".join(f"{p:g}" for p in self.points)],
            ["requests per point", self.requests_per_point],
            ["histories", self.history],
            ["synthesis", self.synthesis],
            ["SLO held when", self.criterion],
            ["cores", self.core_layout],
            ["isolation", self.isolation],
            ["partitions", str(self.partitions)],
        ]
        return table(["protocol", ""], rows)


def _arch(cfg: dict) -> str:
    keys = ("layers", "heads", "dim", "attn_dim", "linear_dim", "num_items", "dtype", "device")
    return "HSTU " + ", ".join(f"{k} {cfg[k]}" for k in keys if k in cfg)


@dataclass
class PointRun:
    x: float
    mode: str
    summary: RunSummary
    trigger: dict[str, int]
    requests: int
    ranking: list[float] = field(repr=False, default_factory=list)
    # 1 for the first of the first point's two runs (reported, never counted), else 2.
    attempt: int = 2
    # The confidence rule (``stopping.StopRule``): misses k of ``requests``, the upper bound of
    # the miss rate, and its verdict; None when the point ran a fixed number of requests.
    misses: int | None = None
    upper: float | None = None
    verdict: str | None = None

    @property
    def holds(self) -> bool:
        if self.verdict is not None:
            return self.verdict == "holds"
        return self.summary.slo.holds_slo


def plain_number(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x


def best(points: list[PointRun], mode: str) -> float | int | None:
    """The largest point at which ``mode`` holds the SLO."""
    ok = [p.x for p in points if p.mode == mode and p.holds]
    return plain_number(max(ok)) if ok else None
