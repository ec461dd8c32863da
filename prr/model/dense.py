"""DenseAttention: the reference AttentionBackend (plain dense decode).

A per-layer KV cache that grows by concatenation, and exact softmax attention via
F.scaled_dot_product_attention with scale 1/sqrt(D). It is the accuracy reference for
every sparse backend and the parity backend against transformers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# enable_gqa (torch >= 2.5) attends grouped KV heads without materialising repeats.
_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """q: [B, Hq, Tq, D], k, v: [B, Hkv, Tk, D] -> [B, Hq, Tq, D]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if _HAS_ENABLE_GQA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, Hq, Tk, D]
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


class DenseAttention:
    """Exact attention over the whole cache. KV cache per layer: k, v [B, Hkv, S, D]."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers

    @classmethod
    def over(cls, keys: list[Tensor], values: list[Tensor], length: int) -> DenseAttention:
        """A backend whose cache holds the first `length` tokens of keys / values [B, Hkv, >= length, D]
        per layer (e.g. another engine's cache: the dense reference of its next step)."""
        attention = cls(len(keys))
        attention.k = [k[:, :, :length] for k in keys]
        attention.v = [v[:, :, :length] for v in values]
        return attention

    def reset(self) -> None:
        """Drop the cache (start a new sequence)."""
        self.k = [None] * self.num_layers
        self.v = [None] * self.num_layers

    @property
    def seq_len(self) -> int:
        """Tokens cached in layer 0 (every layer holds the same number after a full forward)."""
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [B, Hq, T, D], k, v: [B, Hkv, T, D] -> [B, Hq, T, D] (causal, from position 0)."""
        if self.k[layer] is not None:
            raise ValueError(
                f"prefill of layer {layer} on a non-empty cache ({self.k[layer].shape[2]} tokens); "
                "prefill starts at position 0: call reset() first"
            )
        self.k[layer], self.v[layer] = k.contiguous(), v.contiguous()
        return _sdpa(q, k, v, causal=True)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [B, Hq, D], k, v: [B, Hkv, D] -> [B, Hq, D]; appends k, v, attends all S tokens."""
        k, v = k[:, :, None], v[:, :, None]  # [B, Hkv, 1, D]
        if self.k[layer] is not None:
            k = torch.cat((self.k[layer], k), dim=2)  # [B, Hkv, S, D]
            v = torch.cat((self.v[layer], v), dim=2)
        self.k[layer], self.v[layer] = k, v
        # The newest query sees every cached token, itself included: no mask.
        return _sdpa(q[:, :, None], k, v, causal=False)[:, :, 0]  # [B, Hq, D]
