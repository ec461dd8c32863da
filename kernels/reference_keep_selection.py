"""Torch reference for kernels/keep_selection.py: a layer's A kept for reuse=steps in its static
buffers (what `ReusedSelections.keep` ran as torch ops before the kernel: four launches a layer).

Static shapes, no host syncs: the graph engine's torch backend runs it
(prr.runtime.engine_ops.TorchOps) and the kernel tests compare against it.
Imports nothing from prr and nothing from triton.
"""

from __future__ import annotations

from torch import Tensor


def keep_selection_reference(indices: Tensor, count: Tensor, scores: Tensor | None, out_indices: Tensor,
                             out_count: Tensor, out_scores: Tensor | None) -> None:
    """indices [B, Hkv, C] (copied as they are, padding past count included) -> out_indices
    [B, Hkv, width] int32 (zeros past C; width >= C); count [B, Hkv] -> out_count [B, Hkv] int32;
    scores [B, Hkv, NB] -> out_scores [B, Hkv, NB] fp32, skipped when scores is None. In place."""
    capacity, width = indices.shape[-1], out_indices.shape[-1]
    if width < capacity:
        raise ValueError(f"out_indices' width={width} must be >= C={capacity} (it holds A, then zeros)")
    out_indices[..., :capacity].copy_(indices)
    if capacity < width:
        out_indices[..., capacity:].zero_()
    out_count.copy_(count)
    if scores is not None:
        if out_scores is None:
            raise ValueError("scores were given without out_scores: pass the buffer they are kept in")
        out_scores.copy_(scores)
