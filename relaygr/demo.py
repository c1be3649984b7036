"""The main job: RelayGR end to end on MovieLens-100K with a local Kafka broker, and a summary.

1. starts the local broker unless one runs (or RELAYGR_BOOTSTRAP names a cluster);
2. trains the HSTU ranker on MovieLens-100K unless a checkpoint exists (RELAYGR_MODEL_DIR);
3. calibrates the latency model of full ranking on this machine;
4. runs retrieval, pre-processing and N ranking workers as processes on fresh demo topics;
5. replays real users: their history as behaviours, their last interaction as a request whose
   ground truth is that item;
6. prints path mix, latencies, trigger outcomes, cache use and HR@10 / NDCG@10; deletes the demo
   topics (the broker keeps running for the next command; `relaygr broker stop` ends it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np

from relaygr.infra import broker
from relaygr.infra.cluster import ensure_broker
from relaygr.infra.kafka import TopicError, delete_topics_with_prefix, ensure_topics
from relaygr.infra.settings import get_settings
from relaygr.schemas import RankedResult, TopicRegistry
from relaygr.tools.args import int_at_least
from relaygr.tools.prepare import ensure_calibration, ensure_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--users", type=int, default=100, help="MovieLens users to replay (default 100)")
    parser.add_argument("--qps", type=float, default=20.0, help="request rate of the replay")
    parser.add_argument("--ranking-workers", type=int, default=2)
    parser.add_argument("--mode", choices=["relay", "baseline"], default="relay")
    parser.add_argument(
        "--synth-factor",
        type=int,
        default=16,
        help="lengthen histories by time-shifted repetition (1 = real lengths)",
    )
    parser.add_argument(
        "--max-history",
        type=int_at_least(1),
        default=2560,
        help="keep at most this many most recent events per user (serving systems cap sequences too)",
    )
    parser.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    parser.add_argument("--stop-broker", action="store_true", help="stop the local broker at the end")


def _step(msg: str) -> None:
    print(f"== {msg}", flush=True)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def summarize(results: dict[str, RankedResult], sent: int) -> dict:
    rs = list(results.values())
    paths = Counter(r.path.value for r in rs)
    ranking = [r.breakdown_ms.get("ranking", math.nan) for r in rs]
    e2e = [r.latency_ms for r in rs]
    hits, ndcg, labelled = 0, 0.0, 0
    for r in rs:
        if r.label_item_id is None:
            continue
        labelled += 1
        ids = [it.item_id for it in r.items[:10]]
        if r.label_item_id in ids:
            hits += 1
            ndcg += 1.0 / math.log2(ids.index(r.label_item_id) + 2)
    tiers = Counter(r.prefix_tier for r in rs if r.prefix_tier)
    return {
        "requests": sent,
        "results": len(rs),
        "paths": dict(paths),
        "prefix_tiers": dict(tiers),
        "workers": dict(Counter(r.worker_id for r in rs)),
        "ranking_ms_p50": _pct(ranking, 50),
        "ranking_ms_p99": _pct(ranking, 99),
        "e2e_ms_p50": _pct(e2e, 50),
        "e2e_ms_p99": _pct(e2e, 99),
        "mean_history_len": float(np.mean([r.history_len for r in rs])) if rs else 0.0,
        "mean_tokens_computed": float(np.mean([r.tokens_computed for r in rs])) if rs else 0.0,
        "hr@10": hits / labelled if labelled else math.nan,
        "ndcg@10": ndcg / labelled if labelled else math.nan,
    }


def run(args: argparse.Namespace) -> int:
    from relaygr.streams.config import PipelineSettings
    from relaygr.tools.traffic import collect_results, leave_last_out, publish
    from relaygr.tools.up import Pipeline
    from relaygr.workers.movielens import load_movielens

    base = get_settings()
    p = PipelineSettings()
    started = False
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    try:
        settings, started = ensure_broker(base)
        ensure_model(p.model_dir)
        calib = ensure_calibration(p.model_dir)
        settings = settings.model_copy(
            update={"topic_prefix": f"{base.topic_prefix}-{run_id}", "home": Path(base.home) / run_id}
        )
        reg = TopicRegistry(settings.topic_prefix, settings.partitions)
        _step(f"creating topics {settings.topic_prefix}.* ({settings.partitions} partitions each)")
        asyncio.run(ensure_topics(reg, settings))
        env = {
            "RELAYGR_MODEL_DIR": str(p.model_dir),
            "RELAYGR_CALIBRATION_FILE": str(calib),
            # Production's upstream stages take time (feature fetching): emulate W = the ranking
            # budget, split over retrieval and pre-processing, unless configured otherwise.
            "RELAYGR_FEATURE_FETCH_MS": str(p.feature_fetch_ms or p.budget_ms / 2),
        }
        _step(
            f"starting the pipeline: retrieval, preprocess, {args.ranking_workers} ranking worker(s), mode {args.mode}"
        )
        ml = load_movielens("ml-100k")
        users = sorted(ml.histories)[: args.users]
        behaviours, requests = leave_last_out(
            ml, users, synth_factor=args.synth_factor, max_len=args.max_history
        )
        with Pipeline(
            settings, ranking_workers=args.ranking_workers, mode=args.mode, env=env, metrics=True
        ) as pipe:
            waited = asyncio.run(pipe.wait_ready())
            print(f"   ready in {waited:.1f} s (logs in {pipe.log_dir})")
            _step(
                f"replaying {len(requests)} MovieLens users: {len(behaviours)} behaviours, "
                f"then {len(requests)} requests at {args.qps:g}/s"
            )
            t0 = time.monotonic()
            sent = asyncio.run(
                publish(settings, reg, behaviours, requests, qps=args.qps, wait_for_ingest=True)
            )
            want = {r.request_id for r in sent}
            results = asyncio.run(collect_results(settings, reg, want, timeout_s=120))
            print(f"   {len(results)}/{len(sent)} results in {time.monotonic() - t0:.1f} s")
            trigger = {
                k.split('reason="')[1].rstrip('"}'): int(v)
                for k, v in pipe.scrape("retrieval").items()
                if k.startswith("relaygr_trigger_decisions_total{")
            }
        summary = summarize(results, len(sent))
        summary["trigger"] = trigger
        summary["prefill"] = _prefill_outcomes(Path(settings.home) / "workers")
        _print_summary(summary)
        if args.json:
            print(json.dumps(summary))
        asyncio.run(delete_topics_with_prefix(settings, settings.topic_prefix))
        shutil.rmtree(settings.home, ignore_errors=True)
        return 0 if len(results) == len(sent) else 1
    except (broker.BrokerError, TopicError, RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
        print(f"relaygr demo: {e}", file=sys.stderr)
        return 1
    finally:
        if args.stop_broker and started:
            broker.stop(base)


def _prefill_outcomes(workers_dir: Path) -> dict[str, int]:
    out: Counter[str] = Counter()
    for f in workers_dir.glob("**/events.jsonl"):
        for line in f.read_text().splitlines():
            e = json.loads(line)
            if e.get("event") == "prefill":
                out[e["status"]] += 1
    return dict(out)


def _print_summary(s: dict) -> None:
    _step("summary")
    print(f"   results        {s['results']}/{s['requests']}")
    print("   paths          " + ", ".join(f"{k} {v}" for k, v in sorted(s["paths"].items())))
    if s["prefix_tiers"]:
        print("   prefix from    " + ", ".join(f"{k} {v}" for k, v in sorted(s["prefix_tiers"].items())))
    if s.get("trigger"):
        print("   trigger        " + ", ".join(f"{k} {v}" for k, v in sorted(s["trigger"].items())))
    if s.get("prefill"):
        print("   pre-inference  " + ", ".join(f"{k} {v}" for k, v in sorted(s["prefill"].items())))
    print("   workers        " + ", ".join(f"{k} {v}" for k, v in sorted(s["workers"].items())))
    print(f"   ranking stage  p50 {s['ranking_ms_p50']:.1f} ms, p99 {s['ranking_ms_p99']:.1f} ms")
    print(f"   end to end     p50 {s['e2e_ms_p50']:.1f} ms, p99 {s['e2e_ms_p99']:.1f} ms")
    print(
        f"   history        {s['mean_history_len']:.0f} events on average; "
        f"{s['mean_tokens_computed']:.0f} tokens computed per request"
    )
    print(
        f"   quality        HR@10 {s['hr@10']:.3f}, NDCG@10 {s['ndcg@10']:.3f} (true next item among ranked)"
    )
