"""What a run needs before its pipeline starts: a trained model and its latency calibration.

Primitives:
- ``ensure_model(model_dir)``: train the HSTU ranker on MovieLens-100K into ``model_dir`` (in a
  child process, through ``relaygr train``) unless a checkpoint is there.
- ``ensure_calibration(model_dir)``: time full ranking of that model on this machine, with the
  workers' thread count, and the paces of sliced pre-inference and relay ranking
  (``calibration.measure_paces``), and write ``model_dir/calibration.json``; returns its path.
Each step is printed as a ``== ...`` line on standard error (with the training's own output), so a
command's standard output stays what it promises (one JSON line for ``--json``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _step(msg: str) -> None:
    print(f"== {msg}", file=sys.stderr, flush=True)


def ensure_model(model_dir: Path) -> None:
    if (model_dir / "config.json").exists():
        _step(f"using the trained model in {model_dir}")
        return
    _step(f"training the HSTU ranker on MovieLens-100K into {model_dir} (once)")
    cmd = [sys.executable, "-m", "relaygr.cli", "train", "--dataset", "ml-100k", "--out", str(model_dir)]
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def ensure_calibration(model_dir: Path) -> Path:
    from relaygr.streams.config import PipelineSettings
    from relaygr.workers.engine.calibration import calibrate_and_save
    from relaygr.workers.model.model import HSTURanker
    from relaygr.workers.model.runner import ModelRunner

    path = model_dir / "calibration.json"
    _step("calibrating full-ranking latency on this machine, and the pace of relay rankings")
    model = HSTURanker.load(model_dir)
    settings = PipelineSettings()
    # Timed as the workers will run it; the paces as `relaygr calibrate` measures them.
    paces = settings.pace_settings()
    _, samples = calibrate_and_save(ModelRunner(model), path, threads=settings.torch_threads, paces=paces)
    print("   " + ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in samples), file=sys.stderr)
    relay = json.loads(path.read_text()).get("relay_pace", [])
    print(
        "   relay ranking pace: " + ", ".join(f"{n:.0f} cached {p:.1f}x" for n, p in relay), file=sys.stderr
    )
    return path
