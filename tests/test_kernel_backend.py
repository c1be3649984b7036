"""Which HSTU attention backend runs: by device, forced in code, or named by the operator; and
the CPU backend's causal tiles (one user whose queries are all its keys) against the definition."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from relaygr.workers.kernels import AttentionParams, JaggedBatch, cpu, hstu_mha
from relaygr.workers.kernels.interface import BACKEND_ENV, backend_for, use_backend
from relaygr.workers.model.hstu_attention import (
    dense_attention,
    far_index,
    far_scale,
    pair_index,
)


def test_cpu_tensors_run_the_cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert backend_for(torch.zeros(1)) == "cpu"


def test_the_operator_names_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "oracle")
    assert backend_for(torch.zeros(1)) == "oracle"
    monkeypatch.setenv(BACKEND_ENV, "reference")  # the CPU backend's earlier name
    assert backend_for(torch.zeros(1)) == "cpu"
    monkeypatch.setenv(BACKEND_ENV, "cuda-magic")
    with pytest.raises(ValueError, match="cuda-magic"):
        backend_for(torch.zeros(1))


def test_code_forces_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "cuda-magic")
    with use_backend("reference"):
        assert backend_for(torch.zeros(1)) == "cpu"
    with use_backend("oracle"):
        assert backend_for(torch.zeros(1)) == "oracle"
    with pytest.raises(ValueError, match="not available"), use_backend("cuda-magic"):
        pass


def test_a_call_autograd_records_runs_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    q = torch.zeros(1, requires_grad=True)
    assert backend_for(q) == "oracle" and backend_for(torch.zeros(1), q) == "oracle"
    with torch.no_grad():
        assert backend_for(q) == "cpu"


# The CPU backend's causal tiles (one user whose queries are all its keys): the same function as the
# definition, and refused where the positions do not allow skipping the tiles above the diagonal.


def _one_user(n: int, heads: int, positions: torch.Tensor, ts: torch.Tensor, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, heads, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(n, heads, 5, generator=gen, dtype=torch.float64)
    table = torch.randn(24 * 40, generator=gen, dtype=torch.float64)
    return q, k, v, table, JaggedBatch.build([n], [n], positions, ts, positions, ts)


def _definition(q, k, v, table, positions, ts, params: AttentionParams) -> torch.Tensor:
    npos, ntime = params.num_pos, params.num_time
    index = pair_index(positions[:, None] - positions[None, :], ts[:, None] - ts[None, :], npos, ntime)
    own = torch.eye(len(positions), dtype=torch.bool)
    visible = ((positions[:, None] > positions[None, :]) | own).double()
    if params.near_keys:
        scale = far_scale(positions, params.near_keys, params.far_keys)
        visible = visible * torch.where(index >= far_index(params.near_keys, npos, ntime), scale, 1.0)
    out = dense_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), index, visible, table, params.normaliser
    )
    return out.transpose(0, 1)


def _history(n: int, candidates: int, seed: int, whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``0 .. n - 1`` then ``candidates`` at ``n`` (at ``start``), timestamps that tie now
    and then, whole seconds or not."""
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.randint(0, 3, (n,), generator=gen).double() * 10.0 ** torch.randint(
        0, 5, (n,), generator=gen
    )
    ts = 8.8e8 + torch.cumsum(gaps if whole else gaps * 1.37, 0)
    positions = torch.cat([torch.arange(n), torch.full((candidates,), n)])
    return positions, torch.cat([ts, ts[-1:].expand(candidates) + 30.0])


@pytest.mark.parametrize(
    ("n", "heads", "tile", "near", "whole", "start"),
    [
        (61, 1, 16, 4, True, 0),  # 4 blocks of 16 (3 padding tokens), whole seconds
        (61, 2, 16, 20, False, 0),  # two heads, fractional seconds (float64 gaps)
        (45, 3, 7, 0, True, 5_000_000_000),  # positions past int32, in a frame from the smallest
        (9, 1, 512, 1, True, 0),  # one tile
    ],
)
def test_causal_tiles_equal_the_definition(monkeypatch, n, heads, tile, near, whole, start) -> None:
    monkeypatch.setattr(cpu, "TILE_TOKENS", tile)
    positions, ts = _history(n - 5, 5, seed=n + tile, whole=whole)
    positions = positions + start
    params = AttentionParams(24, 40, 7.0, near_keys=near, far_keys=2.5)
    q, k, v, table, batch = _one_user(n, heads, positions, ts, seed=tile)
    with use_backend("cpu"):
        got = hstu_mha(q, k, v, batch, table, params)
        got32 = hstu_mha(q.float(), k.float(), v.float(), replace(batch, scratch={}), table.float(), params)
    layout = batch.scratch[("cpu", params, torch.float64)]
    assert layout.tiles is not None and layout.tiles.blocks == -(-n // tile)
    want = _definition(q, k, v, table, positions, ts, params)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert (got32.double() - want).abs().max() <= 1e-5 * max(float(want.abs().max()), 1.0)


def test_the_int32_frames_give_the_general_layout(monkeypatch) -> None:
    """The int32 pair arithmetic (positions and whole seconds in frames) and the general int64 one
    give the same index and weight, bit for bit."""
    monkeypatch.setattr(cpu, "TILE_TOKENS", 32)
    positions, ts = _history(90, 10, seed=3, whole=True)
    batch = JaggedBatch.build([100], [100], positions + 7, ts, positions + 7, ts)
    assert cpu.host_frame(batch) == cpu.HostFrame(True, 7, float(ts.min()))
    params = AttentionParams(24, 40, 7.0, near_keys=16, far_keys=2.5)
    framed = cpu.pair_layout(batch, params)
    monkeypatch.setattr(cpu, "host_frame", lambda b: cpu.HostFrame(True, None, None))
    general = cpu.pair_layout(replace(batch, scratch={}), params)
    assert framed.tiles is not None and general.tiles is not None
    assert torch.equal(framed.index, general.index) and torch.equal(framed.weight, general.weight)


def test_positions_in_no_order_are_not_tiled() -> None:
    positions, ts = _history(30, 4, seed=1, whole=True)
    positions = positions[torch.randperm(34, generator=torch.Generator().manual_seed(0))]
    params = AttentionParams(24, 40, 7.0, near_keys=4, far_keys=2.5)
    q, k, v, table, batch = _one_user(34, 2, positions, ts, seed=2)
    assert not cpu.host_frame(batch).ordered
    with use_backend("cpu"):
        got = hstu_mha(q, k, v, batch, table, params)
    assert batch.scratch[("cpu", params, torch.float64)].tiles is None
    torch.testing.assert_close(
        got, _definition(q, k, v, table, positions, ts, params), rtol=1e-10, atol=1e-10
    )


def test_the_tiles_cover_the_lower_triangle_once() -> None:
    tiles = cpu.causal_tiles(100, torch.device("cpu"))  # 512-token blocks: one tile
    assert (tiles.blocks, tiles.side, tiles.pad) == (1, 100, 0)
    tiles = cpu.causal_tiles(1500, torch.device("cpu"))  # 3 blocks of 500
    assert (tiles.blocks, tiles.side, tiles.pad) == (3, 500, 0)
    rows = torch.cat([torch.arange(1500), tiles.out_rows]).view(-1, 500)[:, 0] // 500
    cols = tiles.col_slots.view(-1, 500)[:, 0] // 500
    assert sorted(zip(rows.tolist(), cols.tolist(), strict=True)) == [
        (r, c) for r in range(3) for c in range(r + 1)
    ]
    tiles = cpu.causal_tiles(1025, torch.device("cpu"))  # 3 blocks of 342, 1 padding token
    assert (tiles.blocks, tiles.side, tiles.pad) == (3, 342, 1)
    assert int(tiles.rows.min()) == 0 and int(tiles.rows.max()) == 1024


def test_a_finished_layout_leaves_its_scratch_to_the_next_and_live_ones_never_share(monkeypatch) -> None:
    monkeypatch.setattr(cpu, "_spare", {})
    positions, ts = _history(90, 10, seed=3, whole=True)
    params = AttentionParams(24, 40, 7.0, near_keys=16, far_keys=2.5)

    def layout() -> cpu.PairLayout:
        return cpu.pair_layout(JaggedBatch.build([100], [100], positions, ts, positions, ts), params)

    first, second = layout(), layout()
    memory = second.index.untyped_storage().data_ptr()
    assert first.index.untyped_storage().data_ptr() != memory and not cpu._spare
    del second
    assert cpu._spare[(torch.int32, False)].untyped_storage().data_ptr() == memory
    third = layout()
    assert third.index.untyped_storage().data_ptr() == memory
    assert torch.equal(first.index, third.index) and torch.equal(first.weight, third.weight)
    # Memory of a forward under inference mode is an inference tensor: a forward outside it
    # cannot write it in place, so it gets its own (and the other way round).
    del third
    with torch.inference_mode():
        fourth = layout()
    assert fourth.index.untyped_storage().data_ptr() != memory and fourth.index.is_inference()
    del fourth
    assert set(cpu._spare) == {(torch.int32, False), (torch.int32, True)}
    assert layout().index.untyped_storage().data_ptr() == memory
