"""`less` (arXiv 2402.09398, adapted to dynamic block selection): top-K selection plus a
low-rank compensation of the blocks left out.

LESS pairs a sparse KV policy with a small recurrent state that summarises the tokens the
policy drops. Here the dropped tokens change every step (those of the unselected blocks),
so the summaries are kept per block and as running totals (DESIGN.md §1):

    S_b = Σ_{k∈b} φ(k) vᵀ   [m, D],     s_b = Σ_{k∈b} φ(k)   [m],     S_tot, s_tot over all blocks

and at decode the unselected blocks U contribute, per query head,

    mass_U ≈ φ(q) · (s_tot − Σ_{b∈A} s_b),      num_U ≈ φ(q)ᵀ (S_tot − Σ_{b∈A} S_b),

which the runtime merges with the sparse attention state over A as one more partial state
(out = num_U / mass_U, lse = log mass_U) by log-sum-exp, after repair, in the merge stage.

Departures from the paper (docs/design.md's paper-vs-prr table has the measured effects):
1. LESS pairs a fixed eviction policy (H2O, Λ-shaped) with the state of the evicted tokens; here
   selection is dynamic (Quest's bound by default, `scores=features`: the estimated block mass),
   so "evicted" is "not selected this step": summaries per block and totals, unselected =
   total − selected (DSA evicts nothing for good);
2. φ is training-free positive random features by default (`feature_map=random`; LESS learns
   small per-layer MLPs for φ and ψ) or a per-layer map fitted to Quest's unselected blocks
   (`feature_map=trained`); keys are centred;
3. the two states merge by log-sum-exp of their partials, where LESS normalises sparse and state
   attention together in one softmax (the same result when mass_U is exact);
4. the summaries may be bf16 (`summary_dtype`; conf default), the totals stay fp32.

**Feature map** `feature_map=random` (default, training-free): positive random features (FAVOR+, arXiv 2009.14794), with
x' = √scale · x and w_j ~ N(0, I_D) (block-orthogonal rows with chi-distributed norms when
`orthogonal=true`), one draw per layer and KV head from `seed`:

    φ_j(x) = exp(w_j·x' − ‖x'‖²/2) / √m,      E[φ(q)·φ(k)] = exp(scale · q·k)   (unbiased)

so mass_U estimates Σ_{k∈U} exp(scale·q·k) — the same quantity the sparse state's lse is
the log of (prr's convention: natural log of Σ exp of scaled scores). The two states are
therefore commensurate and merge exactly like two attention partials. `scale` is
1/√head_dim, the scale DSABackend uses. Limitation, measured on SmolLM2-135M: its queries
have ‖q‖²·scale ≈ 28, where the estimator is heavy-tailed and, with m = 64, underestimates
the unselected mass by ~e^10 (the compensation then barely changes the output).
`feature_map=trained` fixes that: a per-layer map with query and key branches (random
features of a softened kernel with learned temperatures, plus small MLPs, fitted to Quest's
unselected blocks; prr.selectors.less_training, `make train-less`), loaded from
cache_dir()/less/<feature_map_model>-<hash>.safetensors; a missing file is an error (no
fallback). Layers where held-out validation found no gain are gated off (no compensation).

Variance control: keys are centred on a per-(layer, KV head) vector c fixed at the first
metadata update (the mean prompt key at prefill, `center_keys=true`):
exp(scale·q·k) = exp(scale·q·c) · exp(scale·q·(k − c)); the first factor is exact and is
added to the lse, the features see k − c (RoPE'd keys share a large common component).
Summaries are stored with per-feature offsets (S̃ = S·exp(−c), c a running max of the
feature logits), so no exponential overflows; the subtraction total − selected is done at
the total's offset. Its cancellation noise is ~fp32 eps × the total; a compensation whose
estimated mass is below 1e-6 of the estimated total mass, or that has no unselected block,
is dropped (lse = −inf): with every block selected LESS is exactly dense attention.

**Selection**: `scores=quest` (default) ranks blocks with Quest's bound, so `selector=less`
and `selector=quest` at the same top-K select alike and differ only by the compensation;
`scores=features` ranks them by their estimated mass φ(q)·s_b. `compensate=false` turns
the compensation off (then `scores=quest` is Quest).

Metadata per sparse layer (dense layers keep none): Quest's slots, `less_S`
[B, Hkv, max_blocks, m, D] and `less_s` [B, Hkv, max_blocks, m] in `summary_dtype` (float32, the
class default, or bfloat16, conf/selector/less.yaml's: on SmolLM2 at top-K 512 tokens bf16 moved the
output error against dense by <= 2e-5 at m = 16, 32 and 64, where m moved it by 1e-3, and all of
them stay within 1% of Quest's: experiments/less_compact_state.py), `less_c` [B, Hkv, max_blocks, m] fp32 (memory, `state_bytes`:
m·(D+1) summaries + m fp32 offsets per block and KV head — in fp32 with m = 64, D = 128 about four
times the block's own bf16 keys and values at block_size 16, twice in bf16, about once at the conf's
m = 32 in bf16 (1.02x the KV cache at the 8B shape, 32K, 30 sparse layers); the run's total is
logged beside the KV cache's when the prefill allocates it, and a run whose state cannot fit on
its GPU is refused then, with the numbers, before any of it is allocated), and in the layer's
metadata dict the totals
`less_S_tot` [B, Hkv, m, D], `less_s_tot`/`less_c_tot` [B, Hkv, m], the centre `less_center`
[B, Hkv, D] and the features `less_w` [Hkv, m, D]. `budget=profiled` times selection only,
not the compensation.

**Backends**: torch ops (the CPU path and the kernels' reference) or, with backend=triton and
`scores=quest`, Quest's selection kernels and the compensation kernel (one launch; a trained map's
query branch stays a torch op, its log-features handed in), tested equal. The engine asks for the
layer's output (`compensated`): the attention over A's split partials, merged with the compensation
and written in the model dtype by that same launch (`prr.kernels.less.less_compensate_merge`), so
LESS adds no merge launch to a serial layer; `compensation` (the state alone) is
`less_compensation`. `scores=features` has no selection kernel: that selector runs torch ops under
every backend (`triton_problems()` is None). The decode token's metadata update (`append_metadata`:
the feature summaries and Quest's key max / min) is `less_append`'s one launch under backend triton
(random features; a trained map's key branch keeps the torch ops); the prefill's is torch ops.
That launch is incremental, O(m·D) per token whatever the block size: the token's block takes it
as the totals do, from the open block's unrounded fp32 sums (`less_S_open` [B, Hkv, m, D],
`less_s_open` [B, Hkv, m], written by `update_metadata` and by every decode append), so bf16
summaries are rounded once, as when re-read; the torch path re-reads the block (the reference;
equal within fp32 rounding, tests/test_kernels_less.py). Appends must come in order, one per
position (as the running totals already need).
In the graph engine's step with StaticPlan.side_summaries (on by default,
backend triton) it is split: Quest's key max /
min in the cache append kernel, as for Quest, and the summaries alone (`append_summaries`:
less_append without Quest's part) on the side stream beside selection and the attention over A,
joined before the compensation, their only reader (`summaries_apart`: scores=quest, compensate).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from prr.attention_state import AttentionState
from prr.blocks import inside_context
from prr.cache import PagedKVCache
from prr.selectors.base import Selection, Selector, token_counts
from prr.selectors.quest import QuestSelector

SCORES = ("quest", "features")
FEATURE_MAPS = ("random", "trained")
MIN_RELATIVE_MASS = 1e-6  # compensations carrying less of the estimated total mass are dropped
SUMMARY_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SUMMARY_CHUNK_BLOCKS = 512  # blocks summarised at once in the prefill: bounds its fp32 intermediates
log = logging.getLogger(__name__)


def free_device_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device (None elsewhere: no check on the CPU)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


class LessSelector(QuestSelector):
    metadata_in_append_kernel = False  # its feature summaries are updated by append_metadata
    bulk_metadata_equals_stepwise = False  # fp32 feature sums: another summation order, other bits
    def __init__(
        self,
        topk_blocks: int,
        sink_blocks: int = 1,
        local_blocks: int = 0,
        force_newest: bool = True,
        gqa_reduce: str = "max",
        dense_layers: Sequence[int] = (),
        num_features: int = 64,
        orthogonal: bool = True,
        center_keys: bool = True,
        scores: str = "quest",
        compensate: bool = True,
        seed: int = 0,
        feature_map: str = "random",
        feature_map_model: str = "smollm2-135m",
        summary_dtype: str = "float32",
        hinted_topk: bool = False,
    ) -> None:
        super().__init__(topk_blocks, sink_blocks, local_blocks, force_newest, gqa_reduce, dense_layers, hinted_topk)
        if scores not in SCORES:
            raise ValueError(f"selector.scores={scores!r} is not one of {list(SCORES)}")
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"selector.num_features={num_features!r} must be a positive integer (random features)")
        for name, value in (("orthogonal", orthogonal), ("center_keys", center_keys), ("compensate", compensate)):
            if not isinstance(value, bool):
                raise ValueError(f"selector.{name}={value!r} is not one of [True, False]")
        self.num_features, self.orthogonal, self.center_keys = num_features, orthogonal, center_keys
        self.scores, self.seed = scores, seed
        self.compensates = compensate
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"selector.feature_map={feature_map!r} is not one of {list(FEATURE_MAPS)}")
        self.feature_map, self.feature_map_model = feature_map, feature_map_model
        if summary_dtype not in SUMMARY_DTYPES:
            raise ValueError(f"selector.summary_dtype={summary_dtype!r} is not one of {list(SUMMARY_DTYPES)}")
        self.summary_dtype = SUMMARY_DTYPES[summary_dtype]  # of S_b and s_b; offsets and totals stay fp32
        self.trained = None
        if feature_map == "trained":
            from prr.selectors.less_training import load_trained_map

            # A missing file raises, naming `make train-less` (no silent fallback to random features).
            self.trained = load_trained_map(feature_map_model, num_features)

    def triton_problems(self) -> list[str] | None:
        if self.scores == "features":
            return None  # no kernel for the feature scores: torch selection and compensation under every backend
        return super().triton_problems()  # Quest's selection kernels, and the compensation kernel

    # --- feature map ---------------------------------------------------------------------------
    def _features(self, cache: PagedKVCache, layer: int) -> Tensor:
        """-> w: [Hkv, m, D] fp32, drawn once per layer."""
        slots = cache.metadata[layer]
        if self.trained is not None:
            if self.trained.head_dim != cache.head_dim or layer >= len(self.trained.layers):
                raise ValueError(f"selector.feature_map=trained: the map for {self.feature_map_model!r} has head_dim "
                                 f"{self.trained.head_dim} and {len(self.trained.layers)} layers; this model has head_dim "
                                 f"{cache.head_dim} (layer {layer}): train it for this model (make train-less)")
            if "less_w" not in slots:
                slots["less_w"] = torch.zeros(0, device=cache.device)  # marker: the map is moved once per layer
                self.trained.layers[layer].to(cache.device)
            return slots["less_w"]
        if "less_w" not in slots:
            g = torch.Generator().manual_seed(self.seed * 100_003 + layer)
            h, m, d = cache.num_kv_heads, self.num_features, cache.head_dim
            if self.orthogonal:
                rows = []
                for _ in range(h):
                    chunks = []
                    for _ in range(-(-m // d)):
                        qmat, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
                        chunks.append(qmat.T)  # d orthonormal rows
                    norms = torch.randn(m, d, generator=g, dtype=torch.float64).norm(dim=-1, keepdim=True)
                    rows.append(torch.cat(chunks)[:m] * norms)
                w = torch.stack(rows)
            else:
                w = torch.randn(h, m, d, generator=g, dtype=torch.float64)
            slots["less_w"] = w.float().to(cache.device)
        return slots["less_w"]

    def _logits(self, x: Tensor, w: Tensor, scale: float, layer: int = 0, role: str = "k") -> Tensor:
        """x: [B, Hkv, T, D], w: [Hkv, m, D] -> log φ(x): [B, Hkv, T, m] (role: q | k, trained map only)."""
        if self.trained is not None:
            return self.trained.logits(x, layer, role)
        x = x.float() * math.sqrt(scale)
        return x @ w.transpose(-1, -2) - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(w.shape[1])

    # --- metadata ------------------------------------------------------------------------------
    def update_metadata(self, cache: PagedKVCache, layer: int, start: int, end: int) -> None:
        self.topk_hint(cache, layer)  # (hinted_topk) every slot a decode step writes exists after the prefill
        if self.is_dense_layer(layer) or end <= start:
            return
        if "less_S" not in cache.metadata[layer]:
            self._check_memory(cache)  # before the first sparse layer's state is allocated
        super().update_metadata(cache, layer, start, end)  # Quest's key max/min
        b, h, m, d = cache.batch, cache.num_kv_heads, self.num_features, cache.head_dim
        center = cache.state_slot(layer, "less_center", (b, h, d), torch.float32)
        totals = (cache.state_slot(layer, "less_S_tot", (b, h, m, d), torch.float32),
                  cache.state_slot(layer, "less_s_tot", (b, h, m), torch.float32),
                  cache.state_slot(layer, "less_c_tot", (b, h, m), torch.float32, float("-inf")))
        if start == 0:  # the first append (the prefill) fixes the centre; the totals start empty
            if self.center_keys:
                center.copy_(cache.keys[layer][:, :, start:end].float().mean(2))
            for total, empty in zip(totals, (0.0, 0.0, float("-inf")), strict=True):
                total.fill_(empty)
        self._add_to_totals(cache, layer, cache.keys[layer][:, :, start:end], cache.values[layer][:, :, start:end])
        s = cache.block_size
        for lo in range(start // s, -(-end // s), SUMMARY_CHUNK_BLOCKS):  # host range (the prefill): chunks
            first = torch.full((cache.batch,), lo, dtype=torch.int64, device=cache.device)
            count = min(SUMMARY_CHUNK_BLOCKS, -(-end // s) - lo)
            # the last chunk ends with the block of token end - 1: the open block the decode continues
            self._summarise(cache, layer, first, count, torch.full_like(first, end), lo + count == -(-end // s))

    # --- memory --------------------------------------------------------------------------------
    def state_bytes(self, batch: int, num_kv_heads: int, head_dim: int, max_blocks: int,
                    cache_dtype: torch.dtype) -> int:
        """Bytes of one sparse layer's metadata: per block and KV head Quest's key max / min (2·D
        in the cache dtype), S_b and s_b (m·(D+1) in summary_dtype) and the offsets c_b (m fp32);
        per row and KV head the totals and the centre (m·(D+2) + D fp32) and the open block's
        unrounded S_b, s_b (m·(D+1) fp32)."""
        m, d = self.num_features, head_dim
        per_block = 2 * d * cache_dtype.itemsize + m * (d + 1) * self.summary_dtype.itemsize + m * 4
        return batch * num_kv_heads * (max_blocks * per_block + (m * (d + 2) + d + m * (d + 1)) * 4)

    def memory_report(self, cache: PagedKVCache) -> dict[str, float | int]:
        """LESS's metadata over the cache's sparse layers beside its KV cache, GiB."""
        root = getattr(cache, "parent", cache)  # a row view's whole cache
        sparse = [layer for layer in range(root.num_layers) if not self.is_dense_layer(layer)]
        kv = 2 * root.num_layers * root.keys[0].numel() * root.keys[0].element_size()
        state = len(sparse) * self.state_bytes(root.batch, root.num_kv_heads, root.head_dim, root.max_blocks, root.dtype)
        return {"less_state_gib": state / 2**30, "kv_cache_gib": kv / 2**30, "less_over_kv": state / max(kv, 1),
                "sparse_layers": len(sparse)}

    def _check_memory(self, cache: PagedKVCache) -> None:
        """Refuse, with the numbers, a run whose LESS state cannot fit on its GPU: checked once, when
        the cache's first LESS state is about to be allocated (the prefill), for every sparse layer,
        plus the prefill's summary intermediates."""
        root = getattr(cache, "parent", cache)
        sparse = [i for i in range(root.num_layers) if not self.is_dense_layer(i)]
        if any("less_S" in root.metadata[i] for i in sparse):
            return  # allocated (and checked) before
        report = self.memory_report(root)
        log.info("selector=less state: %.2f GiB over %d sparse layers beside the KV cache's %.2f GiB (%.2fx)",
                 report["less_state_gib"], report["sparse_layers"], report["kv_cache_gib"], report["less_over_kv"])
        free = free_device_memory(root.device)
        if free is None:
            return
        m, d, s = self.num_features, root.head_dim, root.block_size
        need = len(sparse) * self.state_bytes(root.batch, root.num_kv_heads, d, root.max_blocks, root.dtype)
        blocks = min(SUMMARY_CHUNK_BLOCKS, root.max_blocks)
        need += root.batch * root.num_kv_heads * blocks * (m * d + s * m + 2 * s * d) * 4  # the prefill's intermediates
        if need > free:
            raise MemoryError(
                f"selector=less needs {need / 2**30:.2f} GiB for its state over {len(sparse)} sparse layers "
                f"(num_features={m}, summary_dtype={str(self.summary_dtype).replace('torch.', '')}, {root.max_blocks} "
                f"blocks of {s} x {root.num_kv_heads} KV heads x batch {root.batch}: {report['less_over_kv']:.2f}x the "
                f"KV cache's {report['kv_cache_gib']:.2f} GiB) and {free / 2**30:.2f} GiB is free on {root.device}: "
                "lower selector.num_features, set selector.summary_dtype=bfloat16, raise runtime.block_size, add "
                "selector.dense_layers or shorten the prompt")

    def append_metadata(self, cache: PagedKVCache, layer: int, positions: Tensor) -> None:
        if self.is_dense_layer(layer):
            return
        if self._append_kernel(cache):  # one launch: the feature summaries and Quest's key max / min
            self._less_append(cache, layer, positions, *self.metadata(cache, layer))
            return
        super().append_metadata(cache, layer, positions)  # Quest's key max/min
        self.append_summaries(cache, layer, positions)

    def summaries_apart(self) -> bool:
        """`Selector.summaries_apart`: with Quest's scores selection reads Quest's key max / min only,
        and only the compensation reads the feature summaries (scores=features ranks by them)."""
        return self.scores == "quest" and self.compensates

    def append_summaries(self, cache: PagedKVCache, layer: int, positions: Tensor) -> None:
        """`Selector.append_summaries`: the decode token's feature summaries alone (its block's S_b,
        s_b, c_b and the totals), positions [B]; Quest's key max / min are left to the append kernel.
        `append_metadata` = Quest's update + this (the same values: the kernel's Quest part is exact)."""
        if self.is_dense_layer(layer):
            return
        if self._append_kernel(cache):
            self._less_append(cache, layer, positions)
            return
        b, h, d = cache.batch, cache.num_kv_heads, cache.head_dim
        positions = positions.long()
        index = positions.view(b, 1, 1, 1).expand(b, h, 1, d)
        self._add_to_totals(cache, layer, torch.gather(cache.keys[layer], 2, index),
                            torch.gather(cache.values[layer], 2, index))
        self._summarise(cache, layer, positions // cache.block_size, 1, positions + 1, True)

    def _append_kernel(self, cache: PagedKVCache) -> bool:
        """Whether the decode token's summaries are `less_append`'s launch (backend triton, random
        features, the kernel's tl.dot shapes); else torch ops."""
        return self.backend == "triton" and self.trained is None and cache.block_size >= 16 and cache.head_dim >= 16

    def _less_append(self, cache: PagedKVCache, layer: int, positions: Tensor, key_max: Tensor | None = None,
                     key_min: Tensor | None = None) -> None:
        """prr.kernels.less.less_append on the layer's slots (with Quest's key max / min when given)."""
        from prr.kernels.less import less_append

        slots = cache.metadata[layer]
        # Incremental (O(m·D), whatever the block size) from the open block's fp32 sums.
        less_append(cache.keys[layer], cache.values[layer], positions, cache.block_size, self._features(cache, layer),
                    slots["less_center"], slots["less_S"], slots["less_s"], slots["less_c"], slots["less_S_tot"],
                    slots["less_s_tot"], slots["less_c_tot"], 1.0 / math.sqrt(cache.head_dim), key_max, key_min,
                    big_open=slots["less_S_open"], small_open=slots["less_s_open"])

    def _add_to_totals(self, cache: PagedKVCache, layer: int, keys: Tensor, values: Tensor) -> None:
        """Running totals S_tot, s_tot (offset c_tot) += the tokens keys, values [B, Hkv, T, D]."""
        slots = cache.metadata[layer]
        scale = 1.0 / math.sqrt(cache.head_dim)
        center = slots["less_center"].unsqueeze(2)  # [B, Hkv, 1, D]
        logits = self._logits(keys - center, self._features(cache, layer), scale, layer, "k")  # [B, Hkv, T, m]
        c_old = slots["less_c_tot"]
        c_new = torch.maximum(c_old, logits.amax(2))
        keep = torch.exp(c_old - c_new)  # 0 while the totals are empty
        weights = torch.exp(logits - c_new.unsqueeze(2))  # [B, Hkv, T, m]
        slots["less_S_tot"].copy_(slots["less_S_tot"] * keep.unsqueeze(-1) + weights.transpose(-1, -2) @ values.float())
        slots["less_s_tot"].copy_(slots["less_s_tot"] * keep + weights.sum(2))
        slots["less_c_tot"].copy_(c_new)

    def _summarise(self, cache: PagedKVCache, layer: int, first: Tensor, count: int, end: Tensor,
                   open_last: bool = False) -> None:
        """Per-block summaries of blocks first + [0, count) (first: [B]) recomputed from their
        live tokens (positions < end [B]); open_last: the last block's fp32 sums also into the
        open-block slots (`less_S_open` [B, Hkv, m, D], `less_s_open` [B, Hkv, m]), which the
        incremental less_append continues from. Static shapes."""
        b, h, d, m, s = cache.batch, cache.num_kv_heads, cache.head_dim, self.num_features, cache.block_size
        slots = cache.metadata[layer]
        big_s = cache.metadata_slot(layer, "less_S", (m, d), self.summary_dtype)
        small_s = cache.metadata_slot(layer, "less_s", (m,), self.summary_dtype)
        offset = cache.metadata_slot(layer, "less_c", (m,), torch.float32, float("-inf"))
        blocks = first.view(b, 1) + torch.arange(count, device=cache.device)  # [B, n]
        tokens = (blocks.unsqueeze(-1) * s + torch.arange(s, device=cache.device)).view(b, 1, count * s, 1)
        keys = torch.gather(cache.keys[layer], 2, tokens.expand(b, h, count * s, d))  # [B, Hkv, n*S, D]
        values = torch.gather(cache.values[layer], 2, tokens.expand(b, h, count * s, d)).float().view(b, h, count, s, d)
        center = slots["less_center"].unsqueeze(2)
        logits = self._logits(keys - center, self._features(cache, layer), 1.0 / math.sqrt(d), layer, "k")
        logits = logits.view(b, h, count, s, m)
        live = tokens.view(b, 1, count, s, 1) < end.view(b, 1, 1, 1, 1)
        logits = logits.masked_fill(~live, float("-inf"))
        c_block = logits.amax(3)  # [B, Hkv, n, m]; finite: a touched block has a live token
        weights = torch.exp(logits - c_block.unsqueeze(3))  # [B, Hkv, n, S, m]; 0 past `end`
        index = blocks.view(b, 1, count, 1)
        big, small = weights.transpose(-1, -2) @ values, weights.sum(3)  # [B, Hkv, n, m, D], [B, Hkv, n, m] fp32
        big_s.scatter_(2, index.view(b, 1, count, 1, 1).expand(b, h, count, m, d), big.to(big_s.dtype))
        small_s.scatter_(2, index.expand(b, h, count, m), small.to(small_s.dtype))
        offset.scatter_(2, index.expand(b, h, count, m), c_block)
        if open_last:
            big_open, small_open = self._open_slots(cache, layer)
            big_open.copy_(big[:, :, -1])
            small_open.copy_(small[:, :, -1])

    def _open_slots(self, cache: PagedKVCache, layer: int) -> tuple[Tensor, Tensor]:
        """The open block's (the newest token's) summaries unrounded: [B, Hkv, m, D], [B, Hkv, m] fp32."""
        b, h, m, d = cache.batch, cache.num_kv_heads, self.num_features, cache.head_dim
        return (cache.state_slot(layer, "less_S_open", (b, h, m, d), torch.float32),
                cache.state_slot(layer, "less_s_open", (b, h, m), torch.float32))

    # --- selection scores ------------------------------------------------------------------------
    def select_tail(self, q_tail: Tensor, cache: PagedKVCache, layer: int, start: int,
                    queries: Tensor | None = None) -> list[Selection]:
        """Quest's batched tail where the scores are Quest's (they read only its key max / min);
        the feature scores read the open block's summaries as each token grows them: the base
        class's loop, one metadata update and `select` per position."""
        if self.scores == "quest":
            return super().select_tail(q_tail, cache, layer, start, queries=queries)
        return Selector.select_tail(self, q_tail, cache, layer, start, queries=queries)

    def head_scores(self, q: Tensor, cache: PagedKVCache, layer: int, lengths: Tensor) -> Tensor:
        if self.scores == "quest":
            return super().head_scores(q, cache, layer, lengths)
        # Estimated log attention mass per block: log Σ_j φ_j(q) s_{b,j} + scale·q·c.
        scale = 1.0 / math.sqrt(cache.head_dim)
        slots = cache.metadata[layer]
        q_logits = self._logits(q, self._features(cache, layer), scale, layer, "q")  # [B, Hkv, G, m]
        log_s = torch.log(slots["less_s"].float()) + slots["less_c"]  # [B, Hkv, NB, m]; -inf for empty blocks
        per_block = torch.logsumexp(q_logits.unsqueeze(3) + log_s.unsqueeze(2), dim=-1)  # [B, Hkv, G, NB]
        exact = scale * (q.float() * slots["less_center"].unsqueeze(2)).sum(-1, keepdim=True)  # [B, Hkv, G, 1]
        return per_block + exact

    # --- compensation ----------------------------------------------------------------------------
    def compensation(self, q: Tensor, cache: PagedKVCache, layer: int, selection: Selection,
                     length: int | Tensor | None = None) -> AttentionState:
        """q: [B, Hkv, G, D] -> the unselected blocks' estimated state: out [B, Hkv, G, D],
        lse [B, Hkv, G] (log of the estimated Σ exp(scale·q·k) over their tokens; −inf if none)
        over each row's first `length` tokens (host int or [B] tensor; default the cache's).
        Static shapes."""
        if self.trained is not None and not self.trained.enabled(layer):
            # Held-out validation found no gain on this layer (make train-less): no compensation.
            empty = torch.full(q.shape[:-1], float("-inf"), device=q.device)
            return AttentionState(out=torch.zeros_like(q, dtype=torch.float32), lse=empty)
        if self.backend == "triton":
            return self._compensation_triton(q, cache, layer, selection, length)
        scale = 1.0 / math.sqrt(cache.head_dim)
        slots = cache.metadata[layer]
        num_blocks = (token_counts(cache, layer, length, q.shape[0], q.device) + cache.block_size - 1) // cache.block_size
        blocks = selection.blocks
        b, h, c = blocks.indices.shape
        m, d = self.num_features, cache.head_dim
        c_tot = slots["less_c_tot"]  # [B, Hkv, m]
        # Σ over A of the block summaries, brought to the totals' offsets (c_b <= c_tot: no overflow).
        index = blocks.indices.long().unsqueeze(-1)  # [B, Hkv, C, 1]
        rescale = torch.exp(torch.gather(cache.metadata[layer]["less_c"], 2, index.expand(b, h, c, m)) - c_tot.unsqueeze(2))
        rescale = rescale * blocks.valid().unsqueeze(-1)  # padding entries count nothing: [B, Hkv, C, m]
        sel_small = (torch.gather(slots["less_s"], 2, index.expand(b, h, c, m)).float() * rescale).sum(2)  # [B, Hkv, m]
        sel_big = torch.gather(slots["less_S"], 2, index.unsqueeze(-1).expand(b, h, c, m, d)).float()
        sel_big = (sel_big * rescale.unsqueeze(-1)).sum(2)  # [B, Hkv, m, D]
        rest_small = (slots["less_s_tot"] - sel_small).clamp(min=0)
        rest_big = slots["less_S_tot"] - sel_big

        log_w = self._logits(q, self._features(cache, layer), scale, layer, "q") + c_tot.unsqueeze(2)  # [B, Hkv, G, m]
        top = log_w.amax(-1, keepdim=True)
        weights = torch.exp(log_w - top)  # [B, Hkv, G, m]
        mass = (weights * rest_small.unsqueeze(2)).sum(-1)  # [B, Hkv, G], in units of exp(top)
        total = (weights * slots["less_s_tot"].unsqueeze(2)).sum(-1)
        numerator = weights @ rest_big  # [B, Hkv, G, D]

        inside = inside_context(num_blocks, cache.max_blocks)  # [B, 1, NB]
        unselected = (inside & ~blocks.mask(cache.max_blocks)).any(-1)  # [B, Hkv]
        use = unselected.unsqueeze(-1) & (mass > MIN_RELATIVE_MASS * total)  # [B, Hkv, G]
        safe_mass = torch.where(use, mass, torch.ones_like(mass))
        out = torch.where(use.unsqueeze(-1), numerator / safe_mass.unsqueeze(-1), torch.zeros_like(numerator))
        exact = scale * (q.float() * slots["less_center"].unsqueeze(2)).sum(-1)  # [B, Hkv, G]
        lse = torch.where(use, top.squeeze(-1) + torch.log(safe_mass) + exact, torch.full_like(mass, float("-inf")))
        return AttentionState(out=out, lse=lse)

    def compensated(self, q: Tensor, cache: PagedKVCache, layer: int, selection: Selection, lengths: Tensor,
                    out: Tensor, lse: Tensor, out_dtype: torch.dtype) -> Tensor:
        """`Selector.compensated`: under backend triton one launch (`less_compensate_merge`: the
        compensation, the merge of A's split partials with it, the output in out_dtype)."""
        if self.backend != "triton" or (self.trained is not None and not self.trained.enabled(layer)):
            return super().compensated(q, cache, layer, selection, lengths, out, lse, out_dtype)
        from prr.kernels.less import less_compensate_merge

        merged, _ = less_compensate_merge(*self._kernel_arguments(q, cache, layer, selection, lengths), out, lse,
                                          out_dtype=out_dtype, q_logits=self._query_logits(q, layer),
                                          min_relative_mass=MIN_RELATIVE_MASS)
        return merged

    def _query_logits(self, q: Tensor, layer: int) -> Tensor | None:
        """A trained map's log-features of q [B, Hkv, G, m] fp32 (its query branch, torch ops); None for random features."""
        return self.trained.logits(q, layer, "q").float() if self.trained is not None else None

    def _kernel_arguments(self, q: Tensor, cache: PagedKVCache, layer: int, selection: Selection,
                          length: int | Tensor | None) -> tuple:
        """The positional arguments of prr.kernels.less.less_compensation (q to scale)."""
        slots = cache.metadata[layer]
        if isinstance(length, Tensor) and length.dim() == 1:
            lengths = length  # [B] int32/int64 as the engine holds it: no conversion launch
        else:
            lengths = token_counts(cache, layer, length, q.shape[0], q.device)
        w = None if self.trained is not None else self._features(cache, layer)  # [Hkv, m, D]
        blocks = selection.blocks
        return (q, w, blocks.indices.to(torch.int32), blocks.count.to(torch.int32), lengths, cache.block_size,
                slots["less_S"], slots["less_s"], slots["less_c"], slots["less_S_tot"], slots["less_s_tot"],
                slots["less_c_tot"], slots["less_center"], 1.0 / math.sqrt(cache.head_dim))

    def _compensation_triton(self, q: Tensor, cache: PagedKVCache, layer: int, selection: Selection,
                             length: int | Tensor | None) -> AttentionState:
        """`compensation` by the kernel (same arguments and result; one launch)."""
        from prr.kernels.less import less_compensation

        out, lse = less_compensation(*self._kernel_arguments(q, cache, layer, selection, length),
                                     q_logits=self._query_logits(q, layer), min_relative_mass=MIN_RELATIVE_MASS)
        return AttentionState(out=out, lse=lse)
