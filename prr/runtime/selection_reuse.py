"""Selection reuse inside the PRR step (prr/reuse.py names the policies; approximations, issue
53): which layers attend an A selected elsewhere instead of selecting, decided once when the
step is built (`anchors`: static per layer, so the graph engine captures it), and that A.

A reusing layer or step runs no selection, so there is nothing for speculation to hide behind:
`PRRStep` attends the reused A serially. Where the step speculates, P is still proposed as it
would have been and counted against the A attended (hit rates are against the A used), and the
predictor learns from that A (with the scores it came from)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from prr.blocks import BlockSet, Selection
from prr.reuse import NoReuse, SelectionReuse
from prr.runtime.predictor_schedule import PredictorSchedule


class ReusedSelections:
    """The step's reuse: per layer its anchor (reuse=layers) and the A it attended last (shared by
    the step's views: one list)."""

    def __init__(self, reuse: SelectionReuse | None, sparse: list[bool], max_blocks: int, capacity: int) -> None:
        """sparse: per layer; capacity: |A| at most (the selector's), between=predicted's proposal size."""
        self.policy = reuse if reuse is not None else NoReuse()
        self.anchor = self.policy.anchors(sparse)  # per layer: the layer whose A of the step it attends, or None
        self.max_blocks, self.capacity = max_blocks, capacity
        self.selected: list[Selection | None] = [None] * len(sparse)  # each layer's last selected A

    def keep(self, layer: int, selection: Selection) -> None:
        """`layer` attended `selection` (A [B, Hkv, C] with the scores [B, Hkv, NB] it came from)."""
        self.selected[layer] = selection

    def selection(self, layer: int, step: int | None, num_blocks: Tensor, query: Tensor, schedule: PredictorSchedule,
                  stage: Callable[[str], AbstractContextManager]) -> Selection | None:
        """The A `layer` attends without selecting, or None (it selects): reuse=layers, the A its
        anchor selected earlier in this step; reuse=steps off a selection step, the A it attended
        last step (between=last: its last selected A and every block begun since) or its predictor's
        top-|A| proposal (between=predicted), with this step's newest block added (the token's own
        key: a new block starts every block_size steps).
        step: the decode step from 0 (reuse=steps); num_blocks [B] int32; query [B, Hkv, G, D]."""
        anchor = self.anchor[layer]
        if anchor is not None:
            if self.selected[anchor] is None:
                raise RuntimeError(f"layer {layer} reuses layer {anchor}'s A, which has not selected yet: run the "
                                   "layers of a step in order")
            return self.selected[anchor]
        if not self.policy.varies_by_step:
            return None
        if step is None:
            raise ValueError(f"reuse={self.policy.name} needs the decode step's number: sparse_attention(step=)")
        last = self.selected[layer]  # what it attended last step
        if self.policy.selects_at(step) or last is None:  # (None: nothing selected yet in this decode)
            return None
        blocks = last.blocks
        if self.policy.between == "predicted":
            extra = {"query": query} if schedule.passes_query else {}
            with stage("predict"):
                blocks = schedule.predictor.propose(schedule.state, layer, num_blocks, self.capacity, None, **extra)
        return Selection(self.with_newest(blocks, num_blocks), last.scores)

    def with_newest(self, blocks: BlockSet, num_blocks: Tensor) -> BlockSet:
        """blocks [B, Hkv, C] and each row's newest block (num_blocks [B] - 1) -> [B, Hkv, C + 1] int32."""
        mask = blocks.mask(self.max_blocks)  # [B, Hkv, NB]
        newest = (num_blocks.long() - 1).view(-1, 1, 1).expand(*mask.shape[:2], 1)
        union = BlockSet.from_mask(mask.scatter(-1, newest, True), blocks.capacity + 1)
        return BlockSet(union.indices.to(torch.int32), union.count.to(torch.int32))

    @staticmethod
    def propose_beside(schedule: PredictorSchedule, layer: int, query: Tensor, num_blocks: Tensor,
                       predicted_blocks: int | None, speculates: bool, scratch: Callable[[], None],
                       stage: Callable[[str], AbstractContextManager]) -> bool:
        """A reusing layer's P, proposed where its step speculates as it would have been (to be
        counted and learned against the reused A; nothing speculates over it) -> whether it does.
        predicted_blocks: the eager step's |P| (0: serial), None on the graph engine (speculates:
        its plan's variant is prr). query [B, Hkv, G, D]; num_blocks [B] int32."""
        eager = predicted_blocks is not None
        speculating = bool(predicted_blocks) if eager else speculates
        if speculating and schedule.predictor is not None:
            if eager:
                schedule.size_for_step(layer, predicted_blocks, scratch)
            if eager or schedule.proposes_in_step(layer, eager):
                with stage("predict"):
                    schedule.propose(layer, query, num_blocks)
        return speculating
