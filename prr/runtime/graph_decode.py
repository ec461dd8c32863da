"""A decode step for the whole model with static shapes and no host synchronisation, so
CUDA graphs can capture it: the performance path of PRR on a GPU (DESIGN.md §2).

Everything that changes from step to step lives on the device: the position (`pos`), the
input token, the KV cache, Quest / InfLLM metadata, the predictor state and the predicted
set P of every layer. One `step()` appends the token's K/V at `pos`, runs every layer, and
(with advance=True) writes the greedy next token and pos + 1, so replaying a captured step
N times decodes N tokens. With advance=False the step repeats at one position (its KV slot
is rewritten with the same values): the latency of one step, with P held fixed.

Per sparse layer (variant "prr"):

    main stream:  metadata update -> select A  ---------------> repair_plan -> repair A\\P -> merge
    side stream:          speculate over P (q ready) ------------^
                          predictor update + rank P for the next step (after A; off the critical path)

"serial" is select -> attend A (no predictor), "dense" attends every block. The predictor
learns on the side stream and writes next step's P there, so prediction costs the critical
path nothing; it sees only selections of past steps.

Selection and prediction are not defined here: the engine runs the run's own selector and
predictor objects (prr.selectors, prr.predictors) — the same classes, with the same static-
shape code, as the eager research runtime (DSABackend), Quest's through its Triton kernels.
`StaticPlan.selector` / `predictor` only name which of those classes to build when the
caller passes none (benchmarks). Predictors that rank from history alone (`history_only`)
write next step's P right after learning, on the side stream; the others (query_similarity,
cross_layer, oracle) propose at the start of the layer, on the side stream before
speculation (the oracle after selection: it needs A). Selectors that `compensate` (LESS)
merge their estimate of the unselected blocks after repair, as in the eager runtime.
Still eager-only: shadow mode and the per-head records (tests/test_graph_decode.py checks
the engine against the eager runtime: same A, P, tokens and hit rates).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from prr.attention_state import AttentionState, merge
from prr.block_attention import relative_error
from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.model.decoder import Decoder
from prr.model.layer_math import final_norm, fuse_layer_weights, post_attention, pre_attention
from prr.model.rope import rope_cos_sin
from prr.predictors import EmaMembershipPredictor, LastStepPredictor, Predictor
from prr.selectors import InfLLMSelector, QuestSelector, Selection, Selector

VARIANTS = ("dense", "serial", "prr")
SELECTORS = ("quest", "infllm")  # the classes StaticPlan can build (any Selector object may be passed)
# fixed: P set from outside (controlled hit rates); the others name prr.predictors classes
PREDICTORS = ("ema_membership", "last_step", "fixed")
REPAIR_MODES = ("exact", "superset")
MODES = ("sparse", "shadow")
FUSE_MERGE = (False, True, "one_wave")
FUSED_REPAIR = (False, True, "auto")
PROJECTIONS = ("torch", "fused")


def metadata_dtype(selector: str, cache_dtype: torch.dtype) -> torch.dtype:
    """Quest's max / min of keys stored in the cache dtype are exact in it; InfLLM's
    representative is a mean, kept in fp32."""
    return cache_dtype if selector == "quest" else torch.float32


def metadata_bytes_per_block(selector: str, cache_dtype: torch.dtype, head_dim: int) -> int:
    """Bytes the selection reads per (row, KV head, block): the byte floor's metadata share."""
    per_vector = head_dim * metadata_dtype(selector, cache_dtype).itemsize
    return 2 * per_vector if selector == "quest" else per_vector


@dataclass(frozen=True)
class StaticPlan:
    variant: str = "prr"
    selector: str = "quest"
    topk_blocks: int = 128  # |A| capacity per KV head, forced blocks included
    predicted_blocks: int = 128  # |P| (prr only)
    predictor: str = "ema_membership"
    ema_alpha: float = 0.8  # ema_membership: state <- alpha * state + (1 - alpha) * [b in A]
    repair_mode: str = "exact"
    # sparse: the selection decides what is attended; shadow: dense attention continues the
    # model while selection, prediction and speculation run beside it and are measured.
    mode: str = "sparse"
    block_size: int = 16
    sink_blocks: int = 1
    recent_blocks: int = 1
    dense_layers: tuple[int, ...] = (0, 1)
    overlap: bool = True  # speculation on a second CUDA stream (False: one after the other)
    infllm_representatives: int = 4
    # Serial and dense attention merge their splits inside the split kernel (sparse_decode
    # fuse_merge; main stream only): one launch fewer per layer. True: every such attention
    # (+34 µs per token on the H200 at 128K, batch 1: the dense layers' 128-split rows);
    # "one_wave" (default): only launches of at most one program per SM
    # (sparse_decode_one_wave: batch 1, 2K budgets), 9-24 µs per token faster than False there
    # (bench_decode_token.csv, serial_onewave_fused; 30 launches fewer at 128K, block 64);
    # False: always the merge launch.
    fuse_merge: bool | str = "one_wave"
    # Speculation's per-block attention: tokens of P each program covers (None: the kernel's
    # default, about 4 programs per SM). Larger values launch fewer programs, which leaves SMs
    # to the selection running beside it on the other stream (bench_decode.py --parts spec_programs).
    speculation_tokens_per_program: int | None = None
    # PRR's tail (repair plan, repair over A \ P, merge) in one launch (prr.kernels.prr_repair)
    # instead of three; exact repair mode only. "auto" (default): where its default plan keeps
    # within 4 programs per SM (prr_repair.fused_tail_pays: everywhere in bench_decode's grid
    # but batch 8 with 512 blocks of P per row, where the three launches measured faster on the
    # H200; bench_decode.py --parts repair_splits, bench_decode_stage.csv).
    fused_repair: bool | str = "auto"
    # fused_repair: tokens of A each of its programs covers (None: prr_repair.default_splits).
    repair_tokens_per_split: int | None = None
    # The dense parts' projections: "torch" (F.linear, i.e. cuBLAS, with the norms / SiLU /
    # residual adds as separate kernels) or "fused" (prr.kernels.dense_gemv: each projection one
    # Triton launch with its RMSNorm, SwiGLU or residual add inside; 4 launches per layer's dense
    # part; faster than cuBLAS at batch 1 on the H200, slower at batch 8).
    projections: str = "torch"
    # Batch 1 with fused projections: RoPE and the cache append folded into the q|k|v projection
    # (prr.kernels.qkv_append; one launch fewer per layer); False: the two-launch path.
    fuse_append: bool = True
    # Device counters of |A|, |P|, |P ∩ A|, |A_t ∩ A_{t-1}| per layer (a few launches per sparse
    # layer: off while timing), read once per window by `GraphDecoder.counters`.
    count_hits: bool = False
    # Dense-reference metrics (mass recall, output error) on this step (every step in shadow mode).
    measure_dense: bool = False
    # variant "serial" with a predictor (budget=adaptive's serial windows): the predictor still
    # learns from each A on the side stream, as the eager runtime's serial steps do, so PRR
    # windows speculate over a P that has seen every step.
    learn_in_serial: bool = False

    def problems(self) -> list[str]:
        out = []
        for name, value, allowed in (("variant", self.variant, VARIANTS), ("selector", self.selector, SELECTORS),
                                     ("predictor", self.predictor, PREDICTORS),
                                     ("repair_mode", self.repair_mode, REPAIR_MODES), ("mode", self.mode, MODES)):
            if value not in allowed:
                out.append(f"{name}={value!r} is not one of {list(allowed)}")
        if self.projections not in PROJECTIONS:
            out.append(f"projections={self.projections!r} is not one of {list(PROJECTIONS)}")
        if self.topk_blocks < self.sink_blocks + self.recent_blocks or self.topk_blocks < 1:
            out.append(f"topk_blocks={self.topk_blocks} must be >= sink_blocks + recent_blocks "
                       f"({self.sink_blocks} + {self.recent_blocks}) and >= 1")
        if self.variant == "prr" and self.predicted_blocks < 1:
            out.append(f"predicted_blocks={self.predicted_blocks} must be >= 1 for variant=prr (use variant=serial for |P| = 0)")
        if not 0.0 <= self.ema_alpha < 1.0:
            out.append(f"ema_alpha={self.ema_alpha} must lie in [0, 1)")
        if self.fuse_merge not in FUSE_MERGE:
            out.append(f"fuse_merge={self.fuse_merge!r} is not one of {list(FUSE_MERGE)}")
        if self.fused_repair not in FUSED_REPAIR:
            out.append(f"fused_repair={self.fused_repair!r} is not one of {list(FUSED_REPAIR)}")
        if self.fused_repair is True and self.repair_mode != "exact":
            out.append(f"fused_repair=True needs repair_mode='exact' (got {self.repair_mode!r}): it drops the "
                       f"speculated blocks that A lacks")
        for name in ("speculation_tokens_per_program", "repair_tokens_per_split"):
            tokens = getattr(self, name)
            if tokens is not None and (tokens < self.block_size or tokens % self.block_size):
                out.append(f"{name}={tokens} must be None or a positive multiple of block_size={self.block_size} "
                           f"(whole blocks per program)")
        return out

    def make_selector(self) -> Selector:
        """The prr.selectors object this plan names (callers with any other selector pass their own)."""
        recent = self.recent_blocks
        common = dict(topk_blocks=self.topk_blocks, sink_blocks=self.sink_blocks, local_blocks=max(recent - 1, 0),
                      force_newest=recent > 0, dense_layers=self.dense_layers)
        if self.selector == "quest":
            return QuestSelector(gqa_reduce="max", **common)
        return InfLLMSelector(gqa_reduce="sum", representatives=self.infllm_representatives, **common)

    def make_predictor(self) -> Predictor | None:
        """The prr.predictors object this plan names; None for predictor="fixed" (P set from outside)."""
        if self.predictor == "last_step":
            return LastStepPredictor()
        if self.predictor == "ema_membership":
            return EmaMembershipPredictor(alpha=self.ema_alpha)
        return None


class GraphDecoder:
    """Static buffers and the decode step of `model` for `batch` rows of up to `max_tokens`."""

    def __init__(self, model: Decoder, plan: StaticPlan, batch: int, max_tokens: int, compile: bool = False,
                 selector: Selector | None = None, predictor: Predictor | None = None,
                 cache: PagedKVCache | None = None, backend: str = "triton") -> None:
        """compile: torch.compile the dense parts of each layer (residual adds, norms, SiLU around
        the fused GEMVs) into a few kernels; compiled on the first step (seconds to a minute).
        (RoPE runs in the cache-append kernel, or at batch 1 with plan.projections="fused" in the
        q|k|v projection's.)
        The plan never changes: another variant or launch choice over the same buffers is
        another engine view, `with_plan(**changes)`, captured on its own.
        selector / predictor: the run's prr.selectors / prr.predictors objects (default: built
        from `plan`, `StaticPlan.make_selector` / `make_predictor`); the plan's topk / sink /
        recent / dense-layer fields then describe nothing (the selector's own settings rule).
        cache: a prefilled PagedKVCache to decode from (its K/V and the selector's metadata,
        e.g. after the eager prefill); default: a new empty one of max_tokens.
        backend: "triton" (prr.kernels; CUDA, or the CPU under TRITON_INTERPRET=1) or "torch"
        (static-shape torch ops, any device: prr/runtime/engine_ops.py); the selector selects
        on the same backend."""
        from prr.runtime.engine_ops import engine_ops

        if plan.problems():
            raise ValueError("invalid StaticPlan: " + "; ".join(plan.problems()))
        c = model.config
        if c.num_heads % c.num_kv_heads:
            raise ValueError(f"num_heads={c.num_heads} is not a multiple of num_kv_heads={c.num_kv_heads}")
        if backend == "torch" and plan.projections == "fused":
            raise ValueError("plan.projections='fused' runs prr.kernels.dense_gemv: it needs backend='triton' "
                             "(backend='torch' projects with F.linear: projections='torch')")
        self._k = engine_ops(backend)
        self.backend = backend
        self.compiled = compile
        self.model, self.plan, self.batch = model, plan, batch
        self.device, self.dtype = model.device, model.dtype
        self.selector = selector if selector is not None else plan.make_selector()
        self.predictor = predictor if predictor is not None else plan.make_predictor()
        bs = plan.block_size
        if cache is None:
            cache = PagedKVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, bs, max_tokens, self.dtype, self.device)
        problems = []
        if (cache.batch, cache.num_kv_heads, cache.head_dim, cache.block_size) != (batch, c.num_kv_heads, c.head_dim, bs):
            problems.append(f"cache [B={cache.batch}, Hkv={cache.num_kv_heads}, D={cache.head_dim}, block_size="
                            f"{cache.block_size}] does not fit batch={batch}, the model and plan.block_size={bs}")
        if cache.dtype != self.dtype or cache.keys[0].device != self.device:
            problems.append(f"cache dtype/device {cache.dtype}/{cache.device} differ from the model's "
                            f"{self.dtype}/{self.device}")
        if problems:
            raise ValueError("; ".join(problems))
        self.cache = cache
        self.max_tokens, self.max_blocks = cache.max_tokens, cache.max_blocks
        self.num_layers, self.hkv, self.d = c.num_layers, c.num_kv_heads, c.head_dim
        self.hq, self.group = c.num_heads, c.num_heads // c.num_kv_heads
        self.topk_capacity = self.selector.capacity(self.group, self.max_blocks)
        budgets = {"topk_blocks": self.selector.topk_blocks if plan.variant != "dense" else 0,
                   "predicted_blocks": plan.predicted_blocks if plan.variant == "prr" else 0}
        for name, blocks in budgets.items():
            if blocks > self.max_blocks:
                raise ValueError(f"{name}={blocks} exceeds the {self.max_blocks} blocks of max_tokens={max_tokens} "
                                 f"(block_size={bs}): lower it or raise max_tokens")
        self.scale = 1.0 / math.sqrt(c.head_dim)
        dev, B, H, NB = self.device, batch, self.hkv, self.max_blocks
        self.keys, self.values = cache.keys, cache.values  # [B, Hkv, T_max, D] per layer
        # Sparse layers keep metadata whatever the variant, so views of one engine (`with_plan`)
        # can run every variant over the same cache.
        self.sparse = [not self.selector.is_dense_layer(i) for i in range(self.num_layers)]
        # Selection in Triton where the selector has kernels (Quest) and the backend is triton,
        # torch ops otherwise.
        self.selector.set_backend(backend)
        # Selectors whose whole metadata is Quest's key max / min let the append kernels update it
        # (backend triton; the torch backend's append leaves it to the selector's append_metadata).
        # (Metadata slots are allocated by the fill or the prefill, or by the first eager step:
        # captures always follow eager warm-up steps.)
        self.kernel_metadata = self.selector.metadata_in_append_kernel and backend == "triton"
        # Tokens in the cache before this step, per row (rows advance together: equal lengths).
        self.pos = torch.zeros(B, dtype=torch.int32, device=dev)
        self.token = torch.zeros(B, 1, dtype=torch.long, device=dev)
        cos, sin = rope_cos_sin(torch.arange(self.max_tokens, device=dev), model.rope.inv_freq.to(dev))
        self.cos, self.sin = cos.to(self.dtype), sin.to(self.dtype)  # [T_max, D]
        self.all_blocks = torch.arange(NB, dtype=torch.int32, device=dev).expand(B, H, NB).contiguous()
        prr = plan.variant == "prr"  # P buffers exist only when built for prr (a prr view of another is refused)
        # The oracle's P is A itself: A's capacity, whatever the plan's |P|.
        oracle = self.predictor is not None and self.predictor.needs_current_selection
        cap = self.topk_capacity if oracle else plan.predicted_blocks
        self.pred_idx = [torch.zeros(B, H, cap, dtype=torch.int32, device=dev) if prr and s else None
                         for s in self.sparse]
        self.pred_cnt = [torch.zeros(B, H, dtype=torch.int32, device=dev) if prr and s else None for s in self.sparse]
        self.predictor_state = None
        if prr and self.predictor is not None:
            self.predictor_state = self.predictor.init_state(self.num_layers, B, H, NB, dev)
            self.predictor.size_for_query(self.predictor_state, self.group * self.d)
        self.scratch = self._k["prr_merge"].repair_scratch(B, H, NB, dev) if prr else None
        self.arrivals = torch.zeros(B * H, dtype=torch.int32, device=dev)
        # fuse_merge's and fused_repair's, main stream (their kernels run one after the other there)
        self.merge_arrivals = torch.zeros(B * H, dtype=torch.int32, device=dev)
        # Device counters (plan.count_hits), per layer, summed over steps, rows and KV heads.
        # [L, 4, B * Hkv] int64: |A|, |P|, |P ∩ A|, |A_t ∩ A_{t-1}| (prr.kernels.step_counters)
        self.step_counts = torch.zeros(self.num_layers, 4, B * H, dtype=torch.int64, device=dev)
        self.counter_scratch = self._k["step_counters"].counter_scratch(B, H, NB, dev)
        kcap = self.topk_capacity
        self.prev_idx = [torch.zeros(B, H, kcap, dtype=torch.int32, device=dev) if s else None for s in self.sparse]
        self.prev_cnt = [torch.zeros(B, H, dtype=torch.int32, device=dev) if s else None for s in self.sparse]
        # Dense-reference metrics of sampled steps (plan.measure_dense; every step in shadow
        # mode): sums over measured (row, KV head)s, per layer.
        self.mass_recall = torch.zeros(self.num_layers, dtype=torch.float64, device=dev)
        self.output_relerr = torch.zeros(self.num_layers, dtype=torch.float64, device=dev)
        self.measured = torch.zeros(self.num_layers, dtype=torch.float64, device=dev)
        self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._forked = False
        self.last_selection: list[tuple[Tensor, Tensor] | None] = [None] * self.num_layers
        self.fused = fuse_layer_weights(model)
        self.eps = c.rms_norm_eps
        self._pre, self._post, self._final = pre_attention, post_attention, final_norm
        if compile:
            self._pre = torch.compile(pre_attention, dynamic=False, fullgraph=True)
            self._post = torch.compile(post_attention, dynamic=False, fullgraph=True)
            self._final = torch.compile(final_norm, dynamic=False, fullgraph=True)
        self.no_delta = torch.zeros(B, 1, c.hidden_size, dtype=self.dtype, device=dev)  # the first layer's
        # paired_qkv_weights' copy and the weight versions it was made from; one dict that every
        # `with_plan` view shares, so views never hold a second copy.
        self._paired: dict[str, list] = {"weights": None, "versions": []}
        if self._appends_in_projection():
            self.paired_qkv_weights()  # now rather than inside a first step (that may be a capture)

    # Plan fields that size the engine's buffers or name its objects: equal in every view.
    BUFFER_FIELDS = ("selector", "topk_blocks", "predicted_blocks", "predictor", "ema_alpha", "mode", "block_size",
                     "sink_blocks", "recent_blocks", "dense_layers", "infllm_representatives")

    def with_plan(self, **changes) -> GraphDecoder:
        """This engine running another plan: the same buffers, cache, metadata, selector,
        predictor and state tensors, with `changes` to the step's choices (variant, overlap,
        repair_mode, fuse_merge, fused_repair, *_per_*, projections, fuse_append, count_hits,
        measure_dense). Each view's step is captured on its own; neither plan ever changes.
        variant="prr" needs an engine built for prr (its P buffers)."""
        plan = dataclasses.replace(self.plan, **changes)
        problems = plan.problems()
        fixed = sorted(set(changes) & set(self.BUFFER_FIELDS))
        if fixed:
            problems.append(f"{fixed} size the engine's buffers or name its objects: build another GraphDecoder")
        if plan.variant == "prr" and self.scratch is None:
            problems.append(f"variant='prr' needs an engine built with variant='prr' (this one: {self.plan.variant!r})")
        if problems:
            raise ValueError("GraphDecoder.with_plan: " + "; ".join(problems))
        view = copy.copy(self)  # shares every buffer and list; only the plan and the per-step fork flag differ
        view.plan, view._forked = plan, False
        if view._appends_in_projection():
            view.paired_qkv_weights()  # now rather than inside a first step (that may be a capture)
        return view

    # --- context ------------------------------------------------------------------------
    @torch.no_grad()
    def fill_random_context(self, length: int, seed: int = 0) -> None:
        """Random K/V for positions [0, length) of every layer, their metadata, pos = length.
        Timings do not depend on values (bf16 normals, never zeros)."""
        if not 0 < length < self.max_tokens:
            raise ValueError(f"context length {length} must be in [1, {self.max_tokens}) (max_tokens)")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for layer in range(self.num_layers):
            for cache in (self.keys[layer], self.values[layer]):
                cache.zero_()
                cache[:, :, :length].normal_(generator=gen)
        token = torch.randint(0, self.model.config.vocab_size, (self.batch,), generator=gen, device=self.device)
        self.start_at(length, token, gen)

    @torch.no_grad()
    def fill_from_cache(self, keys: list[Tensor], values: list[Tensor], length: int, token: Tensor) -> None:
        """Decode from a prefilled context: keys / values [B, Hkv, >= length, D] per layer, the
        metadata rebuilt from them (`start_at`), pos = length; token [B]: the first token to
        decode. (A run with the eager prefill passes its PagedKVCache to the constructor
        instead, metadata included, and calls `begin`.)"""
        if not 0 < length < self.max_tokens:
            raise ValueError(f"context length {length} must be in [1, {self.max_tokens}) (max_tokens)")
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise ValueError(f"need keys and values of {self.num_layers} layers; got {len(keys)} and {len(values)}")
        for layer in range(self.num_layers):
            for cache, source in ((self.keys[layer], keys[layer]), (self.values[layer], values[layer])):
                if source.shape[:2] != cache.shape[:2] or source.shape[3] != self.d or source.shape[2] < length:
                    raise ValueError(f"layer {layer}: cache of shape {tuple(source.shape)} does not hold [B={self.batch}, "
                                     f"Hkv={self.hkv}, >= {length}, D={self.d}]")
                if source.data_ptr() != cache.data_ptr():  # (the engine's own cache stays as it is)
                    cache.zero_()
                    cache[:, :, :length].copy_(source[:, :, :length])
        self.start_at(length, token.view(self.batch).to(self.device))

    def start_at(self, length: int, token: Tensor, gen: torch.Generator | None = None) -> None:
        """Decode from position `length` of the cache as it is: the selector's metadata of every
        sparse layer rebuilt in place from its first `length` tokens, its backlog
        (`Selector.catch_up`, InfLLM's finalising) done with a random query from `gen`, the
        predictor state back to `init_state`'s, then `begin(length, token)`. In place: graphs
        captured before stay valid."""
        q_gen = gen if gen is not None else torch.Generator(device=self.device).manual_seed(0)
        for layer in range(self.num_layers):
            if not self.sparse[layer]:
                continue
            self.cache.reset_metadata(layer)
            self.cache.set_length(layer, length)
            self.selector.update_metadata(self.cache, layer, 0, length)
            q = torch.randn(self.batch, self.hkv, self.group, self.d, generator=q_gen, device=self.device)
            self.selector.catch_up(q.to(self.dtype), self.cache, layer, length)
        if self.predictor_state is not None:
            fresh = self.predictor.init_state(self.num_layers, self.batch, self.hkv, self.max_blocks, self.device)
            for mine, new in zip(state_tensors(self.predictor_state), state_tensors(fresh), strict=True):
                if mine.shape == new.shape:
                    mine.copy_(new)
                else:  # sized on first use (query_similarity's query store): its empty value is 0
                    mine.zero_()
        self.begin(length, token)

    def begin(self, length: int, token: Tensor) -> None:
        """pos = length, token [B] the next input; hit counters cleared. The selector's
        metadata and the predictor state stay as they are (e.g. after the eager prefill; see
        `checkpoint` / `restore` to rewind capture warm-up steps)."""
        self.pos.fill_(length)
        self.token.copy_(token.view(self.batch, 1))
        for layer in range(self.num_layers):
            if self.pred_cnt[layer] is not None:
                self.pred_cnt[layer].zero_()
        for counter in (self.step_counts, self.mass_recall, self.output_relerr, self.measured):
            counter.zero_()

    def adopt_predictor_state(self, state: object) -> None:
        """Decode on from a predictor state warmed elsewhere (the eager prefill's, same class)."""
        if self.predictor is None:
            raise ValueError("this engine has no predictor (variant != 'prr' or predictor='fixed')")
        self.predictor_state = state
        self.predictor.size_for_query(state, self.group * self.d)

    def prime_predictions(self, length: int) -> None:
        """P of the first decode step (a context of length + 1 tokens) from the predictor state,
        for predictors that propose from history at the end of a step (the others propose inside it)."""
        if self.predictor is None or not self.predictor.history_only:
            return
        bs = self.plan.block_size
        num_blocks = torch.full((self.batch,), (length + bs) // bs, dtype=torch.int32, device=self.device)
        for layer in range(self.num_layers):
            if self.sparse[layer]:
                self._propose(layer, None, num_blocks)

    def set_previous_selections(self, masks: list[Tensor | None]) -> None:
        """A_{t-1} per layer ([B, Hkv, NB] bool, None for dense layers; e.g. the eager prefill's
        last prompt-tail selections), for the last-step overlap counter."""
        for layer, mask in enumerate(masks):
            if mask is not None and self.prev_idx[layer] is not None:
                blocks = BlockSet.from_mask(mask[..., : self.max_blocks].to(self.device), self.topk_capacity)
                self.prev_idx[layer].copy_(blocks.indices)
                self.prev_cnt[layer].copy_(blocks.count)

    def checkpoint(self) -> list[Tensor]:
        """Copies of every tensor a step mutates besides K/V (a step writes K/V only at pos and
        beyond): position, token, metadata, predictor state, P, counters."""
        return [t.clone() for t in self._mutable()]

    def restore(self, saved: list[Tensor]) -> None:
        """Back to a `checkpoint`, in place (captured graphs keep their pointers)."""
        for t, old in zip(self._mutable(), saved, strict=True):
            t.copy_(old)

    def _mutable(self) -> list[Tensor]:
        out = [self.pos, self.token, self.step_counts, self.mass_recall, self.output_relerr, self.measured]
        for layer in range(self.num_layers):
            out += [t for t in self.cache.metadata[layer].values() if isinstance(t, Tensor)]
            out += [t for t in (self.pred_idx[layer], self.pred_cnt[layer], self.prev_idx[layer], self.prev_cnt[layer])
                    if t is not None]
        return out + state_tensors(self.predictor_state)

    # --- one layer's attention ------------------------------------------------------------
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

    def select(self, layer: int, q: Tensor, lengths: Tensor) -> Selection:
        """q: [B, Hq, D] post-RoPE, lengths [B] tokens -> A of the run's selector (indices
        [B, Hkv, K] int32 ascending, counts [B, Hkv] int32, scores [B, Hkv, NB])."""
        return self.selector.select(self._grouped(q), self.cache, layer, lengths)

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
        return self._k["sparse_decode"].sparse_decode(q, self.keys[layer], self.values[layer], idx, cnt, lengths,
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
            return self._k["sparse_decode"].sparse_decode_one_wave(
                idx.shape[-1], self.batch, self.hkv, self.plan.block_size, self.device, head_dim=self.d,
                cache_dtype=self.dtype)
        return bool(mode)

    def step_positions(self) -> tuple[Tensor, Tensor]:
        """-> (lengths [B] int32, num_blocks [B] int32) for this step: computed once per step
        and shared by every layer (each is a launch)."""
        bs = self.plan.block_size
        return self.pos + 1, (self.pos + bs).div(bs, rounding_mode="floor")

    def _quest_metadata(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """(key_max, key_min) [B, Hkv, NB, D] the append kernels update, or (None, None): dense
        layers and selectors with other metadata (updated by `append_metadata` after the append)."""
        if self.kernel_metadata and self.sparse[layer]:
            return self.selector.metadata(self.cache, layer)
        return None, None

    def append(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: bool = False) -> Tensor:
        """This step's K/V at pos, and the Quest metadata of its block, in one launch.
        q: [B, Hq, D], k, v: [B, Hkv, D] (post-RoPE, or pre-RoPE with rope: the append kernel
        rotates q and k, one launch fewer) -> q [B, Hq, D] post-RoPE."""
        q_rot = self._k["cache_append"].append_token(
            self.keys[layer], self.values[layer], k, v, self.pos, *self._quest_metadata(layer), self.plan.block_size,
            rope=(self.cos, self.sin, q) if rope else None)
        return q_rot if rope else q

    def attention(self, layer: int, q: Tensor, k: Tensor | None, v: Tensor | None,
                  positions: tuple[Tensor, Tensor] | None = None, rope: bool = False, appended: bool = False) -> Tensor:
        """q: [B, Hq, D], k, v: [B, Hkv, D] post-RoPE, this step's token -> out [B, Hq, D] in the
        model dtype.
        positions: `step_positions()` of this step (computed here when not given).
        rope: q and k are pre-RoPE; the append kernel rotates both (one launch fewer).
        appended: this step's K/V (and metadata) are in the cache already and q is post-RoPE
        (prr.kernels.qkv_append did both in the q|k|v projection); k and v are unused (None)."""
        p = self.plan
        lengths, num_blocks = positions if positions is not None else self.step_positions()
        if not appended:
            q = self.append(layer, q, k, v, rope)
        if not self.sparse[layer] or p.variant == "dense":
            return self._dense(layer, q, lengths, num_blocks)
        if not self.kernel_metadata:  # the selector's own metadata update (InfLLM, LESS)
            self.selector.append_metadata(self.cache, layer, self.pos)
        out, selection = self._sparse(layer, q, lengths, num_blocks)
        if p.measure_dense or p.mode == "shadow":
            self._measure(layer, q, out, selection, lengths, num_blocks)
        if p.mode == "shadow":  # the dense output continues the model; the sparse one was measured
            return self._dense(layer, q, lengths, num_blocks)
        return out

    def _dense(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor) -> Tensor:
        """Attention over every block of the context -> [B, Hq, D] in the model dtype."""
        counts = num_blocks.view(self.batch, 1).expand(self.batch, self.hkv).contiguous()
        return self.attend(layer, q, self.all_blocks, counts, lengths, final=True)[0]

    def _measure(self, layer: int, q: Tensor, out: Tensor, selection: Selection, lengths: Tensor,
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

    def _sparse(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor) -> tuple[Tensor, Selection]:
        """The DSA step of a sparse layer (serial or PRR) -> (out [B, Hq, D] model dtype, A)."""
        p = self.plan
        compensates = self.selector.compensates
        if p.variant == "serial":
            selection = self.select(layer, q, lengths)
            self._note(layer, selection)
            idx, cnt = selection.blocks.indices, selection.blocks.count
            if p.learn_in_serial and self.predictor is not None and self.predictor_state is not None:
                self._learn(layer, q, selection, lengths)
            if not compensates:
                return self.attend(layer, q, idx, cnt, lengths, final=True)[0], selection
            out, lse = self.attend(layer, q, idx, cnt, lengths)
            return self._compensated(layer, q, out, lse, selection, lengths), selection

        predictor = self.predictor
        if predictor is not None and predictor.needs_current_selection:  # the oracle: P = A, no overlap
            selection = self.select(layer, q, lengths)
            self._propose(layer, q, num_blocks, selection)
            spec = self.attend(layer, q, self.pred_idx[layer], self.pred_cnt[layer], lengths,
                                per_block=p.repair_mode == "exact")
        else:
            spec, selection = self.speculate_beside_selection(layer, q, lengths, num_blocks)
        spec_out, spec_lse = spec
        self._shared(q, lengths, spec_out, spec_lse)
        out, lse, keep = self._repair(layer, q, selection, lengths, spec_out, spec_lse, fp32=compensates)
        # P may be overwritten (next step's prediction) once the repair has read it.
        self._note(layer, selection)  # (its counters read P: before the side stream may rewrite it)
        planned = torch.cuda.Event() if self.side is not None and p.overlap else None
        if planned is not None:
            planned.record()
        if compensates:
            out = self._compensated(layer, q, out, lse, selection, lengths)
        if predictor is None:  # P is set from outside: nothing to learn
            return out, selection
        self._learn(layer, q, selection, lengths, planned)
        return out, selection

    def _learn(self, layer: int, q: Tensor, selection: Selection, lengths: Tensor,
               planned: torch.cuda.Event | None = None) -> None:
        """The predictor learns from A on the side stream (after `planned`, recorded on the main
        stream once A and P's last readers are queued; now when None), and history-only
        predictors write next step's P."""
        predictor = self.predictor
        if planned is None and self.side is not None and self.plan.overlap:
            planned = torch.cuda.Event()
            planned.record()
        if planned is not None:
            self.side.wait_event(planned)
            self._forked = True
            self._shared(selection.blocks.indices, selection.blocks.count, selection.scores)
        with self._side():  # learn from A; history-only predictors write next step's P now
            predictor.update(self.predictor_state, layer, selection)
            if predictor.history_only:
                # The next step's context holds lengths + 1 tokens. (From `lengths`, made at the
                # step's start: `pos` advances on the main stream while this side work may still run.)
                bs = self.plan.block_size
                self._propose(layer, q, (lengths + bs).div(bs, rounding_mode="floor"))

    def _compensated(self, layer: int, q: Tensor, out: Tensor, lse: Tensor, selection: Selection,
                     lengths: Tensor) -> Tensor:
        """out [B, Hq, D] fp32, lse [B, Hq] of the attended blocks ⊕ the selector's estimate of the
        others (LESS) -> [B, Hq, D] in the model dtype."""
        b, h, g, d = self.batch, self.hkv, self.group, self.d
        state = AttentionState(out.float().view(b, h, g, d), lse.view(b, h, g))
        state = merge(state, self.selector.compensation(self._grouped(q), self.cache, layer, selection, lengths))
        return state.out.to(self.dtype).view(b, h * g, d)

    def _propose(self, layer: int, q: Tensor | None, num_blocks: Tensor, current: Selection | None = None) -> None:
        """Write the predictor's P for a context of num_blocks [B] blocks into this layer's P
        buffers (q [B, Hq, D]: this step's query, for predictors that `needs_query`)."""
        predictor = self.predictor
        query = {"query": self._grouped(q)} if predictor.needs_query else {}
        proposed = predictor.propose(self.predictor_state, layer, num_blocks, self.pred_idx[layer].shape[-1], current,
                                     **query)
        self.pred_idx[layer][..., : proposed.capacity].copy_(proposed.indices)
        self.pred_cnt[layer].copy_(proposed.count)

    def speculate_beside_selection(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor):
        """PRR's overlapped part: attention over P on the side stream while A is selected on the
        main one, joined after. P was written by the previous step (history-only predictors, or
        from outside with predictor None), or is proposed first on the side stream (predictors
        that need this step's query or the layer below's selection).
        q: [B, Hq, D] post-RoPE; lengths, num_blocks: [B] int32 (step_positions).
        -> ((spec_out, spec_lse): exact mode [B, Hq, |P|, D], [B, Hq, |P|] per-block states,
            superset [B, Hq, D], [B, Hq]; the Selection A)."""
        self._fork()
        with self._side():
            if self.predictor is not None and not self.predictor.history_only:
                self._propose(layer, q, num_blocks)
            spec = self.attend(layer, q, self.pred_idx[layer], self.pred_cnt[layer], lengths,
                                per_block=self.plan.repair_mode == "exact")
        selection = self.select(layer, q, lengths)
        self.join()  # the speculation is done (the side stream's queue up to here)
        return spec, selection

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
            return self._k["prr_repair"].repair_and_merge(
                q, self.keys[layer], self.values[layer], idx, cnt, pred_idx, pred_cnt, lengths, spec_out, spec_lse,
                p.block_size, self.scale, out_dtype=out_dtype, arrivals=self.merge_arrivals,
                tokens_per_split=p.repair_tokens_per_split)
        kp = self._k["prr_merge"]
        miss_idx, miss_cnt, keep = kp.repair_plan(idx, cnt, pred_idx, pred_cnt, self.scratch)
        # The repair's split partials stay unmerged: merge_speculation folds them in (one launch fewer).
        rep_out, rep_lse = self.attend(layer, q, miss_idx, miss_cnt, lengths, merge_splits=False)
        if p.repair_mode == "superset":  # P attended as a whole: its false positives stay in
            spec_out, spec_lse = spec_out.unsqueeze(2), spec_lse.unsqueeze(2)
            keep = torch.ones(self.batch, self.hkv, 1, dtype=torch.bool, device=self.device)
        out, lse = kp.merge_speculation(spec_out, spec_lse, keep, rep_out, rep_lse, out_dtype=out_dtype)
        return out, lse, keep

    def _fused_repair(self, idx: Tensor, pred_idx: Tensor) -> bool:
        """Whether PRR's tail over A = idx [B, Hkv, K] and P = pred_idx [B, Hkv, |P|] is one
        launch (plan.fused_repair)."""
        mode = self.plan.fused_repair
        if mode == "auto":
            return self.plan.repair_mode == "exact" and self._k["prr_repair"].fused_tail_pays(
                idx.shape[-1], pred_idx.shape[-1], self.batch * self.hkv, self.device)
        return bool(mode)

    def _shared(self, *tensors: Tensor) -> None:
        """Tensors used on both streams: the caching allocator must not recycle them before
        both streams are done with them."""
        if self.side is not None and self.plan.overlap:
            main = torch.cuda.current_stream(self.device)
            for t in tensors:
                t.record_stream(self.side)
                t.record_stream(main)

    def _note(self, layer: int, selection: Selection) -> None:
        """Keep A for callers (benchmarks) and, with count_hits, add this step's |A|, |P|,
        |P ∩ A| and |A_t ∩ A_{t-1}| to the layer's device counters (one launch; any repair mode)."""
        idx, cnt = selection.blocks.indices, selection.blocks.count
        self.last_selection[layer] = (idx, cnt)
        if not self.plan.count_hits:
            return
        speculating = self.plan.variant == "prr"
        self._k["step_counters"].step_counters(idx, cnt, self.pred_idx[layer] if speculating else None,
                                    self.pred_cnt[layer] if speculating else None, self.prev_idx[layer],
                                    self.prev_cnt[layer], self.counter_scratch, self.step_counts[layer])

    COUNTERS = ("selected", "predicted", "hits", "overlap", "mass_recall", "output_relerr", "measured")

    def counters(self) -> dict[str, list[float]]:
        """The device counters per layer, summed since `begin` (one host read: call once per
        window): |A|, |P|, |P ∩ A|, |A_t ∩ A_{t-1}|, and over dense-measured (row, KV head)s the
        sums of mass recall and output error and their count."""
        counts = self.step_counts.sum(-1).double().T  # [4, L]
        stacked = torch.cat([counts, torch.stack([self.mass_recall, self.output_relerr, self.measured])]).cpu()
        return dict(zip(self.COUNTERS, stacked.tolist(), strict=True))

    # --- the whole step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, advance: bool = True) -> Tensor:
        """One decode step of every layer -> logits [B, V] (greedy token and pos + 1 written
        back when advance). Graph-capturable: no host synchronisation, static shapes."""
        positions = self.step_positions()
        if self.plan.projections == "fused":
            logits = self._fused_layers(positions, [self.hq, self.hkv, self.hkv])
        else:
            logits = self._torch_layers(positions)
        if advance:
            self.token.copy_(logits.argmax(-1, keepdim=True))
            self.pos.add_(1)
        self.join()  # the side stream's last work (next-P writes) belongs to this step
        return logits

    def _torch_layers(self, positions: tuple[Tensor, Tensor]) -> Tensor:
        """Every layer with F.linear projections: the model's own forward (Decoder.layers), with
        this engine's attention -> logits [B, V]."""
        m, B = self.model, self.batch

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [B, 1, H*, D] before RoPE
            return self.attention(layer, q[:, 0], k[:, 0], v[:, 0], positions, rope=True).view(B, 1, -1)
        hidden = m.layers(m.model.embed_tokens(self.token), attend, delta=self.no_delta,  # [B, 1, H]
                          pre=self._pre, post=self._post, final=self._final)
        return m.lm_head(hidden)[:, 0]  # [B, V]

    def _fused_layers(self, positions: tuple[Tensor, Tensor], split: list[int]) -> Tensor:
        """Every layer with prr.kernels.dense_gemv -> logits [B, V]: the residual stream x [B, H]
        is updated in place by o_proj's and down's epilogues; the norms run inside the next
        projection."""
        m, B, gemv = self.model, self.batch, self._k["dense_gemv"].dense_gemv
        paired = self.paired_qkv_weights() if self._appends_in_projection() else None
        x = m.model.embed_tokens(self.token).view(B, -1)  # [B, H]: a fresh buffer, ours to update
        for i, w in enumerate(self.fused):
            if paired is not None:  # batch 1: projection, RoPE and append in one launch
                q = self._k["qkv_append"].qkv_rope_append(
                    x, *paired[i], w.ln1, self.eps, self.keys[i], self.values[i], self.pos, self.cos, self.sin,
                    *self._quest_metadata(i), self.plan.block_size, self.hq, self.hkv)  # [1, Hq, D] post-RoPE
                out = self.attention(i, q, None, None, positions, appended=True).view(B, self.hq * self.d)
            else:
                qkv = gemv(x, w.wqkv, w.bqkv, norm_weight=w.ln1, eps=self.eps).view(B, sum(split), self.d)
                q, k, v = qkv.split(split, dim=1)  # [B, Hq | Hkv | Hkv, D], before RoPE
                out = self.attention(i, q, k, v, positions, rope=True).view(B, self.hq * self.d)
            gemv(out, w.wo, w.bo, residual=x)  # x += o_proj(out)
            h = gemv(x, w.w_gate_up, w.b_gate_up, norm_weight=w.ln2, eps=self.eps, swiglu=True)  # [B, I]
            gemv(h, w.w_down, w.b_down, residual=x)  # x += down(h)
        head = m.lm_head
        return gemv(x, head.weight, head.bias, norm_weight=m.model.norm.weight, eps=m.model.norm.eps)  # [B, V]

    def _appends_in_projection(self) -> bool:
        return self.plan.projections == "fused" and self.batch == 1 and self.plan.fuse_append

    def paired_qkv_weights(self) -> list[tuple[Tensor, Tensor | None]]:
        """Per layer (wqkv [(Hq + 2 Hkv) D, H], bqkv [(Hq + 2 Hkv) D] or None) with the q and k
        rows of every head in RoPE pair order (prr.kernels.qkv_append.rope_pair_permutation):
        what the one-launch projection + append reads. A copy (the q|k|v weights twice in memory,
        ~1.6 GB for Llama-3.1-8B in bf16), since the torch path and batch > 1 read `fused[i].wqkv`
        as it is; built on first need, and re-copied in place (captured graphs keep their
        pointers) when the model's q|k|v weights were edited in place since (tensor versions)."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        # The fused q|k|v weight and the module parameters that are views of it (`.data` views:
        # an in-place edit through either bumps only its own version counter).
        versions = [tuple(t._version for t in (w.wqkv, w.bqkv, *layer.self_attn.q_proj.parameters(),
                                               *layer.self_attn.k_proj.parameters(),
                                               *layer.self_attn.v_proj.parameters()) if t is not None)
                    for w, layer in zip(self.fused, self.model.model.layers, strict=True)]
        paired = self._paired
        if paired["weights"] is not None and versions == paired["versions"]:
            return paired["weights"]
        if capturing:
            raise RuntimeError("the paired q|k|v weights are (re)built before use: run a step before capturing "
                               "(capture() warms up first), or call paired_qkv_weights()")
        perm = self._k["qkv_append"].rope_pair_permutation(self.hq, self.hkv, self.d).to(self.device)
        with torch.no_grad():
            if paired["weights"] is None:
                paired["weights"] = [(w.wqkv[perm], None if w.bqkv is None else w.bqkv[perm]) for w in self.fused]
            else:  # the model changed in place: refresh the copy where it is
                for w, (pw, pb) in zip(self.fused, paired["weights"], strict=True):
                    torch.index_select(w.wqkv, 0, perm, out=pw)
                    if pb is not None:
                        torch.index_select(w.bqkv, 0, perm, out=pb)
        paired["versions"] = versions
        return paired["weights"]

    def capture(self, fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
        """Capture `fn()` (e.g. lambda: d.step(False)) after `warmup` eager calls on a side
        stream (as CUDA graphs require). Replaying runs fn's kernels with no launch cost."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need runtime.device=cuda")
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.graph_output = fn()
        return graph

    def set_predictions(self, layer: int, idx: Tensor, cnt: Tensor) -> None:
        """For predictor=fixed: P of `layer` ([B, Hkv, |P|] int32, [B, Hkv] int32)."""
        self.pred_idx[layer].copy_(idx)
        self.pred_cnt[layer].copy_(cnt)


def state_tensors(state: object) -> list[Tensor]:
    """Every tensor of a predictor state (a tensor, a dataclass, a dict, or lists of them)."""
    if isinstance(state, Tensor):
        return [state]
    if dataclasses.is_dataclass(state):
        state = [getattr(state, f.name) for f in dataclasses.fields(state)]
    elif isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, list | tuple):
        return [t for item in state for t in state_tensors(item)]
    return []
