"""End of sequence, stated once: which ids end a sequence, and after how many decode steps a
batch has ended (every run driver path, scored tasks and the lm-eval model read them here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def eos_ids(config: Any) -> list[int]:
    """A model config's eos_token_id (an id, a list of ids as Llama 3.1 has, or None) -> its ids."""
    eos = config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]


def steps_until_eos(inputs: torch.Tensor, eos: Sequence[int] | torch.Tensor) -> int | None:
    """inputs: [B, n] tokens read by steps 0..n-1 -> how many steps a decode runs before it
    stops (after the first step by which every row has read an EOS), or None if not yet."""
    ids = torch.as_tensor(eos, dtype=inputs.dtype, device=inputs.device)
    seen = torch.isin(inputs, ids).int().cummax(1).values.min(0).values  # [n]: all rows have seen one
    return int(seen.argmax()) + 1 if bool(seen.any()) else None
