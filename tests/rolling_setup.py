"""The deployment that the rolling-restart broker tests roll, and what they read back.

- ``rolling_deployment(kafka_settings, home, model_dir, label, **pipeline)``: settings on fresh
  topics (4 partitions, prefix ``label-<random>``, state under ``home``), their registry (the
  topics created), and the environment of a relay pipeline in which every user with history is
  at risk and the short-term window is short (prefill signals flow), with ``pipeline``'s settings
  on top.
- ``worker_events(folder)``: a ranking worker's audit trail (``events.jsonl``), one dict a line.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from relaygr.infra.kafka import ensure_topics
from relaygr.infra.settings import Settings
from relaygr.schemas import TopicRegistry
from relaygr.streams.config import PipelineSettings

PARTITIONS = 4


async def rolling_deployment(
    kafka_settings: Settings, home: Path, model_dir: Path, label: str, **pipeline: Any
) -> tuple[Settings, TopicRegistry, dict[str, str]]:
    prefix = f"{label}-{uuid.uuid4().hex[:8]}"
    update = {"topic_prefix": prefix, "home": home, "partitions": PARTITIONS}
    settings = kafka_settings.model_copy(update=update)
    reg = TopicRegistry(prefix, PARTITIONS)
    await ensure_topics(reg, settings)
    env = PipelineSettings.to_env(
        model_dir=model_dir,
        calibration_file=model_dir / "calibration.json",
        mode="relay",
        theta=1e-6,
        short_term=8,
        **pipeline,
    )
    return settings, reg, env


def worker_events(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
