"""The decoder layer's dense math, written once: `Decoder.layers` runs it for the eager
runtime (prefill and decode, any T) and the graph engine runs the same functions (its torch
path, torch.compile'd on a GPU: the pointwise work around the GEMVs becomes a few generated
kernels instead of dozens of tiny ones).

Per layer, before attention: the previous layer's MLP residual add, RMSNorm, one q|k|v
projection (one GEMM instead of three; RoPE is the attention side's); after attention: o_proj
+ residual, RMSNorm, one gate|up projection, SiLU·up, down (its residual add is the next
layer's, or final_norm's). The fused weights are views the modules share
(`fuse_layer_weights` re-points each module's weight into them, so nothing is stored twice).
The Triton GEMV path (prr.kernels.dense_gemv) is another backend of the same math, tested
equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:  # (the decoder imports this module)
    from prr.model.decoder import Decoder


@dataclass(frozen=True)
class FusedLayer:
    ln1: Tensor  # [H]
    wqkv: Tensor  # [(Hq + 2 Hkv) D, H]
    bqkv: Tensor | None  # [(Hq + 2 Hkv) D]
    wo: Tensor  # [H, Hq D]
    bo: Tensor | None  # [H]
    ln2: Tensor  # [H]
    w_gate_up: Tensor  # [2 I, H]
    b_gate_up: Tensor | None  # [2 I]
    w_down: Tensor  # [H, I]
    b_down: Tensor | None  # [H]


def _fuse(modules: list) -> tuple[Tensor, Tensor | None]:
    """Concatenate the modules' weights (and biases) along the output dim and make each
    module's parameters views of the result."""
    weight = torch.cat([m.weight.data for m in modules])
    has_bias = [m.bias is not None for m in modules]
    if any(has_bias) and not all(has_bias):
        raise ValueError("cannot fuse projections where only some have a bias")
    bias = torch.cat([m.bias.data for m in modules]) if all(has_bias) else None
    start = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[start:start + n]
        if bias is not None:
            m.bias.data = bias[start:start + n]
        start += n
    return weight, bias


@torch.no_grad()
def fuse_layer_weights(model: Decoder) -> list[FusedLayer]:
    """The model's layers with fused projections (done once per model; later calls reuse it;
    loading a state dict drops it, see Decoder._retie)."""
    cached = getattr(model, "fused_layers", None)
    if cached is not None:
        return cached
    # Built outside inference mode even when the first forward runs inside it (the eager
    # prefill): the module parameters become views of these, and inference tensors would
    # stay so for every later use (no version counter, no autograd).
    with torch.inference_mode(False):
        out = _fused_layers_of(model)
    model.fused_layers = out
    return out


def _fused_layers_of(model: Decoder) -> list[FusedLayer]:
    out = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        wqkv, bqkv = _fuse([a.q_proj, a.k_proj, a.v_proj])
        w_gate_up, b_gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
        out.append(FusedLayer(
            ln1=layer.input_layernorm.weight.data, wqkv=wqkv, bqkv=bqkv,
            wo=a.o_proj.weight.data, bo=None if a.o_proj.bias is None else a.o_proj.bias.data,
            ln2=layer.post_attention_layernorm.weight.data, w_gate_up=w_gate_up, b_gate_up=b_gate_up,
            w_down=mlp.down_proj.weight.data, b_down=None if mlp.down_proj.bias is None else mlp.down_proj.bias.data,
        ))
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [..., H]. Normalise in fp32, cast back before the weight (as transformers does)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def pre_attention(x: Tensor, delta: Tensor, ln1: Tensor, wqkv: Tensor, bqkv: Tensor | None, eps: float,
                  heads: int, d: int) -> tuple[Tensor, Tensor]:
    """x: [B, T, H] residual stream without the previous layer's MLP output delta [B, T, H]
    (zeros for the first layer) -> (x + delta, qkv [B, T, heads = Hq + 2 Hkv, D] before RoPE).
    The residual add happens here, inside the norm's kernel (one launch fewer per layer);
    RoPE is the attention side's (the engine's cache append, the decoder's rope table)."""
    x = x + delta
    return x, F.linear(rms_norm(x, ln1, eps), wqkv, bqkv).view(*x.shape[:-1], heads, d)


def post_attention(x: Tensor, attn: Tensor, wo: Tensor, bo: Tensor | None, ln2: Tensor, w_gate_up: Tensor,
                   b_gate_up: Tensor | None, w_down: Tensor, b_down: Tensor | None, eps: float,
                   reduce: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """x: [B, T, H] residual stream, attn: [B, T, Hq D] -> (x + o_proj(attn), the MLP's output
    [B, T, H]): the caller adds the MLP output (the next layer's pre_attention, or final_norm).
    reduce: tensor parallelism's all-reduce (prr.model.tensor_parallel): o_proj and down see a
    rank's share of heads / FFN columns, so their outputs are partial sums over ranks."""
    reduce = reduce or _identity
    x = x + reduce(F.linear(attn, wo, bo))
    gate, up = F.linear(rms_norm(x, ln2, eps), w_gate_up, b_gate_up).chunk(2, dim=-1)
    return x, reduce(F.linear(F.silu(gate) * up, w_down, b_down))


def _identity(x: Tensor) -> Tensor:
    return x


def final_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The last layer's residual add and the model's final RMSNorm: x, delta [B, T, H] -> [B, T, H]."""
    return rms_norm(x + delta, weight, eps)
