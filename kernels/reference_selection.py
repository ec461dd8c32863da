"""Torch references and seeded input generators for the selection kernels
(`prr.kernels.quest`: quest_score, quest_update; `prr.kernels.topk`: topk_select).

The references follow prr's own code: Quest's formula as in `QuestSelector.head_scores`
(computed in fp64 here) with the GQA reduction of `Selector.select`, the metadata rebuild of
`QuestSelector.update_metadata`, and `top_k_blocks` (below; prr.blocks.top_blocks wraps it) for the selected set.
"""

from __future__ import annotations

import torch
from torch import Tensor

# --- references ------------------------------------------------------------------------


def top_k_blocks(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best-scoring blocks per row; blocks scored -inf are never taken.

    scores: [B, Hkv, N] float -> (indices [B, Hkv, min(k, N)] int64 best first, padding 0;
    count [B, Hkv] int64). Ties are broken towards the lower block index (scores are
    compared, then indices), so a selection is a deterministic function of its scores.
    Static shapes (prr.blocks.top_blocks wraps it; the top-k kernel's reference)."""
    k = min(k, scores.shape[-1])
    # Stable descending sort gives the documented tie-break; topk does not promise one.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    taken = torch.gather(scores, -1, order) > float("-inf")
    # Valid entries come first because -inf sorts last.
    return torch.where(taken, order, torch.zeros_like(order)), taken.sum(-1)



def quest_score_reference(
    q: Tensor, key_max: Tensor, key_min: Tensor, num_blocks: Tensor, gqa_reduce: str = "max"
) -> Tensor:
    """q: [B, Hq, D]; key_max, key_min: [B, Hkv, NB_max, D]; num_blocks: [B]
    -> [B, Hkv, NB_max] fp32 GQA-reduced Quest scores (fp64 arithmetic), -inf past num_blocks."""
    batch, num_kv_heads, max_blocks, head_dim = key_max.shape
    group = q.shape[1] // num_kv_heads
    qg = q.double().view(batch, num_kv_heads, group, 1, head_dim)  # [B, Hkv, G, 1, D]
    outside = torch.arange(max_blocks, device=q.device) >= num_blocks.to(q.device).long()[:, None]  # [B, NB]
    outside = outside[:, None, :]  # [B, 1, NB]
    # Blocks past the context may hold ±inf (never written): zero them before multiplying.
    mx = key_max.double().masked_fill(outside[..., None], 0.0).unsqueeze(2)  # [B, Hkv, 1, NB, D]
    mn = key_min.double().masked_fill(outside[..., None], 0.0).unsqueeze(2)
    per_head = torch.maximum(qg * mx, qg * mn).sum(-1)  # [B, Hkv, G, NB]
    reduced = per_head.sum(2) if gqa_reduce == "sum" else per_head.amax(2)
    return reduced.float().masked_fill(outside, float("-inf"))


def quest_metadata_reference(keys: Tensor, length: int, block_size: int, max_blocks: int) -> tuple[Tensor, Tensor]:
    """keys: [B, Hkv, T >= length, D] -> (key_max, key_min) [B, Hkv, max_blocks, D] fp32 rebuilt
    from the first `length` tokens; blocks without tokens hold -inf / +inf (prr's fill)."""
    batch, num_kv_heads, _, head_dim = keys.shape
    key_max = torch.full((batch, num_kv_heads, max_blocks, head_dim), float("-inf"), device=keys.device)
    key_min = torch.full((batch, num_kv_heads, max_blocks, head_dim), float("inf"), device=keys.device)
    nb = -(-length // block_size)
    if nb:
        blocks = torch.zeros(batch, num_kv_heads, nb * block_size, head_dim, device=keys.device)
        blocks[:, :, :length] = keys[:, :, :length].float()
        blocks = blocks.view(batch, num_kv_heads, nb, block_size, head_dim)
        dead = (torch.arange(nb * block_size, device=keys.device) >= length).view(1, 1, nb, block_size, 1)
        key_max[:, :, :nb] = blocks.masked_fill(dead, float("-inf")).amax(3)
        key_min[:, :, :nb] = blocks.masked_fill(dead, float("inf")).amin(3)
    return key_max, key_min


def forced_scores(scores: Tensor, num_blocks: Tensor, sink_blocks: int, recent_blocks: int) -> Tensor:
    """scores: [B, Hkv, N] -> fp32 copy with forced blocks +inf and blocks >= nb -inf."""
    n = scores.shape[-1]
    ids = torch.arange(n, device=scores.device)[None, :]  # [1, N]
    nb = num_blocks.to(scores.device).long().clamp(0, n)[:, None]  # [B, 1]
    inside = ids < nb
    forced = inside & ((ids < torch.clamp(nb, max=sink_blocks)) | (ids >= nb - recent_blocks))
    out = scores.float().masked_fill(~inside[:, None, :], float("-inf"))
    return out.masked_fill(forced[:, None, :], float("inf"))


def topk_select_reference(
    scores: Tensor, k: int, num_blocks: Tensor, sink_blocks: int = 0, recent_blocks: int = 1
) -> tuple[Tensor, Tensor]:
    """-> (indices [B, Hkv, min(k, N)] int32 ascending then padding 0, counts [B, Hkv] int32):
    the set of `top_k_blocks` over `forced_scores`, sorted like the kernel writes it."""
    n = scores.shape[-1]
    k_out = min(k, n)
    if k_out == 0:
        b, h = scores.shape[:2]
        return torch.zeros(b, h, 0, dtype=torch.int32), torch.zeros(b, h, dtype=torch.int32)
    indices, count = top_k_blocks(forced_scores(scores, num_blocks, sink_blocks, recent_blocks), k)
    valid = torch.arange(k_out, device=scores.device) < count.unsqueeze(-1)
    ordered = torch.where(valid, indices, n).sort(-1).values
    ordered = torch.where(ordered == n, torch.zeros_like(ordered), ordered)
    return ordered.to(torch.int32), count.to(torch.int32)


# --- seeded input generators -------------------------------------------------------------


def make_quest_inputs(
    batch: int = 2,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    max_blocks: int = 27,
    num_blocks: list[int] | None = None,
    q_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, Tensor]:
    """Random Quest inputs: q [B, Hq, D] q_dtype, key_max/key_min [B, Hkv, NB_max, D] fp32 with
    M ≥ m (key spread like post-RoPE keys: a per-block centre ± a positive half-width) and
    prr's ±inf fill past each row's num_blocks, num_blocks [B] int32 (default: all full)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = [max_blocks] * batch if num_blocks is None else list(num_blocks)
    shape = (batch, num_kv_heads, max_blocks, head_dim)
    centre = torch.randn(shape, generator=g) * 2.0
    key_max = centre + torch.rand(shape, generator=g) * 1.5
    key_min = centre - torch.rand(shape, generator=g) * 1.5
    for b, nb in enumerate(num_blocks):
        key_max[b, :, nb:] = float("-inf")
        key_min[b, :, nb:] = float("inf")
    q = torch.randn(batch, num_q_heads, head_dim, generator=g).to(q_dtype)
    return {
        "q": q.to(device),
        "key_max": key_max.to(device),
        "key_min": key_min.to(device),
        "num_blocks": torch.tensor(num_blocks, dtype=torch.int32, device=device),
    }


def make_topk_scores(
    batch: int = 2,
    num_kv_heads: int = 2,
    n: int = 113,
    num_blocks: list[int] | None = None,
    kind: str = "randn",
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> tuple[Tensor, Tensor]:
    """-> scores [B, Hkv, N] fp32, num_blocks [B] int32 (default: all N). kind: "randn"
    (distinct values), "ties" (a handful of distinct values, many equal), "integers"
    (small integers of both signs, ±0.0 mixed), "extremes" (±inf, ±FLT_MAX, denormals, ±0)."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, num_kv_heads, n)
    if kind == "randn":
        scores = torch.randn(shape, generator=g) * 10.0
    elif kind == "ties":
        scores = torch.randint(0, 3, shape, generator=g).float() * 0.5 - 0.25
    elif kind == "integers":
        scores = torch.randint(-4, 5, shape, generator=g).float()
        negative_zero = (scores == 0) & (torch.rand(shape, generator=g) < 0.5)
        scores = torch.where(negative_zero, torch.tensor(-0.0), scores)
    elif kind == "extremes":
        pool = torch.tensor(
            [float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-45, -1e-45, 0.0, -0.0, 1.0, -1.0, 1e-38, -1e-38]
        )
        scores = pool[torch.randint(0, len(pool), shape, generator=g)]
    else:
        raise ValueError(f"kind={kind!r} is not one of randn, ties, integers, extremes")
    num_blocks = [n] * batch if num_blocks is None else list(num_blocks)
    return scores.to(device), torch.tensor(num_blocks, dtype=torch.int32, device=device)


def infllm_reference_selections(q_raw: Tensor, k_raw: Tensor, inv_freq: Tensor, prompt_len: int, block_size: int,
                                sink_blocks: int, local_blocks: int, force_newest: bool, topk_blocks: int,
                                representatives: int, return_scores: bool = False
                                ) -> list[list[int]] | tuple[list[list[int]], list[dict[int, float]]]:
    """InfLLM's retrieval as its paper's repository does it (thunlp/InfLLM,
    inf_llm/attention/context_manager.py; arXiv 2402.04617), in prr's block framing, written as
    an explicit loop over positions, heads and tokens (fp64), independent of prr.selectors:

    - every query p (prompt and decode alike) gives each token j of its local window (the
      last local_blocks + force_newest blocks of its context) the softmax probability of
      q_p·k_j/√D, normalised over the always-attended tokens (sink blocks + window) up to p,
      q and k rotated at their true positions; the probabilities add up per token and query head;
    - a block that has left the window is a memory unit: per query head, the mean of the
      pre-RoPE keys of its `representatives` tokens with the largest summed probability;
    - at each decode position p >= prompt_len: unit score = Σ over query heads of
      ⟨R(c)·q_h, representative_h⟩ with q pre-RoPE and c = window tokens − 1 (InfLLM rotates
      every query by the one angle n_local − 1 and leaves unit keys unrotated); the selection
      is the sink and window blocks plus the best-scoring units, topk_blocks in all (ties:
      the lower block).

    q_raw: [T, Hq, D], k_raw: [T, Hkv, D] pre-RoPE queries and keys of positions 0..T-1 (one
    layer, one row); inv_freq [D/2] the model's RoPE frequencies
    -> for each decode position p in [prompt_len, T): its selected block ids, ascending (and,
    with return_scores, each position's unit scores {block: score}, for near-tie diagnostics)."""
    q_raw, k_raw, freqs = q_raw.double(), k_raw.double(), inv_freq.double()
    total, num_heads, head_dim = q_raw.shape
    group = num_heads // k_raw.shape[1]
    s, window = block_size, local_blocks + int(force_newest)

    def rope(x: Tensor, position: int) -> Tensor:  # x: [..., D] rotated by position (rotate_half layout)
        angles = position * freqs
        cos, sin = torch.cat((angles.cos(), angles.cos())), torch.cat((angles.sin(), angles.sin()))
        half = head_dim // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    k_post = torch.stack([rope(k_raw[j], j) for j in range(total)])  # [T, Hkv, D]
    summed = torch.zeros(total, num_heads, dtype=torch.float64)  # summed window probability per token and head
    units: dict[int, Tensor] = {}  # block -> [Hq, D] representative keys (pre-RoPE)
    out, unit_scores = [], []
    for p in range(total):
        num_blocks = p // s + 1
        first_window = num_blocks - window
        window_start = max(first_window, 0) * s  # the window: tokens [window_start, p]
        sink_end = min(sink_blocks * s, window_start)  # sink tokens not in the window: [0, sink_end)
        q_post = rope(q_raw[p], p)  # [Hq, D]
        for h in range(num_heads):
            attended = torch.cat((k_post[:sink_end, h // group], k_post[window_start : p + 1, h // group]))
            probs = torch.softmax(attended @ q_post[h] / head_dim ** 0.5, 0)  # over sinks + window
            summed[window_start : p + 1, h] += probs[sink_end:]  # the window's tokens
        if p < prompt_len:
            continue
        length = p + 1
        for b in range(min(length // s, first_window)):  # full blocks out of the window: memory units
            if b not in units:
                reps = []
                for h in range(num_heads):
                    tokens = sorted(range(b * s, b * s + s), key=lambda j, h=h: -summed[j, h].item())
                    reps.append(torch.stack([k_raw[j, h // group] for j in tokens[:representatives]]).mean(0))
                units[b] = torch.stack(reps)
        q_fixed = rope(q_raw[p], max(window * s - 1, 0))  # [Hq, D] at InfLLM's one angle
        forced = {b for b in range(num_blocks) if b < sink_blocks or b >= first_window}
        scored = sorted(((sum((q_fixed[h] @ units[b][h]).item() for h in range(num_heads)), b)
                         for b in units if b not in forced), key=lambda x: (-x[0], x[1]))
        picked = [b for _, b in scored[: max(topk_blocks - len(forced), 0)]]
        out.append(sorted(forced | set(picked)))
        unit_scores.append({b: score for score, b in scored})
    return (out, unit_scores) if return_scores else out


def unrotate_rope(x: Tensor, inv_freq: Tensor) -> Tensor:
    """x: [T, H, D] rotated by RoPE (rotate_half layout) at positions 0..T-1 -> the same before
    RoPE, fp64 (what infllm_reference_selections takes, from a model's post-RoPE q and k)."""
    angles = torch.arange(x.shape[0], dtype=torch.float64, device=x.device)[:, None] * inv_freq.double()  # [T, D/2]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]  # [T, 1, D]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None]
    half = x.shape[-1] // 2
    x = x.double()
    return x * cos - torch.cat((-x[..., half:], x[..., :half]), -1) * sin
