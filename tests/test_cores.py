"""The emulated accelerator's core layout: a core of its own per ranking worker's device thread."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from relaygr.workers.cores import parse_cores, pin_tasks, pin_this_thread, plan_cores


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
