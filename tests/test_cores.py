"""The emulated accelerator's core layout: a core of its own per ranking worker's device thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from relaygr.workers.engine.cores import (
    PIPELINE_STAGES,
    STAGE_NICE,
    parse_cores,
    pin_tasks,
    pin_this_thread,
    plan_cores,
)


def test_one_device_core_per_worker_from_the_top() -> None:
    one = plan_cores(1, {0, 1, 2})
    assert one.pinned and one.device == (2,) and one.shared == (0, 1)
    assert one.device_core(0) == 2 and "core 2" in one.describe()
    two = plan_cores(2, {0, 1, 2, 3})
    assert two.device == (3, 2) and two.shared == (0, 1) and two.device_core(1) == 2


def test_too_few_cores_means_no_pinning_and_says_so() -> None:
    # The rest of the deployment keeps two cores, or nothing is pinned.
    lay = plan_cores(2, {0, 1, 2})
    assert not lay.pinned and lay.device_core(0) is None and lay.shared == (0, 1, 2)
    assert "needs 4" in lay.describe()
    assert not plan_cores(1, {0, 1}).pinned
    assert not plan_cores(1, {5}).pinned


def test_a_core_per_stage_where_the_machine_has_enough() -> None:
    stages = (*PIPELINE_STAGES, "ranker-0")
    lay = plan_cores(1, set(range(16)), stages=stages)
    assert lay.device == (15,) and dict(lay.stages) == dict(zip(stages, (14, 13, 12, 11, 10), strict=True))
    assert lay.cores_of("retrieval") == (12,) and lay.cores_of("broker") == tuple(range(10))
    assert lay.stage_core_set().isdisjoint(lay.shared) and 15 not in lay.stage_core_set()
    assert "retrieval: core 12" in lay.describe()
    # Two cores must stay for the broker and the load generator, or the stages share them.
    few = plan_cores(1, set(range(7)), stages=stages)
    assert few.pinned and few.stages == () and few.cores_of("retrieval") == few.shared == tuple(range(6))
    assert "needs 8 cores, 7 here" in few.describe()


def test_parse_cores() -> None:
    assert parse_cores("0,2-3") == (0, 2, 3) and parse_cores("1") == (1,) and parse_cores("") == ()


def test_the_device_thread_pins_itself_and_nothing_else() -> None:
    cores = sorted(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}

    def device() -> None:
        pin_this_thread(cores[-1])
        seen["device"] = os.sched_getaffinity(threading.get_native_id())

    t = threading.Thread(target=device)
    t.start()
    t.join()
    assert seen["device"] == {cores[-1]}
    assert sorted(os.sched_getaffinity(0)) == cores  # the calling process keeps its cores


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pin_tasks_moves_every_thread_of_a_process() -> None:
    core = min(os.sched_getaffinity(0))
    code = "import threading,time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(20,)).start()\ntime.sleep(20)"
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(100):  # until its threads are up
            if len(os.listdir(f"/proc/{p.pid}/task")) >= 4:
                break
            threading.Event().wait(0.05)
        assert pin_tasks(p.pid, {core}) >= 4
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == {core}
    finally:
        p.kill()
        p.wait()


def test_unpinned_layouts_lower_the_other_stages_priority() -> None:
    shared = plan_cores(1, {0, 1})
    assert not shared.pinned and shared.stage_nice == STAGE_NICE > 0
    assert f"nice {STAGE_NICE}" in shared.describe()
    assert plan_cores(1, {0, 1}, stage_nice=0).stage_nice == 0
    assert "nice" not in plan_cores(1, {0, 1}, stage_nice=0).describe()
    asked = plan_cores(1, {0, 1, 2, 3}, pin=False)
    assert not asked.pinned and asked.stage_nice == STAGE_NICE


def test_the_launcher_nices_every_stage_but_the_ranking_workers(tmp_path, monkeypatch) -> None:
    from relaygr.infra.settings import Settings
    from relaygr.tools.pipeline import Pipeline

    spawned: dict[str, dict[str, str]] = {}

    def spawn(name, argv, env):
        spawned[name] = env
        return subprocess.Popen([sys.executable, "-c", "pass"])

    for layout, want in (
        (plan_cores(2, {0, 1}), str(STAGE_NICE)),
        (plan_cores(2, {0, 1}, stage_nice=0), None),
    ):
        spawned.clear()
        pipe = Pipeline(Settings(home=tmp_path), ranking_workers=2, cores=layout)
        monkeypatch.setattr(pipe.supervisor, "spawn", spawn)
        pipe.start()
        assert sorted(spawned) == sorted(
            ["ingress-requests", "ingress-behaviors", "retrieval", "preprocess", "ranker-0", "ranker-1"]
        )
        for name, env in spawned.items():
            assert env.get("RELAYGR_CPU_NICE") == (None if name.startswith("ranker-") else want), name


def test_a_stage_process_sets_its_nice_level_before_its_threads_start() -> None:
    code = (
        "import os,threading\n"
        "from relaygr.streams.stage_cli import place_this_process\n"
        "from relaygr.streams.config import PipelineSettings\n"
        "place_this_process(PipelineSettings())\n"
        "out = []\n"
        "t = threading.Thread(target=lambda: out.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))\n"
        "t.start(); t.join(); print(os.nice(0), out[0])"
    )
    base = os.nice(0)
    env = {**os.environ, "RELAYGR_CPU_NICE": "7"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.split() == [str(min(19, base + 7))] * 2
