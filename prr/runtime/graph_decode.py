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

The per-layer attention (select, speculate, repair, merge, learn) is `PRRStep`'s
(prr/runtime/prr_step.py), the one PRR step that the eager research runtime
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

from prr.cache import PagedKVCache
from prr.model.decoder import Decoder
from prr.model.layer_math import final_norm, post_attention, pre_attention, rms_norm
from prr.model.rope import rope_cos_sin
from prr.predictors import Predictor
from prr.reuse import SelectionReuse
from prr.runtime.engine_state import EngineState
from prr.runtime.fused_weights import FusedWeights
from prr.runtime.prr_step import MISSING_SELECTOR
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


class GraphDecoder(EngineState):
    """Static buffers and the decode step of `model` for `batch` rows of up to `max_tokens`:
    the model's forward around `PRRStep`'s attention, capturable as one CUDA graph."""

    def __init__(self, model: Decoder, plan: StaticPlan, batch: int, max_tokens: int, compile: bool = False, *,
                 selector: Selector, predictor: Predictor | None, cache: PagedKVCache | None = None,
                 backend: str = "triton", reuse: SelectionReuse | None = None) -> None:
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
        For now the torch projections only, uncompiled.
        reuse: selection reuse (prr.reuse; default none). reuse=layers is a static choice per layer,
        captured as such: a reusing layer attends its anchor's A of the step and never selects;
        reuse=steps depends on the step number: a view with plan.between_selections is the step
        between selections, the others select; the caller replays one per step (GraphSession does,
        prr/runtime/step_views.py)."""
        c, bs, dtype, device = model.config, plan.block_size, model.dtype, model.device
        problems = decoder_problems(model, plan, batch, cache, selector, backend, compile, max_tokens)
        if problems:  # (before a new cache is allocated: GBs on a GPU)
            raise ValueError("; ".join(problems))
        if cache is None:
            cache = PagedKVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, bs, max_tokens, dtype, device)
        selector.bind_model(c)  # (InfLLM: the RoPE its scoring undoes)
        super().__init__(model, plan, batch, cache, selector=selector, predictor=predictor, backend=backend, reuse=reuse)
        self.compiled = compile
        cos, sin = rope_cos_sin(torch.arange(self.max_tokens, device=device), model.rope.inv_freq.to(device))
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)  # [T_max, D]
        self.weights = FusedWeights(model)  # (shared by every view)
        # The dense parts around the attention: (pre, post, final), compiled into a few kernels each
        self.dense_parts = tuple(torch.compile(f, dynamic=False, fullgraph=True) if compile else f
                                 for f in (pre_attention, post_attention, final_norm))
        self.no_delta = torch.zeros(batch, 1, c.hidden_size, dtype=dtype, device=device)  # the first layer's
        if self.appends_in_projection():
            self.paired_qkv_weights()  # now rather than inside a first step (that may be a capture)

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
        view = copy.copy(self)  # shares every buffer and list; only the plan and the step's per-step hand-offs differ
        view.attn = self.attn.with_plan(plan)
        if view.appends_in_projection():
            view.paired_qkv_weights()  # now rather than inside a first step (that may be a capture)
        return view

    # --- one layer's attention ------------------------------------------------------------
    def step_positions(self) -> tuple[Tensor, Tensor]:
        """-> (lengths [B] int32, num_blocks [B] int32) for this step, per row (rows may differ:
        ragged batches): computed once per step and shared by every layer (each is a launch)."""
        bs = self.plan.block_size
        return self.pos + 1, (self.pos + bs).div(bs, rounding_mode="floor")

    def _quest_metadata(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """(key_max, key_min) [B, Hkv, NB, D] the append kernels update, or (None, None): dense
        layers and selectors with other metadata (updated by `append_metadata` after the append).
        LESS's summaries apart (`PRRStep.summaries_beside`): its Quest key max / min here too."""
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
        self.attn.streams.join()  # the side stream's last work (next-P writes) belongs to this step
        return logits

    def _torch_layers(self, positions: tuple[Tensor, Tensor]) -> Tensor:
        """Every layer with F.linear projections: the model's own forward (Decoder.layers), with
        this engine's attention -> logits [B, V]."""
        m, B = self.model, self.batch

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [B, 1, H*, D] before RoPE
            return self.attention(layer, q[:, 0], k[:, 0], v[:, 0], positions, rope=True).view(B, 1, -1)
        hidden = m.layers(m.model.embed_tokens(self.token), attend, delta=self.no_delta,  # [B, 1, H]
                          pre=self.dense_parts[0], post=self.dense_parts[1], final=self.dense_parts[2],
                          normed=self.take_hidden if self.attn.selector.needs_hidden else None)
        return m.lm_head(hidden)[:, 0]  # [B, V]

    def _fused_layers(self, positions: tuple[Tensor, Tensor], split: list[int]) -> Tensor:
        """Every layer with prr.kernels.dense_gemv -> logits [B, V]: the residual stream x [B, H]
        is updated in place by o_proj's and down's epilogues; the norms run inside the next
        projection."""
        m, B, gemv = self.model, self.batch, self.attn.ops.dense_gemv
        paired = self.paired_qkv_weights() if self.appends_in_projection() else None
        x = m.model.embed_tokens(self.token).view(B, -1)  # [B, H]: a fresh buffer, ours to update
        for i, w in enumerate(self.weights.layers):
            if self.attn.selector.needs_hidden and self.attn.sparse[i]:  # (the lightning indexer)
                projection = self.attn.selector.hidden_projection(self.cache, i)
                if projection is not None:  # x W^T of the normed x into its slot, the norm inside the GEMV
                    gemv(x, projection[0], None, norm_weight=w.ln1, eps=self.weights.eps, out=projection[1])
                else:  # the layer's normed input [B, 1, H]
                    self.take_hidden(i, rms_norm(x, w.ln1, self.weights.eps).unsqueeze(1))
            if paired is not None:  # batch 1: projection, RoPE and append in one launch
                q = self.attn.ops.qkv_rope_append(
                    x, *paired[i], w.ln1, self.weights.eps, self.keys[i], self.values[i], self.pos, self.cos, self.sin,
                    *self._quest_metadata(i), self.plan.block_size, self.hq, self.hkv)  # [1, Hq, D] post-RoPE
                out = self.attention(i, q, None, None, positions, appended=True).view(B, self.hq * self.d)
            else:
                qkv = gemv(x, w.wqkv, w.bqkv, norm_weight=w.ln1, eps=self.weights.eps).view(B, sum(split), self.d)
                q, k, v = qkv.split(split, dim=1)  # [B, Hq | Hkv | Hkv, D], before RoPE
                out = self.attention(i, q, k, v, positions, rope=True).view(B, self.hq * self.d)
            gemv(out, w.wo, w.bo, residual=x)  # x += o_proj(out)
            h = gemv(x, w.w_gate_up, w.b_gate_up, norm_weight=w.ln2, eps=self.weights.eps, swiglu=True)  # [B, I]
            gemv(h, w.w_down, w.b_down, residual=x)  # x += down(h)
        head = m.lm_head
        return gemv(x, head.weight, head.bias, norm_weight=m.model.norm.weight, eps=m.model.norm.eps)  # [B, V]

    def take_hidden(self, layer: int, x: Tensor) -> None:
        """The layer's normed hidden state x [B, 1, H] for a selector that reads it (`needs_hidden`)."""
        self.attn.selector.take_hidden(self.cache, layer, x, prefill=False)

    def appends_in_projection(self) -> bool:
        return self.plan.projections == "fused" and self.batch == 1 and self.plan.fuse_append

    def paired_qkv_weights(self) -> list[tuple[Tensor, Tensor | None]]:
        """`FusedWeights.paired_qkv` in RoPE pair order (prr.kernels.qkv_append), per layer."""
        return self.weights.paired_qkv(lambda: self.attn.ops.rope_pair_permutation(self.hq, self.hkv, self.d),
                                       self.device)

    def capture_all(self, steps: dict) -> dict:
        """key -> step function (each a view's step) => key -> its captured graph's replay on CUDA
        (the warm-up steps advance the state: rewound after each capture), the functions
        themselves elsewhere."""
        if self.device.type != "cuda":
            return dict(steps)
        with torch.inference_mode():  # (a prefill's tensors are inference tensors)
            start = self.checkpoint()
            out = {}
            for key, fn in steps.items():
                out[key] = self.capture(fn).replay
                self.restore(start)
        return out

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
        self.captures[0] += 1  # (shared by every view: the buffers are)
        return graph


def decoder_problems(model: Decoder, plan: StaticPlan, batch: int, cache: PagedKVCache | None,
                     selector: Selector | None, backend: str, compile: bool, max_tokens: int) -> list[str]:
    """Why a GraphDecoder of `model` cannot decode `batch` rows over `cache` (None: a new one of
    max_tokens) (empty: it can)."""
    c, bs, out = model.config, plan.block_size, []
    if model.tensor_parallel is not None and (plan.projections == "fused" or compile):
        out.append("tensor_parallel runs the torch projections uncompiled for now: use plan.projections="
                   "'torch' (runtime.projections=torch) and compile=False")
    if plan.problems():
        out.append("invalid StaticPlan: " + "; ".join(plan.problems()))
    if selector is None:
        return [*out, MISSING_SELECTOR.format(owner="GraphDecoder")]
    if c.num_heads % c.num_kv_heads:
        out.append(f"num_heads={c.num_heads} is not a multiple of num_kv_heads={c.num_kv_heads}")
    if backend == "torch" and plan.projections == "fused":
        out.append("plan.projections='fused' runs prr.kernels.dense_gemv: it needs backend='triton' "
                   "(backend='torch' projects with F.linear: projections='torch')")
    if cache is not None and (cache.batch, cache.num_kv_heads, cache.head_dim, cache.block_size) != (
            batch, c.num_kv_heads, c.head_dim, bs):
        out.append(f"cache [B={cache.batch}, Hkv={cache.num_kv_heads}, D={cache.head_dim}, block_size="
                   f"{cache.block_size}] does not fit batch={batch}, the model and plan.block_size={bs}")
    if cache is not None and (cache.dtype != model.dtype or cache.keys[0].device != model.device):
        out.append(f"cache dtype/device {cache.dtype}/{cache.device} differ from the model's {model.dtype}/{model.device}")
    max_blocks, max_tokens = (cache.max_blocks, cache.max_tokens) if cache is not None else (-(-max_tokens // bs),
                                                                                           max_tokens)
    budgets = {"selector.topk_blocks": selector.topk_blocks if plan.variant != "dense" else 0,
               "predicted_blocks": plan.predicted_blocks if plan.variant == "prr" else 0}
    for name, blocks in budgets.items():
        if blocks > max_blocks:
            out.append(f"{name}={blocks} exceeds the {max_blocks} blocks of max_tokens={max_tokens} "
                       f"(block_size={bs}): lower it or raise max_tokens")
    return out
