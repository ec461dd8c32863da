"""`ema`: an exponential moving average of standardised selector scores, plus selection
stickiness and a recency bonus. The paper's exact formula is not public; ours:

    z_t(b)    = (s_t(b) − mean_b s_t) / std_b s_t          selector score of block b at step t,
                                                             standardised per KV head
    e_t(b)    = α · e_{t−1}(b) + (1 − α) · z_t(b)            (new blocks start at e = 0: average)
    rank_{t+1}(b) = e_t(b) + β · 1[b ∈ A_t] + γ · 1[b among the `recent_blocks` newest]

P = the top-|P| blocks by rank (ties to the lower block id). With calibrate=True (opt-in since issue 53: it
costs about a decode step per request on the CPU for +1.5 points of hit rate at |P| = K) α, β, γ are
calibrated per prompt by grid search: replay the selections of the prefill tail and keep the triple
with the highest hit rate at |P| = |A| (one triple per run, or one per layer with per_layer=True). One given in the config
(`predictor.alpha=0.5`) is kept: the search runs over the others' grids only (null, the
default, means calibrate it).

On backend triton (prr.kernels.predict): propose = one rank launch + the top-k kernel, update =
one launch (standardise, EMA, last_selected); the torch ops here are the definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from prr.blocks import BlockSet, block_counts, inside_context

# z-scores over each row's finite entries, 0 elsewhere: written once, beside the update kernel
# whose reference it is (kernels/ import nothing from prr; prr wraps them, as top_k_blocks)
from prr.kernels.reference_predict import standardise_reference as standardise
from prr.predictors.base import NEVER, Predictor, stacked_blocks
from prr.predictors.options import EmaPredictorOptions
from prr.selectors.base import Selection


@dataclass
class EmaState:
    ema: Tensor  # [L, B, Hkv, max_blocks] fp32
    last_selected: Tensor  # [L, B, Hkv, max_blocks] bool: A_{t-1}
    alpha: Tensor  # [L] decay per layer
    stickiness: Tensor  # [L]
    recency: Tensor  # [L]


def newest_mask(num_blocks: Tensor, recent_blocks: int, max_blocks: int) -> Tensor:
    """num_blocks [B] -> [B, 1, max_blocks] bool: each row's `recent_blocks` newest blocks."""
    ids = torch.arange(max_blocks, device=num_blocks.device)
    nb = num_blocks.view(-1, 1, 1)
    return (ids >= nb - recent_blocks) & (ids < nb)


def memberships(blocks: list[BlockSet], max_blocks: int) -> Tensor:
    """X block sets ([B, Hkv, C_x] each) -> their masks [X, B, Hkv, max_blocks] bool, made at once
    (one `mask` of the stack, capacities padded to the widest: entries past a count are padding)."""
    width = max(b.indices.shape[-1] for b in blocks)
    indices = torch.stack([torch.nn.functional.pad(b.indices, (0, width - b.indices.shape[-1])) for b in blocks])
    return BlockSet(indices, torch.stack([b.count for b in blocks])).mask(max_blocks)


class EmaPredictor(EmaPredictorOptions, Predictor):
    # the constructor is EmaPredictorOptions' (prr.predictors.options: no torch, checked before torch is imported)

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> EmaState:
        shape = (num_layers, batch, num_kv_heads, max_blocks)
        if self._fitted is not None:
            alpha, stick, rec = (p.to(device) for p in self._fitted)
        else:
            alpha, stick, rec = (torch.full((num_layers,), v, device=device) for v in
                                 (self.alpha, self.stickiness, self.recency))
        return EmaState(torch.zeros(shape, device=device), torch.zeros(shape, dtype=torch.bool, device=device),
                        alpha, stick, rec)

    def triton_problems(self) -> list[str]:
        return []

    def propose(self, state: EmaState, layer: int, num_blocks: int | Tensor, budget_blocks: int,
                current: Selection | None = None, query: Tensor | None = None) -> BlockSet:
        if self.backend != "triton" or budget_blocks <= 0:
            return super().propose(state, layer, num_blocks, budget_blocks)
        from prr.kernels.predict import ema_propose

        one = slice(layer, layer + 1)
        return BlockSet(*ema_propose(state.ema[layer], state.last_selected[layer], state.stickiness[one],
                                     state.recency[one], num_blocks, self.recent_blocks, budget_blocks))

    def rank(self, state: EmaState, layer: int, num_blocks: int | Tensor) -> Tensor:
        max_blocks = state.ema.shape[-1]
        nb = block_counts(num_blocks, state.ema.shape[1], state.ema.device)  # [B]
        recent = newest_mask(nb, self.recent_blocks, max_blocks)  # [B, 1, N]
        score = state.ema[layer] + state.stickiness[layer] * state.last_selected[layer] + state.recency[layer] * recent
        return score.masked_fill(~inside_context(nb, max_blocks), NEVER)  # [B, Hkv, N]

    def update(self, state: EmaState, layer: int, selection: Selection) -> None:
        if self.backend == "triton":
            from prr.kernels.predict import ema_update

            ema_update(selection.scores, selection.blocks.indices, selection.blocks.count,
                       state.alpha[layer : layer + 1], state.ema[layer], state.last_selected[layer])
            return
        z = standardise(selection.scores)  # [B, Hkv, N]
        a = state.alpha[layer]  # a 0-dim device tensor: no sync
        state.ema[layer] = torch.where(torch.isfinite(selection.scores), a * state.ema[layer] + (1 - a) * z, state.ema[layer])
        state.last_selected[layer] = selection.blocks.mask(state.ema.shape[-1])

    def learn_tail(self, state: EmaState, history: list[list[Selection] | None]) -> None:
        """`update` of every layer and tail step, batched over the layers whose tails have one
        length (T steps of [L', B, Hkv, N] ops instead of L'·T of [B, Hkv, N]; equal, tested). On
        backend triton, `update`'s kernel layer by layer (where `update_layers` is not asked for)."""
        if self.backend == "triton":
            super().learn_tail(state, history)
            return
        layers = [i for i, h in enumerate(history) if h]
        for length in sorted({len(history[i]) for i in layers}):
            group = [i for i in layers if len(history[i]) == length]
            at = torch.tensor(group, device=state.ema.device)
            a = state.alpha[at].view(-1, 1, 1, 1)  # [L', 1, 1, 1]
            ema = state.ema[at]  # [L', B, Hkv, N]
            for t in range(length):
                scores = torch.stack([history[i][t].scores for i in group])  # [L', B, Hkv, N]
                ema = torch.where(torch.isfinite(scores), a * ema + (1 - a) * standardise(scores), ema)
            state.ema[at] = ema
            state.last_selected[at] = memberships([history[i][-1].blocks for i in group], state.ema.shape[-1])

    layer_range_kernels = True  # (the torch definition learns layer by layer)

    def update_layers(self, state: EmaState, first: int, selections: list[Selection],
                      blocks: BlockSet | None = None) -> None:
        from prr.kernels.predict import ema_update_layers

        span = slice(first, first + len(selections))
        blocks = stacked_blocks(selections, blocks)
        ema_update_layers(torch.stack([s.scores for s in selections]), blocks.indices, blocks.count,
                          state.alpha[span], state.ema[span], state.last_selected[span])

    def propose_layers(self, state: EmaState, first: int, layers: int, num_blocks: int | Tensor,
                       budget_blocks: int) -> tuple[Tensor, Tensor]:
        from prr.kernels.predict import ema_propose_layers

        span = slice(first, first + layers)
        return ema_propose_layers(state.ema[span], state.last_selected[span], state.stickiness[span],
                                  state.recency[span], num_blocks, self.recent_blocks, budget_blocks)

    def calibrate(self, history: list[list[Selection] | None]) -> dict[str, Any]:
        """Grid search of (α, β, γ) on the prefill tail; see the module docstring."""
        if not self.calibrate_on_prefill:
            return {}
        layers = [i for i, h in enumerate(history) if h]
        if not layers:
            return {}
        steps = min(len(history[i]) for i in layers)
        if steps <= self.burn_in_steps + 1:
            raise ValueError(
                f"EMA calibration needs more than burn_in_steps+1={self.burn_in_steps + 1} prefill-tail steps, got {steps};"
                " raise runtime.calibration_tokens or set predictor.calibrate=false"
            )
        # Stack the tail: scores/selected [T, L', B, Hkv, N]
        scores = torch.stack([torch.stack([history[i][t].scores for i in layers]) for t in range(steps)])
        n = scores.shape[-1]
        selected = memberships([history[i][t].blocks for t in range(steps) for i in layers], n)
        selected = selected.unflatten(0, (steps, len(layers)))
        z = standardise(scores)
        finite = torch.isfinite(scores)
        num_blocks = finite[..., 0, :].sum(-1)  # [T, L', B] context blocks per step and row (rows may differ)
        hits, wanted = self._grid_hits(z, finite, selected, num_blocks)
        hit_rate = hits / wanted.clamp(min=1)  # [C, L']
        num_layers = len(history)
        hit_rate, best = hit_rate.cpu(), (hit_rate.argmax(0) if self.per_layer else hit_rate.mean(1).argmax().expand(len(layers))).cpu()
        params = torch.tensor([[self.alpha, self.stickiness, self.recency]] * num_layers)
        for j, i in enumerate(layers):
            params[i] = torch.tensor(self.grid[int(best[j])])
        self._fitted = (params[:, 0].clone(), params[:, 1].clone(), params[:, 2].clone())
        chosen = self.grid[int(best[0])]
        return {
            "calibration_steps": steps - self.burn_in_steps - 1,
            "alpha": chosen[0] if not self.per_layer else params[:, 0].tolist(),
            "stickiness": chosen[1] if not self.per_layer else params[:, 1].tolist(),
            "recency": chosen[2] if not self.per_layer else params[:, 2].tolist(),
            "calibration_hit_rate": float(hit_rate.gather(0, best.view(1, -1)).mean()),
            "kept": list(self.kept),  # the parameters the config gave (not searched)
        }

    def _grid_hits(self, z: Tensor, finite: Tensor, selected: Tensor, num_blocks: Tensor) -> tuple[Tensor, Tensor]:
        """The tail replayed under every (α, β, γ) of the grid: z, finite, selected [T, L', B, Hkv, N]
        (z-scores, in-context blocks, A_t), num_blocks [T, L', B] -> (hits [C, L'] of P = the top
        |A_t| blocks of each rank at steps past the burn-in, wanted [L']: their Σ|A_t|).

        The same sums as ranking each triple apart and taking the top |A_t| by a stable descending
        sort (ties to the lower block id), computed cheaper: the EMA depends on α alone (one per α,
        not per triple), and P's members are those ranked above the |A_t|-th largest rank plus the
        lowest-id blocks tied with it (one top-k of the largest |A_t|, no full sort)."""
        dev, n = z.device, z.shape[-1]
        alphas, sticks, recs = (torch.tensor(axis, device=dev) for axis in self.grid_axes)
        na, ns, nr = len(alphas), len(sticks), len(recs)
        alphas = alphas.view(na, 1, 1, 1, 1)  # [A, 1, 1, 1, 1]
        sticks = sticks.view(1, ns, 1, 1, 1, 1, 1)  # [1, S, 1, 1, 1, 1, 1]
        recs = recs.view(1, 1, nr, 1, 1, 1, 1)  # [1, 1, R, 1, 1, 1, 1]
        ema = torch.zeros(na, *z.shape[1:], device=dev)  # [A, L', B, Hkv, N]
        hits = torch.zeros(na, ns, nr, z.shape[1], device=dev)
        wanted = torch.zeros(z.shape[1], device=dev)
        ids = torch.arange(n, device=dev)
        for t in range(z.shape[0]):
            if t > self.burn_in_steps:
                nb = num_blocks[t].view(*num_blocks.shape[1:], 1, 1)  # [L', B, 1, 1]
                recent = (ids >= nb - self.recent_blocks) & (ids < nb)  # [L', B, 1, N]
                # (ema + β·A_{t-1}) + γ·recent, as one triple's rank; out of context: NEVER (+ 0: recent is
                # false there)
                sticky = (ema.unsqueeze(1) + sticks[:, :, 0] * selected[t - 1]).masked_fill(ids >= nb, NEVER)
                rank = sticky.unsqueeze(2) + recs * recent  # [A, S, R, L', B, Hkv, N]
                # |A_t| per row: predict that many (int32 sums and cumsums: a bool's int64 default is
                # a slow cast on the CPU)
                size = selected[t].sum(-1, keepdim=True, dtype=torch.int32)  # [L', B, Hkv, 1]
                smallest, largest = int(size.min()), int(size.max())
                if largest:
                    if smallest == largest:  # (the usual case: one |A_t| for every row) the k-th largest
                        kth = rank.kthvalue(n - largest + 1, dim=-1, keepdim=True).values
                    else:
                        top = rank.topk(largest, dim=-1).values  # [A, S, R, L', B, Hkv, largest], descending
                        kth = top.gather(-1, (size.long() - 1).clamp(min=0).expand(*top.shape[:-1], 1))
                    above = rank > kth  # kth: [A, S, R, L', B, Hkv, 1], the |A_t|-th largest rank
                    tied = rank == kth
                    room = size - above.sum(-1, keepdim=True, dtype=torch.int32)  # tied blocks P still takes
                    in_p = (above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= room))) & (size > 0)
                    hits += (in_p & selected[t]).sum((-1, -2, -3), dtype=torch.int32).float()
                wanted += selected[t].sum((-1, -2, -3)).float()
            ema = torch.where(finite[t], alphas * ema + (1 - alphas) * z[t], ema)
        return hits.flatten(0, 2), wanted  # [C, L'] in the grid's order (α-major)
