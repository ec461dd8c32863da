"""Programmatic dependent launch (PDL) on sm_90+ GPUs, opt-in: PRR_PDL=1.

A kernel launched with PDL may be scheduled while the kernel before it on the stream is still
running; the decode step's kernels (append, Quest score, top-k rows, split / per-block
attention, merges, repair plan, fused projections) start with `pdl_prologue(PDL)`: it waits
for its predecessor to finish and flush (griddepcontrol.wait), then lets its own successor
launch. Before the wait a kernel may read only what no earlier kernel writes: the fused
projections (dense_gemv) request their first weight tile there, so model weights must not be
written by the decode step (they are not). Everything else happens after the wait, so
results are those of plain launches. At batch 1 the decode step is ~450 short kernels with ~0.4 µs gaps
between them (profile_decode): the gaps are what PDL is for. On the H200 (128K, batch 1) it
measured within run-to-run noise, so it stays off: with / without, ms per token, two runs:
block 64 5.33 / 5.38 and 5.46 / 5.35; block 16 5.91 / 5.95 and 5.91 / 5.96. The GPU tests
pass with it on and off.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def enabled(device) -> bool:
    """PDL for launches on `device` (a torch.device): PRR_PDL=1, CUDA sm_90+, compiled kernels
    (not the interpreter). (torch is imported here only: the *_jit modules stay torch-free.)"""
    if os.environ.get("PRR_PDL", "0") != "1" or device.type != "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    import torch

    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_kwargs(device) -> dict:
    """Keyword arguments for a kernel launch: the PDL constexpr, and the launch option when on."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()  # the predecessor's writes are visible from here on
        tl.extra.cuda.gdc_launch_dependents()  # the successor may be scheduled (it waits likewise)
