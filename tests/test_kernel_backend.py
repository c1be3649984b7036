"""Which HSTU attention backend runs: by device, forced in code, or named by the operator."""

from __future__ import annotations

import pytest
import torch

from relaygr.workers.kernels.interface import BACKEND_ENV, backend_for, use_backend


def test_cpu_tensors_run_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert backend_for(torch.zeros(1)) == "reference"


def test_the_operator_names_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert backend_for(torch.zeros(1)) == "reference"
    monkeypatch.setenv(BACKEND_ENV, "cuda-magic")
    with pytest.raises(ValueError, match="cuda-magic"):
        backend_for(torch.zeros(1))


def test_code_forces_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "cuda-magic")
    with use_backend("reference"):
        assert backend_for(torch.zeros(1)) == "reference"
