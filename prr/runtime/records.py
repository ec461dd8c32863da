"""Typed records a decode step hands to metrics and sinks (the runtime never logs)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class LayerStepRecord:
    step: int  # decode step (0 = first generated token after the prompt)
    layer: int
    context_tokens: int
    selected: Tensor  # [B, Hkv, max_blocks] bool: A_t
    predicted: Tensor  # [B, Hkv, max_blocks] bool: P_t
    previous: Tensor | None  # [B, Hkv, max_blocks] bool: A_{t-1} (None if unknown)
    ranked_at_k: Tensor | None  # [B, Hkv, max_blocks] bool: the predictor's top-|A| blocks, whatever the budget
    budget_blocks: int  # |P| the budget asked for
    timings: dict[str, float]  # seconds per stage (predict, speculate, select, repair, merge)
    block_mass: Tensor | None  # [B, Hkv, max_blocks] dense attention mass per block (mean over the group)
    output_relerr: Tensor | None  # [B, Hkv] ‖sparse − dense‖/‖dense‖ of the attention output
    serial_relerr: Tensor | None  # [B, Hkv] ‖PRR − serial DSA‖/‖serial DSA‖ (runtime.check_serial)
