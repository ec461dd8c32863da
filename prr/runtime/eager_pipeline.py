"""The research runtime's pipeline for scored requests (`runtime.engine=eager`): prefill ->
steps, behind the same interface as the graph engine's (prr/runtime/graph_pipeline.py), so
`prr.evaluation.Engine` drives either.

A fresh `EagerRuntime` per request (its own cache, selector and predictor: samples never share
state), one request at a time, one step per host look, per-(step, layer, row, KV head) records.
"""

from __future__ import annotations

from typing import Any

import torch
from hydra.utils import instantiate
from torch import Tensor

from prr.runtime.eager_run import EagerRuntime, eager_budget_setup
from prr.runtime.run_strategy import Steps, topk_label


class EagerPipeline:
    """Scored requests on the research runtime (see the module docstring)."""

    label = "eager"
    window = 1
    rows = 1  # requests decoded together

    def __init__(self, cfg: Any, model: Any, settings: Any, budget: Any, ops: Any, max_tokens: int,
                 dtype: torch.dtype) -> None:
        """cfg: the run's config (its selector and predictor groups, instantiated per request);
        settings: the runtime group; ops: the backend group; max_tokens: the longest request."""
        if settings.batch_size != 1:
            raise ValueError(f"runtime.batch_size={settings.batch_size}: the research runtime decodes one "
                             "request at a time; use runtime.batch_size=1 (or runtime.engine=graph)")
        self.cfg, self.model, self.settings, self.budget, self.ops, self.dtype = cfg, model, settings, budget, ops, dtype
        selector = self.new_selector()
        self.selection_backend = selector.set_backend(ops.name)
        self.budget_info, self.device_name = eager_budget_setup(budget, selector, settings, model.decoder, max_tokens,
                                                                dtype, ops.name)
        self.topk_blocks = topk_label(selector)
        self.runtime: EagerRuntime | None = None
        self.position = 0  # the position of the token the next step reads

    def new_selector(self) -> Any:
        selector = instantiate(self.cfg.selector)
        selector.bind_model(self.model.config)
        return selector

    def prefill(self, prompts: list[Tensor], kept: list[Any] | None = None,
                new_tokens: int = 0) -> Tensor | list[Tensor | None]:
        """One request's prompt [1, T] through a fresh runtime of T + new_tokens tokens (kept[0]: a
        kept dense prefill's q/k/v replayed instead), the predictor calibrated and warmed on its
        tail -> logits [1, V] at its last position ([None] where a kept prefill was replayed: the
        caller has them)."""
        if len(prompts) != 1:
            raise ValueError(f"the research runtime prefills one request at a time, got {len(prompts)}")
        selector = self.new_selector()
        selector.set_backend(self.ops.name)
        ids = prompts[0]
        self.runtime = runtime = EagerRuntime(self.model.decoder, self.settings, selector, instantiate(self.cfg.predictor),
                                              self.budget, self.ops.name, ids.shape[1] + new_tokens, self.dtype)
        with torch.inference_mode():
            if kept is None or kept[0] is None:
                logits = runtime.prefill(ids, last_logits_only=True)  # [1, V]
            else:
                runtime.replay_prefill(kept[0])  # same q/k/v: selector metadata and tail rebuilt
                logits = [None]
            runtime.finish_prefill()
        self.position = ids.shape[1]
        return logits

    def steps(self, first: list[int], n: int, forced: list[list[int]] | None = None, step: int = 0) -> list[Steps]:
        """n steps of the request: step 0 reads first[0], step i > 0 the token step i - 1 chose
        (forced[0][i - 1], or its greedy token); `step`: the first one's index (records)."""
        out, token = Steps(records=[]), first[0]
        for i in range(n):
            with torch.inference_mode():
                logits, records, wall, measure_s = self.runtime.step(torch.tensor([token]), self.position, step + i)
                row = logits[0].float()  # [V]
                top2 = row.topk(2).values
                best = int(row.argmax())
                chosen = forced[0][i] if forced is not None else best
                out.logprobs.append(float(torch.log_softmax(row, -1)[chosen]))
            out.read.append(token)
            out.chosen.append(chosen)
            out.greedy.append(best == chosen)
            out.margins.append(float(top2[0] - top2[1]))
            out.wall_s.append(wall)
            out.measure_s.append(measure_s)
            out.records.append(records)
            self.position += 1
            token = chosen
        return [out]

    def end(self) -> None:
        self.runtime = None

    def results(self) -> dict[str, Any]:
        return {"engine": "eager"}  # (hit rates and timings: from the step records)
