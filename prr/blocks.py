"""Block sets: which KV blocks a selection, prediction or repair covers.

A BlockSet is a fixed-size padded index tensor with a valid count, so shapes stay static
across decode steps (CUDA graphs, torch.compile) and nothing syncs with the host. Set
algebra (A \\ P, P ∩ A) is done on boolean masks over the cache's block capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prr.kernels.reference_selection import top_k_blocks


@dataclass(frozen=True)
class BlockSet:
    indices: Tensor  # [B, Hkv, C] int32 or int64 block ids; entries at positions >= count are padding (0)
    count: Tensor  # [B, Hkv] int32 or int64 number of valid entries

    @property
    def capacity(self) -> int:
        return self.indices.shape[-1]

    def valid(self) -> Tensor:
        """[B, Hkv, C] bool: which entries of `indices` are real."""
        positions = torch.arange(self.capacity, device=self.indices.device)
        return positions < self.count.unsqueeze(-1)

    def mask(self, max_blocks: int) -> Tensor:
        """[B, Hkv, max_blocks] bool membership mask."""
        # Padding entries write into a spare slot past the end, so they cannot clear a member.
        out = torch.zeros(*self.indices.shape[:-1], max_blocks + 1, dtype=torch.bool, device=self.indices.device)
        index = torch.where(self.valid(), self.indices.long(), max_blocks)
        return out.scatter_(-1, index, True)[..., :max_blocks]

    @staticmethod
    def from_mask(mask: Tensor, capacity: int | None = None) -> BlockSet:
        """mask: [B, Hkv, N] bool -> the members in ascending block order, padded to `capacity`."""
        capacity = mask.shape[-1] if capacity is None else capacity
        # Stable sort of "not member" puts members first, in ascending block order.
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :capacity]
        # Callers guarantee count <= capacity (A \ P fits A's capacity; a union fits G × K);
        # checking here would sync with the host in the middle of a decode step.
        count = mask.sum(-1)
        valid = torch.arange(order.shape[-1], device=mask.device) < count.unsqueeze(-1)
        indices = torch.where(valid, order, torch.zeros_like(order))
        if indices.shape[-1] < capacity:
            pad = torch.zeros(*indices.shape[:-1], capacity - indices.shape[-1], dtype=indices.dtype, device=indices.device)
            indices = torch.cat([indices, pad], dim=-1)
        return BlockSet(indices=indices, count=count)

    @staticmethod
    def empty(batch: int, num_kv_heads: int, device: torch.device | str = "cpu") -> BlockSet:
        return BlockSet(
            indices=torch.zeros(batch, num_kv_heads, 0, dtype=torch.int64, device=device),
            count=torch.zeros(batch, num_kv_heads, dtype=torch.int64, device=device),
        )


@dataclass(frozen=True)
class Selection:
    """A selector's answer for one decode step (set A with the scores it came from). Here, below
    the selectors, so that the model's tensor parallelism and the predictors read it too."""

    blocks: BlockSet  # A: [B, Hkv, C]
    scores: Tensor  # [B, Hkv, max_blocks] fp32 GQA-reduced block scores before forcing; -inf past the context


def block_counts(num_blocks: int | Tensor, batch: int, device: torch.device | str) -> Tensor:
    """Blocks in each row's context as a device tensor [B] int64: a host int (the eager
    runtime, tests) is broadcast, a tensor (the graph engine's per-row count) is used as is,
    so one static-shape definition serves both."""
    if isinstance(num_blocks, Tensor):
        return num_blocks.to(device=device, dtype=torch.int64).expand(batch) if num_blocks.dim() == 0 \
            else num_blocks.to(device=device, dtype=torch.int64)
    return torch.full((batch,), int(num_blocks), dtype=torch.int64, device=device)


def inside_context(num_blocks: Tensor, max_blocks: int) -> Tensor:
    """num_blocks [B] -> [B, 1, max_blocks] bool: block ids below each row's count."""
    return (torch.arange(max_blocks, device=num_blocks.device) < num_blocks.view(-1, 1)).unsqueeze(1)


def top_blocks(scores: Tensor, k: int) -> BlockSet:
    """The k best-scoring blocks per row; blocks scored -inf are never taken.

    scores: [B, Hkv, N] float -> BlockSet with capacity min(k, N), best first (ties towards
    the lower block index; prr.kernels.reference_selection.top_k_blocks is the definition).
    """
    if min(k, scores.shape[-1]) <= 0:
        return BlockSet.empty(scores.shape[0], scores.shape[1], scores.device)
    return BlockSet(*top_k_blocks(scores, k))


def top_blocks_ascending(scores: Tensor, k: int) -> BlockSet:
    """`top_blocks`' set in ascending block order: scores [B, Hkv, N] -> indices [B, Hkv, min(k, N)]
    int32 ascending then 0, counts [B, Hkv] int32 (what prr.selectors.base.ascending(top_blocks(scores,
    k)) gives), without its full stable sort (0.9 ms of a CPU prefill tail's 32 x 3 rows of 248 blocks,
    a top-k 0.07 ms): the k-th largest score from a top-k, the scores above it, then the ones equal
    to it in ascending block order (the stable sort's tie-break) while slots are left; -inf never
    taken. NaN scores are never taken either and hold no slot (top_blocks sorts them first, where
    its valid entries no longer lead: no defined set to match). Static shapes, no host sync."""
    b, h, n = scores.shape
    k = min(k, n)
    if k <= 0:
        empty = torch.zeros(b, h, 0, dtype=torch.int32, device=scores.device)
        return BlockSet(empty, torch.zeros(b, h, dtype=torch.int32, device=scores.device))
    real = scores.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))  # [B, Hkv, N]
    kth = real.topk(k, dim=-1).values[..., -1:]  # [B, Hkv, 1]
    above = real > kth
    tied = real == kth
    taken = (above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))) & (real > float("-inf"))
    rank = torch.where(taken, taken.cumsum(-1) - 1, k)  # each member's output slot; the others a spare one
    ids = torch.arange(n, dtype=torch.int32, device=scores.device).expand(b, h, n)
    indices = torch.zeros(b, h, k + 1, dtype=torch.int32, device=scores.device).scatter_(-1, rank, ids)
    return BlockSet(indices[..., :k], taken.sum(-1, dtype=torch.int32))


def controlled_predictions(selection: tuple[Tensor, Tensor], hit_rate: float, num_blocks: int,
                           gen: torch.Generator, size: int | None = None) -> tuple[Tensor, Tensor]:
    """A predicted set P of a chosen quality, for timing PRR at controlled hit rates.

    selection: A as (indices [B, Hkv, K] ascending, counts [B, Hkv]); size: |P| per (row, KV
    head) (default |A|). P holds round(hit_rate·min(|A|, size)) blocks of A and fills up to
    `size` with blocks of [0, num_blocks) outside A (as many as there are), ascending.
    -> (indices [B, Hkv, max(K, size)] of A's dtype and device, counts [B, Hkv])."""
    idx, cnt = (t.cpu() for t in selection)
    width = idx.shape[-1] if size is None else max(idx.shape[-1], size)
    pred = torch.zeros(*idx.shape[:2], width, dtype=idx.dtype)
    pcnt = torch.zeros_like(cnt)
    for b in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            a = idx[b, h, : int(cnt[b, h])]
            n = len(a) if size is None else size
            keep = round(hit_rate * min(len(a), n))
            kept = a[torch.randperm(len(a), generator=gen)[:keep]]
            outside = torch.ones(num_blocks, dtype=torch.bool)
            outside[a.long()] = False
            others = outside.nonzero()[:, 0]
            others = others[torch.randperm(len(others), generator=gen)[: n - keep]].to(idx.dtype)
            row = torch.cat([kept, others]).sort().values
            pred[b, h, : len(row)] = row
            pcnt[b, h] = len(row)
    return pred.to(selection[0].device), pcnt.to(selection[0].device)
