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
    after the last sparse layer, side stream: every layer's counters in one launch (count_hits,
                          plan.count_at_step_end), then ema's learning of every layer (learn_layers_at_once)

"serial" is select -> attend A (no predictor), "dense" attends every block. The predictor
learns on the side stream and writes next step's P there, so prediction costs the critical
path nothing; it sees only selections of past steps.

The per-layer attention (select, speculate, repair, merge, learn) is `AttentionEngine`'s
(prr/runtime/attention_engine.py), the one PRR step that the eager research runtime
(DSABackend) runs too, uncaptured and timed stage by stage. A `GraphDecoder` holds one
(`attn`: it owns the P buffers, the predictor state and the counters; the decoder reads the
parts its callers need through read-only views) and adds the model's forward, RoPE and the
cache append around it, and the capture. Selection and prediction are
the run's own selector and predictor objects (prr.selectors, prr.predictors), which every
caller passes (benchmarks build them from conf/: `prr.benchmarking.configured`); the plan
holds only shapes and launch choices. Predictors that rank from history alone (`history_only`)
write next step's P right after learning, on the side stream; cross_layer writes a layer's P
right after the layer below it learned (same step; `Predictor.proposals_after_update`); the
others (query_similarity, oracle) propose at the start of the layer, on the side stream before
speculation (the oracle after selection: it needs A).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import Tensor

from prr.blocks import BlockSet
from prr.cache import PagedKVCache
from prr.model.decoder import Decoder
from prr.model.layer_math import final_norm, fuse_layer_weights, post_attention, pre_attention
from prr.model.rope import rope_cos_sin
from prr.predictors import Predictor
from prr.runtime.attention_engine import MISSING_SELECTOR, AttentionEngine
from prr.runtime.static_plan import (  # noqa: F401  (the plan's names, re-exported for callers)
    FUSE_MERGE,
    FUSED_REPAIR,
    MODES,
    PROJECTIONS,
    REPAIR_MODES,
    VARIANTS,
    StaticPlan,
    metadata_bytes_per_block,
    metadata_dtype,
)
from prr.selectors import Selector


def _engine_part(name: str, doc: str) -> property:
    """A read-only view of the attention engine's `name` (GraphDecoder.attn)."""
    return property(lambda self: getattr(self.attn, name), doc=doc)


class GraphDecoder:
    """Static buffers and the decode step of `model` for `batch` rows of up to `max_tokens`:
    the model's forward around `AttentionEngine`'s attention, capturable as one CUDA graph."""

    def __init__(self, model: Decoder, plan: StaticPlan, batch: int, max_tokens: int, compile: bool = False, *,
                 selector: Selector, predictor: Predictor | None, cache: PagedKVCache | None = None,
                 backend: str = "triton") -> None:
        """compile: torch.compile the dense parts of each layer (residual adds, norms, SiLU around
        the fused GEMVs) into a few kernels; compiled on the first step (seconds to a minute).
        (RoPE runs in the cache-append kernel, or at batch 1 with plan.projections="fused" in the
        q|k|v projection's.)
        The plan never changes: another variant or launch choice over the same buffers is
        another engine view, `with_plan(**changes)`, captured on its own.
        selector / predictor (required): the run's prr.selectors / prr.predictors objects; their
        own settings (top-K, forced blocks, dense layers, ...) rule. predictor=None: no predictor,
        P set from outside (`set_predictions`; and what a serial or dense engine passes).
        cache: a prefilled PagedKVCache to decode from (its K/V and the selector's metadata,
        e.g. after the eager prefill); default: a new empty one of max_tokens.
        backend: "triton" (prr.kernels; CUDA, or the CPU under TRITON_INTERPRET=1 for tests) or
        "torch" (static-shape torch ops, any device: prr/runtime/engine_ops.py); the selector
        selects on the same backend.
        A tensor-parallel shard as `model` (prr.model.tensor_parallel.shard_decoder): the engine
        attends the rank's KV heads only, and the model's forward all-reduces o_proj's and down's
        outputs (one all-reduce each per layer); every rank computes the same logits and token.
        For now the torch projections only, uncompiled."""
        if model.tensor_parallel is not None and (plan.projections == "fused" or compile):
            raise ValueError("tensor_parallel runs the torch projections uncompiled for now: use plan.projections="
                             "'torch' (runtime.projections=torch) and compile=False")
        if plan.problems():
            raise ValueError("invalid StaticPlan: " + "; ".join(plan.problems()))
        if selector is None:
            raise ValueError(MISSING_SELECTOR.format(owner="GraphDecoder"))
        c = model.config
        if c.num_heads % c.num_kv_heads:
            raise ValueError(f"num_heads={c.num_heads} is not a multiple of num_kv_heads={c.num_kv_heads}")
        if backend == "torch" and plan.projections == "fused":
            raise ValueError("plan.projections='fused' runs prr.kernels.dense_gemv: it needs backend='triton' "
                             "(backend='torch' projects with F.linear: projections='torch')")
        bs, dtype, device = plan.block_size, model.dtype, model.device
        if cache is None:
            cache = PagedKVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, bs, max_tokens, dtype, device)
        problems = []
        if (cache.batch, cache.num_kv_heads, cache.head_dim, cache.block_size) != (batch, c.num_kv_heads, c.head_dim, bs):
            problems.append(f"cache [B={cache.batch}, Hkv={cache.num_kv_heads}, D={cache.head_dim}, block_size="
                            f"{cache.block_size}] does not fit batch={batch}, the model and plan.block_size={bs}")
        if cache.dtype != dtype or cache.keys[0].device != device:
            problems.append(f"cache dtype/device {cache.dtype}/{cache.device} differ from the model's {dtype}/{device}")
        if problems:
            raise ValueError("; ".join(problems))
        selector.bind_model(c)  # (InfLLM: the RoPE its scoring undoes)
        budgets = {"selector.topk_blocks": selector.topk_blocks if plan.variant != "dense" else 0,
                   "predicted_blocks": plan.predicted_blocks if plan.variant == "prr" else 0}
        for name, blocks in budgets.items():
            if blocks > cache.max_blocks:
                raise ValueError(f"{name}={blocks} exceeds the {cache.max_blocks} blocks of max_tokens={max_tokens} "
                                 f"(block_size={bs}): lower it or raise max_tokens")
        # The attention of every layer (selection, speculation, repair, merge, the predictor, P and the
        # counters) is the engine's; this object adds the model's forward around it, and the capture.
        self.attn = AttentionEngine(plan, cache, c.num_heads, selector=selector, predictor=predictor, backend=backend)
        self.cache, self.keys, self.values = cache, cache.keys, cache.values  # [B, Hkv, T_max, D] per layer
        self.batch, self.num_layers, self.max_tokens, self.max_blocks = batch, c.num_layers, cache.max_tokens, cache.max_blocks
        self.hq, self.hkv, self.group, self.d = c.num_heads, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        self.device, self.dtype = device, dtype
        # Tokens in the cache before this step, per row (rows may differ: ragged batches).
        self.pos = torch.zeros(batch, dtype=torch.int32, device=device)
        self.compiled = compile
        self.replay: dict | None = None  # a replaying predictor's record of its serial pass (prime_predictions)
        # [B, max_tokens] int64 or None: the input token that follows each position, -1 where the
        # step's own greedy token follows. Set only by a replaying predictor's recorded pass
        # (prr/runtime/replay.py: teacher forcing, so a bf16 run cannot leave the recorded trajectory).
        self.forced_tokens: Tensor | None = None
        self.model = model
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        cos, sin = rope_cos_sin(torch.arange(self.max_tokens, device=device), model.rope.inv_freq.to(device))
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)  # [T_max, D]
        self.fused = fuse_layer_weights(model)
        self.eps = c.rms_norm_eps
        self._pre, self._post, self._final = pre_attention, post_attention, final_norm
        if compile:
            self._pre = torch.compile(pre_attention, dynamic=False, fullgraph=True)
            self._post = torch.compile(post_attention, dynamic=False, fullgraph=True)
            self._final = torch.compile(final_norm, dynamic=False, fullgraph=True)
        self.no_delta = torch.zeros(batch, 1, c.hidden_size, dtype=dtype, device=device)  # the first layer's
        # paired_qkv_weights' copy and the weight versions it was made from; one dict that every
        # `with_plan` view shares, so views never hold a second copy.
        self._paired: dict[str, list] = {"weights": None, "versions": []}
        if self._appends_in_projection():
            self.paired_qkv_weights()  # now rather than inside a first step (that may be a capture)

    # Plan fields that size the engine's buffers: equal in every view.
    BUFFER_FIELDS = ("predicted_blocks", "mode", "block_size", "study_ratios")

    # The engine's parts and state that the step's callers (the run driver, budgets, benchmarks)
    # read through the decoder: read-only views of `self.attn`'s, which owns them.
    COUNTERS = AttentionEngine.COUNTERS
    plan = _engine_part("plan", "the StaticPlan this view's step runs")
    backend = _engine_part("backend", "the op backend: triton or torch")
    selector = _engine_part("selector", "the run's selector")
    predictor = _engine_part("predictor", "the run's predictor (None: P set from outside)")
    predictor_state = _engine_part("predictor_state", "the predictor's device state")
    sparse = _engine_part("sparse", "per layer: sparse (selected) or dense")
    pred_idx = _engine_part("pred_idx", "P per layer: [B, Hkv, |P|] int32 (None: dense layers)")
    pred_cnt = _engine_part("pred_cnt", "|P| per layer: [B, Hkv] int32")
    last_selection = _engine_part("last_selection", "A of each layer's last step: (indices, counts)")
    topk_capacity = _engine_part("topk_capacity", "|A| at most, per (row, KV head)")
    kernel_metadata = _engine_part("kernel_metadata", "the append kernels update the selector's metadata")
    scratch = _engine_part("scratch", "the repair plan's workspace")
    scale = _engine_part("scale", "the attention's softmax scale")

    def counters(self) -> dict[str, list[float]]:
        return self.attn.counters()

    def study_counters(self, per_row: bool = False) -> dict[str, Tensor]:
        return self.attn.study_counters(per_row)

    def adopt_predictor_state(self, state: object) -> None:
        self.attn.adopt_predictor_state(state)

    def set_predictions(self, layer: int, idx: Tensor, cnt: Tensor) -> None:
        self.attn.set_predictions(layer, idx, cnt)

    def select(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor | None = None):
        return self.attn.select(layer, q, lengths, num_blocks)

    def attend(self, *args, **kwargs):
        return self.attn.attend(*args, **kwargs)

    def speculate_beside_selection(self, *args, **kwargs):
        return self.attn.speculate_beside_selection(*args, **kwargs)

    def join(self) -> None:
        self.attn.join()

    def with_plan(self, **changes) -> GraphDecoder:
        """This engine running another plan: the same buffers, cache, metadata, selector,
        predictor and state tensors, with `changes` to the step's choices (variant, overlap,
        repair_mode, fuse_merge, fused_repair, *_per_*, projections, fuse_append, count_hits,
        count_at_step_end, measure_dense, study_counters). Each view's step is captured on its own; neither plan ever changes.
        variant="prr" needs an engine built for prr (its P buffers)."""
        plan = dataclasses.replace(self.plan, **changes)
        problems = plan.problems()
        fixed = sorted(set(changes) & set(self.BUFFER_FIELDS))
        if fixed:
            problems.append(f"{fixed} size the engine's buffers: build another GraphDecoder")
        if plan.variant == "prr" and self.attn.scratch is None:
            problems.append(f"variant='prr' needs an engine built with variant='prr' (this one: {self.plan.variant!r})")
        if problems:
            raise ValueError("GraphDecoder.with_plan: " + "; ".join(problems))
        view = copy.copy(self)  # shares every buffer and list; only the plan and the per-step fork flag differ
        view.attn = copy.copy(self.attn)
        view.attn.plan, view.attn._forked, view.attn._learned = plan, False, []  # (a step's selections: its own)
        view.attn._counted, view.attn._stacked = [], None
        if view._appends_in_projection():
            view.paired_qkv_weights()  # now rather than inside a first step (that may be a capture)
        return view

    # --- context ------------------------------------------------------------------------
    @torch.no_grad()
    def fill_random_context(self, length: int | list[int] | Tensor, seed: int = 0) -> None:
        """Random K/V for positions [0, length) of every layer, their metadata, pos = length
        (an int, or one per row: a ragged batch). Timings do not depend on values (bf16
        normals, never zeros)."""
        rows = self.row_lengths(length)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for layer in range(self.num_layers):
            for cache in (self.keys[layer], self.values[layer]):
                cache.zero_()
                if len(set(rows)) == 1:
                    cache[:, :, : rows[0]].normal_(generator=gen)
                    continue
                for b, n in enumerate(rows):
                    cache[b, :, :n].normal_(generator=gen)
        token = torch.randint(0, self.model.config.vocab_size, (self.batch,), generator=gen, device=self.device)
        self.start_at(length, token, gen)

    def row_lengths(self, lengths: int | list[int] | Tensor) -> list[int]:
        """A context length for every row (an int: all rows; a list or [B] tensor: per row,
        ragged batches) -> [B] host ints, each in [1, max_tokens)."""
        if isinstance(lengths, Tensor):
            lengths = lengths.tolist() if lengths.dim() else int(lengths)
        rows = [int(lengths)] * self.batch if isinstance(lengths, int) else [int(n) for n in lengths]
        if len(rows) != self.batch:
            raise ValueError(f"need one context length per row: {self.batch} rows, got {len(rows)} lengths")
        for n in rows:
            if not 0 < n < self.max_tokens:
                raise ValueError(f"context length {n} must be in [1, {self.max_tokens}) (max_tokens)")
        return rows

    @torch.no_grad()
    def fill_from_cache(self, keys: list[Tensor], values: list[Tensor], length: int | list[int] | Tensor,
                        token: Tensor) -> None:
        """Decode from a prefilled context: keys / values [B, Hkv, >= length, D] per layer, the
        metadata rebuilt from them (`start_at`), pos = length; token [B]: the first token to
        decode. length: an int, or one per row (a list or [B] tensor: a ragged batch; row b's
        tokens past its length are zeroed). (A run with the eager prefill passes its
        PagedKVCache to the constructor instead, metadata included, and calls `begin`.)"""
        rows = self.row_lengths(length)
        longest = max(rows)
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise ValueError(f"need keys and values of {self.num_layers} layers; got {len(keys)} and {len(values)}")
        for layer in range(self.num_layers):
            for cache, source in ((self.keys[layer], keys[layer]), (self.values[layer], values[layer])):
                if source.shape[:2] != cache.shape[:2] or source.shape[3] != self.d or source.shape[2] < longest:
                    raise ValueError(f"layer {layer}: cache of shape {tuple(source.shape)} does not hold [B={self.batch}, "
                                     f"Hkv={self.hkv}, >= {longest}, D={self.d}]")
                if source.data_ptr() != cache.data_ptr():  # (the engine's own cache stays as it is)
                    cache.zero_()
                    for b, n in enumerate(rows):
                        cache[b, :, :n].copy_(source[b, :, :n])
        self.start_at(length, token.view(self.batch).to(self.device))

    def start_at(self, length: int | list[int] | Tensor, token: Tensor, gen: torch.Generator | None = None,
                 query: Tensor | None = None) -> None:
        """Decode from position `length` of the cache as it is: the selector's metadata of every
        sparse layer rebuilt in place from its first `length` tokens, its backlog
        (`Selector.catch_up`, InfLLM's finalising) done with a random query from `gen` (or
        `query` [B, Hkv, G, D], one per layer alike; the prompt's queries are not known here, so
        it also stands for every prompt position's query in InfLLM's window scores), the
        predictor state back to `init_state`'s,
        then `begin(length, token)`. In place: graphs captured before stay valid.
        length: an int, or one per row (a list or [B] tensor): rows of different lengths are
        rebuilt one by one (`PagedKVCache.row`), each from its own tokens only; the cache's host
        length is then the longest row's."""
        rows = self.row_lengths(length)
        ragged = len(set(rows)) > 1
        if ragged and not self.attn.selector.per_row_metadata:
            raise ValueError(f"{type(self.attn.selector).__name__} keeps metadata a row view cannot rebuild "
                             "(per_row_metadata=False): rows of different lengths need per-row metadata")
        q_gen = gen if gen is not None else torch.Generator(device=self.device).manual_seed(0)
        for layer in range(self.num_layers):
            if not self.attn.sparse[layer]:
                continue
            self.cache.reset_metadata(layer)
            self.cache.set_length(layer, max(rows))
            q = query if query is not None else torch.randn(self.batch, self.hkv, self.group, self.d, generator=q_gen,
                                                            device=self.device)
            q = q.to(self.device, self.dtype)
            # No prompt queries here: q stands for every prompt position's (InfLLM's window scores).
            if not ragged:
                self.attn.selector.update_metadata(self.cache, layer, 0, rows[0])
                every = q.unsqueeze(3).expand(*q.shape[:3], rows[0], self.d)  # [B, Hkv, G, T, D]
                self.attn.selector.catch_up(q, self.cache, layer, rows[0], queries=every)
                continue
            for b, n in enumerate(rows):  # each row from its own first n tokens
                view = self.cache.row(b)
                view.set_length(layer, n)
                self.attn.selector.update_metadata(view, layer, 0, n)
                qb = q[b : b + 1]
                self.attn.selector.catch_up(qb, view, layer, n, queries=qb.unsqueeze(3).expand(*qb.shape[:3], n, self.d))
        if self.attn.predictor_state is not None:
            fresh = self.attn.predictor.init_state(self.num_layers, self.batch, self.hkv, self.max_blocks, self.device)
            for mine, new in zip(state_tensors(self.attn.predictor_state), state_tensors(fresh), strict=True):
                if mine.shape == new.shape:
                    mine.copy_(new)
                else:  # sized on first use (query_similarity's query store): its empty value is 0
                    mine.zero_()
        self.begin(length, token)

    def begin(self, length: int | list[int] | Tensor, token: Tensor) -> None:
        """pos = length (an int, or one per row), token [B] the next input; hit counters
        cleared. The selector's metadata and the predictor state stay as they are (e.g. after
        the eager prefill; see `checkpoint` / `restore` to rewind capture warm-up steps)."""
        self.pos.copy_(torch.tensor(self.row_lengths(length), dtype=torch.int32))
        self.token.copy_(token.view(self.batch, 1))
        for layer in range(self.num_layers):
            if self.attn.pred_cnt[layer] is not None:
                self.attn.pred_cnt[layer].zero_()
        for counter in (self.attn.step_counts, self.attn.mass_recall, self.attn.output_relerr, self.attn.measured,
                        self.attn.study_counts):
            counter.zero_()

    def prime_predictions(self, length: int | list[int] | Tensor) -> None:
        """P of the first decode step (a context of length + 1 tokens per row) from the
        predictor state, for the layers whose P a step's learning writes for the next step
        (`Predictor.proposals_after_update`: history-only predictors, cross_layer's first
        selected layer); the others are proposed inside the step.
        A predictor that replays selections (`replays_selections`: the benchmark tool
        bench_hit_rate) gets its serial pass recorded first (prr/runtime/replay.py): the engine
        decodes the steps its cache has room for as serial DSA, rewinds, and the predictor builds
        P of every step from the recorded A (its record: `self.replay`)."""
        if self.attn.predictor is None or self.attn.predictor_state is None:
            return
        if self.attn.predictor.replays_selections:
            from prr.runtime.replay import record_serial_pass

            self.replay = record_serial_pass(self, self.row_lengths(length))
        bs = self.plan.block_size
        num_blocks = torch.tensor([(n + bs) // bs for n in self.row_lengths(length)], dtype=torch.int32,
                                  device=self.device)
        for layer in range(self.num_layers):
            if self.attn.sparse[layer]:
                for target, next_step in self.attn.predictor.proposals_after_update(self.attn.predictor_state, layer):
                    if next_step:
                        self.attn._propose(target, None, num_blocks)

    def set_previous_selections(self, masks: list[Tensor | None]) -> None:
        """A_{t-1} per layer ([B, Hkv, NB] bool, None for dense layers; e.g. the eager prefill's
        last prompt-tail selections), for the last-step overlap counter."""
        for layer, mask in enumerate(masks):
            if mask is not None and self.attn.prev_idx[layer] is not None:
                blocks = BlockSet.from_mask(mask[..., : self.max_blocks].to(self.device), self.attn.topk_capacity)
                self.attn.prev_idx[layer].copy_(blocks.indices)
                self.attn.prev_cnt[layer].copy_(blocks.count)

    def checkpoint(self) -> list[Tensor]:
        """Copies of every tensor a step mutates besides K/V (a step writes K/V only at pos and
        beyond): position, token, metadata, predictor state, P, counters."""
        return [t.clone() for t in self._mutable()]

    def restore(self, saved: list[Tensor]) -> None:
        """Back to a `checkpoint`, in place (captured graphs keep their pointers)."""
        for t, old in zip(self._mutable(), saved, strict=True):
            t.copy_(old)

    def _mutable(self) -> list[Tensor]:
        out = [self.pos, self.token, self.attn.step_counts, self.attn.mass_recall, self.attn.output_relerr, self.attn.measured,
               self.attn.study_counts]
        for layer in range(self.num_layers):
            out += [t for t in self.cache.metadata[layer].values() if isinstance(t, Tensor)]
            out += [t for t in (self.attn.pred_idx[layer], self.attn.pred_cnt[layer], self.attn.prev_idx[layer], self.attn.prev_cnt[layer])
                    if t is not None]
        return out + state_tensors(self.attn.predictor_state)

    # --- one layer's attention ------------------------------------------------------------
    def step_positions(self) -> tuple[Tensor, Tensor]:
        """-> (lengths [B] int32, num_blocks [B] int32) for this step, per row (rows may differ:
        ragged batches): computed once per step and shared by every layer (each is a launch)."""
        bs = self.plan.block_size
        return self.pos + 1, (self.pos + bs).div(bs, rounding_mode="floor")

    def _quest_metadata(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """(key_max, key_min) [B, Hkv, NB, D] the append kernels update, or (None, None): dense
        layers and selectors with other metadata (updated by `append_metadata` after the append).
        LESS's summaries apart (`AttentionEngine.summaries_beside`): its Quest key max / min here too."""
        if (self.attn.kernel_metadata or self.attn.summaries_beside()) and self.attn.sparse[layer]:
            return self.attn.selector.metadata(self.cache, layer)
        return None, None

    def append(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rope: bool = False) -> Tensor:
        """This step's K/V at pos, and the Quest metadata of its block, in one launch.
        q: [B, Hq, D], k, v: [B, Hkv, D] (post-RoPE, or pre-RoPE with rope: the append kernel
        rotates q and k, one launch fewer) -> q [B, Hq, D] post-RoPE."""
        q_rot = self.attn.ops.append_token(
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
        if not self.attn.sparse[layer] or p.variant == "dense":
            return self.attn.dense_attention(layer, q, lengths, num_blocks)
        beside = self.attn.summaries_beside()  # LESS's summaries: the engine's, beside selection
        if not self.attn.kernel_metadata and not beside:  # the selector's own metadata update (InfLLM, LESS)
            self.attn.selector.append_metadata(self.cache, layer, self.pos)
        measured = p.measure_dense or p.mode == "shadow"
        # The studies measure the sparse output in fp32, before its cast to the model dtype, as the
        # eager runtime does (in bf16 the cast alone is ~4e-3 of output error).
        out, selection = self.attn.sparse_attention(layer, q, lengths, num_blocks, fp32=measured and p.study_counters,
                                                    summarise=self.pos if beside else None)
        if measured:
            self.attn.measure(layer, q, out, selection, lengths, num_blocks)
        if p.mode == "shadow":  # the dense output continues the model; the sparse one was measured
            return self.attn.dense_attention(layer, q, lengths, num_blocks)
        return out.to(self.dtype)  # (no launch where it is in the model dtype already)

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
            greedy = logits.argmax(-1, keepdim=True)  # [B, 1]
            if self.forced_tokens is not None:  # a replayed trajectory: its recorded next token, where it has one
                forced = self.forced_tokens.gather(1, self.pos.view(-1, 1).long())  # [B, 1]
                greedy = torch.where(forced >= 0, forced, greedy)
            self.token.copy_(greedy)
            self.pos.add_(1)
        self.attn.join()  # the side stream's last work (next-P writes) belongs to this step
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
        m, B, gemv = self.model, self.batch, self.attn.ops.dense_gemv
        paired = self.paired_qkv_weights() if self._appends_in_projection() else None
        x = m.model.embed_tokens(self.token).view(B, -1)  # [B, H]: a fresh buffer, ours to update
        for i, w in enumerate(self.fused):
            if paired is not None:  # batch 1: projection, RoPE and append in one launch
                q = self.attn.ops.qkv_rope_append(
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
        perm = self.attn.ops.rope_pair_permutation(self.hq, self.hkv, self.d).to(self.device)
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
