"""The seq-len experiment serves a copy of the checkpoint whose cap is above its longest point."""

from __future__ import annotations

import json

import torch

from relaygr.tools.experiment.deployment import serving_cap_at_least
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.runner import ModelRunner
from tests.synthetic import history, tiny_model


def test_a_cap_below_the_longest_point_is_raised_in_a_copy_that_ranks_alike(tmp_path) -> None:
    model = tiny_model(3)
    src = model.save(tmp_path / "model")
    cap = model.config.max_seq_len
    said: list[str] = []
    assert serving_cap_at_least(src, cap, tmp_path / "copy", said.append) == src  # high enough
    assert not (tmp_path / "copy").exists() and not said

    out = serving_cap_at_least(src, 4 * cap, tmp_path / "copy", said.append)
    assert out == tmp_path / "copy" and said and str(4 * cap) in said[0]
    assert json.loads((src / "config.json").read_text())["max_seq_len"] == cap  # original untouched
    copy = HSTURanker.load(out)
    assert copy.config.max_seq_len == 4 * cap
    assert copy.model_version != HSTURanker.load(src).model_version
    h = history(min(cap, 300), seed=1)
    cands = torch.arange(1, 9)
    ts = float(h.timestamps[-1]) + 60.0
    torch.testing.assert_close(
        ModelRunner(copy).rank(None, h, cands, ts), ModelRunner(HSTURanker.load(src)).rank(None, h, cands, ts)
    )
