"""run.py's decode on the research runtime (`runtime.engine=eager`): the run driver's strategy
over the eager pipeline (prr/runtime/eager_pipeline.py) with the run's own selector and
predictor, one step per host look, sampling, steps.jsonl per step."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import Tensor

from prr.metrics import per_layer, summarize
from prr.progress import progress_bar
from prr.run_records import step_rows
from prr.runtime.eager_pipeline import EagerPipeline
from prr.runtime.eager_run import next_token
from prr.runtime.run_strategy import Results, Window, topk_label
from prr.sinks import JsonlWriter, read_jsonl

log = logging.getLogger("prr")


class EagerDecode:
    """The run driver's strategy for `runtime.engine=eager`: the eager pipeline with the run's
    objects, one step per host look, sampling (task.temperature, top_p), steps.jsonl per step;
    the summary from the records."""

    progress_label = "decode"
    window = 1

    def __init__(self, cfg: DictConfig, inputs: Any, run_dir: Path) -> None:
        self.cfg, self.inputs, self.run_dir = cfg, inputs, run_dir
        r = inputs
        self.prompt_len = r.input_ids.shape[1]
        ops = instantiate(cfg.backend)
        self.ops = ops.name
        self.pipeline = EagerPipeline(cfg, r.model, r.settings, r.budget, ops, self.prompt_len + r.task.max_new_tokens,
                                      r.dtype, selector=r.selector, predictor=r.predictor, reuse=r.reuse)
        log.info("prompt: %s (%d tokens); model %s loaded in %.1f s", r.prompt.description, self.prompt_len,
                 r.model.name, r.load_s)
        self.steps_out = JsonlWriter(run_dir / "records" / "steps.jsonl")
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.step = 0

    def _choose(self, logits: Tensor) -> Tensor:
        return next_token(logits, self.inputs.task.temperature, self.inputs.task.top_p, self.generator)

    def prefill(self) -> Tensor:
        r = self.inputs
        t0 = time.perf_counter()
        with progress_bar(r.model.config.num_layers, f"prefill ({self.prompt_len} tokens)", "layer") as bar:
            logits = self.pipeline.prefill(r.input_ids, new_tokens=r.task.max_new_tokens, progress=bar)  # [B, V]
        self.prefill_s = time.perf_counter() - t0
        with torch.inference_mode():
            self.token = self._choose(logits)
        return self.token

    def decode(self, n: int) -> Window:
        if n != 1:
            raise ValueError(f"the eager runtime looks at every step's token: windows of 1 step, not {n}")
        rows = self.pipeline.steps(self.token.tolist(), 1, step=self.step, choose=self._choose)
        self.steps_out.write(step_rows(rows[0].records[0]))
        self.token = torch.tensor([row.chosen[0] for row in rows])
        self.step += 1
        return Window(self.token.view(-1, 1), rows[0].wall_s, rows[0].measure_s)

    def results(self, token_ids: Tensor) -> Results:
        self.steps_out.close()
        r, settings, p = self.inputs, self.inputs.settings, self.pipeline
        steps = read_jsonl(self.run_dir / "records" / "steps.jsonl")
        tokens = read_jsonl(self.run_dir / "records" / "tokens.jsonl")
        summary = dict(mode=settings.mode, repair_mode=settings.repair_mode,
                       ops={"backend": self.ops, "selection_backend": p.selection_backend},
                       device=p.device_name, prompt_tokens=self.prompt_len, block_size=settings.block_size,
                       topk_blocks=topk_label(r.selector),
                       timing={"prefill_s": self.prefill_s, "calibration": p.calibration},
                       budget_setup=p.budget_info,
                       results={"generated_token_ids": token_ids.tolist(), **summarize(steps, tokens)})
        return Results(summary, per_layer(steps), steps)
