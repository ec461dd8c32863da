"""Torch references and seeded input generators for the lightning indexer's kernels
(kernels/indexer_keys.py: the index-key append; kernels/indexer_score.py: the scores;
kernels/indexer_step.py: a decode step's query, head weights and key from its projection).

The indexer (DeepSeek-V3.2's DSA; GLM-5, DeepSeek-V4) scores every cached token t of a row b
against H_I index heads with one index key per token, shared by the heads:
    score[b, t] = Σ_h w[b, h] · ReLU(q[b, h, :] · k[b, t, :])   for t < lengths[b],  -inf beyond.
Index keys are kept in bf16, or in fp8 e4m3 with one fp32 scale per token (absmax / 448, so a
token costs d_I + 4 bytes: 132 at d_I = 128, DeepSeek's layout); with fp8 the dot product is
multiplied by the token's scale. q stays bf16 or fp32. Static shapes, no host syncs (the
references may run inside CUDA graphs too). Imports nothing from prr and nothing from triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
INDEX_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def rope_leading(x: Tensor, cos: Tensor, sin: Tensor, rope_dim: int) -> Tensor:
    """RoPE (rotate-half) on the first rope_dim dims of x [..., d] fp32, the rest unchanged.
    cos, sin: [..., rope_dim] fp32, broadcast against x's leading dims (each frequency repeated
    for both halves: prr.model.rope.rope_cos_sin's layout)."""
    if rope_dim == 0:
        return x
    half = rope_dim // 2
    x1, x2 = x[..., :half], x[..., half:rope_dim]
    rotated = torch.cat((-x2, x1), dim=-1)  # rotate_half
    return torch.cat((x[..., :rope_dim] * cos + rotated * sin, x[..., rope_dim:]), dim=-1)


def index_rope_angles(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """positions [...] int, inv_freq [rope_dim // 2] fp32 -> cos, sin [..., rope_dim] fp32 (the angle
    position · inv_freq, one fp32 product, as kernels/indexer_step_jit.py forms it)."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(torch.float32)  # [..., rope_dim // 2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def index_keys_from_projection(projected: Tensor, cos: Tensor, sin: Tensor, norm_weight: Tensor, norm_bias: Tensor,
                               eps: float, rope_dim: int) -> Tensor:
    """The index key of each token from its projection x W_kᵀ: projected [..., d_I] (any float
    dtype), cos/sin [..., rope_dim] -> k_I [..., d_I] fp32 = RoPE(LayerNorm(projected)), in fp32."""
    k = F.layer_norm(projected.float(), (projected.shape[-1],), norm_weight.float(), norm_bias.float(), eps)
    return rope_leading(k, cos, sin, rope_dim)


def indexer_step_reference(projection: Tensor, positions: Tensor, inv_freq: Tensor, norm_weight: Tensor,
                           norm_bias: Tensor, eps: float, index_heads: int, index_dim: int,
                           rope_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Reference for kernels.indexer_step.indexer_step_inputs: a decode step's indexer inputs from
    one projection of each row's normed hidden state x by the stacked weights [W_q; W_k; W_w]:
    projection [B, H_I·d_I + d_I + H_I] (the model's dtype), positions [B] int, inv_freq
    [rope_dim // 2] fp32 -> (q_I [B, H_I, d_I], w [B, H_I], k_I [B, d_I]), all fp32, computed in
    fp32: q_I = RoPE(x W_qᵀ), w = x W_wᵀ, k_I = RoPE(LayerNorm(x W_kᵀ)) (RoPE on the leading
    rope_dim dims at each row's position)."""
    b, q_width = projection.shape[0], index_heads * index_dim
    if projection.shape[1] != q_width + index_dim + index_heads:
        raise ValueError(f"projection must be [B, H_I*d_I + d_I + H_I]=[{b}, {q_width + index_dim + index_heads}]; "
                         f"got {tuple(projection.shape)}")
    cos, sin = index_rope_angles(positions, inv_freq[: rope_dim // 2])  # [B, rope_dim]
    q = projection[:, :q_width].float().view(b, index_heads, index_dim)
    q = rope_leading(q, cos.unsqueeze(1), sin.unsqueeze(1), rope_dim)
    k = index_keys_from_projection(projection[:, q_width : q_width + index_dim], cos, sin, norm_weight, norm_bias,
                                   eps, rope_dim)
    return q, projection[:, q_width + index_dim :].float(), k


def quantize_index_keys_reference(k: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token fp8 e4m3 quantization of index keys: k [N, d_I] (any float dtype; any leading
    dims) -> (fp8 [N, d_I] float8_e4m3fn, scale [N] fp32), so k ≈ fp8 · scale. The arithmetic, in
    fp32 on every device: scale = fp32(k).abs().max() / 448 and fp8 = e4m3(clamp(fp32(k) / scale, ±448)),
    each division IEEE-rounded to fp32, e4m3() torch's round to nearest even (the sign kept: a negative
    entry that rounds to zero is -0.0, byte 0x80). An all-zero key gets scale 0 and fp8 zeros (no 0 / 0).
    kernels/indexer_keys.index_key_append stores the same bytes and scales."""
    k32 = k.float()
    absmax = k32.abs().amax(-1, keepdim=True)  # [N, 1]
    # The divisor a tensor on k's device: torch's CUDA `tensor / python float` multiplies by the
    # rounded reciprocal instead (a scale one ulp off for about half the tokens, and other bytes).
    scale = absmax / torch.full_like(absmax, FP8_MAX)  # [N, 1]
    scaled = torch.where(scale > 0, k32 / scale, torch.zeros_like(k32))
    # |k / scale| <= 448 up to one rounding of the division: the clamp keeps it finite in e4m3.
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.squeeze(-1)


def dequantize_index_keys_reference(keys: Tensor, scales: Tensor | None) -> Tensor:
    """keys [..., d_I] bf16 (scales None) or fp8 (scales [...] fp32) -> fp32 [..., d_I] as the scores see them."""
    if scales is None:
        return keys.float()
    return keys.float() * scales.float().unsqueeze(-1)


def index_key_append_reference(key_cache: Tensor, key_scales: Tensor | None, k_new: Tensor,
                               positions: Tensor) -> None:
    """key_cache [B, T_max, d_I] (bf16, or fp8 with key_scales [B, T_max] fp32) <- k_new [B, d_I]
    at positions [B] (each in [0, T_max)), in place: cast to bf16, or quantized per token
    (quantize_index_keys_reference)."""
    rows, pos = torch.arange(key_cache.shape[0], device=key_cache.device), positions.long()
    if key_scales is None:
        key_cache[rows, pos] = k_new.to(key_cache.dtype)
        return
    fp8, scale = quantize_index_keys_reference(k_new)
    key_cache[rows, pos] = fp8
    key_scales[rows, pos] = scale


def indexer_scores_reference(q: Tensor, weights: Tensor, keys: Tensor, scales: Tensor | None, lengths: Tensor,
                             compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """Reference for kernels.indexer_score.indexer_scores (same arguments and shapes).

    q: [B, H_I, d_I] bf16/fp32; weights: [B, H_I] fp32; keys: [B, T_max, d_I] bf16, or fp8 with
    scales [B, T_max] fp32 (None for bf16); lengths: [B] int.
    -> scores [B, T_max] fp32: Σ_h w[b, h] · ReLU(scale[b, t] · (q[b, h] · k[b, t])) for t < lengths[b],
    -inf from lengths[b] on. The dot product, ReLU and weighted sum run in compute_dtype (float64 for
    tests; float32 or bfloat16 as the torch baseline on the GPU: bf16 multiplies bf16 operands into
    bf16 dot products, as a torch user's bf16 matmul would, and sums the heads in fp32).
    """
    k = keys.to(compute_dtype)  # [B, T_max, d_I]
    dots = torch.einsum("btd,bhd->bth", k, q.to(compute_dtype))  # [B, T_max, H_I]
    if scales is not None:
        dots = dots * scales.to(compute_dtype).unsqueeze(-1)
    accumulate = torch.float32 if compute_dtype == torch.bfloat16 else compute_dtype
    per_token = (torch.relu(dots).to(accumulate) * weights.to(accumulate).unsqueeze(1)).sum(-1)  # [B, T_max]
    live = torch.arange(keys.shape[1], device=keys.device) < lengths.to(keys.device).long().unsqueeze(-1)
    return per_token.masked_fill(~live, float("-inf")).float()


@dataclass
class IndexerInputs:
    q: Tensor  # [B, H_I, d_I] bf16/fp32 index queries
    weights: Tensor  # [B, H_I] fp32 head weights (either sign, as DeepSeek's projection gives)
    keys: Tensor  # [B, T_max, d_I] bf16 or float8_e4m3fn index keys
    scales: Tensor | None  # [B, T_max] fp32 per-token scales (fp8), None (bf16)
    lengths: Tensor  # [B] int32 valid tokens per row

    def args(self) -> tuple:
        """Positional arguments of indexer_scores / indexer_scores_reference."""
        return self.q, self.weights, self.keys, self.scales, self.lengths


def random_indexer_inputs(
    seed: int,
    lengths: list[int],
    num_heads: int,
    head_dim: int,
    index_dtype: str = "bf16",
    q_dtype: torch.dtype = torch.float32,
    extra_tokens: int = 0,
    garbage: float = 50.0,
    device: torch.device | str = "cpu",
) -> IndexerInputs:
    """Fresh random inputs for one indexer scoring step.

    lengths: tokens per batch row (ragged); T_max = max(lengths) + extra_tokens. Keys are normal
    (quantized per token for fp8); slots past a row's length hold `garbage`-scaled keys (fp8: scales),
    so a kernel that reads them is caught. q is normal, so about half the dot products are negative
    (ReLU matters); weights are normal / sqrt(H_I), of either sign.
    """
    if index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype={index_dtype!r} is not one of {list(INDEX_DTYPES)}")
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    batch, max_tokens = len(lengths), max(lengths, default=0) + extra_tokens
    dead = torch.arange(max_tokens, device=device) >= torch.tensor(lengths, device=device).view(-1, 1)
    k = torch.randn(batch, max_tokens, head_dim, generator=g, device=device)
    k = k * torch.where(dead, garbage, 1.0).unsqueeze(-1)  # [B, T_max, d_I]
    q = torch.randn(batch, num_heads, head_dim, generator=g, device=device).to(q_dtype)
    weights = torch.randn(batch, num_heads, generator=g, device=device) * num_heads**-0.5
    if index_dtype == "bf16":
        keys, scales = k.to(torch.bfloat16), None
    else:
        keys, scales = quantize_index_keys_reference(k)
    return IndexerInputs(q=q, weights=weights, keys=keys, scales=scales,
                         lengths=torch.tensor(lengths, dtype=torch.int32, device=device))


def empty_index_cache(batch: int, max_tokens: int, head_dim: int, index_dtype: str = "bf16",
                      device: torch.device | str = "cpu") -> tuple[Tensor, Tensor | None]:
    """A zeroed index-key cache: (keys [B, T_max, d_I] bf16 or fp8, scales [B, T_max] fp32 or None)."""
    if index_dtype not in INDEX_DTYPES:
        raise ValueError(f"index_dtype={index_dtype!r} is not one of {list(INDEX_DTYPES)}")
    keys = torch.zeros(batch, max_tokens, head_dim, dtype=INDEX_DTYPES[index_dtype], device=device)
    scales = None if index_dtype == "bf16" else torch.zeros(batch, max_tokens, device=device)
    return keys, scales
