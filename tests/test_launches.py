"""A ranking dispatches a bounded number of device operations, whatever the history length:
``bench/launches.py`` counts them on the meta device (the model's own code, nothing computed)."""

from __future__ import annotations

import functools

import pytest
import torch

from relaygr.bench.launches import DispatchCounter, count_ranking, full_limit, on_meta, relay_limit
from relaygr.workers.model.model import HSTURanker
from relaygr.workers.model.presets import preset

LENGTHS = (1024, 8192, 32768)


@functools.cache
def _model(name: str) -> HSTURanker:
    torch.manual_seed(0)
    return on_meta(HSTURanker(preset(name).config(dropout=0.0)).eval())


@pytest.mark.parametrize("name", ["small", "large"])
def test_a_ranking_dispatches_a_bounded_count_the_same_at_every_length(name: str) -> None:
    model = _model(name)
    layers = model.config.layers
    relay = [count_ranking(model, n, 64, 128, "relay").total for n in LENGTHS]
    full = [count_ranking(model, n, 64, 128, "full").total for n in LENGTHS]
    assert len(set(relay)) == 1 and len(set(full)) == 1, (relay, full)
    assert relay[0] <= relay_limit(layers), relay
    assert full[0] <= full_limit(layers), full


def test_the_counter_counts_operations_not_views() -> None:
    t = torch.ones(4, 6)
    counter = DispatchCounter()
    with counter:
        u = t.view(6, 4).transpose(0, 1)[1:]
        (u * 2).sum()
    assert dict(counter.counts) == {"mul": 1, "sum": 1}


def test_count_ranking_refuses_what_it_cannot_count() -> None:
    model = _model("small")
    with pytest.raises(ValueError, match="relay or full"):
        count_ranking(model, 100, 10, 4, "half")
    with pytest.raises(ValueError, match="suffix"):
        count_ranking(model, 10, 20, 4, "relay")
    with pytest.raises(ValueError, match="meta"):
        count_ranking(HSTURanker(preset("small").config(dropout=0.0)), 100, 10, 4, "relay")


def test_graphed_bytes_count_real_keys_in_place_and_every_padded_slot_when_gathered() -> None:
    from relaygr.bench.launches import graphed_bytes

    cfg = preset("large").config(dropout=0.0)
    row = cfg.heads * (cfg.attn_dim + cfg.linear_dim) * 2
    a, b = graphed_bytes(cfg, 4352, 64, 128), graphed_bytes(cfg, 8192, 64, 128)
    assert a["gathered"] == b["gathered"]  # both in the 8192-token prefix bucket
    assert b["paged"] - a["paged"] == (8192 - 4352) * (row + 28) * cfg.layers  # only real keys
    assert b["gathered"] > 2 * b["paged"]  # the copy's write and read again, besides the read
    with pytest.raises(ValueError, match="fit no bucket"):
        graphed_bytes(cfg, 100, 1000, 1)


def test_the_graphed_forward_as_cuda_captures_it_counts_the_same_at_every_length() -> None:
    pytest.importorskip("triton")
    from relaygr.bench.launches import count_graphed
    from relaygr.workers.kernels import triton_hstu

    model = _model("large")
    counts = [count_graphed(model, n, 64, 128, backend="triton") for n in LENGTHS]
    assert {c.transfers for c in counts} == {0} and len({c.total for c in counts}) == 1
    assert counts[0].counts["add_"] >= model.config.layers  # at least one launch a layer
    assert hasattr(triton_hstu._hstu_fwd_kernel, "run")  # the kernels are back after counting
    with pytest.raises(ValueError, match="cpu or triton"):
        count_graphed(model, 1024, 64, 128, backend="cuda")
