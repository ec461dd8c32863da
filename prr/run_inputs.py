"""What a run builds from its config before any decoding: the seed, the config groups'
objects, the model and the prompt (shared by the run driver's eager and graph decodes, so
neither imports the other for it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RunInputs:
    """What a decode run builds from its config before any decoding."""

    settings: Any
    task: Any
    selector: Any
    predictor: Any
    budget: Any
    device: torch.device
    dtype: torch.dtype
    model: Any
    load_s: float
    prompt: Any
    input_ids: torch.Tensor  # [B, T_prompt] on the device
    reuse: Any = None  # the reuse group's prr.reuse object (None: none)


def build_run(cfg: DictConfig) -> RunInputs:
    """Seed, instantiate the config groups, load the model, build the prompt (shared by
    the run driver's strategies, prr.runtime.eager_run and prr.runtime.graph_run)."""
    torch.manual_seed(cfg.seed)
    settings = instantiate(cfg.runtime)
    task = instantiate(cfg.task)
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]
    t0 = time.perf_counter()
    model = instantiate(cfg.model).load(settings.dtype, settings.device)
    load_s = time.perf_counter() - t0
    prompt = task.build(model.tokenizer, model.config.vocab_size, settings.batch_size)
    selector = instantiate(cfg.selector)
    selector.bind_model(model.config)  # (InfLLM: the RoPE its scoring undoes)
    reuse = instantiate(cfg.reuse) if "reuse" in cfg else None
    return RunInputs(settings, task, selector, instantiate(cfg.predictor), instantiate(cfg.budget),
                     device, dtype, model, load_s, prompt, prompt.input_ids.to(device), reuse)
