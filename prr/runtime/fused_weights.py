"""The graph engine's projection weights for the fused path (plan.projections="fused":
prr.kernels.dense_gemv): each layer's q|k|v, o, gate|up and down weights fused
(`fuse_layer_weights`), and at batch 1 a copy of q|k|v with the q and k rows in RoPE pair order
for the one-launch projection + RoPE + cache append (prr.kernels.qkv_append)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from prr.model.decoder import Decoder
from prr.model.layer_math import fuse_layer_weights


class FusedWeights:
    """Per layer fused weights of `model` (`layers`), shared by every view of one engine."""

    def __init__(self, model: Decoder) -> None:
        self.model = model
        self.layers = fuse_layer_weights(model)
        self.eps = model.config.rms_norm_eps
        # paired_qkv's copy and the weight versions it was made from
        self.paired: list[tuple[Tensor, Tensor | None]] | None = None
        self.versions: list = []

    def paired_qkv(self, permutation: Callable[[], Tensor], device: torch.device) -> list[tuple[Tensor, Tensor | None]]:
        """Per layer (wqkv [(Hq + 2 Hkv) D, H], bqkv [(Hq + 2 Hkv) D] or None) with its rows in the
        order `permutation()` gives (prr.kernels.qkv_append.rope_pair_permutation: the q and k rows
        of every head in RoPE pair order; called only when the copy is (re)built, never inside a
        capture, where its host-to-device copy is not allowed): what the one-launch projection +
        append reads. A copy (the q|k|v weights twice in memory, ~1.6 GB for Llama-3.1-8B in bf16),
        since the torch path and batch > 1 read `layers[i].wqkv` as it is; built on first need, and
        re-copied in place (captured graphs keep their pointers) when the model's q|k|v weights were
        edited in place since (tensor versions)."""
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        # The fused q|k|v weight and the module parameters that are views of it (`.data` views:
        # an in-place edit through either bumps only its own version counter).
        versions = [tuple(t._version for t in (w.wqkv, w.bqkv, *layer.self_attn.q_proj.parameters(),
                                               *layer.self_attn.k_proj.parameters(),
                                               *layer.self_attn.v_proj.parameters()) if t is not None)
                    for w, layer in zip(self.layers, self.model.model.layers, strict=True)]
        if self.paired is not None and versions == self.versions:
            return self.paired
        if capturing:
            raise RuntimeError("the paired q|k|v weights are (re)built before use: run a step before capturing "
                               "(capture() warms up first), or call paired_qkv_weights()")
        order = permutation().to(device)  # [(Hq + 2 Hkv) D] row ids
        with torch.no_grad():
            if self.paired is None:
                self.paired = [(w.wqkv[order], None if w.bqkv is None else w.bqkv[order]) for w in self.layers]
            else:  # the model changed in place: refresh the copy where it is
                for w, (pw, pb) in zip(self.layers, self.paired, strict=True):
                    torch.index_select(w.wqkv, 0, order, out=pw)
                    if pb is not None:
                        torch.index_select(w.bqkv, 0, order, out=pb)
        self.versions = versions
        return self.paired
