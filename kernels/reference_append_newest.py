"""Torch reference for kernels/append_newest.py: a block list with each row's newest block added
(reuse=steps between selections: the last A plus the block the token's own key is in).

Static shapes, no host syncs: the graph engine's torch backend runs it
(prr.runtime.engine_ops.TorchOps) and the kernel tests compare against it. A sort of the C + 1
candidates (A's entries, then the newest unless A holds it) rather than a membership mask over
every block of the cache: no max_blocks needed, and the same set in the same order as the mask
(`prr.blocks.BlockSet.from_mask` of A's mask with the newest set, which the tests check).
Imports nothing from prr and nothing from triton.
"""

from __future__ import annotations

import torch
from torch import Tensor


def append_newest_reference(indices: Tensor, count: Tensor, num_blocks: Tensor, width: int,
                            out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """indices [B, Hkv, C] int32 / int64 (distinct block ids in any order, the first count
    [B, Hkv] valid, the rest padding of any value); num_blocks [B] (>= 1: row b's newest block is
    num_blocks[b] - 1); width: the output's capacity.
    -> (A ∪ {newest} [B, Hkv, width] int32 in ascending block order, zero padded; its size
    [B, Hkv] int32). A union larger than width keeps its `width` smallest ids and its true size
    (as the mask's `from_mask` does; callers size width to fit: prr.runtime.selection_reuse).
    out: (indices [B, Hkv, width] int32, count [B, Hkv] int32) written and returned instead, the
    inputs themselves included (the union is whole before it is copied)."""
    batch, heads, capacity = indices.shape
    if width < capacity:
        raise ValueError(f"width={width} must be >= C={capacity} (the output holds A and the newest block)")
    valid = torch.arange(capacity, device=indices.device) < count.unsqueeze(-1)  # [B, Hkv, C]
    newest = (num_blocks.long() - 1).view(batch, 1, 1).expand(batch, heads, 1)  # [B, Hkv, 1]
    member = ((indices.long() == newest) & valid).any(-1, keepdim=True)  # [B, Hkv, 1]
    absent = torch.iinfo(torch.int64).max  # sorts past every block id
    candidates = torch.cat([torch.where(valid, indices.long(), absent), torch.where(member, absent, newest)], -1)
    ordered = candidates.sort(-1).values  # [B, Hkv, C + 1]: the union ascending, then `absent`
    if capacity + 1 < width:
        ordered = torch.cat([ordered, ordered.new_full((batch, heads, width - capacity - 1), absent)], -1)
    ordered = ordered[..., :width]
    union = torch.where(ordered == absent, 0, ordered).to(torch.int32)
    size = (candidates != absent).sum(-1).to(torch.int32)
    if out is None:
        return union, size
    out[0].copy_(union)
    out[1].copy_(size)
    return out
