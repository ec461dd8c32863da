"""`spin`: vertical and diagonal EMAs of past block scores, max-pooled, with a small
random-exploration share (after SPIN, arXiv 2610.09025; our reading of its description):

    x_t(b)   = z_t(b) + selection_bonus · 1[b ∈ A_t]      z: selector score standardised per KV head
                                                            (the bonus shows forced blocks, sinks and
                                                            the newest, that raw scores do not)
    v_t(b)   = α_v · v_{t−1}(b) + (1 − α_v) · x_t(b)        vertical: block b itself
    d_t(δ)   = α_d · d_{t−1}(δ) + (1 − α_d) · x_t(n_t − 1 − δ)
                                                            diagonal: the block δ blocks behind the
                                                            newest one (n_t blocks in the context)
    rank_{t+1}(b) = max(v_t(b), d_t(n_{t+1} − 1 − b))       max-pooled

P = the best ⌈(1 − explore)·|P|⌉ blocks by rank, then the rest of the budget drawn uniformly
from the other blocks of the context (exploration finds blocks that turn relevant without a
score history). The draw is counter-based, computed on the device: each block gets

    u(b) = hash(seed, layer, selections seen by the layer, KV head, b) / 2^32   in [0, 1)

(`uniform_draw`: the lowbias32 integer mixer chained over those keys, in int64 arithmetic
that never overflows), and the drawn blocks are the other blocks of highest u. So a
proposal is a deterministic function of the state (proposing twice in one step gives the
same P), nothing is seeded on the host per call, and it captures in a CUDA graph. The batch
row is not a key: a row's P does not depend on which batch it runs in.
Unseen blocks and distances start at 0 (average).

On backend triton (prr.kernels.predict): update = one launch; propose = one launch (rank and
draw) + the top-k kernel, and with exploration a top-k of the exploited blocks, one launch
marking them and a top-k over the draw (the same set as the torch path's, in ascending order).
A range of layers learns and proposes at once with the same launches over its L·B rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from prr.blocks import BlockSet, block_counts, inside_context, top_blocks
from prr.predictors.base import NEVER, Predictor, stacked_blocks
from prr.predictors.ema import standardise
from prr.predictors.options import SpinPredictorOptions
from prr.selectors.base import Selection


@dataclass
class SpinState:
    vertical: Tensor  # [L, B, Hkv, max_blocks] fp32 EMA per block id
    diagonal: Tensor  # [L, B, Hkv, max_blocks] fp32 EMA per distance δ from the newest block (δ = 0: newest)
    updates: Tensor  # [L] int64 selections seen per layer (a key of the exploration draw)


MASK32 = 0xFFFF_FFFF


def mul32(x: Tensor | int, c: int) -> Tensor | int:
    """x · c mod 2^32 for x in [0, 2^32), by 16-bit halves of c: every product stays below
    2^49, so int64 never overflows (its wrap-around is undefined behaviour in C++ kernels)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32(x: Tensor | int) -> Tensor | int:
    """lowbias32 (C. Wellons' hash-prospector): a bijection of [0, 2^32) where every input
    bit flips about half the output bits. Values stay non-negative, so >> is a logical shift.
    Works alike on host ints and int64 tensors."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The seed's part of the draw's key, in [0, 2^32): mix32 chained over the seed's two halves."""
    key = 0
    for part in (seed & MASK32, (seed >> 32) & MASK32):  # host constants, fixed for the run
        key = mix32(key ^ part)
    return key


def draw_key(seed: int, layer: int) -> int:
    """The host part of the draw's key, in [0, 2^32): mix32 chained over (seed, layer) (the
    kernels of a layer range mix the layer into `seed_key` themselves)."""
    return mix32(seed_key(seed) ^ layer)


def uniform_draw(seed: int, layer: int, step: Tensor, shape: tuple[int, int, int]) -> Tensor:
    """step: 0-dim int64 device tensor -> [B, Hkv, N] fp32 uniform in [0, 1), a pure function
    of (seed, layer, step, KV head, block); rows of the batch share it (batch invariance)."""
    key = draw_key(seed, layer)
    b, h, n = shape
    head_block = torch.arange(h * n, device=step.device).view(1, h, n)  # [1, Hkv, N]
    bits = mix32(mix32(key ^ (step & MASK32)) ^ head_block)  # [1, Hkv, N] in [0, 2^32)
    return ((bits >> 8).float() * 2.0**-24).expand(b, h, n)  # 24 bits: exact in fp32, never 1.0


class SpinPredictor(SpinPredictorOptions, Predictor):
    # the constructor is SpinPredictorOptions' (prr.predictors.options: no torch, checked before torch is imported)

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> SpinState:
        shape = (num_layers, batch, num_kv_heads, max_blocks)
        return SpinState(torch.zeros(shape, device=device), torch.zeros(shape, device=device),
                         torch.zeros(num_layers, dtype=torch.int64, device=device))

    def triton_problems(self) -> list[str]:
        return []

    def rank(self, state: SpinState, layer: int, num_blocks: int | Tensor) -> Tensor:
        """-> [B, Hkv, max_blocks]: max of the vertical and diagonal EMAs; NEVER past the context."""
        batch, heads, max_blocks = state.vertical.shape[1:]
        nb = block_counts(num_blocks, batch, state.vertical.device)  # [B]
        ids = torch.arange(max_blocks, device=nb.device)
        distance = (nb.view(-1, 1, 1) - 1 - ids).clamp(0, max_blocks - 1)  # [B, 1, N] of block b from the newest
        diagonal = torch.gather(state.diagonal[layer], -1, distance.expand(-1, heads, -1))  # [B, Hkv, N] by block id
        score = torch.maximum(state.vertical[layer], diagonal)
        return score.masked_fill(~inside_context(nb, max_blocks), NEVER)

    def propose(
        self, state: SpinState, layer: int, num_blocks: int | Tensor, budget_blocks: int,
        current: Selection | None = None, query: Tensor | None = None,
    ) -> BlockSet:
        explored = math.floor(self.explore * budget_blocks)  # host int: the budget is static
        if self.backend == "triton" and budget_blocks > 0:
            from prr.kernels.predict import spin_propose

            return BlockSet(*spin_propose(state.vertical[layer], state.diagonal[layer], num_blocks,
                                          state.updates[layer : layer + 1], draw_key(self.seed, layer), budget_blocks,
                                          explored))
        rank = self.rank(state, layer, num_blocks)  # [B, Hkv, N]
        if explored == 0:
            return top_blocks(rank, budget_blocks)
        n = rank.shape[-1]
        exploit = budget_blocks - explored
        order = torch.sort(rank, dim=-1, descending=True, stable=True).indices  # [B, Hkv, N]
        position = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=rank.device).expand_as(order))
        inside = rank > NEVER
        best = (position < exploit) & inside
        draw = uniform_draw(self.seed, layer, state.updates[layer], tuple(rank.shape))  # [B, Hkv, N] in [0, 1)
        # Exploited blocks keep their order ahead of every drawn one (keys > 1), so the
        # proposal stays best-first; the drawn ones follow in random order.
        key = torch.where(best, 2.0 + (exploit - position).float(), torch.where(inside, draw, torch.full_like(draw, NEVER)))
        return top_blocks(key, budget_blocks)

    layer_range_kernels = True  # (the torch definition learns layer by layer)

    def update_layers(self, state: SpinState, first: int, selections: list[Selection],
                      blocks: BlockSet | None = None) -> None:
        from prr.kernels.predict import spin_update_layers

        span = slice(first, first + len(selections))
        blocks = stacked_blocks(selections, blocks)
        spin_update_layers(torch.stack([s.scores for s in selections]), blocks.indices, blocks.count,
                           state.vertical[span], state.diagonal[span], state.updates[span], self.alpha_vertical,
                           self.alpha_diagonal, self.selection_bonus)

    def propose_layers(self, state: SpinState, first: int, layers: int, num_blocks: int | Tensor,
                       budget_blocks: int) -> tuple[Tensor, Tensor]:
        from prr.kernels.predict import spin_propose_layers

        span = slice(first, first + layers)
        return spin_propose_layers(state.vertical[span], state.diagonal[span], num_blocks, state.updates[span],
                                   seed_key(self.seed), first, budget_blocks, math.floor(self.explore * budget_blocks))

    def update(self, state: SpinState, layer: int, selection: Selection) -> None:
        if self.backend == "triton":
            from prr.kernels.predict import spin_update

            spin_update(selection.scores, selection.blocks.indices, selection.blocks.count, state.vertical[layer],
                        state.diagonal[layer], state.updates[layer : layer + 1], self.alpha_vertical,
                        self.alpha_diagonal, self.selection_bonus)
            return
        scores = selection.scores  # [B, Hkv, N], -inf past the context
        n = scores.shape[-1]
        finite = torch.isfinite(scores)
        x = standardise(scores) + self.selection_bonus * selection.blocks.mask(n)  # [B, Hkv, N]
        a_v, a_d = self.alpha_vertical, self.alpha_diagonal
        state.vertical[layer] = torch.where(finite, a_v * state.vertical[layer] + (1 - a_v) * x, state.vertical[layer])
        num_blocks = finite.sum(-1, keepdim=True)  # [B, Hkv, 1]
        distance = torch.arange(n, device=scores.device)
        source = (num_blocks - 1 - distance).clamp(min=0)  # block at distance δ: [B, Hkv, N]
        x_by_distance = torch.gather(x, -1, source)
        state.diagonal[layer] = torch.where(distance < num_blocks, a_d * state.diagonal[layer] + (1 - a_d) * x_by_distance,
                                            state.diagonal[layer])
        state.updates[layer] += 1  # in place on the device
