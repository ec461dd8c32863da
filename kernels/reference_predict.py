"""Torch references (fp32) and seeded input generators for the predictor kernels
(`prr.kernels.predict`): ema's rank and update, last_step's update, ema_membership's update,
SPIN's rank, exploration draw and update, the cross-layer mix.

The formulas follow prr's predictors (prr/predictors/ema.py, last_step.py, ema_membership.py,
spin.py, cross_layer.py), op for op where the result must be bit-equal (ranks, from which P is
taken); this module imports nothing from prr. Shapes per layer: B rows, Hkv KV heads, N blocks.
P from a rank is `reference_selection.top_k_blocks`' set (ties to the lower block id).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference_selection import top_k_blocks

NEVER = float("-inf")


# --- shared pieces ------------------------------------------------------------------------


def standardise_reference(scores: Tensor) -> Tensor:
    """scores: [..., N] with -inf (or any non-finite value) outside the context -> z-scores over
    the finite entries, 0 elsewhere: (s - mean) / max(std, 1e-6), population std."""
    finite = torch.isfinite(scores)
    x = torch.where(finite, scores, torch.zeros_like(scores))
    n = finite.sum(-1, keepdim=True).clamp(min=1)
    mean = x.sum(-1, keepdim=True) / n
    var = (torch.where(finite, x - mean, torch.zeros_like(x)) ** 2).sum(-1, keepdim=True) / n
    z = (x - mean) / var.sqrt().clamp(min=1e-6)
    return torch.where(finite, z, torch.zeros_like(z))


def membership_reference(indices: Tensor, count: Tensor, max_blocks: int) -> Tensor:
    """indices [B, Hkv, C] (entries >= count are padding), count [B, Hkv] -> [B, Hkv, max_blocks] bool."""
    valid = torch.arange(indices.shape[-1], device=indices.device) < count.unsqueeze(-1)
    out = torch.zeros(*indices.shape[:-1], max_blocks + 1, dtype=torch.bool, device=indices.device)
    return out.scatter_(-1, torch.where(valid, indices.long(), max_blocks), True)[..., :max_blocks]


def inside_reference(num_blocks: Tensor, max_blocks: int) -> Tensor:
    """num_blocks [B] -> [B, 1, max_blocks] bool: ids below each row's count."""
    return (torch.arange(max_blocks, device=num_blocks.device) < num_blocks.long().view(-1, 1)).unsqueeze(1)


def newest_reference(num_blocks: Tensor, recent_blocks: int, max_blocks: int) -> Tensor:
    """num_blocks [B] -> [B, 1, max_blocks] bool: each row's `recent_blocks` newest blocks."""
    ids = torch.arange(max_blocks, device=num_blocks.device)
    nb = num_blocks.long().view(-1, 1, 1)
    return (ids >= nb - recent_blocks) & (ids < nb)


# --- ema ----------------------------------------------------------------------------------


def ema_rank_reference(ema: Tensor, last_selected: Tensor, stickiness: Tensor, recency: Tensor, num_blocks: Tensor,
                       recent_blocks: int) -> Tensor:
    """ema [B, Hkv, N] fp32, last_selected [B, Hkv, N] bool, stickiness / recency 0-dim fp32,
    num_blocks [B] -> rank [B, Hkv, N] fp32 = ema + β·1[selected] + γ·1[among the recent_blocks
    newest], -inf at or past num_blocks."""
    n = ema.shape[-1]
    recent = newest_reference(num_blocks, recent_blocks, n)
    score = ema + stickiness * last_selected + recency * recent
    return score.masked_fill(~inside_reference(num_blocks, n), NEVER)


def ema_update_reference(ema: Tensor, scores: Tensor, indices: Tensor, count: Tensor, alpha: Tensor
                         ) -> tuple[Tensor, Tensor]:
    """ema [B, Hkv, N] fp32, scores [B, Hkv, N] (-inf outside the context), the selection
    (indices [B, Hkv, C], count [B, Hkv]), alpha 0-dim -> (new ema: α·ema + (1-α)·z where the
    score is finite, else unchanged; last_selected [B, Hkv, N] bool)."""
    z = standardise_reference(scores)
    new = torch.where(torch.isfinite(scores), alpha * ema + (1 - alpha) * z, ema)
    return new, membership_reference(indices, count, ema.shape[-1])


def cross_layer_rank_reference(temporal: Tensor, z_source: Tensor, selected_source: Tensor, source_stickiness: float,
                               temporal_weight: float, num_blocks: Tensor) -> Tensor:
    """temporal: ema's rank [B, Hkv, N] (-inf outside); z_source, selected_source: the source
    layer's standardised scores and selection -> (1-w)·(z + s·1[sel]) + w·temporal (w = 0:
    the cross part alone), -inf at or past num_blocks."""
    cross = z_source + source_stickiness * selected_source
    score = (1 - temporal_weight) * cross + temporal_weight * temporal if temporal_weight > 0 else cross
    return score.masked_fill(~inside_reference(num_blocks, score.shape[-1]), NEVER)


# --- last_step / ema_membership ---------------------------------------------------------


def last_step_update_reference(scores: Tensor, indices: Tensor, count: Tensor) -> Tensor:
    """-> rank [B, Hkv, N] fp32: the selected blocks' scores (NaN -> 0, ±inf -> ±1e30), -inf elsewhere."""
    chosen = membership_reference(indices, count, scores.shape[-1])
    finite = torch.nan_to_num(scores.float(), neginf=-1e30, posinf=1e30)
    return torch.where(chosen, finite, torch.full_like(finite, NEVER))


def membership_ema_reference(state: Tensor, indices: Tensor, count: Tensor, alpha: float) -> Tensor:
    """state [B, Hkv, N] fp32 -> α·state + (1-α)·1[b ∈ A]."""
    member = membership_reference(indices, count, state.shape[-1]).to(state.dtype)
    return state * alpha + member * (1.0 - alpha)


# --- spin ---------------------------------------------------------------------------------


def spin_rank_reference(vertical: Tensor, diagonal: Tensor, num_blocks: Tensor) -> Tensor:
    """vertical, diagonal [B, Hkv, N] fp32 -> max(vertical(b), diagonal(nb - 1 - b)) inside the
    context (the distance clamped to [0, N-1]), -inf outside."""
    b, h, n = vertical.shape
    nb = num_blocks.long()
    ids = torch.arange(n, device=vertical.device)
    distance = (nb.view(-1, 1, 1) - 1 - ids).clamp(0, n - 1)
    diag = torch.gather(diagonal, -1, distance.expand(-1, h, -1))
    return torch.maximum(vertical, diag).masked_fill(~inside_reference(nb, n), NEVER)


def spin_update_reference(vertical: Tensor, diagonal: Tensor, scores: Tensor, indices: Tensor, count: Tensor,
                          alpha_vertical: float, alpha_diagonal: float, selection_bonus: float
                          ) -> tuple[Tensor, Tensor]:
    """-> (vertical, diagonal) after one selection: x = z + bonus·1[b ∈ A]; vertical EMA of x where
    the score is finite; diagonal EMA of x(n - 1 - δ) for δ < n (n: finite scores of the row)."""
    n = scores.shape[-1]
    finite = torch.isfinite(scores)
    x = standardise_reference(scores) + selection_bonus * membership_reference(indices, count, n)
    a_v, a_d = alpha_vertical, alpha_diagonal
    new_v = torch.where(finite, a_v * vertical + (1 - a_v) * x, vertical)
    rows = finite.sum(-1, keepdim=True)
    distance = torch.arange(n, device=scores.device)
    source = (rows - 1 - distance).clamp(min=0)
    new_d = torch.where(distance < rows, a_d * diagonal + (1 - a_d) * torch.gather(x, -1, source), diagonal)
    return new_v, new_d


MASK32 = 0xFFFF_FFFF


def _mul32(x: Tensor | int, c: int) -> Tensor | int:
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32_reference(x: Tensor | int) -> Tensor | int:
    """lowbias32 on values in [0, 2^32) (int64 tensors or host ints)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def spin_key_reference(seed: int, layer: int) -> int:
    """The host part of SPIN's exploration key: mix32 chained over (seed low, seed high, layer)."""
    key = 0
    for part in (seed & MASK32, (seed >> 32) & MASK32, layer):
        key = mix32_reference(key ^ part)
    return key


def spin_draw_reference(key: int, step: Tensor, shape: tuple[int, int, int]) -> Tensor:
    """key (spin_key_reference), step 0-dim int64 -> [B, Hkv, N] fp32 in [0, 1): 24 bits of
    mix32(mix32(key ^ step) ^ (head · N + block))."""
    b, h, n = shape
    head_block = torch.arange(h * n, device=step.device).view(1, h, n)
    bits = mix32_reference(mix32_reference(key ^ (step & MASK32)) ^ head_block)
    return ((bits >> 8).float() * 2.0**-24).expand(b, h, n)


def spin_propose_reference(rank: Tensor, draw: Tensor, budget_blocks: int, explored: int) -> Tensor:
    """rank, draw [B, Hkv, N] -> P [B, Hkv, N] bool: the best budget - explored blocks by rank
    (ties to the lower id), then the `explored` other in-context blocks of highest draw."""
    exploit = budget_blocks - explored
    n = rank.shape[-1]
    order = torch.sort(rank, dim=-1, descending=True, stable=True).indices
    position = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=rank.device).expand_as(order))
    inside = rank > NEVER
    best = (position < exploit) & inside
    key = torch.where(best, torch.full_like(draw, 2.0), torch.where(inside, draw, torch.full_like(draw, NEVER)))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :budget_blocks]
    taken = torch.gather(key, -1, order) > NEVER
    return membership_reference(order, taken.sum(-1), n)


# --- query_similarity ---------------------------------------------------------------------


def selection_lists_reference(mask: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """mask [..., N] bool -> (ids [..., width] int32: the members in ascending order, then padding 0;
    count [...] int32): how query_similarity stores a selection (the caller keeps count <= width)."""
    n = mask.shape[-1]
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :width]  # members first, ascending
    count = mask.sum(-1)
    valid = torch.arange(order.shape[-1], device=mask.device) < count.unsqueeze(-1)
    ids = torch.where(valid, order, torch.zeros_like(order)).to(torch.int32)
    if order.shape[-1] < width:  # width > N
        ids = torch.cat([ids, ids.new_zeros(*ids.shape[:-1], width - n)], dim=-1)
    return ids, count.to(torch.int32)


def selection_masks_reference(ids: Tensor, count: Tensor, max_blocks: int) -> Tensor:
    """ids [..., W], count [...] (selection_lists_reference's) -> [..., max_blocks] bool."""
    valid = torch.arange(ids.shape[-1], device=ids.device) < count.unsqueeze(-1)
    out = torch.zeros(*ids.shape[:-1], max_blocks + 1, dtype=torch.bool, device=ids.device)
    return out.scatter_(-1, torch.where(valid, ids.long(), max_blocks), True)[..., :max_blocks]


def query_similarity_rank_reference(query: Tensor, keys: Tensor, set_ids: Tensor, set_count: Tensor,
                                    last_selected: Tensor, last_z: Tensor, filled: int, num_blocks: Tensor,
                                    neighbours: int, recent_blocks: int, tie: float) -> tuple[Tensor, Tensor]:
    """query [B, Hkv, G, D], keys [B, Hkv, C, G·D] fp32 unit rows, set_ids [B, Hkv, C + 1, W] int32
    with set_count [B, Hkv, C + 1] (slot j < C: the selection cached with query j, ascending ids;
    slot C: A_{t-1}, not read here), last_selected [B, Hkv, N] bool, last_z [B, Hkv, N], filled:
    cached pairs -> (rank [B, Hkv, N]: Σ over the `neighbours` most similar cached queries (cosine)
    of (1.5 + s/2)·1[b in their set], A_{t-1} while none is cached, + (2·neighbours + 1)·1[recent]
    + tie·last_z, -inf outside; the normalised query [B, Hkv, G·D])."""
    q = torch.nn.functional.normalize(query.float().flatten(2), dim=-1)
    cache_size, n = keys.shape[2], last_z.shape[-1]
    similarity = torch.einsum("bhcd,bhd->bhc", keys, q)
    cached = torch.arange(cache_size, device=q.device) < filled
    best, which = similarity.masked_fill(~cached, NEVER).topk(neighbours, dim=-1)
    ids = torch.gather(set_ids, 2, which.unsqueeze(-1).expand(-1, -1, -1, set_ids.shape[-1]))
    chosen = selection_masks_reference(ids, torch.gather(set_count, 2, which), n)  # [B, Hkv, m, N]
    weight = torch.where(best > NEVER, 1.5 + best / 2, 0.0)
    votes = (weight.unsqueeze(-1) * chosen).sum(2) if filled > 0 else last_selected.float()
    score = votes + (2 * neighbours + 1) * newest_reference(num_blocks, recent_blocks, n) + tie * last_z
    return score.masked_fill(~inside_reference(num_blocks, n), NEVER), q


def fill_reference(last_z: Tensor, tie: float, width: int) -> Tensor:
    """last_z [B, Hkv, N] -> [B, Hkv, min(width, N)] int32: the blocks of the largest tie·last_z
    (fp32, as the rank adds it), best first, ties to the lower id (top_k_blocks' order): where
    fewer than |P| blocks got a vote, query_similarity's P is them and the best of these."""
    return top_k_blocks(tie * last_z.float(), width)[0].to(torch.int32)


def query_similarity_update_reference(keys: Tensor, set_ids: Tensor, set_count: Tensor, pending: Tensor, paired: bool,
                                      cursor: int, scores: Tensor, indices: Tensor, count: Tensor
                                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (keys, set_ids, set_count with slot `cursor` <- (pending, the selection's list) when
    paired and slot C <- the selection's list; last_selected; last_z = the scores standardised).
    A list: the selection's distinct in-range ids, ascending, padding 0 (selection_lists_reference)."""
    n = scores.shape[-1]
    chosen = membership_reference(indices, count, n)
    ids, cnt = selection_lists_reference(chosen, set_ids.shape[-1])
    keys, set_ids, set_count = keys.clone(), set_ids.clone(), set_count.clone()
    slots = [set_ids.shape[2] - 1] + ([cursor] if paired else [])
    for slot in slots:
        set_ids[:, :, slot], set_count[:, :, slot] = ids, cnt
    if paired:
        keys[:, :, cursor] = pending
    return keys, set_ids, set_count, chosen, standardise_reference(scores)


# --- seeded input generators -------------------------------------------------------------


def make_selection(batch: int = 2, num_kv_heads: int = 3, max_blocks: int = 61, num_blocks: list[int] | None = None,
                   topk: int = 8, seed: int = 0, device: str | torch.device = "cpu", index_dtype: torch.dtype = torch.int32
                   ) -> dict[str, Tensor]:
    """A random selection as selectors hand it to `update`: scores [B, Hkv, N] fp32 (distinct
    values, -inf at or past each row's num_blocks), indices [B, Hkv, min(topk, N)] ascending then
    padding 0 (the top-k of the scores where they are finite), count [B, Hkv], num_blocks [B] int32."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = [max_blocks] * batch if num_blocks is None else list(num_blocks)
    scores = torch.randn(batch, num_kv_heads, max_blocks, generator=g) * 3.0 + 5.0
    nb = torch.tensor(num_blocks, dtype=torch.int32)
    scores = scores.masked_fill(~inside_reference(nb, max_blocks), NEVER)
    k = min(topk, max_blocks)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    taken = torch.gather(scores, -1, order) > NEVER
    count = taken.sum(-1)
    ordered = torch.where(taken, order, max_blocks).sort(-1).values
    indices = torch.where(ordered == max_blocks, 0, ordered)
    return {"scores": scores.to(device), "indices": indices.to(index_dtype).to(device),
            "count": count.to(torch.int32).to(device), "num_blocks": nb.to(device)}


def make_state(batch: int = 2, num_kv_heads: int = 3, max_blocks: int = 61, seed: int = 0,
               device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """Random per-layer predictor state: ema / vertical / diagonal [B, Hkv, N] fp32 (distinct
    values), last_selected [B, Hkv, N] bool (about a quarter set)."""
    g = torch.Generator().manual_seed(seed + 1000)
    shape = (batch, num_kv_heads, max_blocks)
    return {"ema": torch.randn(shape, generator=g).to(device),
            "vertical": torch.randn(shape, generator=g).to(device),
            "diagonal": torch.randn(shape, generator=g).to(device),
            "last_selected": (torch.rand(shape, generator=g) < 0.25).to(device)}
