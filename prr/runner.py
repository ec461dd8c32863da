"""One run: validate, load, prefill, decode through the DSA/PRR backend, write records.

Run directory layout (Hydra's run dir):
  config.yaml              resolved config
  summary.json             run-level numbers; status running -> complete | failed
  records/steps.jsonl      one row per (decode step, layer, batch row, KV head), flushed per step
  records/tokens.jsonl     one row per decode step: token, latency
  layers.csv               per-layer aggregates
  generation.txt           the prompt's description and the generated text
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from prr.cache import PagedKVCache
from prr.config_check import validate
from prr.metrics import layer_step_rows, per_layer, summarize
from prr.paths import write_json_atomic, write_text_atomic
from prr.runtime.dsa_backend import DSABackend
from prr.runtime.probe import StageProbe
from prr.selectors.dense import DenseSelector
from prr.sinks import JsonlWriter
from prr.summary_table import format_summary

log = logging.getLogger("prr")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """logits: [B, V] -> token ids [B]; greedy when temperature == 0."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest set reaching top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator).to(order.device)
    return order.gather(-1, choice).squeeze(-1)


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    validate(cfg)  # every problem at once, before anything loads
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    write_json_atomic(run_dir / "summary.json", {"status": "running"})
    logger = instantiate(cfg.logger)
    logger.start(run_dir, OmegaConf.to_container(cfg, resolve=True), name=run_name(cfg))
    ok = False
    try:
        summary = decode_run(cfg, run_dir, logger)
        ok = True
        return summary
    except BaseException as err:
        write_json_atomic(run_dir / "summary.json", {"status": "failed", "error": f"{type(err).__name__}: {err}"})
        raise
    finally:
        logger.finish(ok)


def run_name(cfg: DictConfig) -> str:
    return "-".join(OmegaConf.select(cfg, f"{g}._target_").rsplit(".", 1)[-1] for g in ("selector", "predictor", "budget"))


def decode_run(cfg: DictConfig, run_dir: Path, logger: Any) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    settings = instantiate(cfg.runtime)
    task = instantiate(cfg.task)
    selector = instantiate(cfg.selector)
    predictor = instantiate(cfg.predictor)
    budget = instantiate(cfg.budget)
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]

    t0 = time.perf_counter()
    model = instantiate(cfg.model).load(settings.dtype, settings.device)
    load_s = time.perf_counter() - t0
    mc = model.config
    prompt = task.build(model.tokenizer, mc.vocab_size, settings.batch_size)
    input_ids = prompt.input_ids.to(device)
    prompt_len = input_ids.shape[1]
    cache = PagedKVCache(mc.num_layers, settings.batch_size, mc.num_kv_heads, mc.head_dim, settings.block_size,
                         prompt_len + task.max_new_tokens, dtype, device)
    ops = instantiate(cfg.backend)
    selection_backend = selector.set_backend(ops.name)
    backend = DSABackend(cache, mc.num_heads, selector, predictor, budget, mode=settings.mode,
                         repair_mode=settings.repair_mode, calibration_tokens=settings.calibration_tokens,
                         dense_metrics_every=settings.dense_metrics_every, check_serial=settings.check_serial, ops=ops)
    probe = StageProbe(selector, settings.repair_mode, settings.batch_size, mc.num_heads, mc.num_kv_heads,
                       mc.head_dim, settings.block_size, cache.max_tokens, dtype, device, ops=ops)
    budget_info = budget.setup(probe, selector.selected_blocks(cache.max_blocks), cache.max_blocks)
    log.info("prompt: %s (%d tokens); model %s loaded in %.1f s", prompt.description, prompt_len, model.name, load_s)

    steps_out = JsonlWriter(run_dir / "records" / "steps.jsonl")
    tokens_out = JsonlWriter(run_dir / "records" / "tokens.jsonl")
    generator = torch.Generator().manual_seed(cfg.seed)
    generated: list[torch.Tensor] = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model.decoder(input_ids, 0, backend)[:, -1]  # [B, V]
        calibration = backend.finish_prefill()
        prefill_s = time.perf_counter() - t0
        token = next_token(logits, task.temperature, task.top_p, generator)
        eos = mc.eos_token_id  # an id, a list of ids (Llama 3.1), or None
        eos_ids = torch.tensor(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos], device=device)
        for step in tqdm(range(task.max_new_tokens), desc="decode", unit="tok"):
            generated.append(token)
            t0 = time.perf_counter()
            logits = model.decoder(token[:, None], prompt_len + step, backend)[:, -1]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            latency = time.perf_counter() - t0
            records, measure_s = backend.end_step()
            steps_out.write([row for r in records for row in layer_step_rows(r)])
            tokens_out.write([{"step": step, "token": int(token[0]), "wall_s": latency, "measure_s": measure_s,
                               "latency_s": latency - measure_s}])
            token = next_token(logits, task.temperature, task.top_p, generator)
            if task.stop_at_eos and bool(torch.isin(torch.stack(generated, 1), eos_ids).any(1).all()):
                break
    steps_out.close()
    tokens_out.close()

    steps = read_jsonl(run_dir / "records" / "steps.jsonl")
    tokens = read_jsonl(run_dir / "records" / "tokens.jsonl")
    layers = per_layer(steps)
    layers.to_csv(run_dir / "layers.csv", index=False)
    token_ids = torch.stack(generated, 1)  # [B, steps]
    text = model.tokenizer.decode(token_ids[0].tolist()) if model.tokenizer is not None else None
    write_text_atomic(run_dir / "generation.txt", f"prompt: {prompt.description}\n\n{text or token_ids[0].tolist()}\n")
    summary = {
        "status": "complete",
        "model": model.name,
        "selector": OmegaConf.to_container(cfg.selector, resolve=True),
        "predictor": OmegaConf.to_container(cfg.predictor, resolve=True),
        "budget": OmegaConf.to_container(cfg.budget, resolve=True),
        "mode": settings.mode,
        "repair_mode": settings.repair_mode,
        "backend": ops.name,
        "selection_backend": selection_backend,
        "device": probe.device_name,
        "prompt_tokens": prompt_len,
        "block_size": settings.block_size,
        "topk_blocks": "all" if isinstance(selector, DenseSelector) else selector.topk_blocks,
        "model_load_s": load_s,
        "prefill_s": prefill_s,
        "calibration": calibration,
        "budget_setup": budget_info,
        "generated_token_ids": token_ids.tolist(),
        **summarize(steps, tokens),
    }
    write_json_atomic(run_dir / "summary.json", summary)
    logger.log_run(summary, layers, steps)
    print(format_summary(summary, layers))
    return summary


def read_jsonl(path: Path) -> pd.DataFrame:
    with open(path, encoding="utf-8") as f:
        return pd.DataFrame([json.loads(line) for line in f if line.strip()])
