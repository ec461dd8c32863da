"""Selection reuse inside the PRR step (prr/reuse.py names the policies; approximations, issue
53): which layers attend an A selected elsewhere instead of selecting, decided once when the
step is built (`anchors`: static per layer, so the graph engine captures it), and that A.

reuse=steps depends on the step number: the eager step is given it (`sparse_attention(step=)`);
the graph engine captures two views of its step, a selecting one and one between selections
(`StaticPlan.between_selections`), and the host replays one or the other per step
(prr/runtime/step_views.py). Each layer's last attended A lives in static buffers of one
capacity (`width`: |A| plus the blocks it can gain before the next selection), which both
runtimes' steps write after every layer and the step between selections reads: every A of such an
engine, selected or reused, is counted and learned at that capacity (the graph engine's counters
and learning at once stack one capacity).

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
from prr.runtime.engine_ops import EngineOps
from prr.runtime.predictor_schedule import PredictorSchedule
from prr.runtime.static_plan import StaticPlan


def reused_width(policy: SelectionReuse, capacity: int) -> int:
    """|A| at most as a layer attends it (capacity: the selector's): reuse=steps adds the newest
    block at each step between selections (between=last: to the last A, every - 1 steps in a row;
    between=predicted: to a top-|A| proposal, once)."""
    if not policy.varies_by_step or policy.every == 1:
        return capacity
    return capacity + (policy.every - 1 if policy.between == "last" else 1)


class ReusedSelections:
    """The step's reuse: per layer its anchor (reuse=layers) and the A it attended last (shared by
    the step's views: one object)."""

    def __init__(self, reuse: SelectionReuse | None, sparse: list[bool], batch: int, num_kv_heads: int,
                 max_blocks: int, capacity: int, device: torch.device, ops: EngineOps) -> None:
        """sparse: per layer; capacity: |A| at most (the selector's), between=predicted's proposal size;
        ops: the step's engine ops (the newest block is added by `ops.append_newest_block`)."""
        self.ops = ops
        self.policy = reuse if reuse is not None else NoReuse()
        self.anchor = self.policy.anchors(sparse)  # per layer: the layer whose A of the step it attends, or None
        self.max_blocks, self.capacity = max_blocks, capacity
        self.width = reused_width(self.policy, capacity)  # |A| at most as attended
        self.selected: list[Selection | None] = [None] * len(sparse)  # reuse=layers: each layer's A of this step
        # reuse=steps: each sparse layer's last attended A ([B, Hkv, width] int32 zero-padded, [B, Hkv]
        # int32) and the scores it was selected with ([B, Hkv, NB] fp32), static (a captured step reads them)
        self.kept: list[Selection | None] = [None] * len(sparse)
        self.buffers: list[Tensor] = []
        if self.policy.varies_by_step:
            L = len(sparse)
            self.buffers = [torch.zeros(L, batch, num_kv_heads, self.width, dtype=torch.int32, device=device),
                            torch.zeros(L, batch, num_kv_heads, dtype=torch.int32, device=device),
                            torch.zeros(L, batch, num_kv_heads, max_blocks, dtype=torch.float32, device=device)]
            idx, cnt, scores = self.buffers
            self.kept = [Selection(BlockSet(idx[i], cnt[i]), scores[i]) if s else None for i, s in enumerate(sparse)]
        self.kept_once = [False] * len(sparse)  # (host: the eager step's check that a layer selected first)

    def keep(self, layer: int, selection: Selection) -> Selection:
        """`layer` attended `selection` (A [B, Hkv, C] with the scores [B, Hkv, NB] it came from)
        -> A as counted and learned: reuse=steps, its copy in the layer's static buffers (width
        `width`, zero-padded: `ops.keep_selection`, nothing to copy for an A `with_newest` wrote
        there); else `selection` itself."""
        kept = self.kept[layer]
        if kept is None:
            self.selected[layer] = selection
            return selection
        blocks, width = selection.blocks, self.width
        if blocks.capacity > width:  # (static shapes: a host check, never a device read)
            raise RuntimeError(f"layer {layer}'s A holds {blocks.capacity} blocks, the reuse buffers {width}")
        fresh_scores = selection.scores if selection.scores is not kept.scores else None
        if blocks.indices is not kept.blocks.indices:  # a selected A: one launch on backend triton
            self.ops.keep_selection(blocks.indices, blocks.count, fresh_scores, kept.blocks.indices,
                                    kept.blocks.count, kept.scores)
        elif fresh_scores is not None:  # (with_newest wrote A in the buffers already)
            kept.scores.copy_(fresh_scores)
        self.kept_once[layer] = True
        return kept

    def selection(self, layer: int, step: int | None, between_view: bool, num_blocks: Tensor, query: Tensor,
                  schedule: PredictorSchedule, stage: Callable[[str], AbstractContextManager]) -> Selection | None:
        """The A `layer` attends without selecting, or None (it selects): reuse=layers, the A its
        anchor selected earlier in this step; reuse=steps between selections, the A it attended
        last step (between=last: its last selected A and every block begun since) or its predictor's
        top-|A| proposal (between=predicted), with this step's newest block added (the token's own
        key: a new block starts every block_size steps).
        step: the eager step's decode step from 0; None: the graph engine's, whose view says
        whether it runs between selections (`between_view`: plan.between_selections).
        num_blocks [B] int32; query [B, Hkv, G, D]."""
        anchor = self.anchor[layer]
        if anchor is not None:
            if self.selected[anchor] is None:
                raise RuntimeError(f"layer {layer} reuses layer {anchor}'s A, which has not selected yet: run the "
                                   "layers of a step in order")
            return self.selected[anchor]
        if self.kept[layer] is None or not (between_view if step is None else not self.policy.selects_at(step)):
            return None
        if step is not None and not self.kept_once[layer]:
            raise RuntimeError(f"reuse={self.policy.name}: layer {layer} reuses its last A at decode step {step}, "
                               "before it selected one: decode from step 0")
        blocks = self.kept[layer].blocks
        if self.policy.between == "predicted":
            extra = {"query": query} if schedule.passes_query else {}
            with stage("predict"):
                blocks = schedule.predictor.propose(schedule.state, layer, num_blocks, self.capacity, None, **extra)
        return Selection(self.with_newest(layer, blocks, num_blocks), self.kept[layer].scores)

    def with_newest(self, layer: int, blocks: BlockSet, num_blocks: Tensor) -> BlockSet:
        """blocks [B, Hkv, C] and each row's newest block (num_blocks [B] - 1) -> their union
        [B, Hkv, width] int32 ascending, zero padded (it fits: `reused_width`), written in `layer`'s
        static buffers (in place under between=last: blocks are those buffers), so `keep` copies
        nothing: one launch on backend triton (prr.kernels.append_newest)."""
        kept = self.kept[layer].blocks
        return BlockSet(*self.ops.append_newest_block(blocks.indices, blocks.count, num_blocks, self.width,
                                                      out=(kept.indices, kept.count)))

    def tensors(self) -> list[Tensor]:
        """What a step mutates here (a checkpoint's share): reuse=steps' last A of every layer."""
        return list(self.buffers)

    def instead_of_selecting(self, layer: int, step: int | None, plan: StaticPlan, num_blocks: Tensor, query: Tensor,
                             predicted_blocks: int | None, schedule: PredictorSchedule, scratch: Callable[[], None],
                             stage: Callable[[str], AbstractContextManager]) -> tuple[Selection | None, bool]:
        """`PRRStep.sparse_attention`'s first question -> (the A `layer` attends without selecting, or
        None: it selects (`selection`, of the step's plan); whether its step speculates, P proposed
        beside it (`propose_beside`))."""
        reused = self.selection(layer, step, plan.between_selections, num_blocks, query, schedule, stage)
        if reused is None:
            return None, False
        return reused, self.propose_beside(schedule, layer, query, num_blocks, predicted_blocks,
                                           plan.variant == "prr", scratch, stage)

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
