"""What one decode step reports: its stage names and one typed record per (step, layer), which
the runtime hands to metrics, sinks and budgets (the runtime never logs). Below the runtime, so
that budgets and metrics read it without importing the runtime."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

# The PRR step's stages, the same words everywhere (timers, records, summaries).
STAGES = ("predict", "speculate", "select", "repair", "merge")


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
