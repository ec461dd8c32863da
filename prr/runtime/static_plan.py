"""The graph engine's plan: the static shapes and launch choices (variant, |P|, block size,
streams, fused launches, counters) an engine is built for and a step runs. Immutable: another
choice is another engine view (`GraphDecoder.with_plan`), captured on its own.

What selects and what predicts are no part of it: the engine is given the run's selector and
predictor objects (prr.selectors, prr.predictors; run.py builds them from conf/, benchmarks
through `prr.benchmarking.configured`), whose own settings (top-K, forced blocks, dense layers,
GQA reduction, EMA rate) rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prr.runtime.settings import REPAIR_MODES, RUN_MODES

VARIANTS = ("dense", "serial", "prr")
MODES = RUN_MODES
FUSE_MERGE = (False, True, "one_wave")
FUSED_REPAIR = (False, True, "auto")
PROJECTIONS = ("torch", "fused")


def metadata_dtype(selector: str, cache_dtype: torch.dtype) -> torch.dtype:
    """Quest's max / min of keys stored in the cache dtype are exact in it; InfLLM's
    representative is a mean, kept in fp32 (selector: "quest" or "infllm")."""
    return cache_dtype if selector == "quest" else torch.float32


def metadata_bytes_per_block(selector: str, cache_dtype: torch.dtype, head_dim: int) -> int:
    """Bytes the selection reads per (row, KV head, block): the byte floor's metadata share
    (selector: "quest" or "infllm", the benchmarks' byte-floor arithmetic)."""
    per_vector = head_dim * metadata_dtype(selector, cache_dtype).itemsize
    return 2 * per_vector if selector == "quest" else per_vector


@dataclass(frozen=True)
class StaticPlan:
    variant: str = "prr"
    # |P| per (row, KV head): the P buffers' size (prr only; the oracle's P is sized by |A|, the
    # selector's capacity). |A|'s capacity is the selector's (`Selector.capacity`, its topk_blocks).
    predicted_blocks: int = 128
    repair_mode: str = "exact"
    # sparse: the selection decides what is attended; shadow: dense attention continues the
    # model while selection, prediction and speculation run beside it and are measured.
    mode: str = "sparse"
    block_size: int = 16
    overlap: bool = True  # speculation on a second CUDA stream (False: one after the other)
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
    # The studies' counters (StepObservers.study_counters; needs count_hits): per layer, row and KV
    # head, the hits of the predictor's ranking at every |P| = ratio × K of `study_ratios` (a fixed
    # budget's |P| at that ratio: what experiments/locality_study.py's RatioProbe counts) and, on
    # dense-measured steps, mass recall and output error. One to four proposes per sparse layer and
    # step: off while timing.
    study_counters: bool = False
    study_ratios: tuple[float, ...] = (1.0, 1.25, 1.5, 2.0)  # sizes the study buffers (a BUFFER_FIELD)
    # A predictor that `learns_layers_at_once` (on the kernels: ema, last_step, ema_membership, spin,
    # query_similarity; bench_hit_rate) learns from every sparse layer's A in one update launch and,
    # history-only, writes the next step's P of every layer in one propose (ema: rank + top-k) once
    # the step's last sparse layer is repaired, on the side stream beside the LM head, instead
    # of three launches after each layer beside the next layer's projections (on the H200 those ran
    # 22 µs a layer of side work and slowed the main stream: experiments/step_breakdown.py). The same
    # P either way (the next step reads it); False: after each layer.
    learn_layers_at_once: bool = True
    # count_hits' counters of every sparse layer in one launch (kernels/step_counters_layers) once the
    # step's last sparse layer is selected, on the side stream beside the LM head, from each layer's
    # A held until then, instead of one launch per layer on the main stream right after its selection
    # (3.4 µs a layer on the H200: 176 µs of a 4.7 ms token). Where P could change before the step's
    # end (a predictor that proposes after each layer's learning) the counters stay per layer
    # (StepObservers.counts_at_end). The same counters either way; False: after each layer.
    # Checked on the H200 (GPU twins in tests/test_graph_decode.py): 4.69 against 4.80 ms a token,
    # Quest serial at 32K (experiments/results/h200/step_breakdown_counters_1a15dde.csv).
    count_at_step_end: bool = True
    # variant "serial" with a predictor (budget=adaptive's serial windows): the predictor still
    # learns from each A on the side stream, as the eager runtime's serial steps do, so PRR
    # windows speculate over a P that has seen every step.
    learn_in_serial: bool = False
    # reuse=steps (prr/runtime/selection_reuse.py): this view's step is one between selection steps, where
    # every sparse layer attends its reused A (its last A, or its predictor's proposal, with the newest
    # block) and no selector runs; the graph engine captures a view of each and the host replays one per
    # step (prr/runtime/step_views.py). False: the step selects. Without reuse=steps: no effect.
    between_selections: bool = False
    # Selectors whose decode-token summaries only their compensation reads (`summaries_apart`:
    # LESS with Quest's scores), backend triton: Quest's key max / min ride in the cache append
    # kernel (as Quest's do) and the summaries (LESS's less_append without them) run on the side
    # stream beside selection and the attention over A (serial) or beside the repair (PRR), joined
    # by an event before the compensation, their only reader: less_append leaves the critical path
    # (issue 33: 15 µs of LESS's 29 µs per layer over Quest at block 64). The same values either
    # way; False: one less_append launch (summaries and Quest's) before selection.
    # Checked on the H200 (tests/test_less_side_summaries.py's GPU twins): LESS's layer 33.3 against
    # 40.7 µs at 32K, block 16 (experiments/results/h200/bench_decode_less_side_1a15dde.csv).
    side_summaries: bool = True
    # Selectors whose selection launch can also attend over P (`speculates_in_selection`: exact on
    # the kernels), in exact mode with P written ahead (not proposed inside the layer: history-only
    # predictors, cross_layer, or P set from outside), compute PRR's per-block states over P there,
    # on the main stream, instead of in a
    # speculation kernel on the side stream beside selection: exact's q·K pass fills the GPU, and on
    # the H200 the speculation beside it slowed it by 8.3 µs a layer (249 µs a token at 32K, block 16,
    # K 32; PRR at P = A 1.076x serial: experiments/results/h200/step_breakdown_exact_quest_b763547.csv).
    # The same states bit for bit (tests/test_exact_speculation.py); False: beside selection.
    speculate_in_selection: bool = True

    def problems(self) -> list[str]:
        out = []
        for name, value, allowed in (("variant", self.variant, VARIANTS), ("repair_mode", self.repair_mode, REPAIR_MODES),
                                     ("mode", self.mode, MODES)):
            if value not in allowed:
                out.append(f"{name}={value!r} is not one of {list(allowed)}")
        if self.projections not in PROJECTIONS:
            out.append(f"projections={self.projections!r} is not one of {list(PROJECTIONS)}")
        if self.variant == "prr" and self.predicted_blocks < 1:
            out.append(f"predicted_blocks={self.predicted_blocks} must be >= 1 for variant=prr (use variant=serial for |P| = 0)")
        if self.fuse_merge not in FUSE_MERGE:
            out.append(f"fuse_merge={self.fuse_merge!r} is not one of {list(FUSE_MERGE)}")
        if self.fused_repair not in FUSED_REPAIR:
            out.append(f"fused_repair={self.fused_repair!r} is not one of {list(FUSED_REPAIR)}")
        if self.fused_repair is True and self.repair_mode != "exact":
            out.append(f"fused_repair=True needs repair_mode='exact' (got {self.repair_mode!r}): it drops the "
                       f"speculated blocks that A lacks")
        if self.study_counters and not self.count_hits:
            out.append("study_counters=True needs count_hits=True (|A| and the last-step overlap per KV head are the "
                       "step counters')")
        if not self.study_ratios or any(r <= 0 for r in self.study_ratios):
            out.append(f"study_ratios={self.study_ratios} must be a non-empty tuple of ratios > 0")
        for name in ("speculation_tokens_per_program", "repair_tokens_per_split"):
            tokens = getattr(self, name)
            if tokens is not None and (tokens < self.block_size or tokens % self.block_size):
                out.append(f"{name}={tokens} must be None or a positive multiple of block_size={self.block_size} "
                           f"(whole blocks per program)")
        return out

    @classmethod
    def eager(cls, repair_mode: str, block_size: int) -> StaticPlan:
        """The plan of the eager runtime's step (DSABackend, StageProbe): stages one after the
        other (no side stream, no fused tail or merge), so each stage has its own timer; |P| is
        sized per step (`sparse_attention(predicted_blocks=)`); the speculation is never folded into
        selection's launch (speculate_in_selection=False)."""
        return cls(variant="serial", repair_mode=repair_mode, block_size=block_size, overlap=False,
                   fused_repair=False, fuse_merge=False, speculate_in_selection=False)
