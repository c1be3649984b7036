"""The relay pipeline against the real broker: retrieval, pre-processing, two ranking workers.

MovieLens users' histories go in as behaviours, their last interaction comes in as a request;
every request gets one result, relay scores equal full inference, the worker that pre-inferred a
prefix is the worker that ranks with it, baseline mode ranks the same, unknown users are answered.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from relaygr.infra.kafka import consumer, delete_topics_with_prefix, ensure_topics, producer
from relaygr.schemas import DeadLetter, RecommendationRequest, TopicRegistry, decode
from relaygr.tools.pipeline import Pipeline
from relaygr.tools.traffic import collect_results, history_of, leave_last_out, publish
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.runner import ModelRunner
from relaygr.workers.training.movielens import load_movielens

pytestmark = [pytest.mark.broker, pytest.mark.slow(seconds=12)]  # two pipelines, for 8 tests

USERS = list(range(1, 41))  # 40 real users, 20..700 events each


@pytest.fixture(scope="module")
def traffic():
    ml = load_movielens("ml-100k")
    behaviours, requests = leave_last_out(ml, USERS, num_candidates=64, top_k=20)
    requests.append(
        RecommendationRequest(request_id="cold-1", user_id="no-such-user", ts=0.0, num_candidates=32)
    )
    return behaviours, requests


def _env(model_dir: Path, mode: str) -> dict[str, str]:
    return {
        "RELAYGR_MODEL_DIR": str(model_dir),
        "RELAYGR_CALIBRATION_FILE": str(model_dir / "calibration.json"),
        "RELAYGR_MODE": mode,
        "RELAYGR_BUDGET_MS": "30000",  # generous: no timeouts on a loaded machine; truncation is tested elsewhere
        "RELAYGR_THETA": "0.000001",  # every history with a prefix is "at risk": exercise the relay path
        "RELAYGR_SHORT_TERM": "8",
        "RELAYGR_DISK_CACHE_MB": "64",
    }


async def _run(kafka_settings, tmp_path_factory, model_dir, traffic, mode: str, workers: int):
    prefix = f"pipe-{mode}-{uuid.uuid4().hex[:8]}"
    settings = kafka_settings.model_copy(
        update={"topic_prefix": prefix, "home": tmp_path_factory.mktemp(f"home-{mode}"), "partitions": 4}
    )
    reg = TopicRegistry(prefix, 4)
    await ensure_topics(reg, settings)
    behaviours, requests = traffic
    pipe = Pipeline(settings, ranking_workers=workers, env=_env(model_dir, mode), metrics=True)
    pipe.start()
    try:
        await pipe.wait_ready(timeout_s=240)
        await _send_raw(settings, reg, BAD)
        # Every stage has all behaviours before the first request: candidates are then the same in
        # both modes, whatever the timing, so rankings can be compared.
        sent = await publish(settings, reg, behaviours, requests, qps=40, wait_for_ingest=True)
        results = await collect_results(settings, reg, {r.request_id for r in sent}, timeout_s=120)
        pipe.check()
        metrics = {name: pipe.scrape(name) for name in pipe.procs}
        dead = await _dead_letters(settings, reg, expect=EXPECTED_DEAD)
    finally:
        pipe.stop()
        await delete_topics_with_prefix(settings, prefix)
    events = []
    for f in Path(settings.home, "workers").glob("**/events.jsonl"):
        events += [json.loads(line) for line in f.read_text().splitlines()]
    return Run(sent, results, events, metrics, dead, reg)


# Bad input mixed into the real traffic: (topic role, key, value, what the reason must say).
BAD = [
    ("behaviors", b"1", b"\xff\xfe not utf-8", "invalid UTF-8"),
    ("behaviors", b"2", b'{"user_id": "2", "item_id": "", "ts": 1.0}', "item_id"),
    ("behaviors", b"3", b'{"user_id": "4", "item_id": 5, "ts": 1.0}', "disagrees"),
    ("requests", b"5", b"{not json", "invalid JSON"),
    (
        "requests",
        b"6",
        b'{"schema_version": 9, "request_id": "r", "user_id": "6", "ts": 1.0}',
        "schema version",
    ),
    (
        "requests",
        b"7",
        b'{"request_id": "big", "user_id": "7", "pad": "' + b"x" * 1_100_000 + b'"}',
        "exceeds",
    ),
    ("retrieved", b"8", b'{"request_id": "r8", "user_id": "8", "ts": 1.0}', "candidates"),
    ("prefill", b"9", b'{"request_id": "r9", "user_id": "9", "ts": -5.0}', "ts"),
    (
        "rank",
        b"10",
        b'{"request_id": "r10", "user_id": "10", "ts": 1.0, "candidates": [1], "top_k": 0}',
        "top_k",
    ),
]
# The public inputs are validated once, by the ingress (the stages read its routed copies); each
# internal topic by the stage that reads it.
EXPECTED_DEAD = 3 + 6
STAGE_OF = {
    "behaviors": "ingress",
    "requests": "ingress",
    "retrieved": "preprocess",
    "prefill": "ranking",
    "rank": "ranking",
}


@dataclass
class Run:
    sent: list
    results: dict
    events: list
    metrics: dict
    dead: list
    registry: TopicRegistry


async def _send_raw(settings, reg, bad) -> None:
    prod = producer(settings, max_request_size=4 << 20)
    await prod.start()
    try:
        for role, key, value, _ in bad:
            await prod.send_and_wait(reg.name(role), value, key=key)
    finally:
        await prod.stop()


async def _dead_letters(settings, reg, expect: int, timeout_s: float = 60.0) -> list[DeadLetter]:
    cons = consumer(settings, reg.name("dead_letters"), group_id=None)
    await cons.start()
    out: list[DeadLetter] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(out) < expect and loop.time() < deadline:
            for msgs in (await cons.getmany(timeout_ms=200)).values():
                out += [decode(DeadLetter, m.value) for m in msgs]
    finally:
        await cons.stop()
    return out


@pytest.fixture(scope="module")
async def relay_run(kafka_settings, tmp_path_factory, model_dir, traffic):
    return await _run(kafka_settings, tmp_path_factory, model_dir, traffic, "relay", workers=2)


@pytest.fixture(scope="module")
async def baseline_run(kafka_settings, tmp_path_factory, model_dir, traffic):
    return await _run(kafka_settings, tmp_path_factory, model_dir, traffic, "baseline", workers=1)


async def test_one_result_per_request(relay_run) -> None:
    sent, results = relay_run.sent, relay_run.results
    assert set(results) == {r.request_id for r in sent}
    for r in sent:
        res = results[r.request_id]
        assert res.user_id == r.user_id
        assert 0 < len(res.items) <= r.top_k
        assert res.latency_ms > 0 and "ranking" in res.breakdown_ms


async def test_relay_path_is_taken_and_scores_equal_full_inference(relay_run, model_dir, traffic) -> None:
    sent, results = relay_run.sent, relay_run.results
    behaviours, _ = traffic
    relay = [results[r.request_id] for r in sent if results[r.request_id].path.value.startswith("relay")]
    assert len(relay) >= len(USERS) // 2, {res.path for res in results.values()}
    model = ModelRunner(HSTURanker.load(model_dir))
    by_id = {r.request_id: r for r in sent}
    for res in relay:
        req = by_id[res.request_id]
        hist = history_of(behaviours, req.user_id, req.model_ts)
        assert res.history_len == len(hist) and 0 < res.prefix_len < len(hist)
        items = torch.tensor([it.item_id for it in res.items])
        full = model.rank_full(hist, items, req.model_ts)
        got = torch.tensor([it.score for it in res.items])
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


async def test_relay_results_ranked_by_the_worker_that_pre_inferred(relay_run) -> None:
    results, events = relay_run.results, relay_run.events
    prefill_by = {e["request_id"]: e["worker_id"] for e in events if e["event"] == "prefill"}
    workers = {res.worker_id for res in results.values()}
    assert len(workers) == 2, "both ranking workers should own partitions"
    relay = [res for res in results.values() if res.path.value.startswith("relay")]
    assert relay
    for res in relay:
        assert res.prefix_worker_id == res.worker_id
        if res.request_id in prefill_by:  # the signal of this very request was handled there too
            assert prefill_by[res.request_id] == res.worker_id


async def test_unknown_user_is_answered(relay_run) -> None:
    results = relay_run.results
    cold = results["cold-1"]
    assert cold.path.value == "cold_start" and len(cold.items) > 0
    assert cold.path_reason == "no_history"


async def test_every_result_off_the_relay_path_says_why(relay_run) -> None:
    for res in relay_run.results.values():
        assert (res.path_reason is None) == res.path.value.startswith("relay"), res


async def test_baseline_mode_gives_the_same_rankings(relay_run, baseline_run) -> None:
    relay = relay_run.results
    sent, base = baseline_run.sent, baseline_run.results
    assert set(base) == {r.request_id for r in sent}
    assert {res.path.value for res in base.values()} <= {"baseline", "cold_start"}
    compared = 0
    for rid, res in base.items():
        if rid == "cold-1":
            continue
        r = relay[rid]
        assert [it.item_id for it in r.items] == [it.item_id for it in res.items] or _ties(r, res)
        torch.testing.assert_close(
            torch.tensor(sorted(it.score for it in r.items)),
            torch.tensor(sorted(it.score for it in res.items)),
            rtol=1e-4,
            atol=1e-4,
        )
        compared += 1
    assert compared == len(USERS)


def _ties(a, b) -> bool:
    """Same scores, order differing only among (near-)equal scores."""
    sa, sb = [it.score for it in a.items], [it.score for it in b.items]
    return all(abs(x - y) < 1e-4 for x, y in zip(sa, sb, strict=True))


async def test_bad_input_goes_to_dead_letters_and_good_traffic_flows(relay_run) -> None:
    dead = relay_run.dead
    assert len(dead) == EXPECTED_DEAD, sorted((d.source_topic, d.stage, d.reason[:60]) for d in dead)
    for role, _key, value, needle in BAD:
        topic = relay_run.registry.name(role)
        mine = [
            d for d in dead if d.source_topic == topic and value.startswith(base64.b64decode(d.value_b64))
        ]
        stages = {d.stage for d in mine}
        assert stages == {STAGE_OF[role]}, (value[:80], stages)
        assert all(needle in d.reason and d.offset >= 0 and d.partition >= 0 for d in mine), [
            d.reason for d in mine
        ]
    big = next(d for d in dead if "exceeds" in d.reason)
    assert len(base64.b64decode(big.value_b64)) == 64 * 1024 and "truncated" in big.reason
    assert len(relay_run.results) == len(relay_run.sent)  # every good request still answered


async def test_stages_export_prometheus_metrics(relay_run) -> None:
    m = relay_run.metrics
    admitted = m["retrieval"].value("relaygr_trigger_decisions_total", reason="admitted")
    assert admitted >= len(USERS) // 2
    relay_paths = sum(
        v
        for w in ("ranker-0", "ranker-1")
        for path, v in m[w].by_label("relaygr_rank_results_total", "path").items()
        if path.startswith("relay")
    )
    assert relay_paths >= len(USERS) // 2
    assert any(s.name == "relaygr_rank_latency_seconds_bucket" for s in m["ranker-0"].samples)
    assert "hits_device" in m["ranker-0"].by_label("relaygr_prefix_store", "name")
