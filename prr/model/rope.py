"""Rotary position embeddings (RoPE), HF "rotate_half" layout.

Frequencies follow the transformers formulas for the scaling types we support (default,
linear, llama3) so our cos/sin match theirs bit for bit in fp32. The table is computed in
fp32 and cast to the activation dtype at use, as transformers does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from prr.model.config import validate_rope_scaling


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> Tensor:
    """Inverse frequencies: inv_freq [head_dim // 2], fp32."""
    validate_rope_scaling(scaling)
    # Same op order as transformers, so the fp32 values are identical.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [D/2]
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        # Linear (position interpolation): positions / factor == inv_freq / factor.
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    """Llama-3.1 scaling: keep high frequencies, divide low ones by `factor`, blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """positions: [T] (int) -> cos, sin: [T, D] fp32 (each frequency repeated for both halves)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x by its positions' angles.

    x: [..., T, D] (e.g. [B, H, T, D]) or [B, H, D] with cos/sin [1, D] -> same shape as x.
    cos, sin: [T, D] in x's dtype.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)  # rotate_half(x)
    return x * cos + rotated * sin


class RopeTable:
    """Lazily grown fp32 cos/sin table for positions [0, n), sliced per forward.

    The table lives on the device of the last request (rebuilt if the model moves) and grows
    by doubling, so decode steps are a slice and a cast.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [D/2] fp32, CPU
        self._cos: Tensor | None = None  # [N, D] fp32
        self._sin: Tensor | None = None

    def get(self, start: int, length: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin for positions [start, start + length): [length, D] in `dtype`."""
        end = start + length
        if self._cos is None or self._cos.device != device or self._cos.shape[0] < end:
            size = max(1024, 1 << (end - 1).bit_length())
            positions = torch.arange(size, device=device)
            self._cos, self._sin = rope_cos_sin(positions, self.inv_freq.to(device))
        return self._cos[start:end].to(dtype), self._sin[start:end].to(dtype)
