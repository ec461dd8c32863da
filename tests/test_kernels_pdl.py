"""Programmatic dependent launch is for compiled kernels on a GPU only; PRR_PDL=0 turns it off."""

from __future__ import annotations

import torch
from prr.kernels import pdl


def test_pdl_is_off_the_gpu_in_the_interpreter_and_when_disabled(monkeypatch):
    monkeypatch.delenv("PRR_PDL", raising=False)
    assert pdl.launch_kwargs(torch.device("cpu")) == {"PDL": False}  # no CUDA device
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda"))  # the interpreter cannot run griddepcontrol
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("PRR_PDL", "0")
    assert not pdl.enabled(torch.device("cuda"))
