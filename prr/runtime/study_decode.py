"""The studies' decode on the graph engine (`--engine graph` of experiments/locality_study.py and
predictor_study.py): one request of a fixed number of steps through `GraphDecoder` with the study
counters on (`StaticPlan.study_counters`, `StepObservers.study_counters`), read back once.

The request starts where the research runtime's prefill left it (`EagerRuntime` after `prefill`
or `replay_prefill`, and `finish_prefill`): its cache, selector metadata and warmed predictor
state, its last prompt-tail selections (the first step's A_{t-1}). The engine decodes on as
`GraphDecode` does (prime P, then steps; on CUDA each step a graph replay), with the host
choosing per step between the view that measures against dense attention and the one that does
not (every `dense_metrics_every`-th step; every step in shadow mode), so no step syncs. A given
trajectory is followed by teacher forcing (`GraphDecoder.forced_tokens`), and the model's argmax
at each step is kept on the device to count disagreements.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from prr.runtime.eager_run import EagerRuntime
from prr.runtime.graph_run import engine_backend
from prr.runtime.graph_session import GraphSession, graph_plan


@dataclass
class StudyDecode:
    counters: dict[str, Tensor]  # StepObservers.study_counters: name -> [L, Hkv] fp64, summed over steps and rows
    tokens: list[int]  # the input token of each decode step (the trajectory followed)
    disagreements: int  # steps whose followed token is not the model's argmax there
    plan: Any  # the StaticPlan the engine ran (predicted_blocks: the engine's own |P|)


def graph_study_decode(runtime: EagerRuntime, last_logits: Tensor, steps: int, ratios: tuple[float, ...],
                       tokens: list[int] | None = None) -> StudyDecode:
    """`steps` decode steps of one prompt (batch 1) through the graph engine with the study counters
    at |P| = ratio × K for each of `ratios`, after `runtime`'s prefill and `finish_prefill`.
    last_logits: [1, V] the prefill's logits at the last prompt position; tokens: the trajectory to
    follow (the input token of each step, >= steps of them; None: greedy). The runtime's selector,
    predictor, budget (fixed |P|: a captured graph's is static), mode, repair mode and
    dense_metrics_every decide the engine's plan; its cache is decoded into in place."""
    backend = runtime.backend  # DSABackend: the prefill's state and options
    selector, predictor, budget = backend.selector, backend.predictor, backend.budget
    problems = budget.engine_problems(predictor.speculates, "study")
    if problems:
        raise ValueError("; ".join(problems))
    cache = runtime.cache
    if cache.batch != 1 or last_logits.shape[0] != 1:
        raise ValueError(f"the study decode runs one prompt (batch 1); the cache holds {cache.batch} rows")
    prompt_len = cache.length(0)
    if prompt_len + steps > cache.max_tokens:
        raise ValueError(f"{steps} steps after {prompt_len} prompt tokens exceed the cache's {cache.max_tokens}")
    if tokens is not None and len(tokens) < steps:
        raise ValueError(f"need a token for each of {steps} steps; got {len(tokens)}")
    # graph_plan reads the run's mode, repair mode and block size: this runtime's own
    options = SimpleNamespace(mode=backend.mode, repair_mode=backend.repair_mode, block_size=cache.block_size)
    plan = dataclasses.replace(graph_plan(options, selector, predictor, budget, cache.max_blocks), count_hits=True,
                               study_counters=True, study_ratios=tuple(ratios))
    session = GraphSession(runtime.decoder, plan, 1, cache, selector=selector, predictor=predictor,
                           backend=engine_backend(str(runtime.device), runtime.backend_name, "triton"),  # kernels on a GPU, as backend=auto
                           scores=True)
    first = tokens[0] if tokens is not None else int(last_logits[0].argmax())
    disagreements = int(first != int(last_logits[0].argmax()))
    if tokens is not None:
        session.forcing()  # (before the capture: the step reads the table it was captured with)
    session.take_over(backend, [prompt_len], torch.tensor([first], device=session.device))
    if tokens is not None:  # step t feeds tokens[t + 1] to the next (the last step: its greedy token)
        session.force([list(tokens[1:steps])], steps - 1)
    every = 1 if plan.mode == "shadow" else backend.dense_metrics_every
    session.capture({m: {"measure_dense": m} for m in ((True,) if every == 1 else (True, False))})
    session.run([step % every == 0 for step in range(steps)])
    out = session.read()  # the token each step chose (forced or greedy) and whether it was the argmax
    with torch.inference_mode():
        counters = session.engine.study_counters()
    followed = [first, *out["tokens"][0][: steps - 1]]
    disagreements += sum(not g for g in out["greedy"][0][: steps - 1])
    return StudyDecode(counters, followed, disagreements, plan)


SUMS = ("mass_recall", "output_relerr")  # the study counters that are float sums; the others count


def layer_head_rows(counters: dict[str, Tensor], layers: list[int]) -> list[dict[str, Any]]:
    """Study counters -> one row per (layer, KV head) of `layers` (the sparse ones), each value
    the sum over the decode's steps (`steps` and `measured` say over how many): counts as ints,
    mass recall and output error as floats."""
    heads = next(iter(counters.values())).shape[-1]
    return [{"layer": layer, "kv_head": h,
             **{name: float(v[layer, h]) if name in SUMS else int(v[layer, h]) for name, v in counters.items()}}
            for layer in layers for h in range(heads)]
