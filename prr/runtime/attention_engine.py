"""One sparse layer's decode attention, the one PRR step of both runtimes (DESIGN.md §2):

    predict -> (speculate ∥ select) -> repair A \\ P -> merge -> update predictor

with static shapes and no host synchronisation, over a PagedKVCache and the run's own
selector and predictor objects, on one of two op backends (prr/runtime/engine_ops.py: Triton
kernels, or torch ops on any device).

Two callers run this same step:
- the graph engine (`GraphDecoder`, which holds one and adds the model's forward) captures it in a
  CUDA graph: speculation on a second stream beside selection (exact on the kernels: inside
  selection's own launch, `speculate_in_selection`), P written on that stream right
  after the learning that completes it (history-only predictors: the layer's next P; cross_layer:
  the layer above's P of this step), |P| fixed by the plan;
- the research runtime (`DSABackend`) runs it eagerly (`AttentionEngine.eager_step`: built
  `sized_per_step`), one stage after the other, with a `StageTimer` around each stage and the
  budget's |P| for this step (`predicted_blocks=`), P proposed at the start of the step at that
  size (0: a serial DSA step).

Selectors that `compensate` (LESS) merge their estimate of the unselected blocks after repair,
also under serial DSA, so exact-mode PRR and serial DSA receive the same compensation.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from prr.block_attention import relative_error
from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.predictors import Predictor
from prr.runtime.static_plan import StaticPlan
from prr.runtime.timing import StageTimer
from prr.selectors import Selection, Selector

MISSING_SELECTOR = ("{owner} needs the run's selector object: pass selector= (a prr.selectors object, e.g. "
                    "QuestSelector(topk_blocks=...); benchmarks build conf/'s with "
                    "prr.benchmarking.configured('selector', 'quest', topk_blocks=...))")


class AttentionEngine:
    """Static buffers and the decode attention of every layer of `cache` for `num_heads` query heads."""

    def __init__(self, plan: StaticPlan, cache: PagedKVCache, num_heads: int, *, selector: Selector,
                 predictor: Predictor | None, backend: str = "triton", timer: StageTimer | None = None,
                 sized_per_step: bool = False) -> None:
        """selector / predictor (required): the run's prr.selectors / prr.predictors objects (the
        plan names neither); predictor=None: P set from outside (`set_predictions`), or none needed
        (serial, dense).
        backend: "triton" (prr.kernels; CUDA, or the CPU under TRITON_INTERPRET=1) or "torch"
        (static-shape torch ops, any device); the selector selects and the predictor proposes and
        learns on the same backend where they have kernels.
        timer: time each stage (the eager runtime; stages then run one after the other: a
        plan with overlap=False and fused_repair=False keeps them apart).
        sized_per_step: the research runtime's step (`eager_step`): |P| given by each call
        (`sparse_attention(predicted_blocks=)`), P proposed at the step's start at that size; else
        the graph engine's: the plan's variant and |P|, P written ahead into the buffers."""
        from prr.runtime.engine_ops import engine_ops

        if plan.problems():
            raise ValueError("invalid StaticPlan: " + "; ".join(plan.problems()))
        if selector is None:
            raise ValueError(MISSING_SELECTOR.format(owner="AttentionEngine"))
        if num_heads % cache.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={cache.num_kv_heads}")
        if cache.block_size != plan.block_size:
            raise ValueError(f"cache block_size={cache.block_size} differs from plan.block_size={plan.block_size}")
        self.ops = engine_ops(backend)
        self.backend, self.timer, self.sized_per_step = backend, timer, sized_per_step
        self.plan, self.cache, self.batch = plan, cache, cache.batch
        self.device, self.dtype = cache.keys[0].device, cache.dtype
        self.selector, self.predictor = selector, predictor
        self.max_tokens, self.max_blocks = cache.max_tokens, cache.max_blocks
        self.num_layers, self.hkv, self.d = cache.num_layers, cache.num_kv_heads, cache.head_dim
        self.hq, self.group = num_heads, num_heads // cache.num_kv_heads
        self.topk_capacity = self.selector.capacity(self.group, self.max_blocks)
        self.scale = 1.0 / math.sqrt(cache.head_dim)
        dev, B, H, NB = self.device, self.batch, self.hkv, self.max_blocks
        self.keys, self.values = cache.keys, cache.values  # [B, Hkv, T_max, D] per layer
        # Sparse layers keep metadata whatever the variant, so views of one engine (`with_plan`)
        # can run every variant over the same cache.
        self.sparse = [not self.selector.is_dense_layer(i) for i in range(self.num_layers)]
        # Selection in Triton where the selector has kernels (Quest) and the backend is triton,
        # torch ops otherwise.
        self.selector.set_backend(backend)
        # The predictor's propose / update likewise: kernels (prr.kernels.predict) where it has them.
        if self.predictor is not None:
            self.predictor.set_backend(backend)
        # Selectors whose whole metadata is Quest's key max / min let the append kernels update it
        # (backend triton; the torch backend's append leaves it to the selector's append_metadata).
        self.kernel_metadata = self.selector.metadata_in_append_kernel and backend == "triton"
        self.all_blocks = torch.arange(NB, dtype=torch.int32, device=dev).expand(B, H, NB).contiguous()
        prr = plan.variant == "prr"  # P buffers exist only when built for prr (a prr view of another is refused)
        # The oracle's P is A itself: A's capacity, whatever the plan's |P|.
        oracle = self.predictor is not None and self.predictor.needs_current_selection
        cap = self.topk_capacity if oracle else plan.predicted_blocks
        # P of every layer in one buffer ([L, B, Hkv, cap], [L, B, Hkv]; a layer's P a view of it), so
        # learning of a range of layers writes all of theirs in one copy (learn_layers_at_once)
        self.pred_all = torch.zeros(self.num_layers, B, H, cap, dtype=torch.int32, device=dev) if prr else None
        self.pred_cnt_all = torch.zeros(self.num_layers, B, H, dtype=torch.int32, device=dev) if prr else None
        self.pred_idx = [self.pred_all[i] if prr and s else None for i, s in enumerate(self.sparse)]
        self.pred_cnt = [self.pred_cnt_all[i] if prr and s else None for i, s in enumerate(self.sparse)]
        self.predictor_state = None
        # The sparse layers learned at once (plan.learn_layers_at_once): a contiguous range, the
        # selections of this step held until its last layer
        sparse_ids = [i for i, s in enumerate(self.sparse) if s]
        self.learn_range = (sparse_ids[0], sparse_ids[-1]) if sparse_ids and all(
            self.sparse[sparse_ids[0] : sparse_ids[-1] + 1]) else None
        self._learned: list[Selection] = []
        if prr and self.predictor is not None:
            self.predictor_state = self.predictor.init_state(self.num_layers, B, H, NB, dev)
            self.predictor.size_for_query(self.predictor_state, self.group * self.d)
            self.predictor.size_for_selection(self.predictor_state, self.topk_capacity)
        self.scratch = self.ops.repair_scratch(B, H, NB, dev) if prr else None
        self.arrivals = torch.zeros(B * H, dtype=torch.int32, device=dev)
        # fuse_merge's and fused_repair's, main stream (their kernels run one after the other there)
        self.merge_arrivals = torch.zeros(B * H, dtype=torch.int32, device=dev)
        # Device counters (plan.count_hits), per layer, summed over steps, rows and KV heads.
        # [L, 4, B * Hkv] int64: |A|, |P|, |P ∩ A|, |A_t ∩ A_{t-1}| (prr.kernels.step_counters)
        self.step_counts = torch.zeros(self.num_layers, 4, B * H, dtype=torch.int64, device=dev)
        # A_{t-1} of every layer in one buffer ([L, B, Hkv, K], [L, B, Hkv]; a layer's a view of it),
        # so one launch counts a range of layers (plan.count_at_step_end)
        kcap = self.topk_capacity
        self.prev_all = torch.zeros(self.num_layers, B, H, kcap, dtype=torch.int32, device=dev)
        self.prev_cnt_all = torch.zeros(self.num_layers, B, H, dtype=torch.int32, device=dev)
        self.prev_idx = [self.prev_all[i] if s else None for i, s in enumerate(self.sparse)]
        self.prev_cnt = [self.prev_cnt_all[i] if s else None for i, s in enumerate(self.sparse)]
        # The counters' membership scratch: one per layer of learn_range for the end-of-step launch
        # (its layers run concurrently), the first also the per-layer launch's ([2, B * Hkv, NB]).
        counted = self.learn_range[1] - self.learn_range[0] + 1 if self.learn_range is not None else 1
        self.layer_counter_scratch = self.ops.layer_counter_scratch(counted, B, H, NB, dev)
        self.counter_scratch = self.layer_counter_scratch[0]
        self._counted: list[tuple[BlockSet, bool]] = []  # this step's (A, speculating) held for the end-of-step count
        # (the held A's indices, the same stacked [L, B, Hkv, K]): the count's copy, which this
        # step's learning at once reuses
        self._stacked: tuple[list[Tensor], BlockSet] | None = None
        # Dense-reference metrics of sampled steps (plan.measure_dense; every step in shadow
        # mode): sums over measured (row, KV head)s, per layer.
        self.mass_recall = torch.zeros(self.num_layers, dtype=torch.float64, device=dev)
        self.output_relerr = torch.zeros(self.num_layers, dtype=torch.float64, device=dev)
        self.measured = torch.zeros(self.num_layers, dtype=torch.float64, device=dev)
        # The studies' counters (plan.study_counters), per layer, row and KV head, summed over steps:
        # [len(study_names), L, B, Hkv] fp64 (counts stay exact up to 2^53). Allocated whatever the
        # plan (a few KB), so a view of this engine can turn them on.
        self.study_names = self.STUDY + tuple(f"{name}_x{r}" for r in plan.study_ratios
                                              for name in ("predicted", "hits"))
        self.study_counts = torch.zeros(len(self.study_names), self.num_layers, B, H, dtype=torch.float64, device=dev)
        # |P| each ratio proposes at, static (a host int per captured graph): round(ratio × K), the
        # fixed budget's |P| once the context holds K blocks; each step truncates it to the row's
        # budget, min(round(ratio × min(K, blocks)), blocks).
        self.study_sizes = [round(r * self.selector.topk_blocks) for r in plan.study_ratios]
        self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._forked = False
        self._next_blocks: tuple[Tensor, Tensor] | None = None  # (this step's lengths, next step's block counts)
        self.last_selection: list[tuple[Tensor, Tensor] | None] = [None] * self.num_layers

    @classmethod
    def eager_step(cls, cache: PagedKVCache, num_heads: int, selector: Selector, predictor: Predictor | None,
                   backend: str, repair_mode: str, timer: StageTimer | None) -> AttentionEngine:
        """The research runtime's step (DSABackend, StageProbe): stages one after the other
        (`StaticPlan.eager`), each timed by `timer`, |P| sized per step by the caller."""
        return cls(StaticPlan.eager(repair_mode, cache.block_size), cache, num_heads, selector=selector,
                   predictor=predictor, backend=backend, timer=timer, sized_per_step=True)

    def adopt_predictor_state(self, state: object) -> None:
        """Decode on from a predictor state warmed elsewhere (the eager prefill's, same class)."""
        if self.predictor is None:
            raise ValueError("this engine has no predictor (built with predictor=None: P set from outside)")
        self.predictor_state = state
        self.predictor.size_for_query(state, self.group * self.d)
        self.predictor.size_for_selection(state, self.topk_capacity)

    def set_predictions(self, layer: int, idx: Tensor, cnt: Tensor) -> None:
        """For an engine without a predictor (predictor=None: P set from outside): P of `layer`
        ([B, Hkv, |P|] int32, [B, Hkv] int32)."""
        self.pred_idx[layer].copy_(idx)
        self.pred_cnt[layer].copy_(cnt)

    def prediction(self, layer: int) -> BlockSet | None:
        """P of `layer` as it stands (after an eager step: the P that step speculated over)."""
        if self.pred_idx[layer] is None:
            return None
        return BlockSet(self.pred_idx[layer], self.pred_cnt[layer])

    # --- streams and stage timers ----------------------------------------------------------
    def _stage(self, name: str):
        return self.timer.stage(name) if self.timer is not None else contextlib.nullcontext()

    def _side(self):
        return torch.cuda.stream(self.side) if self.side is not None and self.plan.overlap else contextlib.nullcontext()

    def _fork(self) -> None:
        if self.side is not None and self.plan.overlap:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            self._forked = True

    def join(self) -> None:
        """The main stream waits for the side stream's work (only if this step forked it:
        a graph capture refuses to wait on work it did not capture)."""
        if self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self._forked = False

    def _shared(self, *tensors: Tensor) -> None:
        """Tensors used on both streams: the caching allocator must not recycle them before
        both streams are done with them."""
        if self.side is not None and self.plan.overlap:
            main = torch.cuda.current_stream(self.device)
            for t in tensors:
                t.record_stream(self.side)
                t.record_stream(main)

    # --- the ops ---------------------------------------------------------------------------
    def select(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor | None = None) -> Selection:
        """q: [B, Hq, D] post-RoPE, lengths [B] tokens (num_blocks [B] int32 their blocks, as
        step_positions gives both) -> A of the run's selector (indices [B, Hkv, K] int32
        ascending, counts [B, Hkv] int32, scores [B, Hkv, NB])."""
        return self.selector.select(self._grouped(q), self.cache, layer, lengths, num_blocks=num_blocks)

    def _grouped(self, q: Tensor) -> Tensor:
        """q: [B, Hq, D] -> [B, Hkv, G, D] (a view)."""
        return q.view(self.batch, self.hkv, self.group, self.d)

    def attend(self, layer: int, q: Tensor, idx: Tensor, cnt: Tensor, lengths: Tensor, per_block: bool = False,
               merge_splits: bool = True, final: bool = False):
        """Attention of q [B, Hq, D] over the blocks idx [B, Hkv, C] (counts cnt [B, Hkv]) of this
        layer's cache, lengths [B] tokens -> (out [B, Hq, D], lse [B, Hq]) fp32, or with per_block
        one state per block ([B, Hq, C, D], [B, Hq, C]), or with merge_splits=False the kernel's
        unmerged split partials (prr.kernels.sparse_decode).
        final: this is the layer's output (main stream): merged in the model dtype (no cast
        launch before the output projection), in the split kernel when plan.fuse_merge (its
        arrival workspace serves one stream). per_block (speculation): programs of
        plan.speculation_tokens_per_program tokens each."""
        fused = final and self._fuse_merge(idx)
        return self.ops.sparse_decode(q, self.keys[layer], self.values[layer], idx, cnt, lengths,
                                      self.plan.block_size, self.scale, per_block=per_block,
                                      merge_splits=merge_splits, fuse_merge=fused,
                                      out_dtype=self.dtype if final else torch.float32,
                                      arrivals=self.merge_arrivals if fused else None,
                                      tokens_per_split=self.plan.speculation_tokens_per_program
                                      if per_block else None)

    def _fuse_merge(self, idx: Tensor) -> bool:
        """Whether a layer's output attention over idx [B, Hkv, C] merges its splits in the
        split kernel (plan.fuse_merge)."""
        mode = self.plan.fuse_merge
        if mode == "one_wave":
            return self.ops.sparse_decode_one_wave(
                idx.shape[-1], self.batch, self.hkv, self.plan.block_size, self.device, head_dim=self.d,
                cache_dtype=self.dtype)
        return bool(mode)

    # --- one layer's attention ------------------------------------------------------------
    def dense_attention(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor) -> Tensor:
        """Attention over every block of the context -> [B, Hq, D] in the model dtype."""
        counts = num_blocks.view(self.batch, 1).expand(self.batch, self.hkv).contiguous()
        return self.attend(layer, q, self.all_blocks, counts, lengths, final=True)[0]

    def measure(self, layer: int, q: Tensor, out: Tensor, selection: Selection, lengths: Tensor,
                num_blocks: Tensor) -> None:
        """Dense-reference metrics of this layer's step, added to device sums: attention-mass
        recall (dense softmax mass inside A, mean over the group) and the output's relative
        error against dense attention, per (row, KV head) — the eager runtime's definitions,
        from the attention kernels: dense attention (out, lse) over every block, and one lse per
        block of A, so mass(A) = Σ_{b∈A} exp(lse_b − lse_dense)."""
        counts = num_blocks.view(self.batch, 1).expand(self.batch, self.hkv).contiguous()
        dense_out, dense_lse = self.attend(layer, q, self.all_blocks, counts, lengths)  # [B, Hq, D], [B, Hq] fp32
        _, block_lse = self.attend(layer, q, selection.blocks.indices, selection.blocks.count, lengths,
                                   per_block=True)  # [B, Hq, |A|]; -inf for padding entries
        mass = torch.exp(block_lse - dense_lse.unsqueeze(-1)).sum(-1)  # [B, Hq]
        recall = mass.view(self.batch, self.hkv, self.group).mean(-1)  # [B, Hkv]
        error = relative_error(self._grouped(out), self._grouped(dense_out))  # [B, Hkv]
        self.mass_recall[layer] += recall.sum()
        self.output_relerr[layer] += error.sum()
        self.measured[layer] += recall.numel()
        if self.plan.study_counters:  # the same, per (row, KV head)
            self.study_counts[1, layer] += 1
            self.study_counts[2, layer] += recall
            self.study_counts[3, layer] += error

    def sparse_attention(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor,
                         predicted_blocks: int | None = None, fp32: bool = False,
                         summarise: Tensor | None = None) -> tuple[Tensor, Selection]:
        """The DSA step of a sparse layer (serial or PRR): q [B, Hq, D] post-RoPE, this step's
        token in the cache and its metadata; lengths, num_blocks [B] int32 -> (out [B, Hq, D] in
        the model dtype, fp32 with fp32=True; A).
        predicted_blocks: an engine `sized_per_step` (the eager runtime) takes its |P| for this
        step here: P is proposed now at that size (0: a serial step, the predictor still learns).
        The graph engine's step gives none: the plan's variant, P from the buffers (written by the
        previous step or from outside).
        summarise: positions [B] of this step's token whose summaries (`summaries_beside`) this step
        updates, beside selection and attention (serial) or the repair (PRR); None: already done."""
        p = self.plan
        compensates = self.selector.compensates
        eager = self.sized_per_step
        if eager != (predicted_blocks is not None):
            raise ValueError("an engine sized per step (the eager runtime's) takes predicted_blocks= at every step, "
                             f"the graph engine's takes none (sized_per_step={eager}, got {predicted_blocks})")
        predictor = self.predictor
        if predicted_blocks == 0 or (not eager and p.variant == "serial"):
            summarised = self._summarise_beside(layer, summarise)
            with self._stage("select"):
                selection = self.select(layer, q, lengths, num_blocks)
            self._note(layer, selection, speculating=False)
            idx, cnt = selection.blocks.indices, selection.blocks.count
            if predictor is not None and self.predictor_state is not None and (eager or p.learn_in_serial):
                self._learn(layer, q, selection, lengths, num_blocks, propose_next=not eager, same_step=False)
            with self._stage("repair"):
                if not compensates:
                    return self.attend(layer, q, idx, cnt, lengths, final=not fp32)[0], selection
                # the split partials: the selector's compensation merges them with its state (LESS: one launch)
                out, lse = self.attend(layer, q, idx, cnt, lengths, merge_splits=False)
            return self._compensated(layer, q, out, lse, selection, lengths, fp32, summarised), selection

        if eager:
            self._size_predictions(layer, predicted_blocks)
        if predictor is not None and predictor.needs_current_selection:  # the oracle: P = A, no overlap
            with self._stage("select"):
                selection = self.select(layer, q, lengths, num_blocks)
            with self._stage("predict"):
                self._propose(layer, q, num_blocks, selection)
            with self._stage("speculate"):
                spec = self.attend(layer, q, self.pred_idx[layer], self.pred_cnt[layer], lengths,
                                   per_block=p.repair_mode == "exact")
        else:
            if eager and predictor is not None and predictor.history_only:
                with self._stage("predict"):
                    self._propose(layer, q, num_blocks)
            # P written ahead: by the previous step's learning (history-only predictors), or by
            # an earlier layer's this step (cross_layer: right after its source layer learned)
            ahead = predictor is not None and (predictor.history_only or (
                not eager and predictor.proposed_ahead(self.predictor_state, layer)))
            spec, selection = self.speculate_beside_selection(layer, q, lengths, num_blocks,
                                                              propose=predictor is not None and not ahead)
        spec_out, spec_lse = spec
        self._shared(q, lengths, spec_out, spec_lse)
        # After the speculation's join, so the summaries do not delay it: beside the repair.
        summarised = self._summarise_beside(layer, summarise)
        out, lse, keep = self._repair(layer, q, selection, lengths, spec_out, spec_lse, fp32=compensates or fp32)
        # P may be overwritten (next step's prediction) once the repair has read it.
        self._note(layer, selection, speculating=True)  # (its counters read P: before the side stream may rewrite it)
        planned = torch.cuda.Event() if self.side is not None and p.overlap else None
        if planned is not None:
            planned.record()
        if compensates:
            out = self._compensated(layer, q, out, lse, selection, lengths, fp32, summarised)
        if predictor is None:  # P is set from outside: nothing to learn
            return out, selection
        self._learn(layer, q, selection, lengths, num_blocks, planned, propose_next=not eager)
        return out, selection

    def _size_predictions(self, layer: int, predicted_blocks: int) -> None:
        """The eager step's P buffers at this step's |P| (the oracle's: A's capacity)."""
        oracle = self.predictor is not None and self.predictor.needs_current_selection
        cap = self.topk_capacity if oracle else predicted_blocks
        if self.pred_idx[layer] is None or self.pred_idx[layer].shape[-1] != cap:
            self.pred_idx[layer] = torch.zeros(self.batch, self.hkv, cap, dtype=torch.int32, device=self.device)
            self.pred_cnt[layer] = torch.zeros(self.batch, self.hkv, dtype=torch.int32, device=self.device)
        if self.scratch is None:
            self.scratch = self.ops.repair_scratch(self.batch, self.hkv, self.max_blocks, self.device)

    def _learn(self, layer: int, q: Tensor, selection: Selection, lengths: Tensor, num_blocks: Tensor,
               planned: torch.cuda.Event | None = None, propose_next: bool = True, same_step: bool = True) -> None:
        """The predictor learns from A on the side stream (after `planned`, recorded on the main
        stream once A and P's last readers are queued; now when None), and with propose_next
        writes the P that this update completes (`Predictor.proposals_after_update`): history-only
        predictors the next step's P of this layer, cross_layer also this step's P of the layer
        above (same_step; num_blocks [B]: this step's blocks), off that layer's critical path."""
        predictor = self.predictor
        at_once = self._learns_at_once(layer, propose_next)
        if at_once and layer != self.learn_range[1] and not self.plan.study_counters:
            self._learned.append(selection)  # learned with the last sparse layer's, at the end of the step
            return
        if planned is None and self.side is not None and self.plan.overlap:
            planned = torch.cuda.Event()
            planned.record()
        if planned is not None:
            self.side.wait_event(planned)
            self._forked = True
            self._shared(selection.blocks.indices, selection.blocks.count, selection.scores)
        if self.plan.study_counters:  # from the state this step's P came from: before the update
            with self._side():
                self._study(layer, q, selection, num_blocks)
        if at_once:
            if layer != self.learn_range[1]:  # (study counters: each layer's read the state before any update)
                self._learned.append(selection)
                return
            self._learn_layers(lengths, [*self._learned, selection])
            return
        with self._side(), self._stage("predict"):  # learn from A; history-only predictors write next step's P now
            predictor.update(self.predictor_state, layer, selection)
            if not propose_next:
                return
            for target, next_step in predictor.proposals_after_update(self.predictor_state, layer):
                if next_step:
                    self._propose(target, q, self._next_step_blocks(lengths))
                elif same_step:
                    self._propose(target, q, num_blocks)

    def _learns_at_once(self, layer: int, propose_next: bool) -> bool:
        """Whether this step's learning waits for the last sparse layer and runs every layer's at
        once (plan.learn_layers_at_once, the graph engine's step, a predictor that can, whose
        update completes only its own next P or none (query_similarity: it proposes in the step),
        over a contiguous range of sparse layers)."""
        predictor = self.predictor
        return (self.plan.learn_layers_at_once and propose_next and not self.sized_per_step
                and self.learn_range is not None and self.pred_all is not None
                and predictor.learns_layers_at_once()
                and predictor.proposals_after_update(self.predictor_state, layer) in ([(layer, True)], []))

    def _learn_layers(self, lengths: Tensor, selections: list[Selection]) -> None:
        """Every sparse layer's update from this step's A (selections, one per layer of
        learn_range) and, for history-only predictors, the next step's P of each, in one update
        and one propose launch, on the side stream once the last layer is repaired (the side
        stream waits for it in `_learn`)."""
        first, last = self.learn_range
        if len(selections) != last - first + 1:
            raise RuntimeError(f"learning layers {first}..{last} at once got {len(selections)} selections: "
                               "a step ran some sparse layers without learning")
        for sel in selections:  # made on the main stream, read on the side stream
            self._shared(sel.blocks.indices, sel.blocks.count, sel.scores)
        self._learned = []
        # A as this step's end-of-step count stacked it (on the side stream, before): no second copy
        stacked, self._stacked = self._stacked, None
        held = stacked is not None and len(stacked[0]) == len(selections) and all(
            a is s.blocks.indices for a, s in zip(stacked[0], selections, strict=True))
        with self._side(), self._stage("predict"):
            self.predictor.update_layers(self.predictor_state, first, selections, blocks=stacked[1] if held else None)
            if self.predictor.proposals_after_update(self.predictor_state, first) == []:
                return  # (query_similarity: its update writes no P; each layer proposes in the step)
            idx, cnt = self.predictor.propose_layers(self.predictor_state, first, len(selections),
                                                     self._next_step_blocks(lengths), self.pred_all.shape[-1])
            self.pred_all[first : last + 1, ..., : idx.shape[-1]].copy_(idx)
            self.pred_cnt_all[first : last + 1].copy_(cnt)

    def _study(self, layer: int, q: Tensor, selection: Selection, num_blocks: Tensor) -> None:
        """The study counters' hits of this step (plan.study_counters): for every ratio r of
        plan.study_ratios, the predictor's proposal by its torch definition, best first
        (`propose_best_first`, from the state this step's P was proposed from), at the static
        |P| round(r·K), truncated to the fixed budget's |P| of each row,
        min(round(r·min(K, blocks)), blocks) — what experiments/locality_study.py's RatioProbe and
        predictor_study.py's replay propose at that budget (equal sets for every predictor whose
        proposal is a top-|P| of its rank; SPIN's exploration draws from |P| itself, so there only
        while the context holds round(r·K) blocks). Adds |P_r| and |P_r ∩ A| per (row, KV head).
        q [B, Hq, D] (for predictors that `needs_query`), A, num_blocks [B] this step's blocks.
        Static shapes, no host read: capturable."""
        predictor, state = self.predictor, self.predictor_state
        in_a = selection.blocks.mask(self.max_blocks)  # [B, Hkv, NB] bool
        blocks = num_blocks.to(torch.float64).view(self.batch, 1)  # [B, 1]
        k = float(self.selector.topk_blocks)
        query = {"query": self._grouped(q)} if predictor.needs_query else {}
        current = selection if predictor.needs_current_selection else None
        first = len(self.STUDY)
        for i, (ratio, size) in enumerate(zip(self.plan.study_ratios, self.study_sizes, strict=True)):
            if size <= 0:  # round(r·K) = 0: P is empty at this ratio
                continue
            # FixedBudget.predicted_blocks on the device (torch.round: half to even, as Python's round)
            budget = torch.minimum(torch.round(ratio * blocks.clamp(max=k)), blocks).long()  # [B, 1]
            ranking = predictor.propose_best_first(state, layer, num_blocks, size, current, **query)  # best first
            taken = torch.arange(ranking.capacity, device=self.device) < torch.minimum(
                ranking.count.long(), budget).unsqueeze(-1)  # [B, Hkv, C]: the prefix of |P_r| entries
            hit = in_a.gather(-1, ranking.indices.long()) & taken  # ids are distinct: one per block
            self.study_counts[first + 2 * i, layer] += taken.sum(-1)
            self.study_counts[first + 2 * i + 1, layer] += hit.sum(-1)

    def _next_step_blocks(self, lengths: Tensor) -> Tensor:
        """lengths [B] (this step's tokens) -> [B] blocks of the next step's context (lengths + 1
        tokens), computed once per step (two launches) on the stream of the first caller and
        reused by the other layers' learning there. (From `lengths`, made at the step's start:
        `pos` advances on the main stream while side work may still run.)"""
        if self._next_blocks is None or self._next_blocks[0] is not lengths:
            bs = self.plan.block_size
            self._next_blocks = (lengths, (lengths + bs).div(bs, rounding_mode="floor"))
        return self._next_blocks[1]

    def summaries_beside(self) -> bool:
        """Whether this step updates the decode token's summaries apart (plan.side_summaries, the
        graph engine's step, backend triton: the append kernels take Quest's key max / min) and, with
        a side stream, beside selection and attention (`_summarise_beside`)."""
        return (self.plan.side_summaries and not self.sized_per_step and self.backend == "triton"
                and self.selector.summaries_apart())

    def _summarise_beside(self, layer: int, positions: Tensor | None) -> torch.cuda.Event | None:
        """The selector's summaries of this step's token (positions [B], in the cache: the append is
        queued before) on the side stream; -> the event the compensation waits for (None: nothing
        queued, or one stream, where program order is the order)."""
        if positions is None:
            return None
        self._fork()  # the side stream waits for the append (and whatever main queued before)
        with self._side():
            self.selector.append_summaries(self.cache, layer, positions)
        if self.side is None or not self.plan.overlap:
            return None
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def _compensated(self, layer: int, q: Tensor, out: Tensor, lse: Tensor, selection: Selection,
                     lengths: Tensor, fp32: bool = False, summarised: torch.cuda.Event | None = None) -> Tensor:
        """out [B, Hq, D] fp32, lse [B, Hq] of the attended blocks (or their split partials
        [B, Hq, S, D], [B, Hq, S]) ⊕ the selector's estimate of the others (LESS,
        `Selector.compensated`) -> [B, Hq, D] in the model dtype (fp32 with fp32=True).
        summarised: the side stream's summary update of this step (`_summarise_beside`), which
        the compensation reads: waited for first."""
        if summarised is not None:
            torch.cuda.current_stream(self.device).wait_event(summarised)
        with self._stage("merge"):
            return self.selector.compensated(self._grouped(q), self.cache, layer, selection, lengths, out, lse,
                                             torch.float32 if fp32 else self.dtype)

    def _propose(self, layer: int, q: Tensor | None, num_blocks: Tensor, current: Selection | None = None) -> None:
        """Write the predictor's P for a context of num_blocks [B] blocks into this layer's P
        buffers (q [B, Hq, D]: this step's query, for predictors that `needs_query`)."""
        predictor = self.predictor
        query = {"query": self._grouped(q)} if predictor.needs_query else {}
        proposed = predictor.propose(self.predictor_state, layer, num_blocks, self.pred_idx[layer].shape[-1], current,
                                     **query)
        self.pred_idx[layer][..., : proposed.capacity].copy_(proposed.indices)
        self.pred_cnt[layer].copy_(proposed.count)

    def speculate_beside_selection(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor,
                                   propose: bool | None = None):
        """PRR's overlapped part: attention over P on the side stream while A is selected on the
        main one, joined after. P was written ahead (by the previous step for history-only
        predictors, by the layer below's learning for cross_layer, or from outside with predictor
        None), or is proposed first on the side stream (propose; default: predictors that are not
        history-only, e.g. query_similarity, which needs this step's query). Where the selection's
        launch can attend over P itself (`_speculates_in_selection`: exact) and P was written ahead,
        both run there, on the main stream.
        q: [B, Hq, D] post-RoPE; lengths, num_blocks: [B] int32 (step_positions).
        -> ((spec_out, spec_lse): exact mode [B, Hq, |P|, D], [B, Hq, |P|] per-block states,
            superset [B, Hq, D], [B, Hq]; the Selection A)."""
        if propose is None:
            propose = self.predictor is not None and not self.predictor.history_only
        if not propose and self._speculates_in_selection():  # one launch on the main stream
            if self.predictor is not None and not self.predictor.history_only:
                self.join()  # P was written this step on the side stream (cross_layer: the layer below's learning)
            with self._stage("select"):
                selection, spec = self.selector.select_speculating(
                    self._grouped(q), self.cache, layer, lengths, num_blocks, self.pred_idx[layer],
                    self.pred_cnt[layer], self.scale, self.plan.speculation_tokens_per_program)
            return spec, selection
        self._fork()
        with self._side():
            if propose:
                with self._stage("predict"):
                    self._propose(layer, q, num_blocks)
            with self._stage("speculate"):
                spec = self.attend(layer, q, self.pred_idx[layer], self.pred_cnt[layer], lengths,
                                   per_block=self.plan.repair_mode == "exact")
        with self._stage("select"):
            selection = self.select(layer, q, lengths, num_blocks)
        self.join()  # the speculation is done (the side stream's queue up to here)
        return spec, selection

    def _speculates_in_selection(self) -> bool:
        """Whether P's per-block states come from the selection's own launch (plan.speculate_in_selection,
        exact mode, a selector that can: exact on the kernels) instead of the side stream."""
        return (self.plan.speculate_in_selection and self.plan.repair_mode == "exact" and self.backend == "triton"
                and self.selector.speculates_in_selection())

    def _repair(self, layer: int, q: Tensor, selection: Selection, lengths: Tensor, spec_out: Tensor,
                spec_lse: Tensor, fp32: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """A = selection, P's speculative states spec_out [B, Hq, |P|, D] and spec_lse [B, Hq, |P|]
        (exact mode; superset: [B, Hq, D], [B, Hq]) -> (out [B, Hq, D] in the model dtype, or fp32
        with fp32=True; lse [B, Hq]; keep [B, Hkv, |P| or 1] bool: which states survived)."""
        p = self.plan
        idx, cnt = selection.blocks.indices, selection.blocks.count
        pred_idx, pred_cnt = self.pred_idx[layer], self.pred_cnt[layer]
        out_dtype = torch.float32 if fp32 else self.dtype
        if self._fused_repair(idx, pred_idx):  # plan, repair and merge in one launch
            with self._stage("repair"):
                return self.ops.repair_and_merge(
                    q, self.keys[layer], self.values[layer], idx, cnt, pred_idx, pred_cnt, lengths, spec_out, spec_lse,
                    p.block_size, self.scale, out_dtype=out_dtype, arrivals=self.merge_arrivals,
                    tokens_per_split=p.repair_tokens_per_split)
        with self._stage("repair"):
            miss_idx, miss_cnt, keep = self.ops.repair_plan(idx, cnt, pred_idx, pred_cnt, self.scratch)
            # The repair's split partials stay unmerged: merge_speculation folds them in (one launch fewer).
            rep_out, rep_lse = self.attend(layer, q, miss_idx, miss_cnt, lengths, merge_splits=False)
        with self._stage("merge"):
            if p.repair_mode == "superset":  # P attended as a whole: its false positives stay in
                spec_out, spec_lse = spec_out.unsqueeze(2), spec_lse.unsqueeze(2)
                keep = torch.ones(self.batch, self.hkv, 1, dtype=torch.bool, device=self.device)
            out, lse = self.ops.merge_speculation(spec_out, spec_lse, keep, rep_out, rep_lse, out_dtype=out_dtype)
        return out, lse, keep

    def _fused_repair(self, idx: Tensor, pred_idx: Tensor) -> bool:
        """Whether PRR's tail over A = idx [B, Hkv, K] and P = pred_idx [B, Hkv, |P|] is one
        launch (plan.fused_repair)."""
        mode = self.plan.fused_repair
        if mode == "auto":
            return self.plan.repair_mode == "exact" and self.ops.fused_tail_pays(
                idx.shape[-1], pred_idx.shape[-1], self.batch * self.hkv, self.device)
        return bool(mode)

    def _note(self, layer: int, selection: Selection, speculating: bool) -> None:
        """Keep A for callers (benchmarks) and, with count_hits, add this step's |A|, |P|,
        |P ∩ A| and |A_t ∩ A_{t-1}| to the layer's device counters (one launch; any repair mode),
        or hold A for the count of every layer at the step's end (`_counts_at_end`)."""
        idx, cnt = selection.blocks.indices, selection.blocks.count
        self.last_selection[layer] = (idx, cnt)
        if not self.plan.count_hits:
            return
        if self.plan.study_counters:
            self.study_counts[0, layer] += 1  # steps counted, per (row, KV head)
        if self._counts_at_end(layer, speculating):
            self._counted.append((selection.blocks, speculating))
            if layer == self.learn_range[1]:
                self._count_layers()
            return
        self.ops.step_counters(idx, cnt, self.pred_idx[layer] if speculating else None,
                               self.pred_cnt[layer] if speculating else None, self.prev_idx[layer],
                               self.prev_cnt[layer], self.counter_scratch, self.step_counts[layer])

    def _counts_at_end(self, layer: int, speculating: bool) -> bool:
        """Whether this step's counters wait for the last sparse layer and count every layer in
        one launch on the side stream (plan.count_at_step_end, the graph engine's step over a
        contiguous range of sparse layers). Exact only where each layer's P stays what the layer
        speculated over until then: no P counted (serial), P set from outside (no predictor), P
        rewritten only by the learning at once, which the side stream runs after the count, or a
        predictor whose update writes no P (query_similarity: each layer's P is proposed in the
        step, before its speculation, and not rewritten until the next step's)."""
        if not self.plan.count_at_step_end or self.sized_per_step or self.learn_range is None:
            return False
        if not speculating or self.predictor is None or self._learns_at_once(layer, propose_next=True):
            return True
        first, last = self.learn_range  # (every layer alike: cross_layer's last layer writes no P, the others do)
        return all(self.predictor.proposals_after_update(self.predictor_state, i) == [] for i in range(first, last + 1))

    def _count_layers(self) -> None:
        """The counters of every layer of learn_range from this step's A (held by `_note`) in one
        launch, on the side stream once the last layer's A is selected, beside the LM head (the
        step's `join` orders it before the next step reads the counters or A_{t-1}). The held A
        are stacked there, one copy, which this step's learning at once reuses."""
        first, last = self.learn_range
        held, self._counted = self._counted, []
        if len(held) != last - first + 1 or len({spec for _, spec in held}) != 1:
            raise RuntimeError(f"counting layers {first}..{last} at once got {len(held)} selections "
                               f"(speculating: {[spec for _, spec in held]}): a step ran some sparse layers "
                               "without holding A, or mixed serial and PRR layers")
        blocks, speculating = [b for b, _ in held], held[0][1]
        if self.side is not None and self.plan.overlap:
            selected = torch.cuda.Event()
            selected.record()
            self.side.wait_event(selected)
            self._forked = True
            self._shared(*(t for b in blocks for t in (b.indices, b.count)))  # made on main, read on the side
        span = slice(first, last + 1)
        with self._side():
            stacked = BlockSet(torch.stack([b.indices for b in blocks]), torch.stack([b.count for b in blocks]))
            self.ops.step_counters_layers(
                stacked.indices, stacked.count, self.pred_all[span] if speculating else None,
                self.pred_cnt_all[span] if speculating else None, self.prev_all[span], self.prev_cnt_all[span],
                self.layer_counter_scratch, self.step_counts[span])
        self._stacked = ([b.indices for b in blocks], stacked)

    COUNTERS = ("selected", "predicted", "hits", "overlap", "mass_recall", "output_relerr", "measured")

    def counters(self) -> dict[str, list[float]]:
        """The device counters per layer, summed since `begin` (one host read: call once per
        window): |A|, |P|, |P ∩ A|, |A_t ∩ A_{t-1}|, and over dense-measured (row, KV head)s the
        sums of mass recall and output error and their count."""
        counts = self.step_counts.sum(-1).double().T  # [4, L]
        stacked = torch.cat([counts, torch.stack([self.mass_recall, self.output_relerr, self.measured])]).cpu()
        return dict(zip(self.COUNTERS, stacked.tolist(), strict=True))

    # The study counters' own rows (then predicted_x{r}, hits_x{r} per ratio of plan.study_ratios):
    # steps counted, dense-measured steps, and the sums of mass recall and output error over them.
    STUDY = ("steps", "measured", "mass_recall", "output_relerr")

    def study_counters(self, per_row: bool = False) -> dict[str, Tensor]:
        """The study counters summed since `begin`, in one host read (call once per request or
        run): name -> [L, Hkv] fp64 CPU tensor summed over rows ([L, B, Hkv] with per_row).
        Names: the step counters' selected, predicted, hits (the plan's P), overlap
        (|A_t ∩ A_{t-1}|), then `STUDY` (steps, measured, mass_recall and output_relerr sums over
        the dense-measured steps) and predicted_x{r}, hits_x{r} for each ratio r of
        plan.study_ratios (AttentionEngine._study). Dense layers hold zeros."""
        L, B, H = self.num_layers, self.batch, self.hkv
        steps = self.step_counts.view(L, 4, B, H).transpose(0, 1).double()  # [4, L, B, Hkv]
        stacked = torch.cat([steps, self.study_counts]).cpu()
        if not per_row:
            stacked = stacked.sum(2)
        return dict(zip(self.COUNTERS[:4] + self.study_names, stacked.unbind(0), strict=True))
