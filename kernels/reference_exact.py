"""Torch reference and seeded input generator for the `exact` selection kernels
(`prr.kernels.exact`).

The reference follows prr's own definition: `ExactSelector.head_scores` is
`prr.block_attention.attend_dense`'s block mass (the softmax of scale·q·k over each row's whole
context, summed per block), reduced over the GQA group as `Selector.select` does; here in fp64.
"""

from __future__ import annotations

import torch
from torch import Tensor


def exact_scores_reference(q: Tensor, keys: Tensor, lengths: Tensor, num_blocks: Tensor, block_size: int,
                           scale: float, gqa_reduce: str = "max") -> Tensor:
    """q: [B, Hq, D]; keys: [B, Hkv, T_max, D]; lengths, num_blocks: [B]
    -> [B, Hkv, NB_max] fp32 (fp64 arithmetic): GQA-reduced block mass, -inf from num_blocks on."""
    batch, num_kv_heads, max_tokens, head_dim = keys.shape
    group = q.shape[1] // num_kv_heads
    max_blocks = max_tokens // block_size
    qg = q.double().view(batch, num_kv_heads, group, head_dim)
    scores = (qg @ keys.double().transpose(-1, -2)) * scale  # [B, Hkv, G, T_max]
    live = torch.arange(max_tokens, device=q.device) < lengths.to(q.device).long().view(batch, 1, 1, 1)
    scores = scores.masked_fill(~live, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))  # 0 past the context
    mass = probs.view(batch, num_kv_heads, group, max_blocks, block_size).sum(-1)  # [B, Hkv, G, NB]
    reduced = mass.sum(2) if gqa_reduce == "sum" else mass.amax(2)
    outside = torch.arange(max_blocks, device=q.device) >= num_blocks.to(q.device).long().view(batch, 1, 1)
    return reduced.float().masked_fill(outside, float("-inf"))


def make_exact_inputs(
    batch: int = 2,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    max_blocks: int = 27,
    lengths: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, Tensor]:
    """Random exact-selection inputs: q [B, Hq, D] and keys [B, Hkv, NB_max * block_size, D] in
    dtype (keys past each row's length are random too: the kernels must mask them), lengths [B]
    int32 (default: every row full), num_blocks [B] int32 = cdiv(lengths, block_size). q is
    scaled by 2, so block masses spread over a few orders of magnitude (distinct: no ties)."""
    g = torch.Generator().manual_seed(seed)
    max_tokens = max_blocks * block_size
    lengths = [max_tokens] * batch if lengths is None else list(lengths)
    q = (torch.randn(batch, num_q_heads, head_dim, generator=g) * 2.0).to(dtype)
    keys = torch.randn(batch, num_kv_heads, max_tokens, head_dim, generator=g).to(dtype)
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    return {
        "q": q.to(device),
        "keys": keys.to(device),
        "lengths": lengths_t.to(device),
        "num_blocks": ((lengths_t + block_size - 1) // block_size).to(torch.int32).to(device),
    }
