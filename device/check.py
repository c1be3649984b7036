"""The prepared device check: the accelerator path proven and RelayGR's axes measured in minutes.

One command; every result is written to files as it goes.

``relaygr bench device --out DIR [--device cuda|npu|cpu] [--quick] [--preset large]`` runs six
steps, each a child process of its own with a time budget (a step past its budget is stopped and
reported as ``cut``; one that fails is reported ``failed`` and the next still runs; the whole check
stays within ``TOTAL_BUDGET_S``, and with what comes before it within 9 minutes):

1. ``environment``: Python, torch, the device (name, memory), a pinned host-to-device copy, the
   project's dependencies (``device.probe``). If the device is unusable, nothing else runs.
2. ``exactness``: relay vs full ranking at 4k and 16k events, fp32 and bf16 (``bench model``):
   the worst absolute score difference and the top-10 agreement.
3. ``model``: ``bench model`` cached vs full at 4k, 8k, 16k and 32k events: milliseconds,
   tokens/s, the speed-up against its FLOP bound, KV bytes per layer, and the largest history
   each path ranks within the 50 ms budget; before it, the ``xl`` preset at 2k and 8k in bf16.
4. ``store``: ``bench store`` device -> host (pinned) -> disk tiers: promotion times vs recompute
   (the preset at 4k and 16k, ``xl`` at 4k).
5. ``profile``: ``device.profiling``: relay and full ranking at 2k and 8k under the profiler
   (kernels per ranking, device busy against wall time, top kernels) next to a fused-attention
   transformer of the same shape, eager and replayed from a CUDA graph.
6. ``pipeline``: a model trained for a few steps (``relaygr train``), then ``relaygr experiment
   seq-len throughput`` on the real broker at points sized from the device's calibration with the
   requests the stopping rule needs (``device.points``), one ranking worker on the device
   and a core of its own per stage where the machine has them (``workers.engine.cores``). The last step,
   it takes what the steps before it left of the total as well as its own budget, and its points
   fit what is left of the step once the model is trained (``RELAYGR_STEP_DEADLINE``).

``--quick`` runs the same steps at tiny sizes (the dry run on a CPU, in the test suite), with
``QUICK_BUDGET_SCALE`` times the budgets.
``DIR`` gets ``report.json`` and ``report.md``, rewritten after every step, and one log per step
(``<step>.log``); scratch (the model, the experiments' folders) goes to ``DIR/../<DIR>-work``
unless ``--work`` names a folder.

Primitives: ``Step`` (a step's commands, budget and what it needs), ``StepResult``, ``plan_steps``,
``budget_s``, ``run_step``, ``run_check``; the summaries and the Markdown are ``device.report``'s.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from relaygr.device.report import parse_json_lines, summarise, write_report

DEADLINE_ENV = "RELAYGR_STEP_DEADLINE"
"""``device.points.DEADLINE_ENV``: the wall-clock end of the step a command runs in."""
BACKEND_ENV = "RELAYGR_ATTENTION_BACKEND"
"""``relaygr.workers.kernels.interface.BACKEND_ENV``, named here so that the check starts without torch."""

TOTAL_BUDGET_S = 485.0
"""Every step's budget together. With the grace a cut step gets to stop and ``RUN_MARGIN_S`` for
what comes before the first step (the bundle unpacked, Python started), the check stays within
``RUN_LIMIT_S``."""
RUN_LIMIT_S = 540.0
"""What the device run allows the whole check: 9 minutes."""
RUN_MARGIN_S = 40.0

STOP_GRACE_S = 15.0
"""A step past its budget gets SIGTERM, then this long to stop what it started, then SIGKILL."""

BUDGETS_S = {
    "environment": 25.0,
    "kernels": 90.0,  # the Triton kernels compile first: 57 s of 60 on the H200
    "exactness": 35.0,
    "model": 110.0,  # 46 s on the H200 before the nvidia-block anchor lines (about 25 s more)
    "store": 40.0,
    "profile": 45.0,
    "pipeline": 140.0,  # and what the steps before it left (the total stays 485 s)
}
XL_PRESET = "xl"
"""Measured besides ``--preset`` by the model and store steps, at fewer lengths."""

QUICK_BUDGET_SCALE = 2.0
"""The dry run's budgets are twice the check's: it measures nothing, its budgets only stop a hang,
and on a shared 2-core machine its pipeline step alone took 160 s at a load of 16-25."""


def budget_scale(args: argparse.Namespace) -> float:
    """Every budget's factor: the dry run's, times ``--budget-scale`` (a shorter lease)."""
    return (QUICK_BUDGET_SCALE if args.quick else 1.0) * getattr(args, "budget_scale", 1.0)


def budget_s(step: str, args: argparse.Namespace) -> float:
    return BUDGETS_S[step] * budget_scale(args)


FULL_SIZES = {
    "exactness_lengths": "4096,16384",
    "model_lengths": "4096,8192,16384,32768",
    "xl_model_lengths": "2048,8192",
    "store_lengths": "4096,16384",
    "xl_store_lengths": "4096",
    "profile_lengths": "2048,8192",
    "users_length": "8192",
    "users": "16",
    "repeats": "5",
    "xl_repeats": "3",
    "store_repeats": "10",
    "hit_repeats": "100",
    "candidates": "128",
    "suffix": "64",
    "block": "1024",
}
TINY_SHAPE = ["--layers", "2", "--heads", "2", "--dim", "32"]
QUICK_SIZES = {
    "exactness_lengths": "48,96",
    "model_lengths": "32,64,128",
    "store_lengths": "64",
    "profile_lengths": "64,128",
    "users_length": "64",
    "users": "4",
    "repeats": "2",
    "store_repeats": "2",
    "hit_repeats": "5",
    "candidates": "16",
    "suffix": "8",
    "block": "32",
}


@dataclass
class Step:
    name: str
    budget_s: float
    commands: list[list[str]]
    modules: tuple[str, ...] = ()  # Python modules the step cannot run without
    needs_broker: bool = False
    independent: bool = False  # a failing command does not stop the next (other presets)
    takes_the_rest: bool = False  # the last step: what the steps before it left of the total, too


@dataclass
class StepResult:
    name: str
    status: str  # ok, cut, failed or skipped
    seconds: float
    budget_s: float
    reason: str = ""
    commands: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    log: str = ""
    cpu_s: float = 0.0  # CPU time of the step's processes (and their children), user + system
    load_avg_1m: float = 0.0  # the machine's load when the step ended: other work slows it too


def _relaygr(*args: str) -> list[str]:
    return [sys.executable, "-m", "relaygr.cli", *args]


def _shape(args: argparse.Namespace, preset: str | None = None) -> list[str]:
    """The model shape of the model and store steps: the preset, or a tiny one for the dry run."""
    return TINY_SHAPE if args.quick else ["--preset", preset or args.preset]


def _bench_model(
    args: argparse.Namespace, sizes: dict, lengths: str, repeats: str, *extra: str, preset: str | None = None
) -> list[str]:
    return _relaygr(
        "bench",
        "model",
        "--json",
        "--device",
        args.device,
        *_shape(args, preset),
        "--lengths",
        lengths,
        "--repeats",
        repeats,
        "--suffix",
        sizes["suffix"],
        "--candidates",
        sizes["candidates"],
        "--block",
        sizes["block"],
        *extra,
        *(["--threads", "1", "--roofline-n", "256"] if args.quick else []),
    )


def _pipeline_commands(args: argparse.Namespace, work: Path) -> list[list[str]]:
    """Train the preset for a few steps (unless ``--model``), then both experiments on one pair of
    pipelines."""
    model = Path(args.model) if args.model else work / "model"
    commands = []
    if not args.model:
        shape = _shape(args)
        commands.append(
            _relaygr(
                "train",
                *shape,
                "--out",
                str(model),
                "--device",
                args.device,
                "--epochs",
                "1",
                "--max-steps",
                "2" if args.quick else "100",
                "--eval-users",
                "20" if args.quick else "200",
                # A run that stops before --min-epochs scores its last epoch on validation: 1,024
                # users by default, most of the dry run's training time on a CPU.
                *(["--valid-users", "20"] if args.quick else []),
                "--eval-lengths",
                "all",
                "--threads",
                "1" if args.quick else "4",
            )
        )
    common = ["--json", "--model", str(model), "--device", args.device, "--out", str(work / "experiments"),
              "--threads", "1", "--first-point-once", "--core-per-stage"]  # fmt: skip
    if args.quick:  # fixed tiny points: the dry run checks the wiring, not the device
        points = ["--lengths", "64", "--history", "64", "--qps", "20", "--qps-list", "20", "--slo-ms", "2000",
                  "--max-requests", "8", "--min-round", "8", "--max-round", "8", "--miss-rate", "0.5",
                  "--pipeline-warmup", "0", "--no-warmup", "--no-isolate"]  # fmt: skip
        commands.append(_relaygr("experiment", "seq-len", "throughput", *common, *points))
        return commands
    # The points from the device's calibration, with the requests the stopping rule needs.
    sizing = [sys.executable, "-m", "relaygr.device.points", "--model", str(model), "--device", args.device,
              "--budget-ms", str(args.budget_ms), "--work", str(work / "points")]  # fmt: skip
    rest = ["--slo-ms", str(args.budget_ms), "--pipeline-warmup", "20", "--patience", "1"]
    commands.append([*sizing, "--", *common, *rest])
    return commands


def _kernel_commands(args: argparse.Namespace) -> list[list[str]]:
    """The attention kernel against its reference: the parity tests on this device, then one
    layer's call timed per shape (``bench kernels``). The dry run times a tiny shape only."""
    bench = [sys.executable, "-m", "relaygr.bench.kernels", "--device", args.device]
    if args.quick:
        return [bench]
    tests = Path(__file__).resolve().parents[1] / "tests" / "test_kernels.py"
    parity = [sys.executable, "-m", "pytest", "--noconftest", "-q", "-p", "no:cacheprovider", str(tests),
              "-k", "cuda_kernel_matches or causal_skip or bad_input"]  # fmt: skip
    return [*([parity] if tests.exists() else []), [*bench, "--repeats", "10"]]


def _profile(args: argparse.Namespace, sizes: dict) -> list[str]:
    shape = ["--preset", "small", "--layers", "2"] if args.quick else ["--preset", args.preset]
    small = [
        "--suffix",
        sizes["suffix"],
        "--candidates",
        sizes["candidates"],
        "--repeats",
        "2",
        "--warmup",
        "1",
    ]
    return [sys.executable, "-m", "relaygr.device.profiling", "--device", args.device, *shape,
            "--lengths", sizes["profile_lengths"], *(small if args.quick else [])]  # fmt: skip


def _bench_store(
    args: argparse.Namespace, sizes: dict, preset: str, lengths: str, repeats: str, hits: str, disk: Path
) -> list[str]:
    return _relaygr("bench", "store", "--json", "--device", args.device, "--preset", preset, "--lengths", lengths,
                    "--repeats", repeats, "--hit-repeats", hits, "--recompute-repeats", "2", "--disk-path", str(disk))  # fmt: skip


def _model_commands(args: argparse.Namespace, sizes: dict) -> list[list[str]]:
    """``xl`` (not in the dry run) at fewer lengths in bf16, first: it is short, and a step cut
    later still keeps the preset's lengths measured so far (one line each); then the preset at
    every length in both dtypes."""
    budget = ["--budget-ms", f"{args.budget_ms:g}"]
    # At one length, a ranking worker's batch too: users' relay rankings in one forward, eager and
    # as one bucket's graph replay (the rankings a second the device serves).
    users = ["--users", sizes["users"], "--users-lengths", sizes["users_length"]]
    commands = [_bench_model(args, sizes, sizes["model_lengths"], sizes["repeats"], "--dtype", "bfloat16,float32",
                             *budget, *users)]  # fmt: skip
    if not args.quick:  # NVIDIA's cached HSTU block shape at batch 1 and 8, first: it reads against theirs
        commands.insert(0, _relaygr("bench", "model", "--anchor", "--json", "--device", args.device,
                                    "--dtype", "bfloat16", "--repeats", "20"))  # fmt: skip
    if not args.quick and args.preset != XL_PRESET:
        xl = _bench_model(args, sizes, sizes["xl_model_lengths"], sizes["xl_repeats"], "--dtype", "bfloat16",
                          *budget, preset=XL_PRESET)  # fmt: skip
        commands.insert(0, xl)
    return commands


def _store_commands(args: argparse.Namespace, sizes: dict, disk: Path) -> list[list[str]]:
    commands = [_bench_store(args, sizes, args.preset, sizes["store_lengths"], sizes["store_repeats"],
                             sizes["hit_repeats"], disk)]  # fmt: skip
    if not args.quick and args.preset != XL_PRESET:
        commands.append(_bench_store(args, sizes, XL_PRESET, sizes["xl_store_lengths"], "3", "20", disk))
    return commands


def plan_steps(args: argparse.Namespace, work: Path) -> list[Step]:
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    store_disk = work / "store"
    store_disk.mkdir(parents=True, exist_ok=True)
    model_needs = ("pydantic", "safetensors")
    return [
        Step(
            "environment",
            budget_s("environment", args),
            [[sys.executable, "-m", "relaygr.device.probe", "--device", args.device]],
        ),
        Step("kernels", budget_s("kernels", args), _kernel_commands(args), ("torch",), independent=True),
        Step(
            "exactness",
            budget_s("exactness", args),
            [
                _bench_model(
                    args, sizes, sizes["exactness_lengths"], "1", "--dtype", "float32,bfloat16", "--no-graphs"
                )
            ],
            model_needs,
        ),
        Step("model", budget_s("model", args), _model_commands(args, sizes), model_needs, independent=True),
        Step(
            "store",
            budget_s("store", args),
            _store_commands(args, sizes, store_disk),
            (*model_needs, "rocksdict"),
            independent=True,
        ),
        Step("profile", budget_s("profile", args), [_profile(args, sizes)], model_needs),
        Step(
            "pipeline",
            budget_s("pipeline", args),
            _pipeline_commands(args, work),
            ("pydantic", "pydantic_settings", "safetensors", "rocksdict", "aiokafka", "faust"),
            needs_broker=True,
            takes_the_rest=True,
        ),
    ]


def broker_missing() -> str:
    """Why no broker can be had here ('' when one can: a bootstrap, a running local broker, or
    java and the broker's jars, or Maven to fetch them)."""
    if os.environ.get("RELAYGR_BOOTSTRAP"):
        return ""
    from relaygr.infra.local import broker
    from relaygr.infra.settings import get_settings

    settings = get_settings()
    up, _ = broker.status(settings)
    if up:
        return ""
    if shutil.which("java") is None:
        return "no Kafka broker: java is not installed and RELAYGR_BOOTSTRAP names no cluster"
    if not (broker.jars_dir(settings) / ".complete").exists() and shutil.which("mvn") is None:
        return "no Kafka broker: its jars are not here and Maven, which fetches them, is not installed"
    return ""


def _why_skipped(step: Step, env_ok: bool) -> str:
    if not env_ok and step.name != "environment":
        return "the environment step failed: the device is not usable"
    missing = [m for m in step.modules if importlib.util.find_spec(m) is None]
    if missing:
        return "Python modules missing: " + ", ".join(missing)
    return broker_missing() if step.needs_broker else ""


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group (commands unwind and stop what they started), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, budget_s: float, log: Path, env: dict[str, str], env_ok: bool = True) -> StepResult:
    """The step's commands one after the other within ``budget_s``; stdout and stderr into ``log``."""
    res = StepResult(step.name, "ok", 0.0, round(budget_s, 1), commands=[" ".join(c) for c in step.commands])
    res.log = log.name
    why = _why_skipped(step, env_ok)
    if why:
        res.status, res.reason = "skipped", why
        log.write_text(f"skipped: {why}\n")
        return res
    t0 = time.monotonic()
    cpu0 = _children_cpu_s()
    with open(log, "w") as f:
        for cmd in step.commands:
            left = budget_s - (time.monotonic() - t0)
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            # The step's end, for a command that sizes its work to the time left (``device.points``).
            deadline = {DEADLINE_ENV: f"{time.time() + left:.1f}"}
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env={**env, **deadline}, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=max(left, 1.0))
            except subprocess.TimeoutExpired:
                _stop(proc)
                res.status, res.reason = (
                    "cut",
                    f"past its budget of {budget_s:.0f} s in: {' '.join(cmd[2:5])}",
                )
                break
            if rc != 0:
                failed = f"exit status {rc} of: {' '.join(cmd[2:6])}"
                res.status, res.reason = "failed", "; ".join(r for r in (res.reason, failed) if r)
                if not step.independent:
                    break
    res.seconds = round(time.monotonic() - t0, 1)
    res.cpu_s = round(_children_cpu_s() - cpu0, 1)
    res.load_avg_1m = round(os.getloadavg()[0], 2)
    return res


def _children_cpu_s() -> float:
    """CPU seconds of every finished child process (and its waited-for children) so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_check(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out.parent / f"{out.name}-work"
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.isolated_home:
        env.setdefault("RELAYGR_HOME", str(work / "home"))
    doc: dict = {
        "check": "device",
        "device": args.device,
        "quick": args.quick,
        "preset": args.preset,
        "model_shape": "tiny (2 layers, d=32: the dry run)" if args.quick else f"preset {args.preset}",
        "budget_ms": args.budget_ms,
        "total_budget_s": TOTAL_BUDGET_S * budget_scale(args),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _commit(),
        "out": str(out),
        "work": str(work),
        "steps": [],
        "attention_backend": env.get(BACKEND_ENV) or "by device (the Triton kernel on CUDA)",
    }
    wanted = set(args.steps.split(",")) if args.steps else None
    t0 = time.monotonic()
    env_ok = True
    for step in plan_steps(args, work):
        left = TOTAL_BUDGET_S * budget_scale(args) - (time.monotonic() - t0)
        if wanted is not None and step.name not in wanted:
            res = StepResult(step.name, "skipped", 0.0, step.budget_s, reason="not asked for (--steps)")
        elif left < 5.0:
            res = StepResult(step.name, "skipped", 0.0, step.budget_s, reason="no time left in the check")
        else:
            budget = left if step.takes_the_rest else min(step.budget_s, left)
            print(f"== {step.name} (budget {budget:.0f} s)", file=sys.stderr, flush=True)
            res = run_step(step, budget, out / f"{step.name}.log", env, env_ok)
            rows = parse_json_lines((out / f"{step.name}.log").read_text())
            res.summary = summarise(step.name, rows, args)
        if step.name == "environment":
            env_ok = res.status == "ok"
        if step.name == "kernels" and res.status in ("failed", "cut") and not args.quick:
            # The model's steps run on the PyTorch backend (``cpu``, which runs on any device)
            # rather than on a kernel that failed its parity.
            env[BACKEND_ENV] = "cpu"
            doc["attention_backend"] = f"cpu (PyTorch): the kernels step {res.status} ({res.reason})"
        print(f"   {res.name}: {res.status} in {res.seconds:.1f} s {res.reason}", file=sys.stderr, flush=True)
        doc["steps"].append(res.__dict__)
        doc["seconds"] = round(time.monotonic() - t0, 1)
        write_report(out, doc)
    return doc


def _commit() -> str | None:
    """The checkout's commit, where the code runs from one (a copied tree has none)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=Path(__file__).resolve().parent,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Nothing here imports the model (pydantic): on a bare machine the environment step still runs
    # and says what is missing.
    parser.add_argument(
        "--out", required=True, type=Path, help="report folder (report.json, report.md, logs)"
    )
    parser.add_argument("--device", default="cuda", help="cuda[:N], npu[:N] or cpu (default cuda)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes: the dry run (any machine; minutes on a CPU)"
    )
    parser.add_argument("--preset", default="large", help="model shape of workers.presets (default large)")
    parser.add_argument(
        "--budget-scale",
        type=float,
        default=1.0,
        help="multiply every step's budget (and the points' sending time): below 1 for a lease shorter than 9 minutes",
    )
    parser.add_argument("--budget-ms", type=int, default=50, help="the ranking budget (default 50 ms)")
    parser.add_argument("--model", type=Path, help="checkpoint for the pipeline step (default: trained here)")
    parser.add_argument("--work", type=Path, help="scratch folder (default: beside --out)")
    parser.add_argument("--steps", help="only these steps, comma separated (the others are reported skipped)")
    parser.add_argument(
        "--isolated-home",
        action="store_true",
        help="RELAYGR_HOME in the scratch folder (unless set): a broker of the check's own",
    )


def run(args: argparse.Namespace) -> int:
    doc = run_check(args)
    statuses = {s["name"]: s["status"] for s in doc["steps"]}
    print(f"device check: {statuses}; report in {Path(args.out) / 'report.md'}", file=sys.stderr)
    return 0 if all(s in ("ok", "skipped") for s in statuses.values()) else 1
