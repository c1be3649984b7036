"""The stage processes of one local deployment: every stage of the cascade, one process each.

``Pipeline`` starts the ingress (one process per input), retrieval, pre-processing and N ranking
workers against the configured broker, each supervised (``relaygr.infra.supervisor``): a stage
that dies is started again with backoff while the others keep running, each restart counted; only
a crash loop (too many exits of one stage in a short window) makes ``check()`` raise. Logs go to
``<home>/logs/<stage>.log``. Benchmarks, experiments and tests run their pipelines through it;
``relaygr up`` (``tools.up``) is its command.

With a pinned ``CoreLayout`` each ranking worker's device thread runs on a CPU core of its own and
every other process on the other cores (``workers.engine.cores``); otherwise the non-ranking stages
run at a lower CPU priority, so the ranking workers get the shared cores first.

A rolling restart (``roll_worker``, ``rolling_restart``) replaces each ranking worker in turn by a
standby of the same id that warmed up beside it and takes over its partitions when it hands over
(``streams.ranking.standby``), so no request waits for a process to start; the steps after the
standby is ready are ``tools.hand_over``'s.

Primitives: ``Pipeline`` (start, wait_ready, scrape, check, pause, resume, stop, start_worker,
stop_worker, roll_worker, rolling_restart, crash), ``Scrape`` (one stage's Prometheus samples,
parsed by ``prometheus_client.parser``: ``value``, ``by_label``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from relaygr.infra.local.broker import free_port
from relaygr.infra.settings import SECURITY_FIELDS, Settings, cluster_env, settings_env
from relaygr.infra.supervisor import RestartPolicy, Supervisor, end_process
from relaygr.streams.config import PipelineSettings
from relaygr.streams.ranking.standby import STANDBY_NICE
from relaygr.streams.ranking.worker_files import WorkerFiles
from relaygr.streams.state_lineage import deployment_dir
from relaygr.tools.hand_over import complete_hand_over, wait_standby
from relaygr.workers.engine.cores import CoreLayout, format_cores, may_renice_to, nice_tasks, pin_tasks


@dataclass(frozen=True)
class Scrape:
    """The samples of one stage's /metrics page."""

    samples: tuple[Sample, ...]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        return cls(tuple(s for fam in text_string_to_metric_families(text) for s in fam.samples))

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """The samples called ``name``, summed per value of ``label``."""
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name == name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out


class Pipeline:
    """The stage processes of one local deployment (a context manager), kept running by a
    ``Supervisor``: ``restarts`` counts each stage's restarts, ``check()`` raises once a stage is
    in a crash loop."""

    def __init__(
        self,
        settings: Settings,
        *,
        ranking_workers: int = 2,
        mode: str | None = None,
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        metrics_base_port: int = 0,
        metrics: bool = False,
        restart_policy: RestartPolicy | None = None,
        cores: CoreLayout | None = None,
    ) -> None:
        self.settings = settings
        self.cores = cores if cores is not None and cores.pinned else None
        self.stage_nice = cores.stage_nice if cores is not None and not cores.pinned else 0
        self.paused = False
        self.n = ranking_workers
        self.mode = mode
        # The model is this process's (resolved before RELAYGR_HOME is pointed at the deployment).
        model = PipelineSettings.to_env(model_dir=PipelineSettings().model_dir)
        self.env = {**os.environ, **model, **(env or {})}
        # Stages sign in as this process does, whatever the environment it inherited says.
        for name in SECURITY_FIELDS:
            self.env.pop(f"RELAYGR_{name.upper()}", None)
        self.env.update(cluster_env(settings))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.log_dir = log_dir or Path(settings.home) / "logs"
        self.metrics_base_port = metrics_base_port
        self.metrics = metrics
        self.metrics_ports: dict[str, int] = {}
        self.supervisor = Supervisor(self.log_dir, restart_policy)

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """The current process of every stage (a restart replaces it)."""
        return self.supervisor.processes()

    @property
    def restarts(self) -> Counter[str]:
        """Restarts per stage since start."""
        return self.supervisor.restarts

    def _spawn(self, name: str, args: list[str], port_index: int, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "relaygr.cli", "stage", *args]
        if self.mode:
            cmd += ["--mode", self.mode]
        if self.metrics_base_port or self.metrics:
            port = self.metrics_base_port + port_index if self.metrics_base_port else free_port()
            self.metrics_ports[name] = port
            cmd += ["--metrics-port", str(port)]
        placement: dict[str, object] = {}
        if self.cores is not None:
            placement["cpu_cores"] = format_cores(self.cores.cores_of(name))
            if name.startswith("ranker-"):
                placement["device_core"] = self.cores.device_core(port_index - 4)
        if self.stage_nice and not name.startswith("ranker-"):
            placement["cpu_nice"] = self.stage_nice
        p = self.supervisor.spawn(
            name, cmd, {**self.env, **(env or {}), **PipelineSettings.to_env(**placement)}
        )
        if self.cores is not None:  # at once, too: the child pins itself only once it has started up
            pin_tasks(p.pid, self.cores.cores_of(name))

    def start(self) -> Pipeline:
        # One ingress process per input: a behaviour burst never shares a CPU slice with requests.
        self._spawn("ingress-requests", ["ingress", "--inputs", "requests"], 0)
        self._spawn("ingress-behaviors", ["ingress", "--inputs", "behaviors"], 1)
        self._spawn("retrieval", ["retrieval"], 2)
        self._spawn("preprocess", ["preprocess"], 3)
        for i in range(self.n):
            self.start_worker(i)
        return self

    def start_worker(self, i: int, *, home: Path | None = None) -> None:
        """Start ranking worker ``ranker-{i}``; with ``home``, its local state lives there (its own
        ``RELAYGR_HOME``, as a worker on another host: it rebuilds its histories from Kafka)."""
        env = settings_env(self.settings.model_copy(update={"home": home}), ["home"]) if home else None
        self._spawn(f"ranker-{i}", ["ranking", "--worker-id", f"ranker-{i}"], 4 + i, env)

    def stop_worker(self, i: int, *, kill: bool = False) -> None:
        """Take ranking worker ``ranker-{i}`` out of the deployment, for good (not restarted).
        SIGTERM: it finishes and commits what it has in flight; its partitions move to the others
        once its session times out (a static member sends no leave). ``kill``: SIGKILL."""
        self.supervisor.release(f"ranker-{i}", kill=kill)

    def roll_worker(
        self,
        i: int,
        *,
        ready_timeout_s: float = 600.0,
        say=None,
        abandon: Callable[[], bool] | None = None,
    ) -> dict[str, float]:
        """Replace ranking worker ``ranker-{i}`` with no gap: start its standby, wait until it is
        warm, tell the old process to hand over (SIGUSR1), wait until the new one serves and has
        joined the group; the supervisor then keeps the new process running as ``ranker-{i}``.
        Returns seconds: ``warm`` (standby start to ready), ``serving`` (hand-over signal to
        ranking), ``joined`` (to group membership), ``old_exit`` (to the old process's exit).
        Once ``abandon()`` says so while the standby warms up (the deployment is stopping), the
        standby is ended and ``RollAbandoned`` raised: the old process never heard of it."""
        name = f"ranker-{i}"
        files = WorkerFiles(deployment_dir(self.settings, "workers") / name)
        files.clear_standby()
        t0 = time.monotonic()
        standby = self.supervisor.start_standby(name, ["--standby"])
        if may_renice_to(os.getpriority(os.PRIO_PROCESS, 0)):  # its start-up too, at the lowest
            nice_tasks(standby.pid, STANDBY_NICE)  # priority (it comes back once it serves)
        if self.cores is not None:
            pin_tasks(standby.pid, self.cores.shared)
        try:
            wait_standby(files, standby, "ready", ready_timeout_s, abandon=abandon)
        except BaseException:
            end_process(standby, kill=True)
            raise
        took = {"warm": time.monotonic() - t0}
        if say is not None:
            say(f"{name}: standby pid {standby.pid} ready in {took['warm']:.1f} s; handing over")
        old = self.supervisor.adopt(name, standby)
        # The old process hands over under its stop grace; past that (and a margin) it is killed.
        grace = float(self.env.get("RELAYGR_STOP_GRACE_S") or PipelineSettings().stop_grace_s)
        return took | complete_hand_over(files, standby, old, name=name, old_grace_s=grace + 5.0)

    def rolling_restart(self, *, say=None) -> dict[str, dict[str, float]]:
        """``roll_worker`` for every running ranking worker, one at a time."""
        return {
            f"ranker-{i}": self.roll_worker(i, say=say) for i in range(self.n) if f"ranker-{i}" in self.procs
        }

    def crash(self, name: str) -> int:
        """SIGKILL stage ``name`` behind the supervisor's back, as a crash would; the supervisor
        restarts it. Returns the killed pid."""
        pid = self.procs[name].pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def scrape(self, name: str) -> Scrape:
        """The Prometheus samples of stage ``name``."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[name]}/metrics", timeout=5) as r:
            return Scrape.parse(r.read().decode())

    def check(self) -> None:
        """Raise (``CrashLoop``, a RuntimeError) once the supervisor gave up on a stage."""
        self.supervisor.check()

    def pause(self) -> None:
        """Stop every stage process (SIGSTOP): none of them takes CPU time until ``resume``."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.paused:
            self.resume()  # a stopped process would not act on SIGTERM
        self.supervisor.stop()

    def __enter__(self) -> Pipeline:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def wait_ready(self, timeout_s: float = 180.0) -> float:
        """Send probe requests until one comes back ranked; returns seconds waited."""
        from relaygr.infra.kafka import consumer, producer
        from relaygr.schemas import RankedResult, RecommendationRequest, TopicRegistry, decode, encode

        reg = TopicRegistry(self.settings.topic_prefix, self.settings.partitions)
        t0 = time.monotonic()
        cons = consumer(self.settings, reg.name("results"), group_id=None, auto_offset_reset="latest")
        prod = producer(self.settings)
        await cons.start()
        await prod.start()
        try:
            await cons.seek_to_end()
            sent: set[str] = set()
            last = 0.0
            while time.monotonic() - t0 < timeout_s:
                self.check()
                if time.monotonic() - last > 2.0:
                    rid = f"probe-{uuid.uuid4().hex[:8]}"
                    req = RecommendationRequest(
                        request_id=rid, user_id=f"probe-{len(sent) % 8}", ts=time.time()
                    )
                    await prod.send_and_wait(reg.name("requests"), encode(req), key=req.key())
                    sent.add(rid)
                    last = time.monotonic()
                batch = await cons.getmany(timeout_ms=200)
                for msgs in batch.values():
                    for m in msgs:
                        if decode(RankedResult, m.value).request_id in sent:
                            return time.monotonic() - t0
            raise TimeoutError(
                f"the pipeline did not answer a probe within {timeout_s:.0f} s (logs in {self.log_dir})"
            )
        finally:
            await cons.stop()
            await prod.stop()
