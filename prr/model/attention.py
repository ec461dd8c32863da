"""The seam between the decoder and whatever attends: the decoder computes post-RoPE
q/k/v and hands them to an AttentionBackend, which owns the KV cache.

The dense reference backend here is the plain decode (and the parity-test backend); the
DSA/PRR runtime (prr.runtime) is another backend with the same two methods.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class AttentionBackend(Protocol):
    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention over a prompt that starts at position 0.

        q: [B, Hq, T, D], k, v: [B, Hkv, T, D] (post-RoPE) -> out [B, Hq, T, D].
        The backend appends k, v to its cache.
        """
        ...

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One decode step: append k, v, then attend q over the whole cache.

        q: [B, Hq, D], k, v: [B, Hkv, D] (post-RoPE) -> out [B, Hq, D].
        """
        ...

    # Optional: `hidden_hook(prefill) -> Callable[[int, Tensor], None] | None`. A backend whose
    # selector reads each layer's normed hidden state (the lightning indexer) returns a callback
    # `(layer, x [B, T, hidden])` the decoder calls before that layer's attention; None: not needed.
