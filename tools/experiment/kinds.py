"""The experiments, one spec per kind: what is swept, how each point is loaded and traced, and
what its report adds. The sweep and the report ask the spec; they never test the kind.

Primitives:
- ``ExperimentKind``: the questions a sweep asks of an experiment (points, requests and QPS of a
  point, the trace a point replays, the protocol's wording, the plots, the headline).
- ``SeqLen``: the longest history whose ranking P99 holds the SLO, at a fixed QPS.
- ``Throughput``: the highest QPS whose ranking P99 holds the SLO, at a fixed history length.
- ``KINDS``: name -> spec, the ``relaygr experiment`` choices.

These are the sweeps. The other kinds, the broker scenarios (``relaygr bench pipeline``,
``steady-load``, ...), each measure one situation on fresh pipelines instead of sweeping for the
SLO's edge: ``tools.experiment.scenarios`` lists them (``SCENARIOS``) and runs them on the same
harness, paced sender and long-user builder.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from relaygr.tools.experiment.plots import plot_sweep
from relaygr.tools.experiment.protocol import EXPERIMENT_SHORT_TERM, MODES, PointRun
from relaygr.tools.report.plots import plot_lines
from relaygr.tools.sizing import NO_PACE, Pace, size_throughput
from relaygr.workers.engine.latency_model import LatencyModel


@dataclass(frozen=True)
class TraceShape:
    """The trace a point replays: ``requests`` window requests at histories of ``length`` events,
    published on ``topic_suffix`` (points with the same shape share one trace)."""

    requests: int
    length: int
    topic_suffix: str


class ExperimentKind:
    name: str
    x_name: str  # what the points are, in the report's words
    key: str  # suffix of the headline's figures: relay_max_<key>, baseline_max_<key>
    point_label: str
    paper_ratio: float
    target_ratio: float
    default_patience: int  # failing points in a row after which a mode stops

    def points(self, args: argparse.Namespace) -> list[float]:
        raise NotImplementedError

    def requests(self, args: argparse.Namespace, x: float) -> int:
        raise NotImplementedError

    def qps(self, args: argparse.Namespace, x: float) -> float:
        raise NotImplementedError

    def trace(self, args: argparse.Namespace, x: float, requests: int) -> TraceShape:
        raise NotImplementedError

    def protocol_text(self, args: argparse.Namespace) -> dict[str, str]:
        """The protocol's ``arrivals``, ``requests_per_point`` and ``history`` rows."""
        raise NotImplementedError

    def size(self, args: argparse.Namespace, latency: LatencyModel, max_seq_len: int, say) -> None:
        """Fill in what the machine's calibration decides (``args`` left as given by default)."""
        if args.slo_tokens is None:
            args.slo_tokens = 1024

    def plots(self, points: list[PointRun], slo_ms: float, out: Path) -> list[Path]:
        raise NotImplementedError

    def quality_at(self, points: list[PointRun], relay_best: float | None) -> dict | None:
        """Quality of both modes at the relay's best point, where that comparison means something."""
        return None

    def headline_extra(
        self,
        args: argparse.Namespace | None,
        points: list[PointRun],
        relay_best: float | None,
        baseline_best: float | None,
    ) -> dict:
        return {}


class SeqLen(ExperimentKind):
    name = "seq-len"
    x_name = "history length"
    key = "len"
    point_label = "history lengths (events)"
    paper_ratio = 1.5
    target_ratio = 2.0
    default_patience = 0

    def points(self, args: argparse.Namespace) -> list[float]:
        return [float(x) for x in args.lengths.split(",")]

    def requests(self, args: argparse.Namespace, x: float) -> int:
        return args.max_requests

    def qps(self, args: argparse.Namespace, x: float) -> float:
        return args.qps

    def trace(self, args: argparse.Namespace, x: float, requests: int) -> TraceShape:
        return TraceShape(requests, int(x), f"trace-L{int(x)}")

    def protocol_text(self, args: argparse.Namespace) -> dict[str, str]:
        return {
            "arrivals": f"Poisson at {args.qps:g} QPS in trace order",
            "requests_per_point": _rounds_text(args),
            "history": "the point's length at each user's first request in the window",
        }

    def plots(self, points: list[PointRun], slo_ms: float, out: Path) -> list[Path]:
        return [
            plot_sweep(
                points,
                slo_ms,
                out / "p99_vs_seq_len.png",
                xlabel="history length (events)",
                title="Ranking P99 against sequence length",
                logx=True,
            ),
            plot_lines(
                {m: [(p.x, p.summary.history.mean_used_len) for p in points if p.mode == m] for m in MODES},
                out / "served_len_vs_seq_len.png",
                xlabel="history length (events)",
                ylabel="events used (mean)",
                title="History actually used at ranking (baseline truncates to fit B)",
                logx=True,
            ),
        ]

    def quality_at(self, points: list[PointRun], relay_best: float | None) -> dict | None:
        if relay_best is None:
            return None
        return {
            p.mode: {
                **p.summary.quality.model_dump(by_alias=True),
                "mean_used_len": p.summary.history.mean_used_len,
                "mean_history_len": p.summary.history.mean_history_len,
            }
            for p in points
            if p.x == relay_best
        }


class Throughput(ExperimentKind):
    name = "throughput"
    x_name = "QPS"
    key = "qps"
    point_label = "offered QPS"
    paper_ratio = 3.6
    target_ratio = 4.0
    default_patience = 2

    def points(self, args: argparse.Namespace) -> list[float]:
        return [float(x) for x in args.qps_list.split(",")]

    def requests(self, args: argparse.Namespace, x: float) -> int:
        return args.max_requests

    def qps(self, args: argparse.Namespace, x: float) -> float:
        return x

    def trace(self, args: argparse.Namespace, x: float, requests: int) -> TraceShape:
        # One trace for every point: the most requests any point sends, at the fixed history.
        most = max(self.requests(args, p) for p in self.points(args))
        return TraceShape(most, args.history, "trace")

    def size(self, args: argparse.Namespace, latency: LatencyModel, max_seq_len: int, say) -> None:
        """The history (unless ``--history``): the longest whose full ranking at low load takes most
        of the product budget (``tools.sizing.size_throughput``), at most half the serving cap (the
        window's interactions lengthen the histories); B is then measured at that length (unless
        ``--slo-tokens``), so the baseline serves it within B at the reference load."""
        from relaygr.streams.config import PipelineSettings

        if args.history is None:
            work = size_throughput(
                latency,
                PipelineSettings().budget_ms,
                max_seq_len // 2,
                EXPERIMENT_SHORT_TERM,
                relay_pace=getattr(args, "relay_pace", NO_PACE),
            )
            args.history, args.sizing = work.history, work.to_dict()
            say(f"history {work.history} events: {work.why_history}")
        else:
            args.sizing = size_throughput_at(latency, args.history, getattr(args, "relay_pace", NO_PACE))
            say(
                f"history {args.history} events (given): compute ratio {args.sizing['compute_ratio']:.1f}x there"
            )
        if args.slo_tokens is None:
            args.slo_tokens = args.history

    def protocol_text(self, args: argparse.Namespace) -> dict[str, str]:
        sized = getattr(args, "sizing", {}).get("why_history")  # None when --history gave it
        return {
            "arrivals": "Poisson at the point's QPS in trace order",
            "requests_per_point": _rounds_text(args),
            "history": f"{args.history} events at each user's first request in the window (fixed"
            + (f": {sized}" if sized else "")
            + "); returning users: the window's users come back as they did in the trace, and each "
            "user's previous visit is replayed unmeasured first",
        }

    def plots(self, points: list[PointRun], slo_ms: float, out: Path) -> list[Path]:
        return [
            plot_sweep(
                points,
                slo_ms,
                out / "p99_vs_qps.png",
                xlabel="offered QPS",
                title="Ranking P99 against QPS",
                logx=False,
            ),
            plot_lines(
                {m: [(p.x, p.summary.slo.slo_throughput_qps) for p in points if p.mode == m] for m in MODES},
                out / "slo_throughput_vs_qps.png",
                xlabel="offered QPS",
                ylabel="SLO-compliant req/s",
                title="SLO-compliant throughput",
                logx=False,
            ),
        ]

    def headline_extra(
        self,
        args: argparse.Namespace | None,
        points: list[PointRun],
        relay_best: float | None,
        baseline_best: float | None,
    ) -> dict:
        sizing = getattr(args, "sizing", {}) if args is not None else {}
        extra: dict = {
            "history": args.history if args is not None else None,
            "compute_ratio": sizing.get("compute_ratio"),
            "predicted_full_ms": sizing.get("predicted_full_ms"),
            "predicted_relay_ms": sizing.get("predicted_relay_ms"),
            "users": "returning",
        }
        for mode, bx in (("relay", relay_best), ("baseline", baseline_best)):
            at = [p for p in points if p.mode == mode and p.x == bx]
            extra[f"{mode}_slo_throughput_qps"] = at[0].summary.slo.slo_throughput_qps if at else None
        return extra


def size_throughput_at(latency: LatencyModel, history: int, relay_pace: Pace = NO_PACE) -> dict:
    """The compute figures at a given history (``--history``)."""
    from relaygr.tools.sizing import relay_ms

    full = latency.predict_ms(history)
    relay = relay_ms(latency, history, EXPERIMENT_SHORT_TERM, relay_pace=relay_pace)
    return {"history": history, "predicted_full_ms": round(full, 2), "predicted_relay_ms": round(relay, 2),
            "compute_ratio": round(full / relay, 2), "overridden": ["history"]}  # fmt: skip


def _rounds_text(args: argparse.Namespace) -> str:
    return (
        "in rounds of the window's next requests until the confidence rule decides, at most "
        f"{args.max_requests} (the first ones of the window; each round's results are collected "
        f"before the rule is asked, rounds of {args.min_round} to {args.max_round}); the window's users are "
        "preloaded and replayed for the cap"
    )


KINDS: dict[str, ExperimentKind] = {kind.name: kind for kind in (SeqLen(), Throughput())}
