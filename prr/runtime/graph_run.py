"""`runtime.engine=graph`: a run.py decode through the CUDA-graph engine (graph_decode.py).

The prompt is prefilled by the research runtime (dense attention over the prompt, as with
engine=eager); the engine takes the cache, rebuilds the Quest metadata from it and decodes
greedily, one CUDA-graph replay per token on a GPU (eager launches on the CPU, where the
kernels run only under TRITON_INTERPRET=1, for tests). It measures what the eager runtime
cannot: per-token latency with speculation overlapped and no host work inside the step.
What it records is therefore less: per token (latency, token) and per layer (hit rate,
|A|), no per-head records, no dense reference metrics.

Mapping from the config (anything else is refused by `graph_problems`, with the reason):
Every selector and predictor config runs here, as the same objects the eager runtime runs;
`graph_problems` names what cannot (and why). |P| is static for the decode (a CUDA graph fixes
every shape): `fixed` sizes it; `profiled` (prr/budget/profiled.py) times the engine's own
stages at the prompt's context (GraphProbe, graph_budget.py: CUDA-graph replays on a GPU, the
host clock on the CPU) and its table gives |P| (0: serial DSA); `adaptive`
(prr/budget/adaptive.py) captures serial DSA and PRR over one cache and its rule picks one per
window of `budget.window_steps` steps from their measured device times and PRR's hit rate.
The predictor's state is warmed on the prefill tail's selections, as the eager runtime does,
so both propose the same P from the first step.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from prr.cache import PagedKVCache
from prr.paths import write_json_atomic, write_text_atomic
from prr.run_inputs import build_run
from prr.runtime.graph_decode import StaticPlan
from prr.selectors.base import stack_rows
from prr.sinks import JsonlWriter
from prr.summary_table import format_summary

log = logging.getLogger("prr")


def graph_problems(built: dict[str, Any], model: Any) -> list[str]:
    """Why this config cannot run on runtime.engine=graph (empty: it can)."""
    runtime, selector, predictor, budget, task = (built[g] for g in ("runtime", "selector", "predictor", "budget",
                                                                     "task"))
    out = []
    head = "runtime.engine=graph"
    name = type(predictor).__name__  # (for messages only)
    # |P| known before decoding (fixed, adaptive's start) for predictors that take the budget's size
    size = budget.static_blocks(selector.topk_blocks) if predictor.speculates and predictor.uses_budget else None
    if size is not None and size < 1:
        out.append(f"{head} with predictor={name} needs |P| >= 1 (the budget gives |P| = {size}); use predictor=none "
                   "for serial DSA")
    if selector.selects_every_block and size is not None and size != selector.topk_blocks:
        out.append(f"{head} with selector=dense speculates over a static |P| = every block of the cache: set "
                   f"budget.ratio=1 (got |P| = {size}); a |P| that grows with the context is eager-only")
    if not predictor.speculates and budget.adapts_online:
        out.append(f"{head} with budget=adaptive chooses between serial DSA and PRR: it needs a predictor; "
                   "predictor=none is serial DSA already")
    prompt_blocks = getattr(task, "prompt_tokens", 0) // max(runtime.block_size, 1)
    if size is not None and not selector.selects_every_block and prompt_blocks and size > prompt_blocks:
        out.append(f"{head}: |P| = {size} blocks exceeds the prompt's {prompt_blocks} blocks; lower budget.ratio / "
                   "budget.blocks")
    backend = engine_backend(runtime.device, built["backend"].name)
    if backend == "triton":
        try:  # the install of `make run` has no Triton: the engine's kernels on a GPU need it
            from prr.kernels.sparse_decode import MIN_BLOCK_SIZE, SUPPORTED_HEAD_DIMS
        except ImportError as err:
            out.append(f"{head} on runtime.device={runtime.device} runs Triton kernels, and {err}: `make install` "
                       "(or pip install -e '.[dev]') adds it")
        else:
            if model.head_dim not in SUPPORTED_HEAD_DIMS:
                out.append(f"{head}: head_dim={model.head_dim} is not one of the kernels' {list(SUPPORTED_HEAD_DIMS)}")
            if runtime.block_size < MIN_BLOCK_SIZE:
                out.append(f"{head}: runtime.block_size={runtime.block_size} must be >= {MIN_BLOCK_SIZE}")
    if backend == "torch" and runtime.graph_projections() == "fused":
        out.append(f"{head} with runtime.projections=fused runs Triton GEMVs: use backend=triton (CUDA, or the CPU "
                   "under TRITON_INTERPRET=1) or runtime.projections=torch")
    if getattr(task, "temperature", 0.0) != 0.0:
        out.append(f"{head} decodes greedily (the step writes its argmax token): set task.temperature=0 "
                   f"(got {task.temperature})")
    if callable(getattr(task, "evaluate", None)):
        out.append(f"{head} decodes one prompt; scored tasks (accuracy, perplexity, lm_eval) run on runtime.engine=eager")
    rows = runtime.row_tokens
    prompt_tokens = getattr(task, "prompt_tokens", None)
    if rows and (prompt_tokens is None or max(rows) > prompt_tokens):
        out.append(f"runtime.row_tokens={rows}: a row holds at most the prompt's task.prompt_tokens="
                   f"{prompt_tokens} tokens; lower it or raise task.prompt_tokens")
    tp = runtime.tensor_parallel
    if tp > 1:
        from prr.model.tensor_parallel import TensorParallel

        out += [f"runtime.tensor_parallel={tp}: {p}" for p in TensorParallel(0, tp).problems(model)]
        world = os.environ.get("WORLD_SIZE")
        if world != str(tp):
            out.append(f"runtime.tensor_parallel={tp} needs {tp} processes (this one sees WORLD_SIZE={world}): launch "
                       f"with `torchrun --nproc_per_node {tp} run.py ...`")
        if budget.profiles or budget.adapts_online:
            out.append(f"runtime.tensor_parallel={tp} with budget={type(budget).__name__}: each rank would decide from "
                       "its own timings; not yet supported (use budget=fixed)")
        if runtime.projections == "fused":
            out.append(f"runtime.tensor_parallel={tp} runs the torch projections (the fused GEMVs cannot all-reduce): "
                       "use runtime.projections=torch or auto")
    return out


def engine_backend(device: str, backend: str) -> str:
    """The engine's ops: Triton kernels on a GPU (the fast path, whatever `backend` names) and
    wherever backend=triton (the CPU under TRITON_INTERPRET=1); torch ops on the CPU otherwise."""
    return "triton" if str(device).startswith("cuda") or backend == "triton" else "torch"


def graph_plan(settings: Any, selector: Any, predictor: Any, budget: Any, max_blocks: int) -> StaticPlan:
    """The engine's plan for this run's objects: serial DSA for a predictor that never
    speculates, else PRR with a static |P| (every block for `dense`; the budget's size; |A|
    for budget=profiled, which then chooses serial or PRR; the oracle's P is sized by the engine)."""
    k = min(selector.topk_blocks, max_blocks)
    if not predictor.speculates:
        size = 0
    elif selector.selects_every_block:
        size = max_blocks
    elif not predictor.uses_budget or budget.profiles:  # (profiled: the profile sizes it before the decode)
        size = k
    else:
        size = min(budget.static_blocks(k), max_blocks)
    return StaticPlan(variant="prr" if predictor.speculates else "serial", topk_blocks=k, predicted_blocks=size,
                      predictor="fixed", repair_mode=settings.repair_mode, mode=settings.mode,
                      block_size=settings.block_size, sink_blocks=0, recent_blocks=0,
                      dense_layers=tuple(sorted(selector.dense_layers)))


def steps_until_eos(inputs: torch.Tensor, eos_ids: torch.Tensor) -> int | None:
    """inputs: [B, n] tokens read by steps 0..n-1 -> how many steps decode_run runs before it
    stops (after the first step by which every row has read an EOS), or None if not yet."""
    seen = torch.isin(inputs, eos_ids).int().cummax(1).values.min(0).values  # [n]: all rows have seen one
    return int(seen.argmax()) + 1 if bool(seen.any()) else None


def tensor_parallel_group(settings: Any):
    """runtime.tensor_parallel > 1: join torchrun's process group (gloo on a CPU, NCCL on GPUs,
    one GPU per rank: cuda:LOCAL_RANK) -> this rank's TensorParallel; None for one process."""
    if settings.tensor_parallel == 1:
        return None
    import torch.distributed as dist

    from prr.model.tensor_parallel import TensorParallel

    cuda = settings.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return TensorParallel(dist.get_rank(), dist.get_world_size())


def graph_decode_run(cfg: DictConfig, run_dir: Path, logger: Any) -> dict[str, Any]:
    """Prefill (research runtime), then decode through the engine; writes tokens.jsonl,
    layers.csv, generation.txt and summary.json like decode_run."""
    import dataclasses

    import pandas as pd  # here: config validation imports this module for graph_problems

    from prr.runtime.dsa_backend import DSABackend
    from prr.runtime.graph_budget import GraphProbe
    from prr.runtime.graph_decode import GraphDecoder
    from prr.runtime.probe import device_name

    tp = tensor_parallel_group(instantiate(cfg.runtime))  # (first: each rank loads onto its own GPU)
    r = build_run(cfg)
    settings, task, selector, predictor, budget = r.settings, r.task, r.selector, r.predictor, r.budget
    device, dtype, model, load_s, prompt, input_ids = r.device, r.dtype, r.model, r.load_s, r.prompt, r.input_ids
    decoder = model.decoder  # the whole model, or this rank's shard (tensor parallelism)
    if tp is not None:
        from prr.model.tensor_parallel import shard_decoder

        decoder = shard_decoder(decoder, tp)
        model.decoder = decoder  # the whole model is freed: a rank keeps its shard only
        if device.type == "cuda":
            torch.cuda.empty_cache()
    mc = decoder.config
    prompt_len = input_ids.shape[1]
    capacity = prompt_len + task.max_new_tokens + 1
    # Tokens of the prompt each row holds: all of it, or a ragged batch's last row_tokens[b].
    row_tokens = settings.row_tokens or [prompt_len] * settings.batch_size
    if max(row_tokens) > prompt_len:  # (graph_problems refuses rows above task.prompt_tokens before any work)
        raise ValueError(f"runtime.row_tokens={settings.row_tokens}: a row cannot hold more than the prompt's "
                         f"{prompt_len} tokens")

    max_blocks = -(-capacity // settings.block_size)
    plan = graph_plan(settings, selector, predictor, budget, max_blocks)
    ops = instantiate(cfg.backend)  # the prefill's ops; the engine's follow the device (engine_backend)
    ops_backend = engine_backend(settings.device, ops.name)
    budget_info: dict[str, Any] = {"policy": type(budget).__name__, "predicted_blocks": plan.predicted_blocks}
    if plan.variant == "prr" and budget.profiles and predictor.uses_budget:  # before the prefill: less memory at once
        # The profile at the first decode step's context (the longest row + 1 tokens): |P| is static
        # for the decode.
        context = (max(row_tokens) + settings.block_size) // settings.block_size
        probe = GraphProbe(lambda n: GraphDecoder(decoder, dataclasses.replace(plan, predicted_blocks=n),
                                                  settings.batch_size, capacity, selector=selector,
                                                  backend=ops_backend),
                           first_size=plan.topk_blocks)
        budget_info.update(budget.setup(probe, plan.topk_blocks, max_blocks, contexts=[context]))
        probe.release()
        size = budget.predicted_blocks(0, context, plan.topk_blocks)
        plan = dataclasses.replace(plan, variant="prr" if size else "serial", predicted_blocks=size)
        budget_info.update(choice=plan.variant, predicted_blocks=size)
    # Prefill through the research runtime (dense over the prompt), into a paged cache: its K/V,
    # the selector's metadata and the warmed predictor state are what the engine decodes from.
    # A ragged batch prefills its rows one by one, each into its row of the cache
    # (`PagedKVCache.row`: its own length and metadata), then calibrates and warms the predictor
    # on every row's prefill tail at once, as a uniform batch does.
    cache = PagedKVCache(mc.num_layers, settings.batch_size, mc.num_kv_heads, mc.head_dim, settings.block_size,
                         capacity, dtype, device)
    selector.set_backend(ops.name)

    def prefill_backend(target: PagedKVCache) -> DSABackend:
        return DSABackend(target, mc.num_heads, selector, predictor, budget, mode="sparse",
                          repair_mode=settings.repair_mode, calibration_tokens=settings.calibration_tokens,
                          dense_metrics_every=1, check_serial=False, backend=ops.name)
    backend = prefill_backend(cache)
    with torch.inference_mode():
        t0 = time.perf_counter()
        if settings.row_tokens is None:
            logits = decoder(input_ids, 0, backend)[:, -1]  # [B, V]
            history = None
        else:
            rows, row_logits = [], []
            for b, n in enumerate(row_tokens):
                rows.append(prefill_backend(cache.row(b)))
                row_logits.append(decoder(input_ids[b : b + 1, prompt_len - n :], 0, rows[-1])[:, -1])  # [1, V]
            logits = torch.cat(row_logits)  # [B, V]
            for layer in range(mc.num_layers):  # the host length: the longest row (rows mask their own)
                cache.set_length(layer, max(row_tokens))
            history = [None if rows[0].history[layer] is None else
                       [stack_rows(list(step)) for step in zip(*(r.history[layer] for r in rows), strict=True)]
                       for layer in range(mc.num_layers)]
            del rows
        calibrate_on = None
        if tp is not None:  # calibration fits every rank's heads (all ranks choose alike, as one process would)
            own = history if history is not None else backend.history
            calibrate_on = [None if h is None else [tp.gather_heads(s) for s in h] for h in own]
        calibration = backend.finish_prefill(history, calibrate_on)  # calibrates and warms the predictor
        prefill_s = time.perf_counter() - t0
    if calibration:
        budget_info["calibration"] = calibration

    speculating = plan.variant == "prr"
    plan = dataclasses.replace(plan, projections=settings.graph_projections())
    engine = GraphDecoder(decoder, plan, settings.batch_size, capacity, compile=device.type == "cuda" and tp is None,
                          selector=selector, predictor=predictor if speculating else None, cache=cache,
                          backend=ops_backend)
    first = logits.argmax(-1)  # [B] greedy
    engine.begin(row_tokens, first)
    if speculating:
        engine.adopt_predictor_state(backend.predictor_state)
        engine.prime_predictions(row_tokens)
    engine.set_previous_selections(backend.previous)  # A of the last prompt-tail step: last-step overlap
    del backend
    log.info("prompt: %s (%d tokens); engine=graph, %s", prompt.description, prompt_len, plan)

    adaptive = budget.adapts_online
    if adaptive:
        budget_info.update(budget.setup(None, plan.topk_blocks, max_blocks))
        log.info("engine=graph budget=adaptive: serial DSA or PRR (|P| = %d blocks) per window of %d steps, by "
                 "measured time and PRR's hit rate (min_hit=%s)", plan.predicted_blocks, budget.window_steps,
                 budget.min_hit)
    steps = task.max_new_tokens
    outputs = torch.zeros(settings.batch_size, steps + 2, dtype=torch.long, device=device)  # each step's token

    # One view of the engine per variant this run can take (adaptive: both, over the same cache).
    # Steps that also measure against dense attention (runtime.dense_metrics_every; shadow mode
    # measures every step) are a second view of each variant. Every view counts |A|, |P|, hits
    # and last-step overlap on the device (a few small reductions per sparse layer), read once
    # per window.
    variants = ("serial", "prr") if adaptive else (plan.variant,)
    every = 1 if plan.mode == "shadow" else settings.dense_metrics_every
    measures = (True,) if every == 1 else (True, False)

    def stepper(view: GraphDecoder):
        def run() -> None:  # one decode step of this view; its greedy token lands in outputs[:, step index]
            view.step(advance=True)
            outputs.index_copy_(1, (view.pos[:1] - row_tokens[0] - 1).long(), view.token)
        return run

    # (adaptive's serial windows keep the predictor learning, as the eager runtime's serial steps do)
    replays = {(variant, m): stepper(engine.with_plan(variant=variant, measure_dense=m, count_hits=True,
                                                      learn_in_serial=adaptive))
               for variant in variants for m in measures}
    if device.type == "cuda":  # capture one step each; the warm-up steps advance the state: rewind it
        with torch.inference_mode():  # (the prefill's tensors are inference tensors)
            start = engine.checkpoint()  # after each capture, and before the decode, to the prompt's end
            for key, fn in list(replays.items()):
                replays[key] = engine.capture(fn).replay
                engine.restore(start)
    eos = mc.eos_token_id
    eos_ids = torch.tensor(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    # Steps run back to back; the host looks at tokens (EOS) every CHECK_EVERY steps, and on a
    # GPU each step's time is its replay's device time (CUDA events): no host sync per token.
    check_every = budget.window_steps if adaptive else 16 if device.type == "cuda" else 1
    latencies: list[float] = []
    ran: list[str] = []  # the variant of each step
    sparse = [i for i in range(mc.num_layers) if engine.sparse[i]]
    # Hit counters summed over PRR steps only (an adaptive run's serial steps count |A|, no hits).
    names = engine.COUNTERS
    totals = {v: torch.zeros(len(names), mc.num_layers, dtype=torch.float64) for v in ("serial", "prr")}
    done = 0
    with torch.inference_mode(), tqdm(total=steps, desc="decode (graph)", unit="tok") as bar:
        while done < steps:
            chunk = min(check_every, steps - done)
            variant = budget.variant if adaptive else plan.variant
            window_replays = [replays[variant, (done + i) % every == 0] for i in range(chunk)]
            # copies: on the CPU .cpu() would alias the counters the steps add to in place
            before = torch.tensor([engine.counters()[n] for n in names], dtype=torch.float64)
            first_latency = len(latencies)
            if device.type == "cuda":
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(chunk)]
                for (start, stop), replay in zip(events, window_replays, strict=True):
                    start.record()
                    replay()
                    stop.record()
                events[-1][1].synchronize()
                latencies += [start.elapsed_time(stop) * 1e-3 for start, stop in events]
            else:
                for replay in window_replays:
                    t0 = time.perf_counter()
                    replay()
                    latencies.append(time.perf_counter() - t0)
            done += chunk
            ran += [variant] * chunk
            bar.update(chunk)
            window = torch.tensor([engine.counters()[n] for n in names], dtype=torch.float64) - before
            totals[variant] += window
            if adaptive:
                window_hit = None
                if variant == "prr":
                    d_hits, d_sel = window[2, sparse].sum(), window[0, sparse].sum()
                    window_hit = float(d_hits / d_sel) if d_sel > 0 else None
                budget.end_window(variant, statistics.median(latencies[first_latency:]), window_hit)
            inputs = torch.cat([first.view(-1, 1).cpu(), outputs[:, : done - 1].cpu()], 1)  # [B, done]
            stop = steps_until_eos(inputs, eos_ids) if task.stop_at_eos else None
            if stop is not None:
                done = stop
                latencies, ran = latencies[:done], ran[:done]
                break
    inputs = torch.cat([first.view(-1, 1).cpu(), outputs[:, : done - 1].cpu()], 1)  # [B, steps]: tokens each step read
    tokens_out = JsonlWriter(run_dir / "records" / "tokens.jsonl")
    tokens_out.write([{"step": i, "token": int(inputs[0, i]), "wall_s": t, "measure_s": 0.0, "latency_s": t,
                       "variant": v} for i, (t, v) in enumerate(zip(latencies, ran, strict=True))])
    tokens_out.close()

    token_ids = inputs
    if tp is not None:  # each rank counted its own KV heads: the run's counts are their sums
        for variant in totals:
            totals[variant] = tp.sum_on_host(totals[variant])
    selected, predicted, hits = (totals["prr"][names.index(n)] for n in ("selected", "predicted", "hits"))
    both = dict(zip(names, totals["prr"] + totals["serial"], strict=True))  # over every step

    def ratio(num: torch.Tensor, den: torch.Tensor) -> float | None:
        return float(num.sum() / den.sum()) if den.sum() > 0 else None

    # hit rate and precision over PRR steps; overlap and the dense-reference metrics over every step
    layers = pd.DataFrame({"layer": sparse,
                           "hit_rate": [ratio(hits[i], selected[i]) for i in sparse],
                           "last_step_overlap": [ratio(both["overlap"][i], both["selected"][i]) for i in sparse],
                           "mass_recall": [ratio(both["mass_recall"][i], both["measured"][i]) for i in sparse],
                           "output_relerr": [ratio(both["output_relerr"][i], both["measured"][i]) for i in sparse]})
    command = "python " + " ".join(sys.argv)  # provenance travels with copies of either file
    layers.assign(command=command).to_csv(run_dir / "layers.csv", index=False)
    text = model.tokenizer.decode(token_ids[0].tolist()) if model.tokenizer is not None else None
    write_text_atomic(run_dir / "generation.txt", f"prompt: {prompt.description}\n\n{text or token_ids[0].tolist()}\n")
    total_selected = float(selected[sparse].sum())  # over PRR steps
    if adaptive:
        budget_info.update(steps_prr=ran.count("prr"), steps_serial=ran.count("serial"))
    median_ms = 1e3 * statistics.median(latencies)
    summary = {
        "status": "complete",
        # how this file was produced (results copied elsewhere keep their provenance)
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "engine": "graph",
        "tensor_parallel": settings.tensor_parallel,
        "kv_heads_per_rank": mc.num_kv_heads,  # (the shard's: the model's / tensor_parallel)
        "engine_ops": engine.backend,  # triton kernels, or static-shape torch ops (a CPU without TRITON_INTERPRET)
        "model": model.name,
        "selector": OmegaConf.to_container(cfg.selector, resolve=True),
        "predictor": OmegaConf.to_container(cfg.predictor, resolve=True),
        "budget": OmegaConf.to_container(cfg.budget, resolve=True),
        "mode": plan.mode,
        "repair_mode": plan.repair_mode,
        "projections": engine.plan.projections,
        "variant": "adaptive" if adaptive else plan.variant,  # adaptive: per step in tokens.jsonl
        "device": device_name(device),
        "prompt_tokens": prompt_len,
        "row_tokens": row_tokens,  # tokens of the prompt each row holds (a ragged batch's differ)
        "block_size": plan.block_size,
        "topk_blocks": plan.topk_blocks,
        "predicted_blocks": plan.predicted_blocks,
        "model_load_s": load_s,
        "prefill_s": prefill_s,
        "budget_setup": budget_info,
        "decode_steps": len(latencies),
        # GPU: device time of each step's graph replay (CUDA events); CPU: wall time of eager steps.
        "token_latency_median_ms": median_ms,
        "token_latency_p90_ms": 1e3 * float(pd.Series(latencies).quantile(0.9)),
        "token_latency_mean_ms": 1e3 * statistics.fmean(latencies),  # with the dense-measured steps' cost
        "tokens_per_s": settings.batch_size * 1e3 / median_ms,
        "hit_rate": float(hits[sparse].sum()) / total_selected if total_selected else None,
        "precision": ratio(hits[sparse], predicted[sparse]),
        "last_step_overlap": ratio(both["overlap"][sparse], both["selected"][sparse]),
        "mean_mass_recall": ratio(both["mass_recall"][sparse], both["measured"][sparse]),
        "mean_output_relerr": ratio(both["output_relerr"][sparse], both["measured"][sparse]),
        "dense_metrics_every": every,
        "generated_token_ids": token_ids.tolist(),
    }
    write_json_atomic(run_dir / "summary.json", summary)
    logger.log_run(summary, layers, pd.DataFrame())
    print(format_summary(summary, layers))
    return summary
