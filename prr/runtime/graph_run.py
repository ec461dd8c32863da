"""`runtime.engine=graph`: a run.py decode through the CUDA-graph engine (graph_decode.py).
(Scored tasks' requests on the same engine: graph_requests.py.)

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

import dataclasses
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

from prr.runtime.graph_decode import StaticPlan
from prr.runtime.run_strategy import Results, Window
from prr.runtime.timing import timed_steps

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
    if callable(getattr(task, "evaluate", None)):  # scored tasks: prr/runtime/graph_requests.py
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


def engine_backend(device: str, backend: str, graph_on_gpu: str | None = None) -> str:
    """The engine's ops: `backend` (backend.name: backend=torch runs torch ops on a GPU too), or
    on a GPU `graph_on_gpu` where the backend group names one (backend=auto: triton)."""
    return graph_on_gpu if graph_on_gpu is not None and str(device).startswith("cuda") else backend


def graph_topk(selector: Any, max_blocks: int) -> int:
    """The run's top-K on the engine, in blocks: the selector's, at most the cache's `max_blocks`
    (what the budgets size |P| from and the summary records)."""
    return min(selector.topk_blocks, max_blocks)


def graph_plan(settings: Any, selector: Any, predictor: Any, budget: Any, max_blocks: int) -> StaticPlan:
    """The engine's plan for this run's objects: serial DSA for a predictor that never
    speculates, else PRR with a static |P| (every block for `dense`; the budget's size before
    anything is measured, `engine_blocks`; the oracle's P is sized by the engine).
    The objects themselves go to the engine (GraphDecoder's selector= / predictor=)."""
    k = graph_topk(selector, max_blocks)
    if not predictor.speculates:
        size = 0
    elif selector.selects_every_block:
        size = max_blocks
    elif not predictor.uses_budget:
        size = k
    else:
        size = budget.engine_blocks(k, max_blocks)
    return StaticPlan(variant="prr" if predictor.speculates else "serial", predicted_blocks=size,
                      repair_mode=settings.repair_mode, mode=settings.mode, block_size=settings.block_size)


def resolved_plan(plan: StaticPlan, budget: Any, predictor: Any, decoder: Any, batch: int, capacity: int,
                  selector: Any, backend: str, context: int) -> tuple[StaticPlan, dict[str, Any]]:
    """The budget's |P| for the decode (`resolve_engine_blocks`, at `context` blocks; a budget that
    measures times the engine's own stages, GraphProbe) -> (the plan with it, serial DSA for
    |P| = 0; what the budget decided). A plan that does not speculate, or a predictor that sizes
    its own P, is kept as it is."""
    if plan.variant != "prr" or not predictor.uses_budget:
        return plan, {}
    from prr.runtime.graph_budget import GraphProbe
    from prr.runtime.graph_decode import GraphDecoder

    max_blocks = -(-capacity // plan.block_size)
    k = graph_topk(selector, max_blocks)

    def make_probe() -> GraphProbe:
        return GraphProbe(lambda n: GraphDecoder(decoder, dataclasses.replace(plan, predicted_blocks=n), batch,
                                                 capacity, selector=selector, predictor=None, backend=backend),
                          first_size=k)

    size, info = budget.resolve_engine_blocks(make_probe, plan.predicted_blocks, k, max_blocks, context)
    if size == plan.predicted_blocks:
        return plan, info
    plan = dataclasses.replace(plan, variant="prr" if size else "serial", predicted_blocks=size)
    return plan, {**info, "choice": plan.variant, "predicted_blocks": size}


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
        self.max_blocks = max_blocks = -(-capacity // settings.block_size)
        plan = graph_plan(settings, selector, predictor, budget, max_blocks)
        ops = instantiate(cfg.backend)
        self.ops = ops.name  # the prefill's ops; the engine's: engine_backend
        self.ops_backend = engine_backend(settings.device, ops.name, ops.graph_on_gpu)
        self.budget_info: dict[str, Any] = {"policy": type(budget).__name__, "predicted_blocks": plan.predicted_blocks}
        # |P| decided at the first decode step's context (the longest row + 1 tokens), static for the
        # decode; before the prefill (a profile's engines and the run's are never in memory at once).
        context = (max(row_tokens) + settings.block_size) // settings.block_size
        plan, info = resolved_plan(plan, budget, predictor, decoder, settings.batch_size, capacity, selector,
                                   self.ops_backend, context)
        self.budget_info.update(info)
        self.plan = plan
        self.variants = budget.engine_variants(plan.variant)  # the views captured (one per variant)
        # Steps run back to back; the host looks at tokens (EOS) every window of steps, and on a
        # GPU each step's time is its replay's device time (CUDA events): no host sync per token.
        self.window = budget.window_steps_or(16 if r.device.type == "cuda" else 1)

    def prefill(self) -> Tensor:
        """The research runtime's prefill into a paged cache (its K/V, the selector's metadata and
        the warmed predictor state are what the engine decodes from), then the engine, its views
        and (on a GPU) their captures."""
        from prr.runtime.eager_run import EagerRuntime
        from prr.runtime.graph_decode import GraphDecoder

        r, settings, tp = self.inputs, self.inputs.settings, self.tp
        selector, predictor, budget, decoder = r.selector, r.predictor, r.budget, self.decoder
        row_tokens, prompt_len, plan = self.row_tokens, self.prompt_len, self.plan
        mc = decoder.config
        # A ragged batch prefills its rows one by one, each into its row of the cache
        # (`PagedKVCache.row`: its own length and metadata), then calibrates and warms the predictor
        # on every row's prefill tail at once, as a uniform batch does.
        selector.set_backend(self.ops)
        eager = EagerRuntime(decoder, settings, selector, predictor, budget, self.ops, self.capacity, r.dtype,
                             mode="sparse", dense_metrics_every=1, check_serial=False)
        cache = eager.cache
        with torch.inference_mode():
            t0 = time.perf_counter()
            if settings.row_tokens is None:
                logits = eager.prefill(r.input_ids)  # [B, V]
                history = None
            else:
                row_logits, history = eager.prefill_rows([r.input_ids[b : b + 1, prompt_len - n :]
                                                          for b, n in enumerate(row_tokens)])
                logits = torch.cat(row_logits)  # [B, V]
            calibrate_on = None
            if tp is not None:  # calibration fits every rank's heads (all ranks choose alike, as one process would)
                own = history if history is not None else eager.backend.history
                calibrate_on = [None if h is None else [tp.gather_heads(s) for s in h] for h in own]
            calibration = eager.finish_prefill(history, calibrate_on)  # calibrates and warms the predictor
            self.prefill_s = time.perf_counter() - t0
        if calibration:
            self.budget_info["calibration"] = calibration

        speculating = plan.variant == "prr"
        plan = self.plan = dataclasses.replace(plan, projections=settings.graph_projections())
        device = r.device
        engine = self.engine = GraphDecoder(decoder, plan, settings.batch_size, self.capacity,
                                            compile=device.type == "cuda" and tp is None, selector=selector,
                                            predictor=predictor if speculating else None, cache=cache,
                                            backend=self.ops_backend, reuse=r.reuse)
        first = logits.argmax(-1)  # [B] greedy
        engine.take_over(row_tokens, first, eager.backend.predictor_state if speculating else None,
                         eager.backend.previous)
        del eager
        log.info("prompt: %s (%d tokens); engine=graph, %s", r.prompt.description, prompt_len, plan)

        if len(self.variants) > 1:
            log.info("engine=graph budget=%s: %s (|P| = %d blocks) chosen per window of %d steps", type(budget).__name__,
                     " or ".join(self.variants), plan.predicted_blocks, self.window)
        steps = r.task.max_new_tokens
        self.outputs = outputs = torch.zeros(settings.batch_size, steps + 2, dtype=torch.long, device=device)

        # One view of the engine per variant this run can take (a budget that switches: both, over the
        # same cache).
        # Steps that also measure against dense attention (runtime.dense_metrics_every; shadow mode
        # measures every step) are a second view of each variant. Every view counts |A|, |P|, hits
        # and last-step overlap on the device (a few small reductions per sparse layer), read once
        # per window.
        variants = self.variants
        self.every = 1 if plan.mode == "shadow" else settings.dense_metrics_every
        measures = (True,) if self.every == 1 else (True, False)

        def stepper(view: GraphDecoder):
            def run() -> None:  # one decode step of this view; its greedy token lands in outputs[:, step index]
                view.step(advance=True)
                outputs.index_copy_(1, (view.pos[:1] - row_tokens[0] - 1).long(), view.token)
            return run

        # (serial windows between PRR ones keep the predictor learning, as the eager runtime's serial steps do)
        switches = len(variants) > 1
        self.replays = {(variant, m): stepper(engine.with_plan(variant=variant, measure_dense=m, count_hits=True,
                                                               learn_in_serial=switches))
                        for variant in variants for m in measures}
        self.replays = engine.capture_all(self.replays)  # (CUDA: one graph each, rewound to the prompt's end)
        self.latencies: list[float] = []
        self.ran: list[str] = []  # the variant of each step
        self.sparse = [i for i in range(mc.num_layers) if engine.sparse[i]]
        # Hit counters summed over PRR steps only (serial steps count |A|, no hits).
        self.totals = {v: torch.zeros(len(engine.COUNTERS), mc.num_layers, dtype=torch.float64)
                       for v in ("serial", "prr")}
        self.done = 0
        return first

    def decode(self, n: int) -> Window:
        """n steps of the variant the budget chooses for this window, then the window's counters;
        the budget learns from its median step time and hit rate (`end_window`)."""
        engine, names, done, budget = self.engine, self.engine.COUNTERS, self.done, self.inputs.budget
        variant = budget.window_variant(self.plan.variant)
        window_replays = [self.replays[variant, (done + i) % self.every == 0] for i in range(n)]
        # copies: on the CPU .cpu() would alias the counters the steps add to in place
        before = torch.tensor([engine.counters()[c] for c in names], dtype=torch.float64)
        latencies = timed_steps(window_replays, self.inputs.device)
        self.done += n
        self.latencies += latencies
        self.ran += [variant] * n
        window = torch.tensor([engine.counters()[c] for c in names], dtype=torch.float64) - before
        self.totals[variant] += window
        window_hit = None
        if variant == "prr":
            d_hits, d_sel = window[names.index("hits"), self.sparse].sum(), window[names.index("selected"), self.sparse].sum()
            window_hit = float(d_hits / d_sel) if d_sel > 0 else None
        budget.end_window(variant, statistics.median(latencies), window_hit)
        return Window(self.outputs[:, done : done + n].cpu(), latencies, [0.0] * n, [variant] * n)

    def results(self, token_ids: Tensor) -> Results:
        """Hit rate and precision over PRR steps; overlap and the dense-reference metrics over every step."""
        import pandas as pd  # here: config validation imports this module for graph_problems

        from prr.runtime.probe import device_name

        r, settings, plan, engine, sparse = self.inputs, self.inputs.settings, self.plan, self.engine, self.sparse
        steps = token_ids.shape[1]
        latencies, ran = self.latencies[:steps], self.ran[:steps]
        totals, names = self.totals, engine.COUNTERS
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
        switches = len(self.variants) > 1
        if switches:
            self.budget_info.update(steps_prr=ran.count("prr"), steps_serial=ran.count("serial"))
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
            budget_setup=self.budget_info,
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
                "dense_metrics_every": self.every,
                "generated_token_ids": token_ids.tolist(),
            })
        return Results(summary, layers, pd.DataFrame(), layers.assign(command=command))
