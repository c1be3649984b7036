"""End to end in a few seconds: trace -> trace topic -> replay into the pipeline -> `relaygr report`;
and the experiment report from hand-made points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from relaygr.infra.kafka import delete_topics_with_prefix, ensure_topics
from relaygr.schemas import TopicRegistry
from relaygr.tools.barriers import wait_sentinels_applied
from relaygr.tools.experiment.kinds import KINDS
from relaygr.tools.experiment.protocol import PointRun, Protocol, best
from relaygr.tools.experiment.report import write_experiment_report
from relaygr.tools.pipeline import Pipeline
from relaygr.tools.replay import Replayer, plan_replay
from relaygr.tools.report.figures import meets_slo, percentile, ranking_ms
from relaygr.tools.report.summary import RunSummary
from relaygr.tools.trace import Trace, TraceTopics, build_trace, load_trace, publish_trace
from relaygr.tools.traffic import collect_results
from relaygr.workers.engine.latency_model import LatencyModel
from relaygr.workers.model.model import HSTUConfig, HSTURanker
from relaygr.workers.training.movielens import load_movielens


def _point(x: float, mode: str, holds: bool, p99: float, attempt: int = 2) -> PointRun:
    def lat(p: float) -> dict:
        return {"p50": p / 2, "p90": p, "p99": p, "p99.9": p, "mean": p / 2, "max": p, "n": 10}

    summary = RunSummary.model_validate(
        {
            "latency_ms": {"ranking": lat(p99), "end_to_end": lat(p99 + 50)},
            "slo": {
                "slo_ms": 40.0,
                "requests": 10,
                "results": 10,
                "compliant": 10 if holds else 5,
                "compliance": 1.0 if holds else 0.5,
                "within_latency": 10,
                "truncated": 0,
                "timeouts": 0,
                "missing": 0,
                "slo_p99_ms": p99,
                "holds_slo": holds,
                "duration_s": 1.0,
                "throughput_qps": x,
                "slo_throughput_qps": x,
            },
            "history": {
                "mean_history_len": 100.0,
                "mean_used_len": 100.0 if holds else 50.0,
                "mean_tokens_computed": 10.0,
                "mean_prefix_len": 90.0,
            },
            "trigger": {"admission_rate": 1.0 if mode == "relay" else 0.0},
            "hit_rates": {"prefill": {"device": 0.5, "computed": 0.5, "hit": 0.5, "n": 10}}
            if mode == "relay"
            else {},
            "quality": {"hr@10": 0.1, "ndcg@10": 0.05, "labelled": 10},
            "paths": {"relay": {"count": 10, "share": 1.0}},
            "path_reasons": {},
        }
    )
    return PointRun(x, mode, summary, {}, 10, [p99 / 2, p99], attempt=attempt)


def test_experiment_report_from_points(tmp_path) -> None:
    pts = [
        _point(512, "relay", False, 90, attempt=1),  # the first point's first run: shown, not counted
        _point(512, "baseline", False, 95, attempt=1),
        _point(512, "relay", True, 10),
        _point(512, "baseline", True, 12),
        _point(1024, "relay", True, 11),
        _point(1024, "baseline", True, 30),
        _point(2048, "relay", True, 14),
        _point(2048, "baseline", False, 60),
        _point(4096, "relay", False, 45),
    ]
    assert best(pts, "relay") == 2048 and best(pts, "baseline") == 1024 and best(pts, "nope") is None
    proto = Protocol(
        experiment="seq-len", model_dir="m", model={"layers": 2}, model_version="v1", threads=1,
        ranking_workers=1, partitions=4, latency_model={"text": "1024: 12.0"}, slo_ms=40.0, slo_method="given",
        upstream_ms=40.0, feature_fetch_ms=20.0, theta=0.25, short_term=64, dataset="ml-100k", min_prior=20,
        window_start=0, warmup=True, pipeline_warmup=100, arrivals="Poisson", seed=0, points=[512, 1024, 2048, 4096],
        point_label="history lengths (events)", requests_per_point="10", history="h", synthesis="s", criterion="c",
    )  # fmt: skip
    meta = {
        "requests": 10,
        "warmup_requests": 2,
        "users": 2,
        "behaviours": 100,
        "synthesised_events": 50,
        "span_s": 9,
    }
    traces = {x: Trace([], [], meta=meta) for x in (512, 1024, 2048, 4096)}
    doc = write_experiment_report(tmp_path, KINDS["seq-len"], proto, pts, traces, None)
    h = doc["headline"]
    assert h["relay_max_len"] == 2048 and h["baseline_max_len"] == 1024
    assert h["ratio"] == pytest.approx(2.0) and h["met_target"] is True
    assert set(h["quality_at_relay_max"]) == {"relay", "baseline"}
    assert h["plots"] == [
        "p99_vs_seq_len.png",
        "served_len_vs_seq_len.png",
        "latency_cdf.png",
        "hit_rates.png",
    ]
    for p in h["plots"]:
        assert (tmp_path / p).stat().st_size > 1000
    md = (tmp_path / "report.md").read_text()
    assert md.index("## Protocol") < md.index("## Result") < md.index("## Points")
    assert "B = 40 ms" in md and "Ratio relay / baseline: 2.00×" in md
    assert md.count("| first (not counted) | 512 |") == 2
    assert [(p["x"], p["attempt"]) for p in doc["points"][:4]] == [(512, 1), (512, 2), (512, 1), (512, 2)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(3)
    d = tmp_path_factory.mktemp("tiny-model")
    m = HSTURanker(HSTUConfig(layers=2, heads=2, dim=32, attn_dim=16, linear_dim=16))
    m.refresh_version()
    m.save(d)
    LatencyModel(1.0, 0.01, 0.0).save(d / "calibration.json")
    return d


@pytest.mark.broker
@pytest.mark.slow(seconds=45)
async def test_trace_replay_report_end_to_end(kafka_settings, tmp_path_factory, tiny_model) -> None:
    prefix = f"smoke-{uuid.uuid4().hex[:8]}"
    home = tmp_path_factory.mktemp("smoke-home")
    settings = kafka_settings.model_copy(update={"topic_prefix": prefix, "home": home, "partitions": 4})
    reg = TopicRegistry(prefix, 4)
    tt = TraceTopics(f"{prefix}.trace", 4)
    built = build_trace(load_movielens(), min_prior=20, start=40000, count=40, target_len=128, warmup=True)
    env = {
        "RELAYGR_MODEL_DIR": str(tiny_model),
        "RELAYGR_CALIBRATION_FILE": str(tiny_model / "calibration.json"),
        "RELAYGR_BUDGET_MS": "2000",
        "RELAYGR_THETA": "0.0001",  # every history is at risk: the relay path is exercised
        "RELAYGR_SHORT_TERM": "8",
        "RELAYGR_FEATURE_FETCH_MS": "5",
        "RELAYGR_TORCH_THREADS": "1",
    }
    await ensure_topics(reg, settings)
    pipe = Pipeline(settings, ranking_workers=1, mode="relay", env=env, metrics=True)
    pipe.start()
    out = home / "report"
    try:
        await publish_trace(settings, tt, built)
        tr = await load_trace(settings, tt)
        assert len(tr.requests) == 40 + len(built.warmup_ids) and len(tr.behaviours) == len(built.behaviours)
        await pipe.wait_ready(timeout_s=240)
        warm = [r for r in tr.requests if r.request_id in built.warmup_ids]
        window = [r for r in tr.requests if r.request_id not in built.warmup_ids]
        async with Replayer(settings, reg, tr.behaviours, user_prefix="p0-") as rp:
            first: dict[str, float] = {}
            for r in window:
                first.setdefault(r.user_id, r.model_ts)
            await rp.preload(first)
            await wait_sentinels_applied(settings, reg, timeout_s=120)
            sent_w = await rp.run(plan_replay(warm, qps=20), behaviours=False)
            assert len(
                await collect_results(settings, reg, {r.request_id for r in sent_w}, timeout_s=60)
            ) == len(warm)
            t_window = time.time()
            sent = await rp.run(plan_replay(window, qps=20, seed=1))
        got = await collect_results(settings, reg, {r.request_id for r in sent}, timeout_s=60)
        assert len(got) == 40
        proc = subprocess.run(
            [sys.executable, "-m", "relaygr.cli", "report", "--prefix", prefix, "--trace-topic", tt.requests.name,
             "--user-prefix", "p0-", "--from-timestamp", str(t_window), "--slo-ms", "2000",
             "--worker-events", str(home / "workers"), "--out", str(out), "--json"],
            env={**os.environ, "RELAYGR_BOOTSTRAP": settings.bootstrap or "", "RELAYGR_HOME": str(home)},
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    finally:
        pipe.stop()
        await delete_topics_with_prefix(settings, prefix)
    assert proc.returncode == 0, proc.stderr[-3000:]
    head = json.loads(proc.stdout.strip().splitlines()[-1])
    assert head["results"] == head["requests"] == 40
    # The report's compliance is the results' own (within 2 s with the whole history), whatever
    # this machine's speed: a latency bound here would assert the machine, not the report.
    compliant = sum(meets_slo(r, 2000.0) for r in got.values())
    assert head["slo_ms"] == 2000 and head["slo_compliance"] == pytest.approx(compliant / 40)
    assert 0.9 <= head["admission_rate"] <= 1.0  # θ ~ 0: every request with history is admitted
    assert sum(v for k, v in head["paths"].items() if k.startswith("relay")) >= 30
    assert 0.0 <= head["hr@10"] <= 1.0
    assert head["ranking_ms_p99"] == pytest.approx(percentile([ranking_ms(r) for r in got.values()], 99.0))
    rep = json.loads((out / "report.json").read_text())
    assert rep["summary"]["quality"]["labelled"] == 40
    assert rep["summary"]["hit_rates"]["prefill"]["n"] >= 30
    assert rep["summary"]["history"]["mean_history_len"] >= 128  # the synthesised length, then growth
    for name in ("latency_cdf.png", "p99_vs_qps.png", "p99_vs_seq_len.png", "hit_rates.png", "report.md"):
        assert (out / name).stat().st_size > 500, name


def test_sweep_runs_the_first_point_twice_in_each_mode(monkeypatch) -> None:
    import argparse
    import types

    from relaygr.tools.experiment import command, deployment

    calls: list[tuple[float, str, int]] = []

    def fake_run_one(run, d, trace, x, i, attempt, n_requests, slo_ms, n_points) -> PointRun:
        calls.append((x, d.mode, attempt))
        return _point(x, d.mode, True, 10.0, attempt=attempt)

    monkeypatch.setattr(command, "_run_one", fake_run_one)
    built: list[str] = []

    def fake_build(settings, ml, args, start, count, length, topic) -> Trace:
        built.append(topic)
        return Trace([], [], meta={})

    monkeypatch.setattr(deployment, "build_and_publish", fake_build)
    kind = types.SimpleNamespace(
        requests=lambda args, x: 10,
        trace=lambda args, x, n: types.SimpleNamespace(requests=n, length=int(x), topic_suffix=f"t{x:g}"),
    )
    run = types.SimpleNamespace(
        args=argparse.Namespace(patience=2, no_isolate=True),
        kind=kind,
        run_id="r",
        topics="relaygr-r",
        settings=None,
        ml=None,
        window_start=0,
    )
    deps = [types.SimpleNamespace(mode="relay"), types.SimpleNamespace(mode="baseline")]
    points, _ = command.sweep(run, deps, [512, 1024], 40.0)
    assert calls == [
        (512, "relay", 1),
        (512, "relay", 2),
        (512, "baseline", 1),
        (512, "baseline", 2),
        (1024, "baseline", 2),
        (1024, "relay", 2),
    ]
    assert len(points) == 6
    assert built == ["relaygr-r.t512", "relaygr-r.t1024"]  # under the run's topic start


def test_an_experiments_topics_and_groups_are_under_the_deployments_prefix(tmp_path) -> None:
    # The cascade role of a secured cluster may use only names starting with the topic prefix.
    from relaygr.infra.settings import Settings
    from relaygr.tools.experiment.command import Run
    from relaygr.tools.experiment.harness import Deployment

    settings = Settings(home=tmp_path, topic_prefix="shop")
    run = Run(None, None, settings, tmp_path, "exp-seq-len-x", *[None] * 8)
    assert run.topics == "shop-exp-seq-len-x"
    dep = Deployment(settings, "relay", {}, tmp_path, run.topics, 1)
    assert dep.settings.topic_prefix.startswith("shop-")
    assert all(dep.reg.name(t).startswith("shop-") for t in ("behaviors", "requests", "rank", "results"))


def test_repeat_reports_each_run_the_median_and_the_worst(monkeypatch, capsys) -> None:
    import argparse

    from relaygr.tools.experiment import command

    ratios = iter([4.0, None, 6.0, 3.0])
    seen_b: list[float | None] = []

    def fake_sweep(args, kinds) -> list[dict]:
        print("== chatter that must stay off stdout")
        seen_b.append(args.slo_ms)
        return [{"ratio": next(ratios), "slo_ms": 70.0 + len(seen_b)}]  # B as a run would measure it

    monkeypatch.setattr(command, "run_sweep", fake_sweep)
    args = argparse.Namespace(repeat=4, json=True, slo_ms=None)
    assert command.run_repeated(args, [KINDS["throughput"]]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ratios"] == [4.0, None, 6.0, 3.0]
    assert out["median_ratio"] == 4.0 and out["worst_ratio"] == 3.0 and out["runs_without_ratio"] == 1
    # B is measured once, by the first run, and every later run uses it.
    assert seen_b == [None, 71.0, 71.0, 71.0]


def test_repeat_keeps_a_given_b_for_every_run(monkeypatch, capsys) -> None:
    import argparse

    from relaygr.tools.experiment import command

    seen_b: list[float | None] = []

    def fake_sweep(args, kinds) -> list[dict]:
        seen_b.append(args.slo_ms)
        return [{"ratio": 2.0, "slo_ms": args.slo_ms}]

    monkeypatch.setattr(command, "run_sweep", fake_sweep)
    assert command.run_repeated(argparse.Namespace(repeat=3, json=True, slo_ms=55.0), [KINDS["seq-len"]]) == 0
    capsys.readouterr()
    assert seen_b == [55.0, 55.0, 55.0]


def test_several_experiments_run_once_on_shared_pipelines_one_json_line_each(monkeypatch, capsys) -> None:
    import argparse

    from relaygr.tools.experiment import command

    calls: list[list[str]] = []

    def fake_sweep(args, kinds) -> list[dict]:
        calls.append([k.name for k in kinds])
        return [{"experiment": k.name, "ratio": 1.0} for k in kinds]

    monkeypatch.setattr(command, "run_sweep", fake_sweep)
    kinds = [KINDS["seq-len"], KINDS["throughput"]]
    assert command.run_repeated(argparse.Namespace(repeat=1, json=True, slo_ms=None), kinds) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert calls == [["seq-len", "throughput"]]  # one run: one calibration, one pair of pipelines
    assert [x["experiment"] for x in lines] == ["seq-len", "throughput"]
    with pytest.raises(SystemExit, match="--repeat"):
        command.run_repeated(argparse.Namespace(repeat=2, json=True, slo_ms=None), kinds)
