"""One sparse layer's decode attention, the one PRR step of both runtimes (DESIGN.md §2):

    predict -> (speculate ∥ select) -> repair A \\ P -> merge -> update predictor

with static shapes and no host synchronisation, over a PagedKVCache and the run's own selector,
on one op backend (prr/runtime/engine_ops.py: Triton kernels, or torch ops on any device).

The step owns its buffers and its streams and does select ∥ speculate -> repair -> merge. The
rest sits at fixed hooks, each decided when the step is built:
- `PredictorSchedule` (prr/runtime/predictor_schedule.py): when P is proposed and when the
  predictor learns, from the predictor's timing class; it owns P and the predictor state;
- observers (`StepObservers`): `StepCounters` (|A|, |P|, hits, last-step overlap), `DenseMetrics`
  (mass recall and output error against dense attention), `StudyCounters` (the studies' per-head counts);
- `SideStream`: the second CUDA stream;
- `ReusedSelections` (prr/runtime/selection_reuse.py): the layers (reuse=layers) or steps (reuse=steps)
  that attend a reused A instead of selecting, serially (approximations; default reuse=none).

Two callers run this same step:
- the graph engine (`GraphDecoder`, which holds one and adds the model's forward) captures it in a
  CUDA graph: speculation on the side stream beside selection (exact on the kernels: inside
  selection's own launch), P written on that stream right after the learning that completes it,
  |P| fixed by the plan;
- the research runtime (`DSABackend`) runs it eagerly (`PRRStep.eager`), one stage after the
  other, with a `StageTimer` around each stage and the budget's |P| for this step
  (`predicted_blocks=`), P proposed at the start of the step at that size (0: a serial DSA step).

Selectors that `compensate` (LESS) merge their estimate of the unselected blocks after repair,
also under serial DSA, so exact-mode PRR and serial DSA receive the same compensation.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import Tensor

from prr.cache import PagedKVCache
from prr.predictors import Predictor
from prr.reuse import SelectionReuse
from prr.runtime.cache_attention import CacheAttention
from prr.runtime.dense_metrics import DenseMetrics
from prr.runtime.engine_ops import engine_ops
from prr.runtime.predictor_schedule import PredictorSchedule
from prr.runtime.selection_reuse import ReusedSelections
from prr.runtime.side_stream import SideStream
from prr.runtime.static_plan import StaticPlan
from prr.runtime.step_counting import StepCounters
from prr.runtime.step_observers import StepObservers
from prr.runtime.study_counting import StudyCounters
from prr.runtime.summary_compensation import SummaryCompensation
from prr.runtime.timing import StageTimer
from prr.selectors import Selection, Selector

MISSING_SELECTOR = ("{owner} needs the run's selector object: pass selector= (a prr.selectors object, e.g. "
                    "QuestSelector(topk_blocks=...); benchmarks build conf/'s with "
                    "prr.benchmarking.configured('selector', 'quest', topk_blocks=...))")


def reuse_problems(reuse: SelectionReuse | None, predictor: Predictor | None) -> list[str]:
    """Why a PRRStep cannot run `reuse` (empty: it can; prr.config_check refuses these before any work)."""
    out = []
    if reuse is None:
        return out
    if reuse.name != "none" and predictor is not None and predictor.needs_current_selection:
        out.append(f"reuse={reuse.name} with predictor=oracle: the oracle's P is the A a reusing layer or step does not "
                   "compute")
    if getattr(reuse, "between", None) == "predicted" and (predictor is None or not predictor.speculates):
        out.append("reuse.between=predicted needs the step's predictor, and it has none (predictor=none, or a graph "
                   "engine built serial: a budget that chose |P| = 0); use reuse.between=last")
    return out


def step_problems(plan: StaticPlan, cache: PagedKVCache, num_heads: int, selector: Selector | None) -> list[str]:
    """Why a PRRStep cannot be built over `cache` (empty: it can)."""
    out = ["invalid StaticPlan: " + "; ".join(plan.problems())] if plan.problems() else []
    if selector is None:
        out.append(MISSING_SELECTOR.format(owner="PRRStep"))
    if num_heads % cache.num_kv_heads:
        out.append(f"num_heads={num_heads} is not a multiple of num_kv_heads={cache.num_kv_heads}")
    if cache.block_size != plan.block_size:
        out.append(f"cache block_size={cache.block_size} differs from plan.block_size={plan.block_size}")
    return out


class PRRStep:
    """Static buffers and the decode attention of every layer of `cache` for `num_heads` query heads."""

    def __init__(self, plan: StaticPlan, cache: PagedKVCache, num_heads: int, *, selector: Selector,
                 predictor: Predictor | None, backend: str = "triton", timer: StageTimer | None = None,
                 sized_per_step: bool = False, reuse: SelectionReuse | None = None) -> None:
        """selector / predictor (required): the run's prr.selectors / prr.predictors objects (the
        plan names neither); predictor=None: P set from outside (`schedule.set_predictions`), or
        none needed (serial, dense).
        backend: "triton" (prr.kernels; CUDA, or the CPU under TRITON_INTERPRET=1) or "torch"
        (static-shape torch ops, any device); the selector selects and the predictor proposes and
        learns on the same backend where they have kernels.
        timer: time each stage (the eager runtime; stages then run one after the other).
        sized_per_step: the research runtime's step (`eager`): |P| given by each call
        (`sparse_attention(predicted_blocks=)`), P proposed at the step's start at that size; else
        the graph engine's: the plan's variant and |P|, P written ahead into the buffers.
        reuse: selection reuse (prr.reuse; default none), decided here once per layer."""
        problems = step_problems(plan, cache, num_heads, selector) + reuse_problems(reuse, predictor)
        if problems:
            raise ValueError("; ".join(problems))
        self.ops = engine_ops(backend)
        self.backend, self.timer, self.eager_sized = backend, timer, sized_per_step
        self.plan, self.cache, self.selector = plan, cache, selector
        self.hq, self.group = num_heads, num_heads // cache.num_kv_heads
        self.topk_capacity = selector.capacity(self.group, cache.max_blocks)
        dev, B, H, NB = self.device, cache.batch, cache.num_kv_heads, cache.max_blocks
        # Sparse layers keep metadata whatever the variant, so views of one step (`with_plan`)
        # can run every variant over the same cache.
        self.sparse = [not selector.is_dense_layer(i) for i in range(cache.num_layers)]
        self.reuse = ReusedSelections(reuse, self.sparse, B, H, NB, self.topk_capacity, dev,
                                      self.ops)  # decided here, per layer
        selector.set_backend(backend)  # (their kernels where they have them, on backend triton)
        self.selection_speculates = backend == "triton" and selector.speculates_in_selection()  # decided once
        if predictor is not None:
            predictor.set_backend(backend)
        # Selectors whose whole metadata is Quest's key max / min let the append kernels update it
        # (backend triton; the torch backend's append leaves it to the selector's append_metadata).
        self.kernel_metadata = selector.metadata_in_append_kernel and backend == "triton"
        speculates = plan.variant == "prr"  # P buffers exist only when built for prr (a prr view of another is refused)
        # The sparse layers learned and counted at once: a contiguous range, this step's A held until its last layer
        ids = [i for i, s in enumerate(self.sparse) if s]
        learn_range = (ids[0], ids[-1]) if ids and all(self.sparse[ids[0] : ids[-1] + 1]) else None
        self.schedule = PredictorSchedule(
            predictor, speculates=speculates, sparse=self.sparse, batch=B, num_kv_heads=H, max_blocks=NB,
            group=self.group, head_dim=cache.head_dim, block_size=plan.block_size,
            predicted_blocks=plan.predicted_blocks, selection_capacity=self.reuse.width, learn_range=learn_range,
            device=dev)
        self.scratch = self.ops.repair_scratch(B, H, NB, dev) if speculates else None
        self.attention = CacheAttention(self.ops, cache, plan)
        self.compensation = SummaryCompensation(selector, cache)
        self.observers = StepObservers(StepCounters(self.ops, self.sparse, B, H, NB, self.reuse.width, learn_range, dev),
                                       DenseMetrics(cache.num_layers, dev),
                                       StudyCounters(plan.study_ratios, selector.topk_blocks, cache.num_layers, B, H,
                                                     NB, dev))
        self.streams = SideStream(dev, plan.overlap)
        self.last_selection: list[tuple[Tensor, Tensor] | None] = [None] * cache.num_layers

    @classmethod
    def eager(cls, cache: PagedKVCache, num_heads: int, selector: Selector, predictor: Predictor | None,
              backend: str, repair_mode: str, timer: StageTimer | None, reuse: SelectionReuse | None = None) -> PRRStep:
        """The research runtime's step (DSABackend): stages one after the other, |P| per step."""
        return cls(StaticPlan.eager(repair_mode, cache.block_size), cache, num_heads, selector=selector,
                   predictor=predictor, backend=backend, timer=timer, sized_per_step=True, reuse=reuse)

    def with_plan(self, plan: StaticPlan) -> PRRStep:
        """This step running another plan over the same buffers, state and counters."""
        view = copy.copy(self)
        view.plan, view.streams, view.attention = plan, self.streams.view(plan.overlap), self.attention.with_plan(plan)
        view.schedule, view.observers = self.schedule.view(), self.observers.view()
        return view

    def use_side_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Side work on `stream` here and in views made after (benchmarks); None: the step's own."""
        self.streams = self.streams.using(stream)

    # --- shapes (the cache's) ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.cache.keys[0].device

    dtype = property(lambda self: self.cache.dtype, doc="the cache's dtype")

    def _grouped(self, q: Tensor) -> Tensor:
        """q: [B, Hq, D] -> [B, Hkv, G, D] (a view)."""
        return q.view(self.cache.batch, self.cache.num_kv_heads, self.group, self.cache.head_dim)

    def _stage(self, name: str):
        return self.timer.stage(name) if self.timer is not None else contextlib.nullcontext()

    # --- the ops ---------------------------------------------------------------------------
    def select(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor | None = None) -> Selection:
        """q: [B, Hq, D] post-RoPE, lengths [B] tokens (num_blocks [B] int32) -> A of the run's selector
        (indices [B, Hkv, K] int32 ascending, counts [B, Hkv] int32, scores [B, Hkv, NB])."""
        return self.selector.select(self._grouped(q), self.cache, layer, lengths, num_blocks=num_blocks)

    def attend(self, layer: int, q: Tensor, idx: Tensor, cnt: Tensor, lengths: Tensor, per_block: bool = False,
               merge_splits: bool = True, final: bool = False):
        """`CacheAttention.attend` of this step's plan (q [B, Hq, D], idx [B, Hkv, C], cnt [B, Hkv])."""
        return self.attention.attend(layer, q, idx, cnt, lengths, per_block, merge_splits, final)

    def dense_attention(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor) -> Tensor:
        """Attention over every block of the context -> [B, Hq, D] in the model dtype."""
        return self.attention.dense(layer, q, lengths, num_blocks)

    def measure(self, layer: int, q: Tensor, out: Tensor, selection: Selection, lengths: Tensor,
                num_blocks: Tensor) -> None:
        """The observers' hook after a layer's output (q, out [B, Hq, D]; lengths, num_blocks [B])."""
        self.observers.measure(self.plan, self.attend, self.attention.all_blocks, layer, q, out, selection, lengths,
                               num_blocks)

    # --- one layer's attention ------------------------------------------------------------
    def sparse_attention(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor,
                         predicted_blocks: int | None = None, fp32: bool = False,
                         summarise: Tensor | None = None, step: int | None = None) -> tuple[Tensor, Selection]:
        """The DSA step of a sparse layer (serial or PRR): q [B, Hq, D] post-RoPE, this step's
        token in the cache and its metadata; lengths, num_blocks [B] int32 -> (out [B, Hq, D] in
        the model dtype, fp32 with fp32=True; A).
        predicted_blocks: a step `sized_per_step` (the eager runtime) takes its |P| for this
        step here: P is proposed now at that size (0: a serial step, the predictor still learns).
        The graph engine's step gives none: the plan's variant, P from the buffers.
        summarise: positions [B] of this step's token whose summaries (`summaries_beside`) this step
        updates, beside selection and attention (serial) or the repair (PRR); None: already done.
        step: the eager step's number from 0, for reuse=steps (graph engine views: plan.between_selections)."""
        eager = self.eager_sized
        if eager != (predicted_blocks is not None):
            raise ValueError("a step sized per step (the eager runtime's) takes predicted_blocks= at every step, "
                             f"the graph engine's takes none (sized_per_step={eager}, got {predicted_blocks})")
        reused, speculating = self.reuse.instead_of_selecting(layer, step, self.plan, num_blocks, self._grouped(q),
                                                              predicted_blocks, self.schedule, self._ensure_scratch,
                                                              self._stage)
        if reused is not None:  # attended serially; P proposed beside it where the step speculates
            return self._serial(layer, q, lengths, num_blocks, fp32, summarise, reused, speculating)
        if predicted_blocks == 0 or (not eager and self.plan.variant == "serial"):
            return self._serial(layer, q, lengths, num_blocks, fp32, summarise)
        return self._speculative(layer, q, lengths, num_blocks, predicted_blocks, fp32, summarise)

    def _serial(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor, fp32: bool,
                summarise: Tensor | None, reused: Selection | None = None,
                speculating: bool = False) -> tuple[Tensor, Selection]:
        """Serial DSA: select, then attend A (the predictor still learns where asked). reused: A
        without selecting (selection reuse), its step `speculating`: P counted and learned as PRR's."""
        summarised = self.compensation.summarise_beside(self.streams, layer, summarise)
        with self._stage("select") if reused is None else contextlib.nullcontext():
            selection = self.select(layer, q, lengths, num_blocks) if reused is None else reused
        kept = self._note(layer, selection, speculating)  # (reuse=steps: A at the reuse buffers' width)
        idx, cnt = selection.blocks.indices, selection.blocks.count
        if self.schedule.has_state() and (speculating or self.eager_sized or self.plan.learn_in_serial):
            self._learn(layer, q, kept, lengths, num_blocks, self.streams.mark() if speculating else None,
                        propose_next=not self.eager_sized, same_step=speculating)
        with self._stage("repair"):
            if not self.compensation.active:
                return self.attend(layer, q, idx, cnt, lengths, final=not fp32)[0], selection
            # the split partials: the selector's compensation merges them with its state (LESS: one launch)
            out, lse = self.attend(layer, q, idx, cnt, lengths, merge_splits=False)
        return self.compensation.compensated(layer, self._grouped(q), out, lse, selection, lengths,
                                                 torch.float32 if fp32 else self.dtype, self._stage, summarised), selection

    def _speculative(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor,
                     predicted_blocks: int | None, fp32: bool, summarise: Tensor | None) -> tuple[Tensor, Selection]:
        """PRR: speculate over P beside selection, repair A \\ P, merge, learn."""
        schedule, eager = self.schedule, self.eager_sized
        if eager:
            schedule.size_for_step(layer, predicted_blocks, self._ensure_scratch)
        if schedule.oracle:  # P = A, no overlap
            with self._stage("select"):
                selection = self.select(layer, q, lengths, num_blocks)
            with self._stage("predict"):
                schedule.propose(layer, self._grouped(q), num_blocks, selection)
            with self._stage("speculate"):
                spec = self.attend(layer, q, schedule.pred_idx[layer], schedule.pred_cnt[layer], lengths,
                                   per_block=self.plan.repair_mode == "exact")
        else:
            if eager and schedule.history_only:
                with self._stage("predict"):
                    schedule.propose(layer, self._grouped(q), num_blocks)
            spec, selection = self.speculate_beside_selection(
                layer, q, lengths, num_blocks, propose=schedule.proposes_in_step(layer, eager))
        spec_out, spec_lse = spec
        self.streams.share(q, lengths, *(t for t in spec if t is not None))  # token states: spec_out None
        # After the speculation's join, so the summaries do not delay it: beside the repair.
        summarised = self.compensation.summarise_beside(self.streams, layer, summarise)
        compensates = self.compensation.active
        out, lse, _ = self._repair(layer, q, selection, lengths, spec_out, spec_lse, fp32=compensates or fp32)
        # P may be overwritten (next step's prediction) once the repair has read it.
        kept = self._note(layer, selection, speculating=True)  # (its counters read P: before the side stream rewrites it)
        planned = self.streams.mark()
        if compensates:
            out = self.compensation.compensated(layer, self._grouped(q), out, lse, selection, lengths,
                                                 torch.float32 if fp32 else self.dtype, self._stage, summarised)
        if schedule.predictor is None:  # P is set from outside: nothing to learn
            return out, selection
        self._learn(layer, q, kept, lengths, num_blocks, planned, propose_next=not eager)
        return out, selection

    def _ensure_scratch(self) -> None:
        if self.scratch is None:
            c = self.cache
            self.scratch = self.ops.repair_scratch(c.batch, c.num_kv_heads, c.max_blocks, self.device)

    def speculate_beside_selection(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor,
                                   propose: bool | None = None):
        """PRR's overlapped part: attention over P on the side stream while A is selected on the
        main one, joined after. P was written ahead, or is proposed first on the side stream
        (propose; default: where the schedule proposes in the step). Where the selection's launch
        can attend over P itself (`speculates_in_selection`: exact) and P was written ahead, both
        run there, on the main stream.
        q: [B, Hq, D] post-RoPE; lengths, num_blocks: [B] int32.
        -> ((spec_out, spec_lse): exact mode [B, Hq, |P|, D] (None at block size 1), [B, Hq, |P|];
            superset [B, Hq, D], [B, Hq]; the Selection A)."""
        schedule = self.schedule
        if propose is None:
            propose = schedule.predictor is not None and not schedule.history_only
        if not propose and self.speculates_in_selection():  # one launch on the main stream
            if schedule.predictor is not None and not schedule.history_only:
                self.streams.join()  # P was written this step on the side stream (cross_layer: the layer below's learning)
            with self._stage("select"):
                selection, spec = self.selector.select_speculating(
                    self._grouped(q), self.cache, layer, lengths, num_blocks, schedule.pred_idx[layer],
                    schedule.pred_cnt[layer], self.attention.scale, self.plan.speculation_tokens_per_program)
            return spec, selection
        self.streams.fork()
        with self.streams.on_side():
            if propose:
                with self._stage("predict"):
                    schedule.propose(layer, self._grouped(q), num_blocks)
            with self._stage("speculate"):
                spec = self.attend(layer, q, schedule.pred_idx[layer], schedule.pred_cnt[layer], lengths,
                                   per_block=self.plan.repair_mode == "exact")
        with self._stage("select"):
            selection = self.select(layer, q, lengths, num_blocks)
        self.streams.join()  # the speculation is done (the side stream's queue up to here)
        return spec, selection

    def speculates_in_selection(self) -> bool:
        """Whether P's per-block states come from the selection's own launch (plan.speculate_in_selection,
        exact mode, a selector that can: exact on the kernels) instead of the side stream."""
        return self.plan.speculate_in_selection and self.plan.repair_mode == "exact" and self.selection_speculates

    def _repair(self, layer: int, q: Tensor, selection: Selection, lengths: Tensor, spec_out: Tensor | None,
                spec_lse: Tensor, fp32: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """A = selection, P's states spec_out [B, Hq, |P|, D] (token states: None, read from the cache by
        the one op) and spec_lse [B, Hq, |P|] (superset: [B, Hq, D], [B, Hq]) -> (out [B, Hq, D] in the
        model dtype, or fp32 with fp32=True; lse [B, Hq]; keep [B, Hkv, |P| or 1] bool)."""
        p = self.plan
        idx, cnt = selection.blocks.indices, selection.blocks.count
        pred_idx, pred_cnt = self.schedule.pred_idx[layer], self.schedule.pred_cnt[layer]
        out_dtype = torch.float32 if fp32 else self.dtype
        if spec_out is None or self.fuses_repair(idx, pred_idx):  # plan, repair and merge in one launch
            with self._stage("repair"):
                return self.ops.repair_and_merge(
                    q, self.cache.keys[layer], self.cache.values[layer], idx, cnt, pred_idx, pred_cnt, lengths,
                    spec_out, spec_lse, p.block_size, self.attention.scale, out_dtype=out_dtype,
                    arrivals=self.attention.merge_arrivals, tokens_per_split=p.repair_tokens_per_split)
        with self._stage("repair"):
            miss_idx, miss_cnt, keep = self.ops.repair_plan(idx, cnt, pred_idx, pred_cnt, self.scratch)
            # The repair's split partials stay unmerged: merge_speculation folds them in (one launch fewer).
            rep_out, rep_lse = self.attend(layer, q, miss_idx, miss_cnt, lengths, merge_splits=False)
        with self._stage("merge"):
            if p.repair_mode == "superset":  # P attended as a whole: its false positives stay in
                spec_out, spec_lse = spec_out.unsqueeze(2), spec_lse.unsqueeze(2)
                keep = torch.ones(*idx.shape[:2], 1, dtype=torch.bool, device=self.device)
            out, lse = self.ops.merge_speculation(spec_out, spec_lse, keep, rep_out, rep_lse, out_dtype=out_dtype)
        return out, lse, keep

    def fuses_repair(self, idx: Tensor, pred_idx: Tensor) -> bool:
        """Whether PRR's tail over A = idx [B, Hkv, K] and P = pred_idx [B, Hkv, |P|] is one
        launch (plan.fused_repair)."""
        mode = self.plan.fused_repair
        if mode == "auto":
            b, h = idx.shape[:2]
            return self.plan.repair_mode == "exact" and self.ops.fused_tail_pays(
                idx.shape[-1], pred_idx.shape[-1], b * h, self.device)
        return bool(mode)

    # --- the hooks -------------------------------------------------------------------------
    def _note(self, layer: int, selection: Selection, speculating: bool) -> Selection:
        """Keep A (benchmarks, reuse), call the observers' hook after A is known -> A as counted and learned."""
        self.last_selection[layer] = (selection.blocks.indices, selection.blocks.count)
        kept = self.reuse.keep(layer, selection)
        self.observers.selected(self.plan, layer, kept, speculating, self.schedule, self.streams, self.eager_sized)
        return kept

    def _learn(self, layer: int, q: Tensor, selection: Selection, lengths: Tensor, num_blocks: Tensor,
               planned: torch.cuda.Event | None = None, propose_next: bool = True, same_step: bool = True) -> None:
        """The schedule's learning from A (`PredictorSchedule.learn`), with the study's proposals counted first."""
        at_once = self.plan.learn_layers_at_once and self.schedule.learns_at_once(layer, propose_next, self.eager_sized)
        self.schedule.learn(layer, self._grouped(q), selection, lengths, num_blocks, self.streams, self._stage,
                            at_once=at_once, planned=planned, propose_next=propose_next, same_step=same_step,
                            study=self.observers.study if self.plan.study_counters else None,
                            counting=self.observers.counting)

    # --- LESS's summaries and compensation (`SummaryCompensation`) ---------------------------
    def summaries_beside(self) -> bool:
        """Whether this step updates the decode token's summaries apart, beside selection."""
        return self.compensation.beside(self.plan.side_summaries, self.eager_sized, self.backend)

    def mutable_tensors(self) -> list[Tensor]:
        """Every tensor a step mutates besides K/V and the selector's metadata: counters, A_{t-1},
        P, the predictor state and reuse=steps' last A of every layer (a checkpoint's share)."""
        return [*self.observers.tensors(), *self.schedule.tensors(), *self.reuse.tensors()]
