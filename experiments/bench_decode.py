"""Decode-latency benchmark of PRR against serial DSA, dense attention and the memory floors.

    python experiments/bench_decode.py [--quick] [--parts stage,token,matrix,select,stream_priority,spec_programs,repair_splits]
        [--out experiments/results/h200/bench_decode]

Model: the Llama-3.1-8B shape (32 query / 8 KV heads, head_dim 128, 32 layers) with random
bf16 weights and random KV contexts (timings do not depend on values), through
prr.runtime.graph_decode (static shapes, speculation on a second CUDA stream).

Part `stage` (attention stage per layer, the PRR map): for batch × context × block size ×
top-K × selector, one cache of NL layers (so replays walk NL different caches and do not
time the L2), and in one run: dense (our split kernel, and torch SDPA), serial DSA, PRR at
controlled hit rates (P = the true A with a fraction of its blocks swapped for unselected
ones), with speculation overlapped on a second stream and not; and each stage alone
(select, speculate, repair at that hit rate, merge; serial DSA with the merge launch, and with
the splits merged in the split kernel: serial_fused_merge), and PRR's step up to the join (append,
then select ∥ speculate: serial over it bounds what any repair + merge could leave PRR).
The selector of a cell is its conf/selector YAML's object (run.py's), every layer sparse;
`--stage-cells` runs only the cells named (batch 1) and `--hit-rates` sets PRR's controlled rates.
The profiled choice is compared with serial DSA timed again next to it (the PRR runs leave
the L2 in another state than the first serial timing saw). Times: CUDA-graph replays of all NL
layers, median over repeats, per layer. Floor: metadata + selected KV bytes / copy
bandwidth measured in the same run.

Part `token` (per-token decode latency, whole model): batch 1 at 32K/64K/128K and batch 8
where the cache fits, with CUDA graphs on and off: dense, serial DSA, PRR at controlled
hit rates (one step replayed at a fixed position, P fixed), and PRR with the engine's
ema_membership (EMA of selection membership) and last_step predictors decoding for real (the
hit rate, precision and last-step overlap they had are counted in a separate, identical pass).
Floor: bytes read per token (the weights, less the rows of an untied embedding table a step
does not read, + KV + metadata) / bandwidth.

Part `matrix` (every conf/selector YAML × predictor none, last_step, ema, as run.py builds them):
batch 1, 32K, block 16, K = 2048 tokens, dense layers 0 and 1, budget=fixed ratio 1 (|P| = |A|;
every block for selector=dense), no torch.compile: per-token latency (the step's CUDA-graph
replay), the attention stage per sparse layer, each over the same selector's serial DSA
(predictor=none) in the same run, and the hit rate, precision and last-step overlap the
engine's device counters give over the same steps (`matrix_rows`).

Parts `stream_priority`, `spec_programs`, `repair_splits` (launch shapes of the PRR stage, over 4
caches of the 8B shape with P set from outside, every PRR output checked against serial DSA's):
selection on a high-priority stream and speculation on a low one against default streams;
speculation's per-block program size (StaticPlan.speculation_tokens_per_program) against select ∥
speculate and PRR; the one-launch repair + merge's split count (StaticPlan.repair_tokens_per_split)
against the three launches and serial DSA. They chose the engine's defaults (at least 4 blocks per
speculation program, prr_repair.default_splits) and left stream priorities off.

Part `select` (issue 33: each selector's selection as the engine calls it, through its Triton path):
batch 1, the 8B shape, 32K and 128K, blocks 16 and 64, top-K 32 and 128 blocks, over --stage-layers
caches: Quest (score + top-k), exact (q·K pass + mass pass + top-k; its score launches alone), LESS
(Quest's selection + the compensation, m = 32, bf16 summaries: conf/selector/less.yaml's; the
compensation alone; the decode token's metadata update with Quest's: less_append, incremental, and
less_append_reread, the block re-read it replaced), beside the attention
over A and dense SDPA, and a whole serial layer as the graph engine runs it (quest_layer: select + the
attention over A in the model dtype; less_layer: less_append + select + the attention's split partials
+ the one-launch compensation and merge, all on one stream, as the engine ran it before
StaticPlan.side_summaries and runs it with side_summaries=False; less_layer_extra = their difference, what
LESS adds; less_layer_side: the engine's order with side_summaries (the default): Quest's max / min
in the cache append kernel, as for Quest (untimed in both), the summaries alone (less_append_summaries:
less_append without Quest's max / min) on a side stream beside select + the attention's split partials,
joined by an event before the compensation and merge; less_layer_side_extra = less_layer_side − quest_layer), per
layer, with byte floors, exact's sets and LESS's state and merged output checked against each
selector's torch path, and LESS's state memory beside the KV cache's; InfLLM and infllm_prr beside Quest
(experiments/bench_infllm_select.py's columns: the live mean + select, their kernels alone, the score
kernel's tilings, floors, sets checked against the torch path). `--select-cells` picks cells.
`--parts select --tiny` runs it on a CPU under TRITON_INTERPRET=1 at toy sizes (a smoke run, not a speed).

Writes OUT.json (command, GPU, driver, versions, date, every row) and OUT_<part>.csv;
prints short tables last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from prr.kernels import prr_merge, quest

from prr.benchmarking import (
    BF16,
    HEADROOM,
    configured,
    copy_bandwidth,
    environment,
    model_of,
    read_bandwidth,
    time_graph_us,
)
from prr.blocks import controlled_predictions
from prr.budget.profiled import ProfiledBudget
from prr.model.decoder import Decoder
from prr.paths import strict_json_dumps
from prr.runtime.graph_budget import GraphProbe, graph_median_us
from prr.runtime.graph_decode import GraphDecoder, StaticPlan, metadata_bytes_per_block

ROOT = Path(__file__).resolve().parents[1]


HIT_RATES = (1.0, 0.98, 0.90, 0.68, 0.0)


def time_eager_us(fn, repeats: int = 15, warmup: int = 2) -> float:
    """Median µs of fn() launched eagerly (host launch overhead included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


# --- part 1: the attention stage per layer ------------------------------------------------------

def stage_rows(batch: int, context: int, block: int, topk_tokens: int, selector: str, layers: int,
               bandwidth: float, model: Decoder, capacity: int, hit_rates: tuple[float, ...] = HIT_RATES) -> list[dict]:
    """selector: a conf/selector YAML (run.py's object, every layer sparse, top-K = topk_tokens)."""
    k_blocks = topk_tokens // block
    chosen = configured("selector", selector, topk_blocks=k_blocks, dense_layers=[])
    plan = StaticPlan(variant="prr", predicted_blocks=k_blocks, block_size=block)
    eng = GraphDecoder(model, plan, batch=batch, max_tokens=capacity, selector=chosen, predictor=None)  # P from outside
    eng.fill_random_context(context, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    hq, hkv, d = eng.hq, eng.hkv, eng.d
    qs = [torch.randn(batch, hq, d, generator=gen, device="cuda").to(model.dtype) for _ in range(layers)]
    ks = [torch.randn(batch, hkv, d, generator=gen, device="cuda").to(model.dtype) for _ in range(layers)]
    vs = [torch.randn(batch, hkv, d, generator=gen, device="cuda").to(model.dtype) for _ in range(layers)]

    def run(variant: str, overlap: bool = True, repair_mode: str = "exact", fuse_merge: bool | str = False,
            fused_repair: bool | str = "auto"):
        view = eng.with_plan(variant=variant, overlap=overlap, repair_mode=repair_mode, fuse_merge=fuse_merge,
                             fused_repair=fused_repair)

        def attention_of_all_layers():
            positions = view.step_positions()  # once per step, as GraphDecoder.step does
            for i in range(layers):
                view.attention(i, qs[i], ks[i], vs[i], positions)
            view.join()  # a captured graph must end with the side stream joined
        return attention_of_all_layers

    # The true selections at this position (advance never happens here: pos stays `context`).
    run("serial")()
    torch.cuda.synchronize()
    selections = [eng.last_selection[i] for i in range(layers)]
    num_blocks = context // block + 1
    lengths = eng.pos + 1  # [B] tokens at this step (the engine's step_positions()[0])

    def per_layer(fn) -> float:
        return time_graph_us(fn) / layers

    out = {}
    out["dense_kernel"] = per_layer(run("dense"))
    out["dense_sdpa"] = per_layer(lambda: [F.scaled_dot_product_attention(
        qs[i].unsqueeze(2), eng.keys[i][:, :, : context + 1], eng.values[i][:, :, : context + 1], enable_gqa=True)
        for i in range(layers)])
    out["serial"] = per_layer(run("serial"))
    out["serial_fused_merge"] = per_layer(run("serial", fuse_merge=True))  # splits merged in the split kernel

    def select_only():  # the token's metadata update, then A: the selection part of the engine's layer
        positions = eng.step_positions()  # once per step, as GraphDecoder.step does
        for i in range(layers):
            if eng.kernel_metadata:  # Quest: the running key max / min the append kernel keeps
                quest.quest_update(*eng.selector.metadata(eng.cache, i), ks[i], eng.pos, block)
            else:  # InfLLM: the selector's own update of the token's block (GraphDecoder.attention's)
                eng.selector.append_metadata(eng.cache, i, eng.pos)
            eng.select(i, qs[i], *positions)
    out["stage_select"] = per_layer(select_only)
    a_idx = [s[0] for s in selections]
    a_cnt = [s[1] for s in selections]
    out["stage_attend_A"] = per_layer(lambda: [eng.attend(i, qs[i], a_idx[i], a_cnt[i], lengths)
                                               for i in range(layers)])
    rows = []
    for hit in hit_rates:
        hgen = torch.Generator().manual_seed(int(hit * 1000))
        for i in range(layers):
            eng.set_predictions(i, *controlled_predictions(selections[i], hit, num_blocks, hgen))
        t = dict(out)
        t["prr"] = per_layer(run("prr", overlap=True))  # the engine's default tail (fused_repair="auto")
        t["prr_three_launches"] = per_layer(run("prr", fused_repair=False))  # repair plan, repair, merge
        t["prr_fused_repair"] = per_layer(run("prr", fused_repair=True))  # plan + repair + merge: one launch
        t["prr_no_overlap"] = per_layer(run("prr", overlap=False))
        t["prr_superset"] = per_layer(run("prr", repair_mode="superset", fused_repair=False))
        t["stage_speculate"] = per_layer(lambda: [eng.attend(i, qs[i], eng.pred_idx[i], eng.pred_cnt[i], lengths,
                                                              per_block=True) for i in range(layers)])
        plans = [prr_merge.repair_plan(a_idx[i], a_cnt[i], eng.pred_idx[i], eng.pred_cnt[i], eng.scratch)
                 for i in range(layers)]
        spec = [eng.attend(i, qs[i], eng.pred_idx[i], eng.pred_cnt[i], lengths, per_block=True) for i in range(layers)]
        rep = [eng.attend(i, qs[i], plans[i][0], plans[i][1], lengths, merge_splits=False) for i in range(layers)]

        def repair_stage(plans=plans):  # the plan, then attention over A \ P (splits left unmerged)
            for i in range(layers):
                prr_merge.repair_plan(a_idx[i], a_cnt[i], eng.pred_idx[i], eng.pred_cnt[i], eng.scratch)
                eng.attend(i, qs[i], plans[i][0], plans[i][1], lengths, merge_splits=False)

        def merge_stage(plans=plans, spec=spec, rep=rep):
            for i in range(layers):
                prr_merge.merge_speculation(spec[i][0], spec[i][1], plans[i][2], rep[i][0], rep[i][1])
        t["stage_repair"] = per_layer(repair_stage)
        t["stage_merge"] = per_layer(merge_stage)

        # PRR's step up to the join: append, then select ∥ speculate (exact on the kernels: one launch,
        # StaticPlan.speculate_in_selection, as the engine runs it; stage_speculate times the separate kernel)
        def overlap_stage():
            positions = eng.step_positions()
            for i in range(layers):
                q = eng.append(i, qs[i], ks[i], vs[i])
                if not eng.kernel_metadata:  # InfLLM's metadata update, as GraphDecoder.attention does
                    eng.selector.append_metadata(eng.cache, i, eng.pos)
                eng.speculate_beside_selection(i, q, *positions)
        t["stage_overlap"] = per_layer(overlap_stage)
        measured_hit = float(sum(p[2].sum() for p in plans) / sum(c.sum() for c in a_cnt))
        # Floors (bytes / measured copy bandwidth): selection reads the metadata once; attention
        # reads the selected K/V; dense reads the whole context's K/V.
        meta_bytes = batch * hkv * num_blocks * metadata_bytes_per_block("quest" if selector == "quest" else "infllm",
                                                                         eng.dtype, d)
        elt = model.dtype.itemsize
        kv_sel_bytes = batch * hkv * k_blocks * block * d * 2 * elt
        kv_dense_bytes = batch * hkv * (context + 1) * d * 2 * elt
        t.update(batch=batch, context=context, block=block, topk_tokens=topk_tokens, selector=selector,
                 dtype=str(model.dtype).replace("torch.", ""),
                 target_hit_rate=hit, hit_rate=measured_hit, layers_timed=layers,
                 floor_sparse_us=(meta_bytes + kv_sel_bytes) / bandwidth * 1e6,
                 floor_dense_us=kv_dense_bytes / bandwidth * 1e6)
        t["speedup_prr_vs_serial"] = t["serial"] / t["prr"]
        t["speedup_three_launches_vs_serial"] = t["serial"] / t["prr_three_launches"]
        # What overlap could give with these kernels: the longer of select and speculate, then
        # repair and merge (the three-launch tail's parts), plus the per-layer bookkeeping serial DSA also pays (append, lengths);
        # never below the byte floor of both stages.
        bookkeeping = max(0.0, t["serial"] - t["stage_select"] - t["stage_attend_A"])
        t["prr_ideal_overlap"] = max(max(t["stage_select"], t["stage_speculate"]) + t["stage_repair"]
                                     + t["stage_merge"] + bookkeeping, t["floor_sparse_us"])
        # budget=profiled's stage check at |P| = |A|: speculate only where the measured PRR step beat serial
        # DSA at this hit rate by more than its margin, else |P| = 0; the chosen variant is timed again, so the
        # reported time is not the minimum of two noisy samples.
        t["profiled_choice"] = "prr" if t["prr"] < t["serial"] * (1.0 - ProfiledBudget().margin) else "serial"
        t["prr_profiled"] = per_layer(run(t["profiled_choice"]))
        # Serial DSA timed again right after, in the state the profiled timing saw (after
        # the PRR runs): the ratio of the two is what "never slower than serial" is read from.
        t["serial_retimed"] = per_layer(run("serial"))
        t["profiled_over_serial"] = t["prr_profiled"] / t["serial_retimed"]
        # The most any repair + merge could give: serial over its step up to the join.
        t["prr_overlap_bound"] = t["serial"] / t["stage_overlap"]
        t["speedup_serial_vs_dense"] = t["dense_kernel"] / t["serial"]
        t["prr_over_floor"] = t["prr"] / t["floor_sparse_us"]
        t["serial_over_floor"] = t["serial"] / t["floor_sparse_us"]
        rows.append(t)
    return rows


# --- part 2: per-token latency of the whole model -------------------------------------------------

@contextlib.contextmanager
def pdl(on: bool):
    """Programmatic dependent launch for prr's kernels on or off while a variant is captured
    (kernels/pdl.py reads PRR_PDL at each launch)."""
    before = os.environ.get("PRR_PDL")
    os.environ["PRR_PDL"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PRR_PDL"]
        else:
            os.environ["PRR_PDL"] = before


def counted_pass(eng: GraphDecoder, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """`steps` real decode steps of eng with the device counters on (a view with count_hits),
    then eng back where it was (checkpoint / restore rewinds position, metadata, P and the
    predictor state) -> (the counters summed over layers after step 1, and after the last):
    |A|, |P|, |P ∩ A|, |A_t ∩ A_t-1|, ... (step 1 has no A_{t-1} and no P yet)."""
    start = eng.checkpoint()
    counted = eng.with_plan(count_hits=True)
    first = {}
    for step in range(steps):
        counted.step(advance=True)
        if step == 0:
            first = {k: sum(v) for k, v in eng.counters().items()}
    last = {k: sum(v) for k, v in eng.counters().items()}
    eng.restore(start)
    return first, last


def token_rows(batch: int, context: int, block: int, topk_tokens: int, selector: str, model: Decoder,
               bandwidth: float, steps: int, capacity: int, compile: bool) -> list[dict]:
    """selector: "quest" or "infllm", conf/selector's at top-K = topk_tokens, layers 0 and 1 dense,
    the sink block and the newest forced (infllm: no local window)."""
    k_blocks = topk_tokens // block
    cfg = model.config
    chosen = configured("selector", selector, topk_blocks=k_blocks, dense_layers=[0, 1], local_blocks=0)
    objects = dict(selector=chosen, predictor=None)  # P set from outside (but for the predictors' rows)
    base = StaticPlan(variant="prr", predicted_blocks=k_blocks, block_size=block)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:  # a step reads one embedding row per batch row, not the table
        emb = model.model.embed_tokens.weight  # [V, H]
        weight_bytes -= (emb.shape[0] - batch) * emb.shape[1] * emb.element_size()
    hkv, d, nl = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    kv_dense = batch * hkv * (context + 1) * d * 2 * BF16
    num_blocks = context // block + 1
    meta = batch * hkv * num_blocks * metadata_bytes_per_block(selector, model.dtype, d)
    kv_sel = batch * hkv * k_blocks * block * d * 2 * BF16
    floors = {"dense": (weight_bytes + nl * kv_dense) / bandwidth * 1e6,
              "sparse": (weight_bytes + 2 * kv_dense + (nl - 2) * (meta + kv_sel)) / bandwidth * 1e6}
    rows = []

    def record(name: str, eng: GraphDecoder, advance: bool, hit: float | None, graphs: bool = True,
               **extra) -> None:
        start = eng.pos.clone()
        fn = lambda: eng.step(advance=advance)  # noqa: E731
        us = time_graph_us(fn, repeats=steps) if graphs else time_eager_us(fn, repeats=max(8, steps // 4))
        eng.pos.copy_(start)
        floor = floors["dense" if name.startswith("dense") else "sparse"]
        rows.append(dict(batch=batch, context=context, block=block, topk_tokens=topk_tokens, selector=selector,
                         variant=name, cuda_graphs=graphs, compiled=eng.compiled and eng.plan.projections == "torch",
                         projections=eng.plan.projections,
                         pdl=os.environ.get("PRR_PDL", "0") == "1",
                         hit_rate=hit,
                         token_us=us, floor_us=floor,
                         over_floor=us / floor, **extra))

    def record_fused(name: str, eng: GraphDecoder, hit: float | None) -> None:
        """`name` again with the fused Triton projections (a view with plan.projections="fused"),
        graphs on, PDL off (name_fused) and on (name_fused_pdl)."""
        fused = eng.with_plan(projections="fused")
        for on, suffix in ((False, "_fused"), (True, "_fused_pdl")):
            with pdl(on):
                record(name + suffix, fused, advance=False, hit=hit)

    if compile:  # what compiling the dense parts buys: serial DSA without it, graphs on
        eng = GraphDecoder(model, dataclasses.replace(base, variant="serial"), batch=batch, max_tokens=capacity,
                           **objects)
        eng.fill_random_context(context, seed=1)
        record("serial_uncompiled", eng, advance=False, hit=None)
        del eng
    # budget=profiled as run.py runs it in the graph engine (conf/budget/profiled.yaml's settings, its own
    # random queries and cache), at this context: the |P| whose whole PRR stage (90% hit rate) was
    # fastest, kept if it beat serial DSA's; else 0.
    profiled = ProfiledBudget(use_cache=False)
    probe = GraphProbe(lambda n: GraphDecoder(model, dataclasses.replace(base, predicted_blocks=n), batch=batch,
                                              max_tokens=capacity, **objects), first_size=k_blocks, seed=7)
    context_blocks = (context + block) // block
    profiled.setup(probe, k_blocks, num_blocks, contexts=[context_blocks])
    probe.release()
    profiled_size = profiled.predicted_blocks(0, context_blocks, k_blocks)
    profiled_row = json.dumps(profiled.setup_info["profile_measurements"][0])
    eng = GraphDecoder(model, base, batch=batch, max_tokens=capacity, compile=compile, **objects)
    eng.fill_random_context(context, seed=1)
    for name in ("dense", "serial"):
        view = eng.with_plan(variant=name)
        for graphs in (True, False):
            record(name, view, advance=False, hit=None, graphs=graphs)
        if batch == 1:
            record_fused(name, view, hit=None)
    if batch == 1:  # every split merged by a merge launch (the default merges one-wave launches in the split kernel)
        record_fused("serial_mergelaunch", eng.with_plan(variant="serial", fuse_merge=False), hit=None)
    eng.with_plan(variant="serial").step(advance=False)
    torch.cuda.synchronize()
    selections = list(eng.last_selection)
    for hit in (1.0, 0.9, 0.68):
        hgen = torch.Generator().manual_seed(int(hit * 1000))
        for i, s in enumerate(selections):
            if s is not None:
                eng.set_predictions(i, *controlled_predictions(s, hit, num_blocks, hgen))
        for graphs in ((True, False) if hit == 1.0 else (True,)):
            record(f"prr_fixed_{hit:.2f}", eng, advance=False, hit=hit, graphs=graphs)
        if hit == 1.0 and batch == 1:
            record_fused(f"prr_fixed_{hit:.2f}", eng, hit=hit)
        if hit in (1.0, 0.9):  # PRR's tail in three launches (plan.fused_repair=False; the default is "auto")
            three = eng.with_plan(fused_repair=False)
            record(f"prr_threelaunch_{hit:.2f}", three, advance=False, hit=hit)
            if batch == 1:
                record_fused(f"prr_threelaunch_{hit:.2f}", three, hit=hit)
        if hit == 0.9 and profiled_size in (0, base.predicted_blocks):  # the profiled choice, on the same data
            record("prr_profiled_0.90", eng.with_plan(variant="prr" if profiled_size else "serial"), advance=False,
                   hit=hit)
            rows[-1].update(profiled_choice=profiled_size, profile=profiled_row)
    del eng
    if profiled_size not in (0, base.predicted_blocks):  # another |P|: an engine of that size, P at 90% of A
        eng = GraphDecoder(model, dataclasses.replace(base, predicted_blocks=profiled_size), batch=batch,
                           max_tokens=capacity, compile=compile, **objects)
        eng.fill_random_context(context, seed=1)
        eng.with_plan(variant="serial").step(advance=False)
        hgen = torch.Generator().manual_seed(900)
        for i, s in enumerate(list(eng.last_selection)):
            if s is not None:
                idx, cnt = controlled_predictions(s, 0.9, num_blocks, hgen, size=profiled_size)
                eng.set_predictions(i, idx[..., :profiled_size], cnt)
        record("prr_profiled_0.90", eng, advance=False, hit=0.9)
        rows[-1].update(profiled_choice=profiled_size, profile=profiled_row)
        del eng
    # Real predictors (the engine's prr.predictors objects) decode for real: count the hit rate in
    # one pass, time an identical one from the same state (checkpoint / restore rewinds the
    # position, metadata, P and the predictor state; fill_random_context would keep the state).
    for predictor in ("ema_membership", "last_step"):  # conf/predictor's (ema_membership: alpha 0.8)
        eng = GraphDecoder(model, base, batch=batch, max_tokens=capacity, compile=compile, selector=chosen,
                           predictor=configured("predictor", predictor))
        eng.fill_random_context(context, seed=1)
        first, n = counted_pass(eng, steps)
        later = n["selected"] - first["selected"]
        record(f"prr_{predictor}", eng, advance=True, hit=n["hits"] / max(n["selected"], 1),
               precision=n["hits"] / max(n["predicted"], 1),
               last_step_overlap=(n["overlap"] - first["overlap"]) / later if later > 0 else None)
        del eng
    torch.cuda.empty_cache()
    return rows


# --- part 3: every selector × {none, last_step, ema} through the one engine ---------------------

MATRIX_PREDICTORS = ("none", "last_step", "ema")


def matrix_rows(selector_name: str, context: int, block: int, topk_tokens: int, model: Decoder, capacity: int,
                steps: int, stage_repeats: int = 15) -> list[dict]:
    """One row per predictor in MATRIX_PREDICTORS for `selector_name`'s YAML at K = topk_tokens:
    the engine built from the run's objects (graph_plan, budget=fixed ratio 1, as run.py with
    runtime.engine=graph builds it), a random context, then
    - counted: `steps` real decode steps with the device counters on; hit rate, precision and
      last-step overlap over steps 2.. (step 1 has no A_{t-1} and no P);
    - token_us: the same steps again from the same state (checkpoint / restore), one CUDA-graph
      replay each, counters off, median;
    - stage_us: the attention stage of every sparse layer (append, select, speculate, repair,
      merge, next P) captured once over all of them, per layer, median.
    predictor=none is the selector's serial DSA; ema runs uncalibrated (α=0.8, β=γ=1: a random
    context has nothing to calibrate on)."""
    from types import SimpleNamespace

    from prr.runtime.graph_run import graph_plan, graph_topk

    overrides = {"dense_layers": [0, 1]}
    if selector_name != "dense":
        overrides["topk_blocks"] = topk_tokens // block
    if selector_name == "less":  # random features: the trained map's model name is never read
        overrides["feature_map_model"] = "unused"
    budget = configured("budget", "fixed", ratio=1.0)
    settings = SimpleNamespace(repair_mode="exact", mode="sparse", block_size=block)
    max_blocks = -(-capacity // block)
    rows = []
    for predictor_name in MATRIX_PREDICTORS:
        selector = configured("selector", selector_name, **overrides)
        predictor = configured("predictor", predictor_name, **({"calibrate": False} if predictor_name == "ema" else {}))
        plan = graph_plan(settings, selector, predictor, budget, max_blocks)
        eng = GraphDecoder(model, plan, batch=1, max_tokens=capacity, selector=selector,
                           predictor=predictor if predictor.speculates else None)
        eng.fill_random_context(context, seed=1)
        first, n = counted_pass(eng, steps)
        start = eng.checkpoint()
        token_us = time_graph_us(lambda eng=eng: eng.step(advance=True), repeats=steps)
        eng.restore(start)
        sparse = [i for i in range(model.config.num_layers) if not selector.is_dense_layer(i)]
        gen = torch.Generator(device=eng.device).manual_seed(2)
        hq, hkv, d = eng.hq, eng.hkv, eng.d
        qkv = {i: [torch.randn(1, h, d, generator=gen, device=eng.device).to(model.dtype) for h in (hq, hkv, hkv)]
               for i in sparse}

        def stage(eng=eng, qkv=qkv, sparse=sparse):
            positions = eng.step_positions()
            for i in sparse:
                eng.attention(i, *qkv[i], positions)
            eng.join()
        stage_us = time_graph_us(stage, repeats=stage_repeats) / len(sparse)
        later = {k: n[k] - first[k] for k in n}  # steps 2..: step 1 has no A_{t-1} and no P yet
        rows.append(dict(selector=selector_name, predictor=predictor_name, context=context, block=block,
                         topk_tokens=topk_tokens, variant=plan.variant,
                         topk_blocks=max_blocks if selector.selects_every_block else graph_topk(selector, max_blocks),
                         predicted_blocks=plan.predicted_blocks, token_us=token_us, stage_us=stage_us,
                         hit_rate=later["hits"] / later["selected"] if predictor.speculates else None,
                         precision=later["hits"] / later["predicted"] if later["predicted"] else None,
                         last_step_overlap=later["overlap"] / later["selected"] if later["selected"] else None,
                         counted_steps=steps, sparse_layers=len(sparse)))
        del eng, qkv
        torch.cuda.empty_cache()
    serial = rows[0]  # predictor=none: this selector's serial DSA, timed in the same run
    for r in rows:
        r["token_over_serial"] = r["token_us"] / serial["token_us"]
        r["stage_over_serial"] = r["stage_us"] / serial["stage_us"]
    return rows



# --- part 4: launch shapes of the PRR stage (stream priorities, speculation programs, repair splits) ---
# Each walks LAUNCH_LAYERS caches of the 8B shape with P set from outside (predictor=None,
# |P| = |A|, no dense layers) and checks every PRR output against serial DSA's (exact mode).

LAUNCH_LAYERS = 4
STREAMS = {"default": (0, None), "prio": (-1, 0)}  # (main, side) priorities; lower is higher, 0 the default


def stream_graph_us(fn, stream: torch.cuda.Stream, repeats: int = 20) -> float:
    """Median µs of one replay of fn() captured on `stream` (its priority goes into the graph)."""
    return graph_median_us([fn], repeats, stream=stream)


def make_streams() -> dict[str, tuple[torch.cuda.Stream, torch.cuda.Stream | None]]:
    return {name: (torch.cuda.Stream(priority=main), None if side is None else torch.cuda.Stream(priority=side))
            for name, (main, side) in STREAMS.items()}


def fixed_prediction_engine(model: Decoder, batch: int, context: int, block: int, topk_tokens: int):
    """A Quest PRR engine with P set from outside over `context` random tokens, and
    LAUNCH_LAYERS random post-RoPE queries [B, Hq, D]."""
    k_blocks = topk_tokens // block
    quest = configured("selector", "quest", topk_blocks=k_blocks, dense_layers=[])
    plan = StaticPlan(variant="prr", predicted_blocks=k_blocks, block_size=block)
    eng = GraphDecoder(model, plan, batch=batch, max_tokens=context + HEADROOM, selector=quest, predictor=None)
    eng.fill_random_context(context, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    qs = [torch.randn(batch, eng.hq, eng.d, generator=gen, device="cuda").to(torch.bfloat16)
          for _ in range(LAUNCH_LAYERS)]
    return eng, qs


def layer_stage(eng: GraphDecoder, qs, positions, **changes):
    """fn(): the attention stage of every layer through a view of the engine with `changes`."""
    view = eng.with_plan(**changes)

    def fn():
        return [view.attention(i, qs[i], None, None, positions, appended=True) for i in range(LAUNCH_LAYERS)]
    return fn


def max_abs_diff(outs, ref) -> float:
    torch.cuda.synchronize()
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs, ref, strict=True))


def stream_priority_rows(model: Decoder, batch: int, context: int, block: int, topk_tokens: int) -> list[dict]:
    """Selection on a high-priority stream, speculation on a low one, against default streams: serial
    DSA, select alone, speculate alone, select ∥ speculate (nothing after) and PRR, at 100% and 90% hit."""
    eng, qs = fixed_prediction_engine(model, batch, context, block, topk_tokens)
    positions = eng.step_positions()
    lengths, nb_t = positions
    outs_serial = [o.clone() for o in layer_stage(eng, qs, positions, variant="serial")()]
    selections = [eng.last_selection[i] for i in range(LAUNCH_LAYERS)]

    def select_only():
        for i in range(LAUNCH_LAYERS):
            eng.select(i, qs[i], lengths, nb_t)

    def spec_only():
        for i in range(LAUNCH_LAYERS):
            eng.attend(i, qs[i], eng.pred_idx[i], eng.pred_cnt[i], lengths, per_block=True)

    def overlap_only():
        for i in range(LAUNCH_LAYERS):
            eng.speculate_beside_selection(i, qs[i], lengths, nb_t)

    rows = []
    for hit in (1.0, 0.9):
        hgen = torch.Generator().manual_seed(int(hit * 1000))
        for i in range(LAUNCH_LAYERS):
            eng.set_predictions(i, *controlled_predictions(selections[i], hit, context // block + 1, hgen))
        row = dict(batch=batch, context=context, block=block, topk_tokens=topk_tokens, hit_rate=hit)
        for name, (main, side) in make_streams().items():
            eng.use_side_stream(side)  # a view takes the side stream as it is now (None: the engine's own)
            row[f"max_abs_diff_prr_vs_serial_{name}"] = max_abs_diff(
                layer_stage(eng, qs, positions, variant="prr")(), outs_serial)
            row[f"serial_{name}"] = stream_graph_us(layer_stage(eng, qs, positions, variant="serial"), main) / LAUNCH_LAYERS
            row[f"select_{name}"] = stream_graph_us(select_only, main) / LAUNCH_LAYERS
            row[f"speculate_{name}"] = stream_graph_us(spec_only, main) / LAUNCH_LAYERS
            row[f"overlap_{name}"] = stream_graph_us(overlap_only, main) / LAUNCH_LAYERS
            row[f"prr_{name}"] = stream_graph_us(layer_stage(eng, qs, positions, variant="prr"), main) / LAUNCH_LAYERS
        eng.use_side_stream(None)
        rows.append(row)
    return rows


SPEC_TOKENS_PER_PROGRAM = (None, 256, 512, 1024, 2048)  # None: the kernel's default


def spec_program_rows(model: Decoder, batch: int, context: int, block: int, topk_tokens: int) -> list[dict]:
    """Speculation's per-block programs (StaticPlan.speculation_tokens_per_program) against select ∥
    speculate and PRR at 100% hit, on default and on prioritised streams."""
    from prr.kernels.sparse_decode import per_block_entries

    eng, qs = fixed_prediction_engine(model, batch, context, block, topk_tokens)
    positions = eng.step_positions()
    lengths, nb_t = positions
    outs_serial = [o.clone() for o in layer_stage(eng, qs, positions, variant="serial")()]
    for i in range(LAUNCH_LAYERS):  # P = A: 100% hit
        eng.set_predictions(i, *eng.last_selection[i])
    rows_per_launch, capacity = batch * eng.hkv, topk_tokens // block

    def select_only():
        for i in range(LAUNCH_LAYERS):
            eng.select(i, qs[i], lengths, nb_t)

    def spec_only(tokens):
        view = eng.with_plan(speculation_tokens_per_program=tokens)

        def fn():
            for i in range(LAUNCH_LAYERS):
                view.attend(i, qs[i], eng.pred_idx[i], eng.pred_cnt[i], lengths, per_block=True)
        return fn

    def overlap_only(tokens):
        view = eng.with_plan(speculation_tokens_per_program=tokens)

        def fn():
            for i in range(LAUNCH_LAYERS):
                view.speculate_beside_selection(i, qs[i], lengths, nb_t)
        return fn

    rows = []
    for name, (main, side) in make_streams().items():
        eng.use_side_stream(side)
        serial = stream_graph_us(layer_stage(eng, qs, positions, variant="serial"), main) / LAUNCH_LAYERS
        select = stream_graph_us(select_only, main) / LAUNCH_LAYERS
        for tokens in SPEC_TOKENS_PER_PROGRAM:
            if tokens is not None and tokens % block:
                continue
            prr = layer_stage(eng, qs, positions, variant="prr", speculation_tokens_per_program=tokens)
            entries = per_block_entries(capacity, rows_per_launch, block, "cuda", tokens)
            row = dict(batch=batch, context=context, block=block, topk_tokens=topk_tokens, streams=name,
                       tokens_per_program=tokens or 0, programs=-(-capacity // entries) * rows_per_launch,
                       serial=serial, select=select,
                       speculate=stream_graph_us(spec_only(tokens), main) / LAUNCH_LAYERS,
                       overlap=stream_graph_us(overlap_only(tokens), main) / LAUNCH_LAYERS,
                       prr=stream_graph_us(prr, main) / LAUNCH_LAYERS,
                       max_abs_diff_prr_vs_serial=max_abs_diff(prr(), outs_serial))
            row["prr_speedup"] = row["serial"] / row["prr"]
            row["overlap_vs_longer"] = row["overlap"] / max(row["select"], row["speculate"])
            rows.append(row)
    eng.use_side_stream(None)
    return rows


REPAIR_SPLITS = (None, 64, 32, 16, 8, 4)  # None: serial DSA's split plan


def repair_split_rows(model: Decoder, batch: int, context: int, block: int, topk_tokens: int) -> list[dict]:
    """Split count of the one-launch repair + merge (StaticPlan.repair_tokens_per_split) against the
    three launches and serial DSA, at 100% and 68% hit."""
    from prr.kernels.sparse_decode import sparse_decode_num_splits

    eng, qs = fixed_prediction_engine(model, batch, context, block, topk_tokens)
    stream = torch.cuda.Stream()
    k_blocks = topk_tokens // block
    positions = eng.step_positions()

    def splits_of(tokens):
        return sparse_decode_num_splits(k_blocks, batch, eng.hkv, block, "cuda", None, tokens,
                                        head_dim=eng.d, cache_dtype=torch.bfloat16)

    outs_serial = [o.clone() for o in layer_stage(eng, qs, positions, variant="serial")()]
    selections = [eng.last_selection[i] for i in range(LAUNCH_LAYERS)]
    serial = stream_graph_us(layer_stage(eng, qs, positions, variant="serial"), stream) / LAUNCH_LAYERS
    serial_splits = splits_of(None)
    rows = []
    for hit in (1.0, 0.68):
        hgen = torch.Generator().manual_seed(int(hit * 1000))
        for i in range(LAUNCH_LAYERS):
            eng.set_predictions(i, *controlled_predictions(selections[i], hit, context // block + 1, hgen))
        three = stream_graph_us(layer_stage(eng, qs, positions, fused_repair=False), stream) / LAUNCH_LAYERS
        for splits in REPAIR_SPLITS:
            if splits is not None and splits >= serial_splits:
                continue  # the serial plan is timed as None
            tokens = None if splits is None else block * -(-k_blocks // splits)
            fused_stage = layer_stage(eng, qs, positions, fused_repair=True, repair_tokens_per_split=tokens)
            err = max_abs_diff(fused_stage(), outs_serial)
            fused = stream_graph_us(fused_stage, stream) / LAUNCH_LAYERS
            launched = splits_of(tokens)
            rows.append(dict(batch=batch, context=context, block=block, topk_tokens=topk_tokens, hit_rate=hit,
                             splits=launched, serial_plan=splits is None, states_per_split=-(-k_blocks // launched),
                             serial=serial, prr_three_launches=three, prr_fused=fused,
                             fused_speedup_vs_serial=serial / fused, fused_vs_three=three / fused,
                             max_abs_diff_vs_serial=err))
    return rows


# --- part select: one selection per selector (Quest, exact, LESS), as the engine calls it ------------

# (context tokens, cache tokens, block, top-K blocks): batch 1 at the 8B shape; --tiny: CPU smoke sizes.
SELECT_GRID = [(c - HEADROOM, c, bs, k) for c in (32768, 131072) for bs in (16, 64) for k in (32, 128)]
SELECT_TINY = [(200, 256, 16, 4), (300, 512, 64, 3)]


def select_rows(batch: int, context: int, cache_tokens: int, block: int, k_blocks: int, layers: int,
                bandwidth: float, device: torch.device, heads: tuple[int, int] = (32, 8), head_dim: int = 128,
                num_features: int = 32, dtype: torch.dtype = torch.bfloat16,
                summary_dtype: str = "bfloat16") -> list[dict]:
    """Selection per layer, the selector objects' Triton paths on `layers` caches of `context`
    random tokens (so replays walk several caches): Quest (score + top-k), exact (its two score
    launches + top-k; the score launches alone), LESS (Quest's selection + the compensation; the
    compensation alone, over Quest's A), beside the attention over A and dense SDPA. On a GPU:
    CUDA-graph replays, median; on the CPU (TRITON_INTERPRET=1) the host clock (a smoke run, not
    a speed). Checked on layer 0 against each selector's torch path: exact's sets, LESS's state."""
    from prr.kernels.exact import exact_scores
    from prr.kernels.sparse_decode import sparse_decode, sparse_decode_one_wave

    from prr.cache import PagedKVCache
    from prr.runtime.graph_budget import stage_timing
    from prr.selectors import ExactSelector, LessSelector, QuestSelector

    hq, hkv = heads
    group, scale = hq // hkv, head_dim ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)
    cache = PagedKVCache(layers, batch, hkv, head_dim, block, cache_tokens, dtype, device)
    for i in range(layers):
        cache.append(i, torch.randn(batch, hkv, context, head_dim, generator=gen, device=device).to(dtype),
                     torch.randn(batch, hkv, context, head_dim, generator=gen, device=device).to(dtype))
    kw = dict(sink_blocks=1, local_blocks=0)
    less_kw = dict(num_features=num_features, summary_dtype=summary_dtype, **kw)  # conf/selector/less.yaml's storage
    quest, exact, less = QuestSelector(k_blocks, **kw), ExactSelector(k_blocks, **kw), LessSelector(k_blocks, **less_kw)
    exact_torch, less_torch = ExactSelector(k_blocks, **kw), LessSelector(k_blocks, **less_kw)
    for sel in (quest, exact, less):
        if sel.set_backend("triton") != "triton":
            raise RuntimeError(f"{type(sel).__name__} has no Triton path here: {sel.triton_problems()}")
    for i in range(layers):
        less.update_metadata(cache, i, 0, context)  # Quest's key max / min too (LESS keeps them in the same slots)
    qs = [torch.randn(batch, hkv, group, head_dim, generator=gen, device=device).to(dtype) for _ in range(layers)]
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    nb = (lengths + block - 1) // block
    a_sets = [quest.select(qs[i], cache, i, lengths, num_blocks=nb) for i in range(layers)]  # what LESS compensates around

    def every_layer(step):
        return lambda: [step(i) for i in range(layers)]

    def less_step(i):
        less.compensation(qs[i], cache, i, less.select(qs[i], cache, i, lengths, num_blocks=nb), lengths)

    def attend(i):
        sparse_decode(qs[i].view(batch, hq, head_dim), cache.keys[i], cache.values[i], a_sets[i].blocks.indices,
                      a_sets[i].blocks.count, lengths, block, scale)

    # A layer's selection and attention as the serial graph engine runs them: Quest's output merged in
    # the model dtype (its metadata rides in the cache append kernel); LESS's adds less_append, leaves
    # the splits unmerged and merges them with its compensation in one launch (Selector.compensated).
    fused = sparse_decode_one_wave(k_blocks, batch, hkv, block, device, head_dim=head_dim, cache_dtype=dtype) \
        if device.type == "cuda" else False

    def quest_layer(i):
        sel = quest.select(qs[i], cache, i, lengths, num_blocks=nb)
        sparse_decode(qs[i].view(batch, hq, head_dim), cache.keys[i], cache.values[i], sel.blocks.indices,
                      sel.blocks.count, lengths, block, scale, out_dtype=dtype, fuse_merge=fused)

    def less_attend(i, sel):
        return sparse_decode(qs[i].view(batch, hq, head_dim), cache.keys[i], cache.values[i], sel.blocks.indices,
                             sel.blocks.count, lengths, block, scale, merge_splits=False)

    def less_layer(i):
        less.append_metadata(cache, i, lengths - 1)
        sel = less.select(qs[i], cache, i, lengths, num_blocks=nb)
        less.compensated(qs[i], cache, i, sel, lengths, *less_attend(i, sel), dtype)

    def less_append_reread(i):
        from prr.kernels.less import less_append

        s = cache.metadata[i]
        less_append(cache.keys[i], cache.values[i], lengths - 1, block, s["less_w"], s["less_center"], s["less_S"],
                    s["less_s"], s["less_c"], s["less_S_tot"], s["less_s_tot"], s["less_c_tot"], scale,
                    *less.metadata(cache, i))

    # PRRStep's serial LESS layer with plan.side_summaries: the summaries on the side stream
    # (forked after the append), selection and the attention over A on the main one, an event joined
    # before the compensation, their only reader. (The CPU: one stream, program order.)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def less_layer_side(i):
        if side is None:
            less.append_summaries(cache, i, lengths - 1)
        else:
            main = torch.cuda.current_stream(device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                less.append_summaries(cache, i, lengths - 1)
            summarised = torch.cuda.Event()
            summarised.record(side)
        sel = less.select(qs[i], cache, i, lengths, num_blocks=nb)
        partials = less_attend(i, sel)
        if side is not None:
            main.wait_event(summarised)
        less.compensated(qs[i], cache, i, sel, lengths, *partials, dtype)

    parts = [less_attend(i, a_sets[i]) for i in range(layers)]  # A's split partials

    def dense(i):
        F.scaled_dot_product_attention(qs[i].view(batch, hq, 1, head_dim), cache.keys[i][:, :, :context],
                                       cache.values[i][:, :, :context], enable_gqa=True)

    variants = {
        "quest_select": every_layer(lambda i: quest.select(qs[i], cache, i, lengths, num_blocks=nb)),
        "exact_select": every_layer(lambda i: exact.select(qs[i], cache, i, lengths, num_blocks=nb)),
        "exact_scores": every_layer(lambda i: exact_scores(qs[i].view(batch, hq, head_dim), cache.keys[i], lengths,
                                                           nb, block, scale)),
        "less_select_compensate": every_layer(less_step),
        "less_compensation": every_layer(lambda i: less.compensation(qs[i], cache, i, a_sets[i], lengths)),
        "less_compensate_merge": every_layer(lambda i: less.compensated(qs[i], cache, i, a_sets[i], lengths, *parts[i],
                                                                        dtype)),
        "quest_layer": every_layer(quest_layer),
        "less_layer": every_layer(less_layer),
        "less_layer_side": every_layer(less_layer_side),
        # the decode token's metadata update (Quest's max / min + less_append), re-applied at one position
        "less_append": every_layer(lambda i: less.append_metadata(cache, i, lengths - 1)),
        # its summaries alone (what the side stream runs with side_summaries)
        "less_append_summaries": every_layer(lambda i: less.append_summaries(cache, i, lengths - 1)),
        # less_append's block re-read (the pre-incremental kernel, the reference; with Quest's max / min):
        # less_append is incremental now (O(m·D) per token; re-applied at one position its sums grow,
        # its time does not)
        "less_append_reread": every_layer(less_append_reread),
        "attend_A": every_layer(attend),
        "dense_sdpa": every_layer(dense),
    }
    row = dict(batch=batch, context=context, block=block, topk_blocks=k_blocks, layers_timed=layers,
               heads=f"{hq}/{hkv}", head_dim=head_dim, num_features=num_features, summary_dtype=summary_dtype,
               dtype=str(dtype).replace("torch.", ""))
    for name, fn in variants.items():
        fn()  # compile / warm up outside any capture
        row[name] = stage_timing(fn, device, per_call=layers).median_s * 1e6  # µs per layer
    # exact's q·K pass tilings (tokens per tl.dot tile x tiles per program): which default to keep.
    tilings = {}
    for tile_tokens in (64, 128, 256):
        for tiles in (2, 4, 8):
            tile_blocks = max(1, tile_tokens // block)
            if tile_blocks * block != tile_tokens:
                continue

            def scores_at(i, tile_blocks=tile_blocks, tiles=tiles):
                exact_scores(qs[i].view(batch, hq, head_dim), cache.keys[i], lengths, nb, block, scale,
                             tile_blocks=tile_blocks, tiles=tiles)
            fn = every_layer(scores_at)
            fn()
            tilings[f"{tile_blocks * block}x{tiles}"] = stage_timing(fn, device, per_call=layers).median_s * 1e6
    row["exact_scores_tilings"] = tilings
    row["exact_best_tiling"] = min(tilings, key=tilings.get)
    row["exact_scores_best"] = tilings[row["exact_best_tiling"]]
    # The same selection by each selector's torch path (layer 0), in full fp32 (main() allows TF32).
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    want = exact_torch.select(qs[0], cache, 0, lengths)
    got = exact.select(qs[0], cache, 0, lengths, num_blocks=nb)
    row["exact_sets_equal"] = float((got.blocks.indices == want.blocks.indices).all(-1).float().mean())
    row["exact_counts_equal"] = bool(torch.equal(got.blocks.count, want.blocks.count))
    ref = less_torch.compensation(qs[0], cache, 0, a_sets[0], lengths)
    state = less.compensation(qs[0], cache, 0, a_sets[0], lengths)
    used = torch.isfinite(ref.lse)
    row["less_same_dropped"] = bool(torch.equal(used, torch.isfinite(state.lse)))
    row["less_lse_max_abs_err"] = float((state.lse - ref.lse)[used].abs().max()) if used.any() else 0.0
    row["less_out_rel_err"] = float((state.out - ref.out).norm() / ref.out.norm().clamp(min=1e-30))
    merged = less.compensated(qs[0], cache, 0, a_sets[0], lengths, *parts[0], torch.float32)
    merged_ref = less_torch.compensated(qs[0], cache, 0, a_sets[0], lengths, *parts[0], torch.float32)
    row["less_merged_rel_err"] = float((merged - merged_ref).norm() / merged_ref.norm().clamp(min=1e-30))
    torch.backends.cuda.matmul.allow_tf32 = tf32
    # Ratios (the acceptance's per-layer view) and byte floors (bytes / bandwidth of this run).
    row["exact_over_quest"] = row["exact_select"] / row["quest_select"]
    row["less_over_quest"] = row["less_select_compensate"] / row["quest_select"]
    row["less_layer_extra"] = row["less_layer"] - row["quest_layer"]  # µs LESS adds to a serial layer
    row["less_layer_over_quest"] = row["less_layer"] / row["quest_layer"]
    row["less_layer_side_extra"] = row["less_layer_side"] - row["quest_layer"]  # the same with side_summaries
    row["less_layer_side_over_quest"] = row["less_layer_side"] / row["quest_layer"]
    row["exact_serial_over_dense"] = (row["exact_select"] + row["attend_A"]) / row["dense_sdpa"]
    row["quest_serial_over_dense"] = (row["quest_select"] + row["attend_A"]) / row["dense_sdpa"]
    elt = torch.empty((), dtype=dtype).element_size()
    blocks = -(-context // block)
    row["less_state_mib_per_layer"] = less.state_bytes(batch, hkv, head_dim, cache.max_blocks, dtype) / 2**20
    row["kv_mib_per_layer"] = 2 * cache.keys[0].numel() * elt / 2**20
    floors = {"quest_select": 2 * batch * hkv * blocks * head_dim * elt,
              "exact_select": batch * hkv * context * head_dim * elt,
              "less_compensation": batch * hkv * (k_blocks * num_features * ((head_dim + 1) * less.summary_dtype.itemsize
                                                                             + 4) + num_features * (head_dim + 2) * 4),
              "attend_A": 2 * batch * hkv * k_blocks * block * head_dim * elt,
              "dense_sdpa": 2 * batch * hkv * context * head_dim * elt}
    for name, nbytes in floors.items():
        row[f"{name}_floor_us"] = nbytes / bandwidth * 1e6
    return [row]


LAUNCH_PARTS = {  # part -> (rows function, (batch, cache tokens, block, top-K tokens) grid)
    "stream_priority": (stream_priority_rows, ((1, 131072, 64, 8192), (1, 32768, 64, 8192), (1, 131072, 64, 2048),
                                               (1, 131072, 16, 8192), (8, 32768, 64, 8192), (8, 131072, 64, 8192))),
    "spec_programs": (spec_program_rows, ((1, 131072, 64, 8192), (1, 32768, 64, 8192), (1, 131072, 16, 8192),
                                          (1, 131072, 64, 2048), (8, 131072, 64, 2048), (8, 32768, 64, 8192))),
    "repair_splits": (repair_split_rows, ((1, 131072, 64, 8192), (1, 32768, 64, 8192), (1, 131072, 16, 8192),
                                          (1, 131072, 64, 2048), (8, 32768, 16, 8192), (8, 131072, 64, 2048),
                                          (8, 131072, 64, 8192))),
}


def write_stage_csv(results: dict, out: Path):
    """OUT_stage.csv from the stage rows so far (provenance in every row) -> the frame."""
    import pandas as pd

    df = pd.DataFrame(results["stage"]).assign(command=results["command"])
    df.to_csv(out.parent / (out.name + "_stage.csv"), index=False)
    return df


def stage_cells(text: str) -> list[tuple[int, int, int, int, str]]:
    """'quest:32768:16:512,...' -> [(batch 1, context, block, topk_tokens, selector), ...]."""
    cells = []
    for cell in text.split(","):
        parts = cell.split(":")
        try:
            selector, context, block, topk = parts[0], *map(int, parts[1:])
        except ValueError:
            raise argparse.ArgumentTypeError(f"{cell!r} is not selector:context:block:topk_tokens") from None
        if not (ROOT / "conf" / "selector" / f"{selector}.yaml").is_file():
            raise argparse.ArgumentTypeError(f"{cell!r}: no conf/selector/{selector}.yaml")
        if min(context, block, topk) <= 0 or topk % block:
            raise argparse.ArgumentTypeError(f"{cell!r}: context, block, topk_tokens positive, topk_tokens a multiple "
                                             "of block")
        cells.append((1, context, block, topk, selector))
    return cells


def hit_rate_list(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of hit rates") from None
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: every hit rate must lie in [0, 1]")
    return rates


def fits(batch: int, context: int, layers: int, weight_gib: float) -> bool:
    kv_gib = 2 * batch * 8 * context * 128 * BF16 * layers / 2**30
    free = torch.cuda.mem_get_info()[0] / 2**30
    return kv_gib * 1.35 + weight_gib + 4 < free


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only (smoke run)")
    parser.add_argument("--parts", default="stage,token",
                        help="comma-separated: stage, token, matrix, select, " + ", ".join(LAUNCH_PARTS))
    parser.add_argument("--stage-layers", type=int, default=4, help="caches the stage timing walks through")
    parser.add_argument("--no-compile", action="store_true", help="per-token runs without torch.compile")
    parser.add_argument("--steps", type=int, default=48, help="timed decode steps (graph replays) per variant")
    parser.add_argument("--selectors", default="dense,exact,quest,infllm,less",
                        help="part matrix: conf/selector YAMLs to run (each × none, last_step, ema)")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/h200/bench_decode")
    parser.add_argument("--stage-cells", type=stage_cells,
                        help="part stage: only these cells, each selector:context:block:topk_tokens at batch 1 "
                             "(e.g. quest:32768:16:512,infllm:131072:64:2048); the selector a conf/selector YAML")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the stage map's model and cache dtype (the whole runs it predicts: runtime.dtype)")
    parser.add_argument("--hit-rates", type=hit_rate_list, default=HIT_RATES,
                        help="part stage: PRR's controlled hit rates (default " + ",".join(map(str, HIT_RATES)) + ")")
    parser.add_argument("--tiny", action="store_true",
                        help="part select at CPU smoke sizes (the only part that runs without a GPU, TRITON_INTERPRET=1)")
    parser.add_argument("--select-cells", type=lambda v: {tuple(int(x) for x in c.split(":")) for c in v.split(",")},
                        help="part select: only these cells, each cache_tokens:block:topk_blocks (e.g. 32768:16:32)")
    args = parser.parse_args()
    if 4 * args.steps + 64 > HEADROOM:
        parser.error(f"--steps={args.steps}: at most {(HEADROOM - 64) // 4} (the decoded tokens must fit the cache headroom)")
    parts = set(args.parts.split(","))
    if args.dtype != "bfloat16" and parts != {"stage"}:
        parser.error(f"--dtype {args.dtype} applies to the stage map only: add --parts stage")
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    if not on_gpu and (parts != {"select"} or not args.tiny):
        parser.error("without a CUDA device (or under TRITON_INTERPRET=1) only `--parts select --tiny` runs: a smoke run")
    torch.backends.cuda.matmul.allow_tf32 = True
    if on_gpu:
        env = environment()
        bw = copy_bandwidth() | read_bandwidth()
        bandwidth = max(bw.values())
        print(f"{env['gpu']}: bandwidth for the floors {bandwidth / 1e12:.2f} TB/s ("
              + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in bw.items()) + ")", flush=True)
    else:
        import triton

        env, bw, bandwidth = {"gpu": "none (CPU, TRITON_INTERPRET=1)", "torch": torch.__version__,
                              "triton": triton.__version__}, {}, float("nan")
    results = {"command": "python " + " ".join(sys.argv), "environment": env, "copy_bandwidth": bw,
               "hit_rates": args.hit_rates, "stage": [], "token": [], "matrix": [], "select": [],
               **{part: [] for part in LAUNCH_PARTS}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every configuration: an interrupted run keeps what it measured
        args.out.with_suffix(".json").write_text(strict_json_dumps(results, indent=1))

    if "stage" in parts:
        model = model_of(args.stage_layers, getattr(torch, args.dtype))
        grid = [(b, c, bs, k, sel) for sel in ("quest", "infllm") for b in (1, 8) for c in (32768, 65536, 131072)
                for bs in (16, 64) for k in (2048, 8192)]
        if args.quick:
            grid = [(1, 131072, 16, 2048, "quest"), (8, 32768, 64, 8192, "infllm")]
        if args.stage_cells:
            grid = args.stage_cells
        for b, c, bs, k, sel in grid:
            rows = stage_rows(b, c - HEADROOM, bs, k, sel, args.stage_layers, bandwidth, model, capacity=c,
                              hit_rates=args.hit_rates)
            torch.cuda.empty_cache()
            results["stage"].extend(rows)
            write_stage_csv(results, args.out)  # after every cell: a cut run keeps the map it measured
            r = rows[0]
            print(f"stage B={b} ctx={c} bs={bs} K={k} {sel}: dense {r['dense_kernel']:.1f} serial {r['serial']:.1f} "
                  f"prr@100% {r['prr']:.1f} sel {r['stage_select']:.1f} spec {r['stage_speculate']:.1f} µs", flush=True)
            save()
        del model
        torch.cuda.empty_cache()
    if "token" in parts:
        model = model_of(32)
        weight_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        grid = [(1, c, 16, k, "quest") for c in (32768, 65536, 131072) for k in (2048, 8192)]
        grid += [(8, c, 16, 2048, "quest") for c in (32768, 65536)]
        grid += [(1, 131072, 64, 2048, "quest"), (1, 131072, 64, 2048, "infllm")]
        if args.quick:
            grid = [(1, 32768, 16, 2048, "quest")]
        for b, c, bs, k, sel in grid:
            if not fits(b, c, 32, weight_gib):
                print(f"token B={b} ctx={c}: skipped, the KV cache does not fit in free memory", flush=True)
                results["token"].append(dict(batch=b, context=c, block=bs, topk_tokens=k, selector=sel,
                                             variant="skipped: KV cache does not fit"))
                continue
            rows = token_rows(b, c - HEADROOM, bs, k, sel, model, bandwidth, args.steps, capacity=c,
                              compile=not args.no_compile)
            results["token"].extend(rows)
            save()
            print(f"token B={b} ctx={c} bs={bs} K={k} {sel}: " + ", ".join(
                f"{r['variant']}{'' if r['cuda_graphs'] else '(eager)'} {r['token_us']:.0f}" for r in rows), flush=True)
    if "matrix" in parts:
        model = model_of(32)
        c = 32768
        for sel in args.selectors.split(","):
            rows = matrix_rows(sel, c - HEADROOM, 16, 2048, model, capacity=c, steps=args.steps)
            results["matrix"].extend(rows)
            save()
            print(f"matrix {sel}: " + ", ".join(f"{r['predictor']} {r['token_us']:.0f} µs/token "
                                                 f"{r['stage_us']:.1f} µs/layer" for r in rows), flush=True)
        del model
        torch.cuda.empty_cache()
    if "select" in parts:
        from bench_infllm_select import (
            infllm_select_columns,  # (a sibling script: experiments/ is sys.path[0])
        )

        device = torch.device("cuda" if on_gpu else "cpu")
        tiny = dict(heads=(8, 2), head_dim=64, num_features=16) if args.tiny else {}
        grid = SELECT_TINY if args.tiny else SELECT_GRID[:2] if args.quick else SELECT_GRID
        if args.select_cells:
            grid = [cell for cell in grid if cell[1:] in args.select_cells]
        for ctx, cache_tokens, bs, k in grid:
            rows = select_rows(1, ctx, cache_tokens, bs, k, 2 if args.tiny else args.stage_layers, bandwidth, device,
                               **tiny)
            # InfLLM and infllm_prr beside Quest (experiments/bench_infllm_select.py; K >= their 6 forced blocks)
            rows[0].update(infllm_select_columns(1, ctx, cache_tokens, bs, max(k, 6), 2 if args.tiny else args.stage_layers,
                                                 bandwidth, device, tilings=not args.tiny,
                                                 **{n: tiny[n] for n in ("heads", "head_dim") if n in tiny}))
            results["select"].extend(rows)
            save()
            r = rows[0]
            print(f"select ctx={ctx} bs={bs} K={k}: quest {r['quest_select']:.1f} exact {r['exact_select']:.1f} "
                  f"less {r['less_select_compensate']:.1f} (compensation {r['less_compensation']:.1f}; layer "
                  f"{r['less_layer']:.1f}, summaries beside {r['less_layer_side']:.1f}, vs Quest's "
                  f"{r['quest_layer']:.1f}) "
                  f"attend A {r['attend_A']:.1f} dense {r['dense_sdpa']:.1f} µs/layer", flush=True)
            print(f"  infllm {r['infllm_select']:.1f} ({r['infllm_over_quest']:.2f}x Quest's "
                  f"{r['quest_select_beside_infllm']:.1f}) infllm_prr {r['infllm_prr_select']:.1f} "
                  f"({r['infllm_prr_over_quest']:.2f}x) µs/layer", flush=True)
            if on_gpu:
                torch.cuda.empty_cache()
    for part, (rows_of, grid) in LAUNCH_PARTS.items():
        if part not in parts:
            continue
        model = model_of(LAUNCH_LAYERS)
        for b, c, bs, k in grid[:1] if args.quick else grid:
            rows = rows_of(model, b, c - HEADROOM, bs, k)
            torch.cuda.empty_cache()
            results[part].extend(rows)
            save()
            print(f"{part} B={b} ctx={c} bs={bs} K={k}: {len(rows)} rows", flush=True)
        del model
        torch.cuda.empty_cache()
    save()
    try:
        import pandas as pd
    except ImportError:
        return
    if results["stage"]:
        df = write_stage_csv(results, args.out)
        cols = ["selector", "batch", "context", "block", "topk_tokens", "target_hit_rate", "dense_kernel", "serial",
                "prr", "prr_three_launches", "prr_fused_repair", "prr_no_overlap", "prr_superset", "prr_ideal_overlap", "profiled_choice", "profiled_over_serial",
                "stage_select", "stage_speculate", "stage_overlap", "prr_overlap_bound", "speedup_prr_vs_serial",
                "serial_over_floor"]
        print(df[cols].round(2).to_string(index=False))
    if results["token"]:
        df = pd.DataFrame(results["token"]).assign(command=results["command"])
        df.to_csv(args.out.parent / (args.out.name + "_token.csv"), index=False)
        print(df.round(3).to_string(index=False))
    if results["matrix"]:
        df = pd.DataFrame(results["matrix"]).assign(command=results["command"])
        df.to_csv(args.out.parent / (args.out.name + "_matrix.csv"), index=False)
        cols = ["selector", "predictor", "variant", "predicted_blocks", "token_us", "token_over_serial", "stage_us",
                "stage_over_serial", "hit_rate", "precision", "last_step_overlap"]
        print(df[cols].round(3).to_string(index=False))
    if results["select"]:
        df = pd.DataFrame(results["select"]).assign(command=results["command"])
        df.to_csv(args.out.parent / (args.out.name + "_select.csv"), index=False)
        cols = ["context", "block", "topk_blocks", "quest_select", "exact_select", "exact_scores", "exact_scores_best",
                "exact_best_tiling",
                "less_select_compensate", "less_compensation", "less_compensate_merge", "less_append",
                "less_append_summaries", "less_append_reread", "quest_layer", "less_layer", "less_layer_extra", "less_layer_side",
                "less_layer_side_extra", "attend_A", "dense_sdpa", "exact_over_quest",
                "less_over_quest", "exact_serial_over_dense", "exact_sets_equal", "less_lse_max_abs_err",
                "less_merged_rel_err", "less_state_mib_per_layer", "kv_mib_per_layer",
                "quest_select_beside_infllm", "infllm_select", "infllm_prr_select", "infllm_over_quest",
                "infllm_prr_over_quest", "infllm_sets_equal", "infllm_prr_sets_equal"]
        print("select (µs per layer; ratios in the same run)")
        print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    for part in LAUNCH_PARTS:
        if results[part]:
            df = pd.DataFrame(results[part]).assign(command=results["command"])
            df.to_csv(args.out.parent / (args.out.name + f"_{part}.csv"), index=False)
            print(part)
            print(df.drop(columns="command").round(2).to_string(index=False))


if __name__ == "__main__":
    main()
