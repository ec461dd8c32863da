"""When the predictor proposes P and learns from A inside the PRR step, decided once from the
predictor's timing class when the engine is built (DESIGN.md §2):

- history only (last_step, ema, spin): learns from A on the side stream after the layer's repair
  and writes the layer's next-step P there; the graph engine's step learns every layer at once
  after the last sparse layer where the predictor can (`learns_layers_at_once`);
- reads the layer below (cross_layer): a layer's learning writes the P of the layer above for
  this step (`Predictor.proposals_after_update`);
- reads this step's query (query_similarity): proposes at the layer's start, on the side stream
  before speculation;
- the oracle (P = A): proposes after selection, no overlap;
- no predictor: P set from outside (`set_predictions`).

The schedule owns the predictor's device state and the P buffers of every layer; the step reads P
from `pred_idx` / `pred_cnt` and calls the hooks `propose`, `learn`, `size_for_step`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.predictors import Predictor
from prr.runtime.side_stream import SideStream
from prr.runtime.step_counting import StepCounters
from prr.runtime.study_counting import StudyCounters
from prr.selectors import Selection


class PredictorSchedule:
    """The predictor of one engine (None: P set from outside), its state and every layer's P."""

    def __init__(self, predictor: Predictor | None, *, speculates: bool, sparse: list[bool], batch: int,
                 num_kv_heads: int, max_blocks: int, group: int, head_dim: int, block_size: int,
                 predicted_blocks: int, selection_capacity: int, learn_range: tuple[int, int] | None,
                 device: torch.device) -> None:
        """speculates: the engine is built for PRR (P buffers and the predictor state exist only
        then); predicted_blocks: |P| of the plan; selection_capacity: |A| at most (the oracle's
        |P|); learn_range: the contiguous sparse layers learned at once (None: not contiguous)."""
        L, B, H = len(sparse), batch, num_kv_heads
        self.predictor, self.sparse, self.learn_range = predictor, sparse, learn_range
        self.batch, self.num_kv_heads, self.group, self.head_dim = B, H, group, head_dim
        self.block_size, self.max_blocks, self.capacity = block_size, max_blocks, selection_capacity
        self.device = device
        # The timing class, once (None: P from outside).
        self.oracle = predictor is not None and predictor.needs_current_selection
        self.history_only = predictor is not None and predictor.history_only
        self.passes_query = predictor is not None and predictor.needs_query  # propose gets this step's query
        # learns a range of layers in one launch (on the backend set before the schedule is built)
        self.learns_in_one_launch = predictor is not None and predictor.learns_layers_at_once()
        cap = selection_capacity if self.oracle else predicted_blocks
        # P of every layer in one buffer ([L, B, Hkv, cap], [L, B, Hkv]; a layer's P a view of it), so
        # learning of a range of layers writes all of theirs in one copy (learn_layers_at_once)
        self.pred_all = torch.zeros(L, B, H, cap, dtype=torch.int32, device=device) if speculates else None
        self.pred_cnt_all = torch.zeros(L, B, H, dtype=torch.int32, device=device) if speculates else None
        self.pred_idx = [self.pred_all[i] if speculates and s else None for i, s in enumerate(sparse)]
        self.pred_cnt = [self.pred_cnt_all[i] if speculates and s else None for i, s in enumerate(sparse)]
        # The state in a box every view shares, so a state adopted through any view is every view's
        self.state_box: list = [None]
        if speculates and predictor is not None:
            self.state = predictor.init_state(L, B, H, max_blocks, device)
            self._size_state()
        self.learned: list[Selection] = []  # this step's A held for the learning at once
        self.next_blocks: tuple[Tensor, Tensor] | None = None  # (this step's lengths, next step's block counts)

    @property
    def state(self):
        """The predictor's device state (None: no predictor, or not built for PRR)."""
        return self.state_box[0]

    @state.setter
    def state(self, value) -> None:
        self.state_box[0] = value

    def view(self) -> PredictorSchedule:
        """The same state (one box) and buffers for another plan's step (its own held selections)."""
        view = object.__new__(PredictorSchedule)
        view.__dict__.update(self.__dict__)
        view.learned = []
        return view

    def _size_state(self) -> None:
        self.predictor.size_for_query(self.state, self.group * self.head_dim)
        self.predictor.size_for_selection(self.state, self.capacity)

    def adopt_state(self, state: object) -> None:
        """Decode on from a predictor state warmed elsewhere (the eager prefill's, same class)."""
        if self.predictor is None:
            raise ValueError("this engine has no predictor (built with predictor=None: P set from outside)")
        self.state = state
        self._size_state()

    def copy_state(self, state: object) -> None:
        """A state warmed elsewhere copied into this one in place (captured graphs keep their pointers)."""
        mine, warmed = state_tensors(self.state), state_tensors(state)
        if len(mine) != len(warmed) or any(a.shape != b.shape for a, b in zip(mine, warmed, strict=False)):
            raise ValueError(f"predictor={type(self.predictor).__name__}: the prefill's state "
                             f"{[tuple(t.shape) for t in warmed]} does not fit the engine's "
                             f"{[tuple(t.shape) for t in mine]}; use runtime.engine=eager")
        for a, b in zip(mine, warmed, strict=True):
            a.copy_(b)

    def set_predictions(self, layer: int, idx: Tensor, cnt: Tensor) -> None:
        """P of `layer` from outside ([B, Hkv, |P|] int32, [B, Hkv] int32)."""
        self.pred_idx[layer].copy_(idx)
        self.pred_cnt[layer].copy_(cnt)

    def prediction(self, layer: int) -> BlockSet | None:
        """P of `layer` as it stands."""
        if self.pred_idx[layer] is None:
            return None
        return BlockSet(self.pred_idx[layer], self.pred_cnt[layer])

    def has_state(self) -> bool:
        return self.predictor is not None and self.state is not None

    # --- at the step's hooks -------------------------------------------------------------------
    def proposes_in_step(self, layer: int, eager: bool) -> bool:
        """Whether `layer`'s P is proposed at its step's start (not written ahead by an earlier
        learning: history-only predictors' previous step, cross_layer's layer below)."""
        if self.predictor is None:
            return False
        return not (self.history_only or (not eager and self.predictor.proposed_ahead(self.state, layer)))

    def propose(self, layer: int, query: Tensor | None, num_blocks: Tensor, current: Selection | None = None) -> None:
        """Write the predictor's P for a context of num_blocks [B] blocks into `layer`'s P buffers
        (query [B, Hkv, G, D]: this step's, for predictors that `needs_query`; current: A, the oracle's)."""
        extra = {"query": query} if self.passes_query else {}
        proposed = self.predictor.propose(self.state, layer, num_blocks, self.pred_idx[layer].shape[-1], current,
                                          **extra)
        self.pred_idx[layer][..., : proposed.capacity].copy_(proposed.indices)
        self.pred_cnt[layer].copy_(proposed.count)

    def size_for_step(self, layer: int, predicted_blocks: int, scratch: Callable[[], None]) -> None:
        """The eager step's P buffers at this step's |P| (the oracle's: A's capacity)."""
        cap = self.capacity if self.oracle else predicted_blocks
        if self.pred_idx[layer] is None or self.pred_idx[layer].shape[-1] != cap:
            self.pred_idx[layer] = torch.zeros(self.batch, self.num_kv_heads, cap, dtype=torch.int32, device=self.device)
            self.pred_cnt[layer] = torch.zeros(self.batch, self.num_kv_heads, dtype=torch.int32, device=self.device)
        scratch()

    def keeps_p_until_step_end(self, layer: int, at_once_possible: bool) -> bool:
        """Whether every layer's P stays what the layer speculated over until the step's end (so
        the counters may count every layer at once then): P set from outside, rewritten only by
        the learning at once, or a predictor whose update writes no P (query_similarity)."""
        if self.predictor is None or (at_once_possible and self.learns_at_once(layer, True, False)):
            return True
        first, last = self.learn_range  # (every layer alike: cross_layer's last layer writes no P, the others do)
        return all(self.predictor.proposals_after_update(self.state, i) == [] for i in range(first, last + 1))

    def learns_at_once(self, layer: int, propose_next: bool, eager: bool) -> bool:
        """Whether this step's learning waits for the last sparse layer and runs every layer's at
        once (the graph engine's step, a predictor that can, whose update completes only its own
        next P or none, over a contiguous range of sparse layers)."""
        return (propose_next and not eager and self.learn_range is not None and self.pred_all is not None
                and self.learns_in_one_launch
                and self.predictor.proposals_after_update(self.state, layer) in ([(layer, True)], []))

    def learn(self, layer: int, query: Tensor, selection: Selection, lengths: Tensor, num_blocks: Tensor,
              streams: SideStream, stage: Callable[[str], AbstractContextManager], *, at_once: bool,
              planned: torch.cuda.Event | None = None, propose_next: bool = True, same_step: bool = True,
              study: StudyCounters | None = None, counting: StepCounters | None = None) -> None:
        """The predictor learns from A on the side stream (after `planned`, recorded on the main
        stream once A and P's last readers are queued; now when None), and with propose_next
        writes the P that this update completes (`Predictor.proposals_after_update`): history-only
        predictors the next step's P of this layer, cross_layer also this step's P of the layer
        above (same_step; num_blocks [B]: this step's blocks), off that layer's critical path.
        at_once: `learns_at_once` (and the plan asks for it): held until the last sparse layer.
        study: count the study's proposals first (from the state this step's P came from).
        query [B, Hkv, G, D]."""
        if at_once and layer != self.learn_range[1] and study is None:
            self.learned.append(selection)  # learned with the last sparse layer's, at the end of the step
            return
        streams.after(planned)
        streams.share(selection.blocks.indices, selection.blocks.count, selection.scores)
        if study is not None:  # from the state this step's P came from: before the update
            with streams.on_side():
                study.count_proposals(self.predictor, self.state, layer, query, selection, num_blocks)
        if at_once:
            if layer != self.learn_range[1]:  # (study counters: each layer's read the state before any update)
                self.learned.append(selection)
                return
            self._learn_layers(lengths, [*self.learned, selection], streams, stage, counting)
            return
        with streams.on_side(), stage("predict"):  # learn from A; history-only predictors write next step's P now
            self.predictor.update(self.state, layer, selection)
            if not propose_next:
                return
            for target, next_step in self.predictor.proposals_after_update(self.state, layer):
                if next_step:
                    self.propose(target, query, self._next_step_blocks(lengths))
                elif same_step:
                    self.propose(target, query, num_blocks)

    def _learn_layers(self, lengths: Tensor, selections: list[Selection], streams: SideStream,
                      stage: Callable[[str], AbstractContextManager], counting: StepCounters | None) -> None:
        """Every sparse layer's update from this step's A (selections, one per layer of
        learn_range) and, for history-only predictors, the next step's P of each, in one update
        and one propose launch, on the side stream once the last layer is repaired."""
        first, last = self.learn_range
        if len(selections) != last - first + 1:
            raise RuntimeError(f"learning layers {first}..{last} at once got {len(selections)} selections: "
                               "a step ran some sparse layers without learning")
        for sel in selections:  # made on the main stream, read on the side stream
            streams.share(sel.blocks.indices, sel.blocks.count, sel.scores)
        self.learned = []
        # A as this step's end-of-step count stacked it (on the side stream, before): no second copy
        stacked = counting.take_stacked([s.blocks.indices for s in selections]) if counting is not None else None
        with streams.on_side(), stage("predict"):
            self.predictor.update_layers(self.state, first, selections, blocks=stacked)
            if self.predictor.proposals_after_update(self.state, first) == []:
                return  # (query_similarity: its update writes no P; each layer proposes in the step)
            idx, cnt = self.predictor.propose_layers(self.state, first, len(selections),
                                                     self._next_step_blocks(lengths), self.pred_all.shape[-1])
            self.pred_all[first : last + 1, ..., : idx.shape[-1]].copy_(idx)
            self.pred_cnt_all[first : last + 1].copy_(cnt)

    def _next_step_blocks(self, lengths: Tensor) -> Tensor:
        """lengths [B] (this step's tokens) -> [B] blocks of the next step's context (lengths + 1
        tokens), computed once per step on the stream of the first caller and reused by the other
        layers' learning there. (From `lengths`, made at the step's start: `pos` advances on the
        main stream while side work may still run.)"""
        if self.next_blocks is None or self.next_blocks[0] is not lengths:
            bs = self.block_size
            self.next_blocks = (lengths, (lengths + bs).div(bs, rounding_mode="floor"))
        return self.next_blocks[1]

    # --- between requests ----------------------------------------------------------------------
    def prime(self, num_blocks: Tensor) -> None:
        """P of the first decode step (num_blocks [B]: its context's blocks) from the state, for
        the layers whose P a step's learning writes for the next step; the others are proposed
        inside the step."""
        if not self.has_state():
            return
        for layer in range(len(self.sparse)):
            if self.sparse[layer]:
                for target, next_step in self.predictor.proposals_after_update(self.state, layer):
                    if next_step:
                        self.propose(target, None, num_blocks)

    def reset_state(self) -> None:
        """The predictor state back to `init_state`'s, in place (captured graphs stay valid)."""
        if self.state is None:
            return
        fresh = self.predictor.init_state(len(self.sparse), self.batch, self.num_kv_heads, self.max_blocks, self.device)
        for mine, new in zip(state_tensors(self.state), state_tensors(fresh), strict=True):
            if mine.shape == new.shape:
                mine.copy_(new)
            else:  # sized on first use (query_similarity's query store): its empty value is 0
                mine.zero_()

    def clear_predictions(self) -> None:
        """|P| = 0 in every layer (a new request's start)."""
        for cnt in self.pred_cnt:
            if cnt is not None:
                cnt.zero_()

    def tensors(self) -> list[Tensor]:
        """What a step mutates here (a checkpoint's share): P and the predictor state."""
        out = [t for t in (self.pred_all, self.pred_cnt_all) if t is not None]
        return out + state_tensors(self.state)


def state_tensors(state: object) -> list[Tensor]:
    """Every tensor of a predictor state (a tensor, a dataclass, a dict, or lists of them)."""
    import dataclasses

    if isinstance(state, Tensor):
        return [state]
    if dataclasses.is_dataclass(state):
        state = [getattr(state, f.name) for f in dataclasses.fields(state)]
    elif isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, list | tuple):
        return [t for item in state for t in state_tensors(item)]
    return []
