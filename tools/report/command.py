"""Report of a results topic: latency, SLO compliance, trigger, cache tiers, path mix and quality.

`relaygr report --out DIR` reads the results topic of a pipeline (and the trace, for ground truth
that results lack; the prefill-signals topic, for the trigger's admissions; the ranking workers'
event logs, for pre-inference outcomes) and writes ``report.json``, ``report.md`` and PNG plots.

The parts: ``figures`` (pure functions of the results), ``plots``, ``markdown``, ``inputs``
(reading the topics and the workers' logs); this module writes the report and is the command.

Definitions (the figure computations are pure functions of a list of ``RankedResult``):
- percentiles are nearest-rank: P(q) is the smallest value with at least q % of values at or
  below it (so P99 of 100 values is the 99th smallest);
- ranking latency is ``breakdown_ms["ranking"]`` (rank request produced -> result produced), end
  to end is ``latency_ms`` (request sent -> result produced);
- a request meets the SLO when it has a result, was ranked (path not ``timeout``), its ranking
  latency is at most the bound B, and, unless truncation is allowed, it used its whole history
  (``used_len >= history_len``). A run holds the SLO when at least 99 % of its requests meet it,
  i.e. when the P99 of ranking latency, counting missing, timed-out and truncated requests as
  infinitely late, is at most B (``slo_p99_ms``);
- SLO-compliant throughput = requests that met the SLO / the run's duration (given, or the span
  of the requests' send times times n / (n - 1));
- trigger admission rate = prefill signals / requests; cache hit rates per tier: where the rank
  lookup found the prefix (``prefix_tier``) and how pre-inference got it (worker logs);
- pre-inference: the ranking workers' last reports (worker-stats topic), summed: admitted,
  finished, cached, late (their ranking went ahead), refused, dropped (and why), and the share
  of device time pre-inference got (since each worker started);
- HR@10 / NDCG@10: the true next item among the ranked top 10 (a label missing from the
  candidates is a miss).

Plots: ``latency_cdf.png``, ``p99_vs_qps.png`` (per-window achieved QPS), ``p99_vs_seq_len.png``
(binned by history length), ``hit_rates.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from relaygr.schemas import RankedResult
from relaygr.tools.report.figures import headline, json_safe
from relaygr.tools.report.inputs import (
    pre_inference_counts,
    prefill_statuses,
    rank_batch_counts,
    read_admitted_ids,
    read_labels,
    read_results,
    read_worker_stats,
)
from relaygr.tools.report.markdown import summary_markdown
from relaygr.tools.report.plots import run_plots
from relaygr.tools.report.summary import RunSummary


def write_run_report(
    out: Path,
    results: Sequence[RankedResult],
    summary: dict,
    *,
    slo_ms: float,
    inputs: Mapping[str, object],
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    plots = run_plots(results, summary, out, slo_ms)
    doc = {"inputs": dict(inputs), "summary": summary, "plots": plots}
    (out / "report.json").write_text(json.dumps(json_safe(doc), indent=2))
    md = [
        "# RelayGR run report",
        "Inputs: " + ", ".join(f"{k} `{v}`" for k, v in inputs.items()),
        "Percentiles are nearest-rank; a request meets the SLO when its ranking latency is within the "
        "bound, it was ranked, and it used its whole history (missing results count as violations).",
        summary_markdown(summary, title="Run"),
        "## Plots",
        *[f"![{p}]({p})" for p in plots],
    ]
    (out / "report.md").write_text("\n\n".join(md) + "\n")
    return doc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder for report.json, report.md, *.png")
    parser.add_argument("--prefix", help="topic prefix of the pipeline (default RELAYGR_TOPIC_PREFIX)")
    parser.add_argument("--results-topic", help="results topic (default <prefix>.results)")
    parser.add_argument(
        "--trace-topic", help="trace topic with the ground truth (default: the results' labels)"
    )
    parser.add_argument(
        "--user-prefix",
        default="",
        help="prefix the replay put before user and request ids: only those results are reported",
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--from-offset", help="results from this offset: N, or P:N,P:N")
    start.add_argument("--from-timestamp", help="results written since (epoch seconds or ISO 8601)")
    parser.add_argument(
        "--slo-ms", type=float, help="P99 bound B on ranking latency (default RELAYGR_BUDGET_MS)"
    )
    parser.add_argument(
        "--allow-truncated", action="store_true", help="count truncated histories as compliant"
    )
    parser.add_argument("--worker-events", type=Path, help="folder with the ranking workers' events.jsonl")
    parser.add_argument("--no-prefill-topic", action="store_true", help="don't read the prefill signals")
    parser.add_argument("--json", action="store_true", help="print the headline figures as one JSON line")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from relaygr.infra.local.broker import BrokerError
    from relaygr.infra.local.cluster import ensure_broker
    from relaygr.infra.settings import get_settings
    from relaygr.infra.topic_reader import Start
    from relaygr.schemas import TopicRegistry
    from relaygr.streams.config import PipelineSettings

    try:
        settings, _ = ensure_broker(get_settings())
        reg = TopicRegistry(args.prefix or settings.topic_prefix, settings.partitions)
        topic = args.results_topic or reg.name("results")
        slo_ms = args.slo_ms or PipelineSettings().budget_ms
        start = Start.parse(args.from_offset, args.from_timestamp)

        async def gather_inputs():
            res = await read_results(settings, topic, start)
            labels = (
                await read_labels(settings, args.trace_topic, args.user_prefix) if args.trace_topic else None
            )
            admitted = None
            if not args.no_prefill_topic:
                try:
                    mine = {k for k in res if k.startswith(args.user_prefix)}
                    admitted = await read_admitted_ids(settings, reg.name("prefill"), mine)
                except LookupError:
                    admitted = None
            try:
                workers = await read_worker_stats(settings, reg.name("worker_stats"))
            except LookupError:
                workers = {}
            return res, labels, admitted, workers

        res, labels, admitted, workers = asyncio.run(gather_inputs())
    except (BrokerError, LookupError, ValueError) as e:
        print(f"relaygr report: {e}", file=sys.stderr)
        return 1
    results = sorted(
        (r for r in res.values() if r.request_id.startswith(args.user_prefix)), key=lambda r: r.ts
    )
    if not results:
        print(f"relaygr report: no results in {topic}", file=sys.stderr)
        return 1
    ids = {r.request_id for r in results}
    statuses = prefill_statuses(args.worker_events, ids) if args.worker_events else None
    summary = RunSummary.of(
        results,
        slo_ms=slo_ms,
        labels=labels,
        admitted=admitted,
        prefill_statuses=statuses,
        allow_truncated=args.allow_truncated,
    )
    inputs = {"results": topic, "trace": args.trace_topic, "slo_ms": slo_ms, "results_read": len(results)}
    if workers:
        summary = summary.model_copy(
            update={
                "pre_inference": pre_inference_counts(workers),
                "rank_batches": rank_batch_counts(workers),
            }
        )
    doc = summary.to_dict()
    write_run_report(args.out, results, doc, slo_ms=slo_ms, inputs=inputs)
    print(f"report written to {args.out / 'report.md'} ({len(results)} results)", file=sys.stderr)
    if args.json:
        print(json.dumps({"report": str(args.out), **headline(doc)}))
    return 0
