"""Torch references and seeded input generator for LESS's kernels (`prr.kernels.less`): the
compensation and the decode token's metadata update.

The reference follows prr's own `LessSelector.compensation` (prr/selectors/less.py) step by
step, in fp64: the selected blocks' summaries brought to the totals' offsets and subtracted
from the totals, the query's log-features, the estimated mass and numerator, and the state
(out, lse) with the same rule for dropping it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .reference_merge import lse_merge, lse_merge_many


def query_log_features(q: Tensor, w: Tensor, scale: float) -> Tensor:
    """Random features of q: [B, Hkv, G, D], w [Hkv, m, D] -> log φ(q) [B, Hkv, G, m] fp64."""
    x = q.double() * math.sqrt(scale)
    return x @ w.double().transpose(-1, -2) - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(w.shape[1])


def less_compensation_reference(
    q: Tensor, w: Tensor | None, indices: Tensor, counts: Tensor, lengths: Tensor, block_size: int,
    big: Tensor, small: Tensor, offset: Tensor, big_tot: Tensor, small_tot: Tensor, offset_tot: Tensor,
    center: Tensor, scale: float, q_logits: Tensor | None = None, min_relative_mass: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Arguments as prr.kernels.less.less_compensation -> (out [B, Hkv, G, D], lse [B, Hkv, G]) fp32
    (fp64 arithmetic)."""
    b, h, c = indices.shape
    m, d = big.shape[3], big.shape[4]
    max_blocks = big.shape[2]
    valid = torch.arange(c, device=q.device) < counts.long().unsqueeze(-1)  # [B, Hkv, C]
    index = indices.long().unsqueeze(-1)  # [B, Hkv, C, 1]
    c_tot = offset_tot.double()
    rescale = torch.exp(torch.gather(offset.double(), 2, index.expand(b, h, c, m)) - c_tot.unsqueeze(2))
    rescale = rescale * valid.unsqueeze(-1)
    sel_small = (torch.gather(small.double(), 2, index.expand(b, h, c, m)) * rescale).sum(2)  # [B, Hkv, m]
    sel_big = (torch.gather(big.double(), 2, index.unsqueeze(-1).expand(b, h, c, m, d)) * rescale.unsqueeze(-1)).sum(2)
    rest_small = (small_tot.double() - sel_small).clamp(min=0)
    rest_big = big_tot.double() - sel_big
    logits = q_logits.double() if q_logits is not None else query_log_features(q, w, scale)
    log_w = logits + c_tot.unsqueeze(2)  # [B, Hkv, G, m]
    top = log_w.amax(-1, keepdim=True)
    weights = torch.exp(log_w - top)
    mass = (weights * rest_small.unsqueeze(2)).sum(-1)  # [B, Hkv, G]
    total = (weights * small_tot.double().unsqueeze(2)).sum(-1)
    numerator = weights @ rest_big  # [B, Hkv, G, D]
    num_blocks = (lengths.long() + block_size - 1) // block_size
    selected = torch.zeros(b, h, max_blocks + 1, dtype=torch.bool, device=q.device)
    selected.scatter_(2, torch.where(valid, indices.long(), max_blocks), True)
    inside = torch.arange(max_blocks, device=q.device) < num_blocks.view(b, 1, 1)
    unselected = (inside & ~selected[..., :max_blocks]).any(-1)  # [B, Hkv]
    use = unselected.unsqueeze(-1) & (mass > min_relative_mass * total)
    safe_mass = torch.where(use, mass, torch.ones_like(mass))
    out = torch.where(use.unsqueeze(-1), numerator / safe_mass.unsqueeze(-1), torch.zeros_like(numerator))
    exact = scale * (q.double() * center.double().unsqueeze(2)).sum(-1)
    lse = torch.where(use, top.squeeze(-1) + torch.log(safe_mass) + exact, torch.full_like(mass, float("-inf")))
    return out.float(), lse.float()


def less_compensate_merge_reference(
    q: Tensor, w: Tensor | None, indices: Tensor, counts: Tensor, lengths: Tensor, block_size: int,
    big: Tensor, small: Tensor, offset: Tensor, big_tot: Tensor, small_tot: Tensor, offset_tot: Tensor,
    center: Tensor, scale: float, part_out: Tensor, part_lse: Tensor, q_logits: Tensor | None = None,
    min_relative_mass: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Arguments as prr.kernels.less.less_compensate_merge -> (out [B, Hq, D], lse [B, Hq]) fp32 (fp64
    arithmetic): the split partials merged (merge_many), then merged with the compensation's state
    (merge), as prr's Selector.compensated does."""
    b, h, g, d = q.shape
    if part_out.dim() == 3:
        part_out, part_lse = part_out.unsqueeze(2), part_lse.unsqueeze(2)
    comp_out, comp_lse = less_compensation_reference(q, w, indices, counts, lengths, block_size, big, small, offset,
                                                     big_tot, small_tot, offset_tot, center, scale, q_logits,
                                                     min_relative_mass)
    att_out, att_lse = lse_merge_many(part_out.double(), part_lse.double())  # [B, Hq, D], [B, Hq]
    out, lse = lse_merge(att_out, att_lse, comp_out.double().reshape(b, h * g, d), comp_lse.double().reshape(b, h * g))
    return out.float(), lse.float()


def make_partials(batch: int, num_q_heads: int, splits: int, head_dim: int, empty: int = 1, seed: int = 0) -> tuple:
    """Random split partials of an attention over A: out [B, Hq, S, D] fp32, lse [B, Hq, S] fp32 around
    LESS-like magnitudes, the last `empty` splits of every head empty (lse -inf, out 0: padding splits)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(batch, num_q_heads, splits, head_dim, generator=g)
    lse = 3.0 * torch.randn(batch, num_q_heads, splits, generator=g) + 2.0
    if empty:
        out[..., splits - empty:, :] = 0.0
        lse[..., splits - empty:] = float("-inf")
    return out, lse


def make_less_inputs(
    batch: int = 2,
    num_kv_heads: int = 2,
    group: int = 3,
    head_dim: int = 64,
    num_features: int = 24,
    block_size: int = 16,
    max_blocks: int = 11,
    lengths: list[int] | None = None,
    counts: list[int] | None = None,
    capacity: int = 4,
    q_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict:
    """Consistent random LESS state, built as prr's LessSelector builds it (in fp64, stored fp32):
    random keys and values of each row's first `lengths` tokens, centred on their mean, random
    features w, per-block summaries at per-block offsets and totals at running-max offsets
    (blocks past the context zero with offset -inf); A: `counts` distinct random blocks per
    (row, KV head) inside the context (default: about half, at most capacity), ascending, padded
    with 0. -> the keyword arguments of less_compensation (scale 1/sqrt(D))."""
    g = torch.Generator().manual_seed(seed)
    max_tokens = max_blocks * block_size
    lengths = [max_tokens] * batch if lengths is None else list(lengths)
    scale = 1.0 / math.sqrt(head_dim)
    keys = torch.randn(batch, num_kv_heads, max_tokens, head_dim, generator=g, dtype=torch.float64)
    values = torch.randn(batch, num_kv_heads, max_tokens, head_dim, generator=g, dtype=torch.float64)
    w = torch.randn(num_kv_heads, num_features, head_dim, generator=g, dtype=torch.float64)
    q = torch.randn(batch, num_kv_heads, group, head_dim, generator=g, dtype=torch.float64).to(q_dtype)
    center = torch.zeros(batch, num_kv_heads, head_dim, dtype=torch.float64)
    big = torch.zeros(batch, num_kv_heads, max_blocks, num_features, head_dim, dtype=torch.float64)
    small = torch.zeros(batch, num_kv_heads, max_blocks, num_features, dtype=torch.float64)
    offset = torch.full((batch, num_kv_heads, max_blocks, num_features), float("-inf"), dtype=torch.float64)
    big_tot = torch.zeros(batch, num_kv_heads, num_features, head_dim, dtype=torch.float64)
    small_tot = torch.zeros(batch, num_kv_heads, num_features, dtype=torch.float64)
    offset_tot = torch.full((batch, num_kv_heads, num_features), float("-inf"), dtype=torch.float64)
    indices = torch.zeros(batch, num_kv_heads, capacity, dtype=torch.int32)
    count_t = torch.zeros(batch, num_kv_heads, dtype=torch.int32)
    for row, length in enumerate(lengths):
        if length == 0:
            continue
        k = keys[row, :, :length]
        center[row] = k.mean(1)
        x = (k - center[row].unsqueeze(1)) * math.sqrt(scale)
        logits = x @ w.transpose(-1, -2) - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(num_features)
        offset_tot[row] = logits.amax(1)
        weights = torch.exp(logits - offset_tot[row].unsqueeze(1))  # [Hkv, T, m]
        big_tot[row] = weights.transpose(-1, -2) @ values[row, :, :length]
        small_tot[row] = weights.sum(1)
        nb = -(-length // block_size)
        for blk in range(nb):
            lo, hi = blk * block_size, min(length, (blk + 1) * block_size)
            part = logits[:, lo:hi]
            offset[row, :, blk] = part.amax(1)
            bw = torch.exp(part - offset[row, :, blk].unsqueeze(1))
            big[row, :, blk] = bw.transpose(-1, -2) @ values[row, :, lo:hi]
            small[row, :, blk] = bw.sum(1)
        for head in range(num_kv_heads):
            n = min(max(1, nb // 2), capacity) if counts is None else min(counts[row], nb, capacity)
            chosen = torch.randperm(nb, generator=g)[:n].sort().values
            indices[row, head, :n] = chosen.to(torch.int32)
            count_t[row, head] = n
    as32 = {"device": device, "dtype": torch.float32}
    return {
        "q": q.to(device), "w": w.to(**as32), "indices": indices.to(device), "counts": count_t.to(device),
        "lengths": torch.tensor(lengths, dtype=torch.int32, device=device), "block_size": block_size,
        "big": big.to(**as32), "small": small.to(**as32), "offset": offset.to(**as32), "big_tot": big_tot.to(**as32),
        "small_tot": small_tot.to(**as32), "offset_tot": offset_tot.to(**as32), "center": center.to(**as32),
        "scale": scale,
    }


def less_append_reference(keys: Tensor, values: Tensor, positions: Tensor, block_size: int, w: Tensor, center: Tensor,
                          big: Tensor, small: Tensor, offset: Tensor, big_tot: Tensor, small_tot: Tensor,
                          offset_tot: Tensor, scale: float) -> dict[str, Tensor]:
    """Arguments as prr.kernels.less.less_append -> the updated state, new tensors (fp64
    arithmetic, stored in each input's dtype): big, small, offset, big_tot, small_tot, offset_tot.
    As prr's LessSelector.append_metadata (random features): the totals take the token at the
    running max of the offsets, its block's summaries are recomputed from the block's tokens up to it."""
    out = {name: t.clone() for name, t in dict(big=big, small=small, offset=offset, big_tot=big_tot,
                                               small_tot=small_tot, offset_tot=offset_tot).items()}
    batch, num_kv_heads = keys.shape[:2]
    m = w.shape[1]
    for b in range(batch):
        p = int(positions[b])
        blk = p // block_size
        if blk >= big.shape[2]:
            continue
        lo = blk * block_size
        k = keys[b, :, lo : p + 1].double() - center[b].double().unsqueeze(1)  # [Hkv, n, D]
        v = values[b, :, lo : p + 1].double()
        x = k * math.sqrt(scale)
        logits = x @ w.double().transpose(-1, -2) - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(m)  # [Hkv, n, m]
        c_block = logits.amax(1)  # [Hkv, m]
        weights = torch.exp(logits - c_block.unsqueeze(1))
        out["big"][b, :, blk] = (weights.transpose(-1, -2) @ v).to(big.dtype)
        out["small"][b, :, blk] = weights.sum(1).to(small.dtype)
        out["offset"][b, :, blk] = c_block.float()
        new = logits[:, -1]  # [Hkv, m]: the appended token
        c_old = offset_tot[b].double()
        c_new = torch.maximum(c_old, new)
        keep, add = torch.exp(c_old - c_new), torch.exp(new - c_new)
        out["big_tot"][b] = (big_tot[b].double() * keep.unsqueeze(-1) + add.unsqueeze(-1) * v[:, -1].unsqueeze(1)).float()
        out["small_tot"][b] = (small_tot[b].double() * keep + add).float()
        out["offset_tot"][b] = c_new.float()
    return out
