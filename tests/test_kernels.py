"""The Triton HSTU kernel matches the oracle (``kernel_parity.CASES``), alone and with what follows
attention in a layer (``kernel_parity.GATED_CASES``: the norm over the heads and the gate).

On every machine the cases run through Triton's interpreter on the CPU, in a subprocess:
``TRITON_INTERPRET=1`` must be set before Triton is imported, and this process stays as it was.
Where CUDA is present the same cases run on the GPU too. Also: bad input is a clear error, the
causal skip is refused for users whose positions do not allow it, and the split choice. Keys read
through a row index (``JaggedBatch.k_rows``) give the packed keys' result in both backends.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_parity import CASES, DTYPES, GATED_CASES, index_keys, make_case, run_case, run_gated_case

pytest.importorskip("triton")

from relaygr.workers.kernels.triton_hstu import (
    KernelConfig,
    causal_limits,
    choose_config,
    hstu_forward,
    position_frames,
)

# Worst absolute difference allowed, relative to the oracle's largest output: float32 sums the
# same terms in another order; 16-bit outputs are rounded once more (and the scores fed to the
# second product too), a few units in the last place.
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 4e-3}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "kernel_parity.py"), "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def _within(name: str, diffs: dict) -> None:
    for dtype, d in diffs.items():
        bound = TOLERANCE[dtype] * (1.0 if dtype == "fp32" else max(d["scale"], 1.0))
        assert d["worst"] <= bound, f"{name} {dtype}: worst difference {d['worst']:.3g} over {bound:.3g}"
        assert d["scale"] > 0.1, f"{name} {dtype}: the oracle is near zero, the case checks nothing"


NAMES = sorted(CASES) + [f"gated:{name}" for name in GATED_CASES]


@pytest.mark.parametrize("name", NAMES)
def test_interpreted_kernel_matches_the_oracle(interpreted: dict, name: str) -> None:
    assert set(interpreted[name]) == set(CASES[name.removeprefix("gated:")].dtypes)
    _within(name, interpreted[name])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_kernel_matches_the_oracle(name: str) -> None:
    case = CASES[name.removeprefix("gated:")]
    run = run_gated_case if name.startswith("gated:") else run_case
    _within(name, {dt: run(case, DTYPES[dt], "cuda") for dt in case.dtypes})


def test_causal_skip_only_where_positions_allow_it() -> None:
    sorted_case = CASES["users_candidates_far"]
    *_, batch, _, _ = make_case(sorted_case, torch.float32, "cpu")
    assert causal_limits(batch).tolist() == [1, 1, 1]
    *_, batch, _, _ = make_case(CASES["shuffled_positions"], torch.float32, "cpu")
    assert causal_limits(batch).tolist() == [0, 0]
    assert ("triton", "causal_limits") in batch.scratch


def test_positions_past_int32_fall_back_per_user() -> None:
    # User 0's cached prefix lies 3 * 2^30 positions back: its gaps need int64. User 1 sits at
    # -2^35 with a short history: relative to its own first position it fits in int32.
    *_, batch, _, _ = make_case(CASES["positions_past_int32_one_head"], torch.float32, "cpu")
    q_rel, k_rel, fits = position_frames(batch)
    assert fits.tolist() == [0, 1]
    assert q_rel.dtype == k_rel.dtype == torch.int32
    start = int(batch.k_offsets[1])
    assert k_rel[start:].tolist() == (batch.k_pos[start:] - batch.k_pos[start]).tolist()
    assert not k_rel[:start].any()
    *_, batch, _, _ = make_case(CASES["single_user_relay"], torch.float32, "cpu")
    assert position_frames(batch)[2].tolist() == [1]


def test_bad_input_is_a_clear_error() -> None:
    q, k, v, batch, bias, params = make_case(CASES["single_user_relay"], torch.float32, "cpu")
    with pytest.raises(ValueError, match="share one dtype"):
        hstu_forward(q, k.double(), v, batch, bias, params)
    with pytest.raises(ValueError, match="share one dtype"):
        hstu_forward(q.double(), k.double(), v.double(), batch, bias, params)
    with pytest.raises(ValueError, match="bias table of"):
        hstu_forward(q, k, v, batch, bias[:-1], params)
    with pytest.raises(ValueError, match="head dims up to 256"):
        wide_v = torch.zeros(k.shape[0], k.shape[1], 512)
        hstu_forward(q, k, wide_v, batch, bias, params)
    with pytest.raises(ValueError, match="queries and"):
        hstu_forward(q[1:], k, v, batch, bias, params)
    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(block_m=48)
    with pytest.raises(ValueError, match="does not divide"):
        hstu_forward(q, k, v, batch, bias, params, KernelConfig(head_group=4))


def test_keys_are_split_only_when_the_grid_is_small() -> None:
    relay = choose_config(torch.bfloat16, 64, 64, 192, 8192, users=1, heads=4, sm_count=132)
    assert relay.splits > 1 and 8192 // relay.splits >= relay.block_n
    full = choose_config(torch.bfloat16, 128, 128, 32768, 32768, users=1, heads=8, sm_count=132)
    assert full.splits == 1
    short_full = choose_config(torch.bfloat16, 64, 64, 2048, 2048, users=1, heads=4, sm_count=132)
    assert short_full.splits > 1
    many_users = choose_config(torch.bfloat16, 128, 128, 192, 2048, users=64, heads=8, sm_count=132)
    assert many_users.splits == 1


def test_bench_runs_the_cpu_backend_on_a_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    from relaygr.cli import main

    assert main(["bench", "kernels", "--device", "cpu", "--presets", "tiny", "--lengths", "200",
                 "--repeats", "1", "--dtype", "fp32"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["bench"] == "kernels" and not report["interpreted"]
    assert [r["kind"] for r in report["rows"]] == ["relay_1", "relay_batch", "full"]
    for row in report["rows"]:
        assert row["reference_ms"] > 0 and row["reference_tflops"] > 0 and row["triton_ms"] is None


def test_bench_compares_the_interpreted_kernel_with_the_cpu_backend() -> None:
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "relaygr.bench.kernels", "--device", "cpu", "--presets", "tiny",
         "--lengths", "192", "--kinds", "relay_1,full", "--repeats", "1", "--dtype", "fp32"],
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["interpreted"]
    for row in report["rows"]:
        assert row["triton_ms"] > 0 and row["worst_diff"] <= TOLERANCE["fp32"], row
        assert row["triton_gated_ms"] > 0, row


def test_bench_refuses_a_relay_shorter_than_its_queries() -> None:
    from relaygr.bench.kernels import make_call

    with pytest.raises(ValueError, match="under the 192 queries"):
        make_call("tiny", "relay_1", 100, 1, torch.float32, "cpu", 0)


def test_the_chosen_configs_compile_for_hopper_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    # The interpreter runs no GPU lowering: this builds the sm_90 code of the large preset's relay.
    from relaygr.cli import main

    assert main(["bench", "kernels", "--build", "sm_90", "--presets", "large", "--lengths", "2048",
                 "--kinds", "relay_1", "--dtype", "bf16"]) == 0  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert row["config"]["head_group"] == 2 and row["config"]["splits"] > 1
    assert row["shared_bytes"] > 0


@pytest.mark.parametrize("name", ["indexed_users_split", "indexed_one_user", "indexed_full_causal"])
@pytest.mark.parametrize("width", ["longest", "capacity"])
def test_the_cpu_backend_reads_indexed_keys_as_packed_ones(name: str, width: str, monkeypatch) -> None:
    """The CPU backend through a row index == on the packed keys, with the dense layout as wide as
    the longest user (a CPU) or the batch's capacity (``max_k``: what a device lays out)."""
    from relaygr.workers.kernels import cpu

    if width == "capacity":
        monkeypatch.setattr(cpu, "_key_width", lambda batch: batch.max_k)
    for dtype in (torch.float32, torch.float64):
        q, k, v, batch, bias, params = make_case(CASES[name], dtype, "cpu")
        k_store, v_store, indexed = index_keys(k, v, batch)
        want = cpu.cpu_hstu_mha(q, k, v, batch, bias, params)
        got = cpu.cpu_hstu_mha(q, k_store, v_store, indexed, bias, params)
        assert got.dtype == dtype and got.shape == want.shape
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert float(want.abs().max()) > 0.1


@pytest.mark.parametrize("backend", ["oracle", "cpu", "triton"])
def test_a_bad_row_index_is_a_clear_error(backend: str) -> None:
    from relaygr.workers.kernels.cpu import cpu_hstu_mha
    from relaygr.workers.kernels.oracle import oracle_hstu_mha

    call = {"oracle": oracle_hstu_mha, "cpu": cpu_hstu_mha, "triton": hstu_forward}[backend]
    q, k, v, batch, bias, params = make_case(CASES["indexed_users_split"], torch.float32, "cpu")
    k_store, v_store, indexed = index_keys(k, v, batch)

    def with_rows(rows: torch.Tensor):
        return dataclasses.replace(indexed, k_rows=rows, scratch={})

    rows = indexed.k_rows
    assert rows is not None
    with pytest.raises(ValueError, match="k_rows has"):
        call(q, k_store, v_store, with_rows(rows[1:]), bias, params)
    with pytest.raises(ValueError, match="1-d int64"):
        call(q, k_store, v_store, with_rows(rows.to(torch.int32)), bias, params)
    with pytest.raises(ValueError, match="reads rows"):
        call(
            q, k_store, v_store, with_rows(torch.where(rows == rows[0], k_store.shape[0], rows)), bias, params
        )
    with pytest.raises(ValueError, match="reads rows"):
        call(q, k_store, v_store, with_rows(rows - 1 - int(rows.min())), bias, params)
    with pytest.raises(ValueError, match=r"key rows for|shapes do not agree"):
        call(q, k_store, v_store[1:], indexed, bias, params)
    with pytest.raises(ValueError, match="keys for a batch"):
        call(q, k_store, v_store, dataclasses.replace(indexed, k_rows=None, scratch={}), bias, params)
    if backend == "triton":
        with pytest.raises(ValueError, match="k_rows is on"):
            call(q, k_store, v_store, with_rows(rows.to("meta")), bias, params)


def test_the_paged_kernel_compiles_for_hopper_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from relaygr.cli import main

    assert main(["bench", "kernels", "--build", "sm_90", "--paged", "--presets", "large", "--lengths",
                 "8192", "--kinds", "relay_1", "--dtype", "bf16"]) == 0  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert row["config"]["splits"] > 1 and row["shared_bytes"] > 0


def test_the_nvidia_block_shape_compiles_for_hopper_without_spills(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Heads of 256 (hidden 1024, 4 heads): 64-query tiles spill 616 bytes, 32-query tiles none.
    from relaygr.cli import main

    assert main(["bench", "kernels", "--build", "sm_90", "--paged", "--presets", "nvidia-block", "--lengths",
                 "4096", "--kinds", "relay_1", "--dtype", "bf16"]) == 0  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert row["config"]["block_m"] == 32 and row["config"]["splits"] > 1
    if row["stack_bytes"] is not None:  # (where the cubin's resource use can be read)
        assert row["stack_bytes"] == 0


def test_the_sweep_lists_its_grid_without_timing(capsys: pytest.CaptureFixture[str]) -> None:
    from relaygr.bench.kernels import around
    from relaygr.cli import main
    from relaygr.workers.kernels.triton_hstu import KernelConfig

    assert main(["bench", "kernels", "--sweep", "--dry-run", "--presets", "large,nvidia-block", "--lengths",
                 "4096", "--kinds", "relay_1"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    grids = {r["preset"]: r["first_stage"] for r in rows}
    assert {tuple(c[:2]) for c in grids["large"]} >= {(64, 16), (128, 64), (32, 32)}
    assert {c[5] for c in grids["large"]} == {1, 2, 4} and {c[5] for c in grids["nvidia-block"]} == {1, 2}
    second = around(KernelConfig(64, 16, head_group=2), 44, "relay_1")
    assert {c.splits for c in second} == {0, 1, 11, 22, 88} and {c.row_terms for c in second} == {False, True}
    assert {c.splits for c in around(KernelConfig(), 8, "full")} == {0}


def test_the_anchor_refuses_the_full_shape_on_a_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench model --anchor`` (NVIDIA's block shape) is refused on a CPU without ``--quick``:
    the suite never runs it at size."""
    from relaygr.bench.model_anchor import ANCHOR, NVIDIA_MS, TARGET_MS
    from relaygr.cli import main
    from relaygr.workers.model.presets import preset

    assert main(["bench", "model", "--anchor", "--device", "cpu"]) == 2
    assert "--quick" in capsys.readouterr().err
    shape = preset("nvidia-block")
    assert (shape.layers, shape.dim, shape.heads) == (8, 1024, 4) and shape.config().attn_dim == 256
    assert ANCHOR["cached"] + ANCHOR["new"] == ANCHOR["history"] == 4096 and ANCHOR["candidates"] == 256
    assert NVIDIA_MS == {1: 0.18, 8: 0.5} and TARGET_MS == {1: 0.4, 8: 1.2}
