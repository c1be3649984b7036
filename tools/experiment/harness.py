"""The one pipeline harness: a pipeline on topics and a home of its own, for an experiment or a run.

The sweeps (``relaygr experiment``), the scenarios (``relaygr bench pipeline``, ``steady-load``,
...), the demo and ``bench host-path`` all measure a local pipeline (``tools.pipeline.Pipeline``)
that shares the broker with whatever else runs there: its topics start with a prefix of its own
(under the deployment's, so that the cascade role of a secured cluster may run it), its stages
keep their state in a folder of their own, and every stage serves its metrics.

Primitives:
- ``Deployment(settings, mode, env, root, topics, workers, cores)``: one mode's pipeline on topics
  ``<topics>-<mode>.*`` with its state in ``<root>/<mode>``: ``start``, ``stop``,
  ``trigger_counts``, ``wait_idle``.
- ``fresh_deployment(settings, tag, mode, env, ...)``: a ``Deployment`` for one run, started and
  ready, then stopped and removed (topics and state) however the run ends.
- ``broker_pids(settings)``: the processes of the local broker (every node) recorded there.
- ``move_off_device(cores, broker_settings)``: this process and the local broker on the shared
  cores while a pinned layout's pipelines run; ``move_back`` puts them back on every core.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from relaygr.infra.settings import Settings
from relaygr.workers.engine.cores import CoreLayout, pin_tasks


class Deployment:
    """One mode's pipeline on its own topics and state."""

    def __init__(
        self, settings, mode: str, env: dict[str, str], root: Path, topics: str, workers: int, cores=None
    ) -> None:
        """``topics``: the start of its topic names (``<topics>-<mode>.*``)."""
        from relaygr.schemas import TopicRegistry
        from relaygr.tools.pipeline import Pipeline

        self.mode = mode
        self.settings = settings.model_copy(update={"topic_prefix": f"{topics}-{mode}", "home": root / mode})
        self.reg = TopicRegistry(self.settings.topic_prefix, self.settings.partitions)
        self.pipe = Pipeline(
            self.settings, ranking_workers=workers, mode=mode, env=env, metrics=True, cores=cores
        )

    async def start(self) -> None:
        from relaygr.infra.kafka import ensure_topics

        await ensure_topics(self.reg, self.settings)
        self.pipe.start()

    def stop(self) -> None:
        self.pipe.stop()

    def trigger_counts(self) -> dict[str, int]:
        try:
            decisions = self.pipe.scrape("retrieval").by_label("relaygr_trigger_decisions_total", "reason")
        except OSError:
            return {}
        return {reason: int(n) for reason, n in decisions.items()}

    async def wait_idle(self, timeout_s: float = 120.0) -> None:
        """Until every ranking worker has nothing in flight (pre-inference included), twice in a row."""
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while time.monotonic() < deadline and quiet < 2:
            busy = 0.0
            for name in self.pipe.procs:
                if name.startswith("ranker-"):
                    try:
                        busy += self.pipe.scrape(name).value("relaygr_rank_inflight")
                    except OSError:
                        busy += 1
            quiet = quiet + 1 if busy == 0 else 0
            await asyncio.sleep(0.2)


@contextlib.contextmanager
def fresh_deployment(
    settings: Settings,
    tag: str,
    mode: str,
    env: dict[str, str],
    *,
    workers: int = 1,
    cores: CoreLayout | None = None,
    say: Callable[[str], None] | None = None,
) -> Iterator[Deployment]:
    """A ``Deployment`` for one run, on topics ``<prefix>-<tag>-<random>-<mode>.*`` with its state
    in a folder of that name under ``settings.home``: started and ready (``say`` hears how soon),
    then stopped, its topics deleted and its folder removed, however the run ends."""
    from relaygr.infra.kafka import delete_topics_with_prefix

    run_id = f"{tag}-{uuid.uuid4().hex[:6]}"
    root = Path(settings.home) / run_id
    dep = Deployment(settings, mode, env, root, f"{settings.topic_prefix}-{run_id}", workers, cores)
    try:
        asyncio.run(dep.start())
        waited = asyncio.run(dep.pipe.wait_ready())
        if say is not None:
            say(f"{mode}: pipeline ready in {waited:.1f} s")
        yield dep
    finally:
        dep.stop()
        asyncio.run(delete_topics_with_prefix(dep.settings, dep.settings.topic_prefix))
        shutil.rmtree(root, ignore_errors=True)


def broker_pids(settings: Settings) -> list[int]:
    """The pids of every node of the local broker or cluster recorded under ``settings``."""
    from relaygr.infra.local.broker import status

    alive, state = status(settings)
    if not alive or state is None:
        return []
    return [n.pid for n in state.nodes] or [state.pid]


def move_off_device(cores: CoreLayout, broker_settings: Settings) -> None:
    """With a pinned layout, this process and the local broker's nodes onto the shared cores: the
    device cores are the ranking workers'. Nothing otherwise."""
    if cores.pinned:
        for pid in [os.getpid(), *broker_pids(broker_settings)]:
            pin_tasks(pid, cores.shared)


def move_back(cores: CoreLayout, broker_settings: Settings) -> None:
    """This process and the local broker's nodes back on every core of the layout."""
    if cores.pinned:
        every = set(cores.shared) | set(cores.device) | set(cores.stage_core_set())
        for pid in [os.getpid(), *broker_pids(broker_settings)]:
            pin_tasks(pid, every)
