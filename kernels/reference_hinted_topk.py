"""Torch references and seeded input generators for hinted exact top-K
(`prr.kernels.hinted_topk.hinted_topk_select`).

- `hinted_topk_reference`: the kernels' algorithm step by step (bracket rounds, candidates, the
  candidates' top-k), per row in int64 keys: it gives the kernels' indices, counts, next hints
  and paths, and its indices are checked against the unhinted `topk_select_reference`.
- `hinted_top_k_blocks`: the static-shape torch form the selectors' torch backend runs (no host
  synchronisation, capturable): the candidates at or above the hint when they hold the top-k,
  else the whole row; the same set as `top_k_blocks`, and the same next hint as the kernels.
- `make_hinted_scores`: a previous and a current step's scores whose top-k sets overlap at a
  chosen rate, for tests and benchmarks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .reference_selection import forced_scores, top_k_blocks, topk_select_reference

INF_KEY = 0xFF800000  # the key of +inf (forced blocks)
ROUND0_OFFSETS = (-(1 << 23), -(1 << 20), -(1 << 17), -(1 << 14), 0, 1 << 14, 1 << 17, 1 << 20)
TILED_ROUNDS = 12  # rounds of the tiled kernel (it narrows to the exact k-th key)


def score_keys(scores: Tensor) -> Tensor:
    """float scores (any shape) -> int64 order keys in [0, 2^32) as the kernels make them
    (fp32 bits: sign bit set for >= 0, all bits flipped for < 0; -0.0 as +0.0; NaN as -inf)."""
    s = scores.float()
    s = torch.where(s.isnan(), float("-inf"), s)
    s = torch.where(s == 0, 0.0, s)
    bits = s.view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(bits >> 31 == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)


def key_scores(keys: Tensor) -> Tensor:
    """int64 order keys -> the fp32 scores they are the keys of (the inverse of score_keys)."""
    bits = torch.where(keys >> 31 == 1, keys ^ 0x80000000, keys ^ 0xFFFFFFFF)
    return ((bits + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32).view(torch.float32)


def _round_thresholds(a: int, b: int, hint_key: int, around_hint: bool) -> list[int]:
    if around_hint:
        return [min(max(hint_key + off, a), b - 1) for off in ROUND0_OFFSETS]
    return [a + (b - a) * j // 8 for j in range(8)]


def hinted_topk_reference(
    scores: Tensor, k: int, num_blocks: Tensor, hint: Tensor, sink_blocks: int = 0, recent_blocks: int = 1,
    rounds: int = 3, candidate_cap: int = 64, tiled: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernels' algorithm in torch (hinted_topk_jit's docstring), one row at a time.

    scores: [B, Hkv, N]; hint: [B, Hkv] fp32 (read only); candidate_cap: the kernel's CAP (after
    the launcher's clamp); tiled: the tiled kernel's rounds (narrow to the exact key) instead of
    `rounds` and the full-row fallback. -> (indices [B, Hkv, min(k, N)] int32 ascending then 0,
    counts [B, Hkv] int32, next hint [B, Hkv] fp32 (the k-th largest score, -inf when nothing is
    selectable), path [B, Hkv] int32 (rounds run before the candidates fit CAP; -1: never))."""
    forced = forced_scores(scores.cpu(), num_blocks.cpu(), sink_blocks, recent_blocks)  # [B, Hkv, N]
    keys = torch.where(forced > float("-inf"), score_keys(forced), 0)  # invalid blocks: key 0
    hint_keys = score_keys(hint.cpu())
    batch, num_kv_heads, n = scores.shape
    k_out = min(k, n)
    indices = torch.zeros(batch, num_kv_heads, k_out, dtype=torch.int32)
    counts = torch.zeros(batch, num_kv_heads, dtype=torch.int32)
    next_hint = torch.full((batch, num_kv_heads), float("-inf"))
    path = torch.zeros(batch, num_kv_heads, dtype=torch.int32)
    for row in range(batch):
        for head in range(num_kv_heads):
            row_keys = keys[row, head]
            valid = row_keys > 0
            n_valid = int(valid.sum())
            context = min(max(int(num_blocks[row]), 0), n)
            a, b, ran = 1, INF_KEY + 1, 0  # every valid key is >= 1
            count_a, k_eff = context, min(context, k_out)  # until round 0 counts the valid keys
            for r in range(TILED_ROUNDS if tiled else rounds):
                if count_a <= candidate_cap or (tiled and b - a <= 1):
                    break
                if r == 0:
                    count_a, k_eff = n_valid, min(n_valid, k_out)
                thresholds = _round_thresholds(a, b, int(hint_keys[row, head]), r == 0)
                above = [int((row_keys >= t).sum()) for t in thresholds]
                enough = [t for t, c in zip(thresholds, above, strict=True) if c >= k_eff]
                if enough:
                    a, count_a = enough[-1], above[len(enough) - 1]
                if len(enough) < 8:
                    b = thresholds[len(enough)]
                ran += 1
            k_eff = min(n_valid, k_out)
            if count_a <= candidate_cap:
                candidates = valid & (row_keys >= a)
                masked = forced[row, head].masked_fill(~candidates, float("-inf"))
                path[row, head] = ran
            else:
                masked = forced[row, head]
                path[row, head] = -1
            if k_out:
                chosen, count = top_k_blocks(masked.view(1, 1, n), k_out)
                ids = chosen[0, 0, : int(count)].sort().values
                indices[row, head, : len(ids)] = ids.to(torch.int32)
                counts[row, head] = int(count)
            if k_eff:
                next_hint[row, head] = masked.sort(descending=True).values[k_eff - 1]
    return indices, counts, next_hint, path


def hinted_top_k_blocks(scores: Tensor, k: int, hint: Tensor) -> tuple[Tensor, Tensor]:
    """`top_k_blocks` from a threshold guess, in static shapes with no host synchronisation
    (the selectors' torch backend with selector.hinted_topk): scores [B, Hkv, N] forced and
    masked (+inf forced, -inf never taken); hint [B, Hkv] fp32, in place: in, the guess; out, the
    k-th largest score (-inf where nothing is selectable), as the kernels write it.
    -> (indices [B, Hkv, min(k, N)] int64 best first, padding 0; count [B, Hkv] int64): the
    same as top_k_blocks(scores, k). The rows whose scores >= hint hold the top-k take it from
    those candidates, the others from the whole row (torch selects over the full row shape
    either way: on this backend the option proves the plumbing, not a speed-up)."""
    k_out = min(k, scores.shape[-1])
    valid = scores > float("-inf")  # [B, Hkv, N]
    k_eff = valid.sum(-1).clamp(max=k_out)  # [B, Hkv]
    candidates = valid & (scores >= hint.unsqueeze(-1))
    enough = candidates.sum(-1) >= k_eff  # [B, Hkv]: T >= hint, so the candidates hold every key >= T
    masked = torch.where(candidates | ~enough.unsqueeze(-1), scores, float("-inf"))
    indices, count = top_k_blocks(masked, k_out)
    if k_out:
        last = torch.gather(indices, -1, (count - 1).clamp(min=0).unsqueeze(-1))  # [B, Hkv, 1] the k-th block
        kth = torch.gather(masked, -1, last).squeeze(-1).float()
        hint.copy_(torch.where(count > 0, kth, float("-inf")))
    else:
        hint.fill_(float("-inf"))
    return indices, count


def hinted_topk_select_reference(
    scores: Tensor, k: int, num_blocks: Tensor, hint: Tensor, sink_blocks: int = 0, recent_blocks: int = 1
) -> tuple[Tensor, Tensor]:
    """The contract of hinted_topk_select: the unhinted `topk_select_reference`'s set (the hint
    changes nothing but the time). Updates hint in place like the kernels."""
    forced = forced_scores(scores, num_blocks, sink_blocks, recent_blocks)
    hinted_top_k_blocks(forced, k, hint)
    return topk_select_reference(scores, k, num_blocks, sink_blocks, recent_blocks)


# --- seeded input generators -------------------------------------------------------------


def make_hinted_scores(
    batch: int, num_kv_heads: int, n: int, k: int, hit_rate: float, seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[Tensor, Tensor]:
    """-> (previous, current) scores [B, Hkv, N] fp32 on `device` (no ±inf) whose top-k sets
    overlap in about `hit_rate` of k per row (|prev top-k ∩ cur top-k| / k: `topk_overlap`).

    current = sqrt(1 - rho^2) * fresh + rho * previous, previous and fresh iid N(0, 1) x 10
    (correlated Gaussians: consecutive decode queries score blocks alike); rho by bisection (16
    steps) on the mean measured overlap of these very rows, so the mean overlap is the rate's
    within a few percent at k >= 32. Drawn on `device` from a generator seeded there (the same
    seed gives other draws on another device type)."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate={hit_rate} must be in [0, 1]")
    g = torch.Generator(device=device).manual_seed(seed)
    previous = torch.randn(batch, num_kv_heads, n, generator=g, device=device) * 10.0
    fresh = torch.randn(batch, num_kv_heads, n, generator=g, device=device) * 10.0
    k = min(k, n)

    def mix(rho: float) -> Tensor:
        return math.sqrt(max(0.0, 1.0 - rho * rho)) * fresh + rho * previous

    lo, hi = 0.0, 1.0
    for _ in range(16):
        rho = (lo + hi) / 2
        if topk_overlap(previous, mix(rho), k).mean().item() < hit_rate:
            lo = rho
        else:
            hi = rho
    return previous, mix((lo + hi) / 2)


def topk_overlap(previous: Tensor, current: Tensor, k: int) -> Tensor:
    """[B, Hkv] fraction of the current top-k (plain scores, no forcing) that the previous top-k holds."""
    k = min(k, previous.shape[-1])
    prev_ids = previous.topk(k, dim=-1).indices
    cur_ids = current.topk(k, dim=-1).indices
    n = previous.shape[-1]
    prev_mask = torch.zeros(*previous.shape[:2], n, dtype=torch.bool, device=previous.device).scatter_(-1, prev_ids, True)
    return torch.gather(prev_mask, -1, cur_ids).float().mean(-1)


def kth_scores(scores: Tensor, k: int) -> Tensor:
    """[B, Hkv] fp32 k-th largest score of each row (no forcing): the previous step's hint."""
    return scores.float().topk(min(k, scores.shape[-1]), dim=-1).values[..., -1].contiguous()
