"""A process supervisor: child processes restarted with backoff when they die, a crash loop stops all.

Primitives:
- ``RestartPolicy``: the first restart's delay, its doubling up to a ceiling, and the crash-loop
  limit (more than ``max_restarts`` exits of one child within ``window_s``).
- ``Supervisor(policy, log_dir)``: ``spawn(name, argv, env)`` starts a child (its output appended
  to ``<log_dir>/<name>.log``) and watches it from a monitor thread. A child that exits while
  supervised, whatever its exit code, is started again with the same command after its backoff,
  while the others keep running; each restart is one log line (``<log_dir>/supervisor.log`` and
  stderr) and counts in ``restarts[name]``. ``release(name, kill=False)`` ends one child for good
  (SIGTERM, or SIGKILL) without a restart; ``stop()`` ends them all. A rolling restart replaces
  a child without a gap: ``start_standby(name, extra_args)`` starts its replacement beside it
  (same command plus ``extra_args``, same log, not supervised yet), and ``adopt(name, proc)``
  makes that the supervised process and returns the one it replaces, whose exit then restarts
  nothing (a crash of the replacement restarts the child's own command).
- ``CrashLoop``: what ``failure`` holds (and ``check()`` raises) once a child crashed too often:
  the supervisor then restarts nothing more, and its owner stops the deployment.
- ``end_process(proc, kill=False, grace_s=30)``: SIGTERM (or SIGKILL), wait, SIGKILL after the grace.

Children run in sessions of their own: a Ctrl-C at the terminal reaches the supervising process
only, which stops the children in order instead of racing them. Each child finds the
supervisor's pid in ``RELAYGR_SUPERVISOR_PID``: a stage stops by itself once the supervisor is
gone (``stop_guard.watch_supervisor``), even one killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from relaygr.infra.stop_guard import SUPERVISOR_PID_ENV


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    # More than this many exits of one child within window_s is a crash loop.
    max_restarts: int = 5
    window_s: float = 60.0


class CrashLoop(RuntimeError):
    """A supervised child kept crashing: restarting it again would not help."""


@dataclass
class _Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen
    exits: deque[float] = field(default_factory=deque)  # monotonic times of recent exits
    restart_at: float | None = None  # set while a restart waits out its backoff
    last_code: int | None = None


def end_process(proc: subprocess.Popen, *, kill: bool = False, grace_s: float = 30.0) -> None:
    """SIGTERM (or SIGKILL with ``kill``), then SIGKILL if it is still there after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Supervisor:
    """The children of one deployment, kept running (see the module docstring)."""

    def __init__(
        self,
        log_dir: Path,
        policy: RestartPolicy | None = None,
        *,
        poll_s: float = 0.1,
        echo: str | None = "relaygr up",
    ) -> None:
        self.log_dir = log_dir
        self.policy = policy or RestartPolicy()
        self.poll_s = poll_s
        self.echo = echo  # also print each restart on stderr, after this label (None: don't)
        self.restarts: Counter[str] = Counter()
        self.failure: CrashLoop | None = None
        self._children: dict[str, _Child] = {}
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None

    # ------------------------------------------------------------------ children

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Start ``argv`` as child ``name`` and supervise it from now on."""
        with self._lock:
            if name in self._children:
                raise ValueError(f"a child named {name} is already supervised")
            if self._stopping.is_set():  # started again after stop(): supervise anew
                self._stopping.clear()
                self._monitor = None
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{name}.log"
            child = _Child(name, list(argv), dict(env), log_path, self._popen(argv, env, log_path))
            self._children[name] = child
            if self._monitor is None:
                self._monitor = threading.Thread(target=self._watch, name="supervisor", daemon=True)
                self._monitor.start()
            return child.proc

    @staticmethod
    def _popen(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                argv,
                env={**env, SUPERVISOR_PID_ENV: str(os.getpid())},  # a stage ends when we are gone
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def processes(self) -> dict[str, subprocess.Popen]:
        """The current process of every supervised child (a restart replaces it)."""
        with self._lock:
            return {name: c.proc for name, c in self._children.items()}

    def release(self, name: str, *, kill: bool = False, grace_s: float = 30.0) -> None:
        """Stop supervising child ``name`` and end it (SIGTERM, or SIGKILL with ``kill``)."""
        with self._lock:
            child = self._children.pop(name)
        end_process(child.proc, kill=kill, grace_s=grace_s)

    def start_standby(self, name: str, extra_args: list[str]) -> subprocess.Popen:
        """Start a replacement of child ``name`` beside it, unsupervised until ``adopt``."""
        with self._lock:
            child = self._children[name]
            return self._popen(child.argv + list(extra_args), child.env, child.log_path)

    def adopt(self, name: str, replacement: subprocess.Popen) -> subprocess.Popen:
        """Supervise ``replacement`` as child ``name`` from now on; returns the process it
        replaces, which its caller ends (its exit is no longer watched)."""
        with self._lock:
            child = self._children[name]
            old, child.proc = child.proc, replacement
            child.restart_at = None  # a restart waiting out its backoff is what this replaces
            self._say(f"stage {name}: pid {replacement.pid} takes over from pid {old.pid}", child)
            return old

    def stop(self, grace_s: float = 30.0) -> None:
        """End every child (SIGTERM to all, then wait for each); nothing is restarted any more."""
        self._stopping.set()
        with self._lock:
            children = list(self._children.values())
            self._children.clear()
        for c in children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        for c in children:
            end_process(c.proc, grace_s=grace_s)
        if self._monitor is not None:
            self._monitor.join(timeout=5)

    def check(self) -> None:
        """Raise the ``CrashLoop`` that made the supervisor give up, if any."""
        if self.failure is not None:
            raise self.failure

    # ------------------------------------------------------------------ monitor

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            with self._lock:
                for child in list(self._children.values()):
                    self._tend(child, time.monotonic())

    def _tend(self, child: _Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at and self.failure is None:
                child.restart_at = None
                child.proc = self._popen(child.argv, child.env, child.log_path)
                self._say(f"stage {child.name} restarted (pid {child.proc.pid})", child)
            return
        code = child.proc.poll()
        if code is None:
            return
        child.last_code = code
        child.exits.append(now)
        while child.exits and now - child.exits[0] > self.policy.window_s:
            child.exits.popleft()
        crashes = len(child.exits)
        if crashes > self.policy.max_restarts or self.failure is not None:
            if self.failure is None:
                self.failure = CrashLoop(
                    f"stage {child.name} exited {crashes} times within {self.policy.window_s:.0f} s "
                    f"(last exit code {code}); not restarting it again. See {child.log_path}:\n"
                    + _tail(child.log_path)
                )
                self._say(f"stage {child.name} exited with code {code}: crash loop, giving up", child)
            return
        backoff = min(self.policy.max_backoff_s, self.policy.initial_backoff_s * 2 ** (crashes - 1))
        child.restart_at = now + backoff
        self.restarts[child.name] += 1
        self._say(
            f"stage {child.name} exited with code {code}; restarting in {backoff:.1f} s "
            f"(restart {self.restarts[child.name]}, {crashes} exit(s) within {self.policy.window_s:.0f} s)",
            child,
        )

    def _say(self, line: str, child: _Child) -> None:
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}"
        for path in (self.log_dir / "supervisor.log", child.log_path):
            try:
                with open(path, "a") as f:
                    f.write(f"== {stamped}\n" if path == child.log_path else stamped + "\n")
            except OSError:
                pass
        if self.echo:
            print(f"{self.echo}: {line}", file=sys.stderr, flush=True)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
