"""`runtime.engine=graph`: a run.py decode through the CUDA-graph engine (graph_decode.py).
(Its pipeline, also scored tasks': graph_pipeline.py; the engine over the cache: graph_session.py.)

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
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import Tensor

from prr.runtime.graph_pipeline import GraphPipeline
from prr.runtime.graph_session import (  # noqa: F401 - engine_backend, graph_plan, resolved_plan: imported from here
    engine_backend,
    graph_plan,
    graph_topk,
    resolved_plan,
)
from prr.runtime.run_strategy import Results, Window

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
    prompt_blocks = getattr(task, "prompt_tokens", 0) // max(runtime.block_size, 1)
    if size is not None and not selector.selects_every_block and prompt_blocks and size > prompt_blocks:
        out.append(f"{head}: |P| = {size} blocks exceeds the prompt's {prompt_blocks} blocks; lower budget.ratio / "
                   "budget.blocks")
    backend = engine_backend(runtime.device, built["backend"].name, built["backend"].graph_on_gpu)
    if backend == "triton":
        try:  # the install of `make run` has no Triton: the engine's kernels on a GPU need it
            import triton  # noqa: F401
        except ImportError as err:
            out.append(f"{head} on runtime.device={runtime.device} runs Triton kernels, and {err}: `make install` "
                       "(or pip install -e '.[dev]') adds it")
        else:
            from prr.runtime.engine_ops import triton_shape_problems

            if built["backend"].name != "triton":  # (backend=triton's own check names these)
                out += [f"{head}: {p}" for p in triton_shape_problems(model.head_dim, runtime.block_size)]
    if backend == "torch" and runtime.graph_projections() == "fused":
        chosen = "fused" if runtime.projections == "fused" else "auto (fused on a GPU at batch 1)"
        out.append(f"{head} with runtime.projections={chosen} runs Triton GEMVs, and backend=torch runs torch ops: "
                   "use backend=auto or triton (CUDA, or the CPU under TRITON_INTERPRET=1) or runtime.projections=torch")
    if getattr(task, "temperature", 0.0) != 0.0:
        out.append(f"{head} decodes greedily (the step writes its argmax token): set task.temperature=0 "
                   f"(got {task.temperature})")
    if callable(getattr(task, "evaluate", None)):  # scored tasks: prr/runtime/graph_pipeline.py
        out += scoring_problems(runtime, predictor, budget)
    else:
        out += budget.engine_problems(predictor.speculates, "decode", runtime.tensor_parallel)
    rows = runtime.row_tokens
    prompt_tokens = getattr(task, "prompt_tokens", None)
    if rows and (prompt_tokens is None or max(rows) > prompt_tokens):
        out.append(f"runtime.row_tokens={rows}: a row holds at most the prompt's task.prompt_tokens="
                   f"{prompt_tokens} tokens; lower it or raise task.prompt_tokens")
    tp = runtime.tensor_parallel
    if tp > 1:
        from prr.model.tensor_parallel import TensorParallel

        out += [f"runtime.tensor_parallel={tp}: {p}" for p in TensorParallel(0, tp).problems(model)]
        if runtime.projections == "fused":
            out.append(f"runtime.tensor_parallel={tp} runs the torch projections (the fused GEMVs cannot all-reduce): "
                       "use runtime.projections=torch or auto")
    return out


def scoring_problems(settings: Any, predictor: Any, budget: Any) -> list[str]:
    """Why scored tasks cannot run on runtime.engine=graph with these objects (empty: they can)."""
    head = "runtime.engine=graph with a scored task"
    out = budget.engine_problems(predictor.speculates, "scoring", settings.tensor_parallel)
    if predictor.replays_selections:
        out.append(f"{head}: predictor={type(predictor).__name__} replays a recorded serial pass (a decode "
                   "benchmark tool); use another predictor")
    if settings.row_tokens:
        out.append(f"{head}: runtime.row_tokens={list(settings.row_tokens)}: each request's prompt sets its "
                   "row's length; leave runtime.row_tokens unset")
    if settings.tensor_parallel != 1:
        out.append(f"{head}: runtime.tensor_parallel={settings.tensor_parallel}: not yet; use runtime.tensor_parallel=1")
    return out


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


class GraphDecode:
    """The run driver's strategy for `runtime.engine=graph`: prefill through the research
    runtime (`EagerRuntime`, dense over the prompt; a ragged batch row by row), then windows of
    engine steps, CUDA-graph replays on a GPU; the summary from the device counters."""

    progress_label = "decode (graph)"

    def __init__(self, cfg: DictConfig, inputs: Any, tp: Any) -> None:
        self.cfg, self.inputs, self.tp = cfg, inputs, tp
        r, settings = inputs, inputs.settings
        selector, predictor, budget = r.selector, r.predictor, r.budget
        decoder = r.model.decoder  # the whole model, or this rank's shard (tensor parallelism)
        if tp is not None:
            from prr.model.tensor_parallel import shard_decoder

            decoder = shard_decoder(decoder, tp)
            r.model.decoder = decoder  # the whole model is freed: a rank keeps its shard only
            if r.device.type == "cuda":
                torch.cuda.empty_cache()
        self.decoder = decoder
        self.prompt_len = prompt_len = r.input_ids.shape[1]
        self.capacity = capacity = prompt_len + r.task.max_new_tokens + 1
        # Tokens of the prompt each row holds: all of it, or a ragged batch's last row_tokens[b].
        self.row_tokens = row_tokens = settings.row_tokens or [prompt_len] * settings.batch_size
        if max(row_tokens) > prompt_len:  # (graph_problems refuses rows above task.prompt_tokens before any work)
            raise ValueError(f"runtime.row_tokens={settings.row_tokens}: a row cannot hold more than the prompt's "
                             f"{prompt_len} tokens")
        self.max_blocks = -(-capacity // settings.block_size)
        # |P| decided at the first decode step's context (the longest row + 1 tokens), static for the
        # decode; before the prefill (a profile's engines and the run's are never in memory at once).
        context = (max(row_tokens) + settings.block_size) // settings.block_size
        self.pipeline = GraphPipeline(settings, decoder, selector, predictor, budget, instantiate(cfg.backend),
                                      rows=settings.batch_size, capacity=capacity, dtype=r.dtype, purpose="decode",
                                      context=context, tp=tp, reuse=r.reuse)
        self.window = self.pipeline.window

    def prefill(self) -> Tensor:
        """The research runtime's prefill into the pipeline's paged cache (its K/V, the selector's
        metadata and the warmed predictor state are what the engine decodes from; a ragged batch
        row by row), then the engine, its views and (on a GPU) their captures."""
        r, p = self.inputs, self.pipeline
        t0 = time.perf_counter()
        if r.settings.row_tokens is None:
            logits = p.prefill(r.input_ids)  # [B, V]
        else:
            logits = p.prefill([r.input_ids[b : b + 1, self.prompt_len - n :] for b, n in enumerate(self.row_tokens)])
        self.prefill_s = time.perf_counter() - t0
        log.info("prompt: %s (%d tokens); engine=graph, %s", r.prompt.description, self.prompt_len, p.plan)
        if len(p.variants) > 1:
            log.info("engine=graph budget=%s: %s (|P| = %d blocks) chosen per window of %d steps",
                     type(r.budget).__name__, " or ".join(p.variants), p.plan.predicted_blocks, self.window)
        return logits.argmax(-1)  # [B] greedy

    def decode(self, n: int) -> Window:
        """n steps of the variant the budget chooses for this window (the pipeline's `steps`)."""
        rows = self.pipeline.steps(None, n)
        return Window(torch.tensor([row.chosen for row in rows]), rows[0].wall_s, [0.0] * n,
                      self.pipeline.log.ran[-n:])

    def results(self, token_ids: Tensor) -> Results:
        """Hit rate and precision over PRR steps; overlap and the dense-reference metrics over every step."""
        import pandas as pd  # here: config validation imports this module for graph_problems

        from prr.runtime.probe import device_name

        r, settings, p = self.inputs, self.inputs.settings, self.pipeline
        plan, engine = p.plan, p.engine
        sparse = [i for i, s in enumerate(engine.sparse) if s]
        steps = token_ids.shape[1]
        latencies, ran = p.log.latencies[:steps], p.log.ran[:steps]
        totals, names = p.log.totals, engine.COUNTERS
        if self.tp is not None:  # each rank counted its own KV heads: the run's counts are their sums
            for variant in totals:
                totals[variant] = self.tp.sum_on_host(totals[variant])
        selected, predicted, hits = (totals["prr"][names.index(n)] for n in ("selected", "predicted", "hits"))
        both = dict(zip(names, totals["prr"] + totals["serial"], strict=True))  # over every step

        def ratio(num: torch.Tensor, den: torch.Tensor) -> float | None:
            return float(num.sum() / den.sum()) if den.sum() > 0 else None

        layers = pd.DataFrame({"layer": sparse,
                               "hit_rate": [ratio(hits[i], selected[i]) for i in sparse],
                               "last_step_overlap": [ratio(both["overlap"][i], both["selected"][i]) for i in sparse],
                               "mass_recall": [ratio(both["mass_recall"][i], both["measured"][i]) for i in sparse],
                               "output_relerr": [ratio(both["output_relerr"][i], both["measured"][i])
                                                 for i in sparse]})
        command = "python " + " ".join(sys.argv)  # provenance travels with copies of either file
        total_selected = float(selected[sparse].sum())  # over PRR steps
        switches = len(p.variants) > 1
        if switches:
            p.budget_info.update(steps_prr=ran.count("prr"), steps_serial=ran.count("serial"))
        median_ms = 1e3 * statistics.median(latencies)
        summary = dict(
            # how this file was produced (results copied elsewhere keep their provenance)
            provenance={"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "torch": torch.__version__, "engine": "graph", "tensor_parallel": settings.tensor_parallel,
                        "kv_heads_per_rank": self.decoder.config.num_kv_heads,  # (the shard's: the model's / tp)
                        # triton kernels, or static-shape torch ops (a CPU without TRITON_INTERPRET)
                        "engine_ops": engine.backend},
            mode=plan.mode, repair_mode=plan.repair_mode,
            ops={"projections": plan.projections,
                 "variant": "adaptive" if switches else plan.variant},  # switching: per step in tokens.jsonl
            device=device_name(r.device), prompt_tokens=self.prompt_len,
            rows={"row_tokens": self.row_tokens},  # tokens of the prompt each row holds (a ragged batch's differ)
            block_size=plan.block_size, topk_blocks=graph_topk(r.selector, self.max_blocks),
            sizes={"predicted_blocks": plan.predicted_blocks}, timing={"prefill_s": self.prefill_s},
            budget_setup=p.budget_info,
            results={
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
                "dense_metrics_every": p.every,
                "generated_token_ids": token_ids.tolist(),
            })
        return Results(summary, layers, pd.DataFrame(), layers.assign(command=command))
