"""Programmatic dependent launch is opt-in (PRR_PDL=1) and never reaches the interpreter or a CPU."""

from __future__ import annotations

import torch
from prr.kernels import pdl


def test_pdl_is_opt_in_and_off_the_gpu(monkeypatch):
    monkeypatch.delenv("PRR_PDL", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not pdl.enabled(torch.device("cuda"))  # off unless asked for
    monkeypatch.setenv("PRR_PDL", "1")
    assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}  # no CUDA device
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda"))  # the interpreter cannot run griddepcontrol
