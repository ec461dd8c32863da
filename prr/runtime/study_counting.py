"""The studies' counters (plan.study_counters), an observer of the PRR step: per layer, row and
KV head, summed over steps: steps counted, dense-measured steps and their mass recall and output
error, and for every ratio r of plan.study_ratios the hits of the predictor's proposal at |P| =
round(r·K) (what experiments/locality_study.py and predictor_study.py replay at that budget)."""

from __future__ import annotations

import torch
from torch import Tensor

from prr.selectors import Selection


class StudyCounters:
    """[len(names), L, B, Hkv] fp64 sums (counts stay exact up to 2^53)."""

    # Own rows first (then predicted_x{r}, hits_x{r} per ratio): steps counted, dense-measured
    # steps, and the sums of mass recall and output error over them.
    STUDY = ("steps", "measured", "mass_recall", "output_relerr")

    def __init__(self, ratios: tuple[float, ...], topk_blocks: int, num_layers: int, batch: int, num_kv_heads: int,
                 max_blocks: int, device: torch.device) -> None:
        self.ratios, self.topk_blocks, self.max_blocks = ratios, topk_blocks, max_blocks
        self.names = self.STUDY + tuple(f"{name}_x{r}" for r in ratios for name in ("predicted", "hits"))
        # Allocated whatever the plan (a few KB), so a view of the engine can turn them on.
        self.counts = torch.zeros(len(self.names), num_layers, batch, num_kv_heads, dtype=torch.float64, device=device)
        # |P| each ratio proposes at, static (a host int per captured graph): round(ratio × K), the
        # fixed budget's |P| once the context holds K blocks; each step truncates it to the row's
        # budget, min(round(ratio × min(K, blocks)), blocks).
        self.sizes = [round(r * topk_blocks) for r in ratios]

    def count_step(self, layer: int) -> None:
        """One more step of `layer`, per (row, KV head)."""
        self.counts[0, layer] += 1

    def count_measured(self, layer: int, recall: Tensor, error: Tensor) -> None:
        """A dense-measured step: recall, error [B, Hkv] (`DenseMetrics.measure`)."""
        self.counts[1, layer] += 1
        self.counts[2, layer] += recall
        self.counts[3, layer] += error

    def count_proposals(self, predictor, state, layer: int, query: Tensor | None, selection: Selection,
                        num_blocks: Tensor) -> None:
        """For every ratio r, the predictor's proposal by its torch definition, best first
        (`propose_best_first`, from the state this step's P was proposed from: call before the
        update), at the static |P| round(r·K), truncated to the fixed budget's |P| of each row,
        min(round(r·min(K, blocks)), blocks) — equal sets to the studies' replay for every
        predictor whose proposal is a top-|P| of its rank (SPIN's exploration draws from |P|
        itself, so there only while the context holds round(r·K) blocks). Adds |P_r| and
        |P_r ∩ A| per (row, KV head). query [B, Hkv, G, D] for predictors that `needs_query`,
        num_blocks [B] this step's blocks. Static shapes, no host read: capturable."""
        in_a = selection.blocks.mask(self.max_blocks)  # [B, Hkv, NB] bool
        blocks = num_blocks.to(torch.float64).view(-1, 1)  # [B, 1]
        k = float(self.topk_blocks)
        extra = {"query": query} if predictor.needs_query else {}
        current = selection if predictor.needs_current_selection else None
        first = len(self.STUDY)
        for i, (ratio, size) in enumerate(zip(self.ratios, self.sizes, strict=True)):
            if size <= 0:  # round(r·K) = 0: P is empty at this ratio
                continue
            # FixedBudget.predicted_blocks on the device (torch.round: half to even, as Python's round)
            budget = torch.minimum(torch.round(ratio * blocks.clamp(max=k)), blocks).long()  # [B, 1]
            ranking = predictor.propose_best_first(state, layer, num_blocks, size, current, **extra)  # best first
            taken = torch.arange(ranking.capacity, device=in_a.device) < torch.minimum(
                ranking.count.long(), budget).unsqueeze(-1)  # [B, Hkv, C]: the prefix of |P_r| entries
            hit = in_a.gather(-1, ranking.indices.long()) & taken  # ids are distinct: one per block
            self.counts[first + 2 * i, layer] += taken.sum(-1)
            self.counts[first + 2 * i + 1, layer] += hit.sum(-1)
