"""The run's pipeline for scored requests, chosen by runtime.engine: `build_pipeline`.

Both pipelines offer `prefill(prompts, kept, new_tokens) -> logits`, `steps(first, n, forced)
-> [Steps per row]`, `end()` (a batch done), `results()` and `rows`, `window`, `label`,
`selection_backend`, `budget_info`, `device_name`, `topk_blocks`:
- `EagerPipeline` (eager_pipeline.py): the research runtime, one request at a time, per-head records;
- `GraphPipeline` (graph_pipeline.py, purpose "scoring"): the CUDA-graph engine, batches of
  runtime.batch_size requests in ragged rows. run.py's graph decode (`GraphDecode`) runs the same
  class with purpose "decode".
"""

from __future__ import annotations

from typing import Any

import torch
from hydra.utils import instantiate

from prr.runtime.eager_pipeline import EagerPipeline
from prr.runtime.graph_pipeline import GraphPipeline

ENGINES = ("eager", "graph")


def build_pipeline(cfg: Any, model: Any, settings: Any, budget: Any, ops: Any, max_tokens: int,
                   dtype: torch.dtype, reuse: Any = None) -> EagerPipeline | GraphPipeline:
    """Scored requests' pipeline for this config: settings (the runtime group), budget and ops (the
    backend group) instantiated once by the caller; max_tokens: the longest request; reuse: the
    run's selection reuse (prr.reuse; None: none), as run.py's decode takes it."""
    engine = settings.engine
    if engine == "eager":
        return EagerPipeline(cfg, model, settings, budget, ops, max_tokens, dtype, reuse=reuse)
    if engine != "graph":
        raise ValueError(f"runtime.engine={engine!r} is not one of {list(ENGINES)}")
    from prr.runtime.graph_run import scoring_problems

    selector = instantiate(cfg.selector)
    selector.bind_model(model.config)
    predictor = instantiate(cfg.predictor)
    problems = scoring_problems(settings, predictor, budget)
    if problems:
        raise ValueError("; ".join(problems))
    return GraphPipeline(settings, model.decoder, selector, predictor, budget, ops, rows=settings.batch_size,
                         capacity=max_tokens, dtype=dtype, purpose="scoring", reuse=reuse)
