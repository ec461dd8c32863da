"""One run: validate, load, prefill, decode through the DSA/PRR backend, write records.

Run directory layout (Hydra's run dir):
  config.yaml              resolved config
  provenance.json          git commit and dirty flag, prr/torch/triton/transformers versions, argv
  summary.json             run-level numbers; status running -> complete | failed
  records/steps.jsonl      one row per (decode step, layer, batch row, KV head), flushed per step
  records/tokens.jsonl     one row per decode step: token, latency
  layers.csv               per-layer aggregates
  generation.txt           the prompt's description and the generated text
  .hydra/                  Hydra's record of the job (config, hydra.yaml, overrides), when Hydra launched it
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from prr.cache import PagedKVCache
from prr.cli_exits import Terminated
from prr.config_check import validate
from prr.evaluation import evaluate_run, is_evaluation_task
from prr.metrics import layer_step_rows, per_layer, summarize
from prr.paths import write_json_atomic, write_text_atomic
from prr.progress import PrefillProgress, progress_bar
from prr.provenance import provenance
from prr.run_inputs import build_run
from prr.runtime.dsa_backend import DSABackend, check_finite
from prr.runtime.graph_run import graph_decode_run
from prr.runtime.probe import StageProbe
from prr.selectors.dense import DenseSelector
from prr.sinks import JsonlWriter, NoLogger, read_jsonl
from prr.summary_table import format_summary

log = logging.getLogger("prr")


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


class RunDirTaken(FileExistsError):
    """The run dir holds a finished run of another config: refused, never overwritten."""


def finished_run(run_dir: Path, config_yaml: str) -> dict[str, Any] | None:
    """The summary of a complete run of this config in run_dir, if there is one.

    This is how sweeps resume: re-launched into the same directory, finished jobs are
    skipped and unfinished ones (running/failed) run again. A run of another config,
    finished or not, is never overwritten (RunDirTaken)."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text())
    config_path = run_dir / "config.yaml"
    same = config_path.is_file() and config_path.read_text() == config_yaml
    if summary.get("status") != "complete":
        if config_path.is_file() and not same:  # its records are kept for a rerun of its own config only
            raise RunDirTaken(f"{run_dir} holds an unfinished run (status {summary.get('status')!r}) of a different "
                              "config, whose records prr never overwrites; choose another hydra.run.dir (or "
                              "hydra.sweep.dir), or run its own config again there to redo it")
        return None
    if not same:
        raise RunDirTaken(f"{run_dir} holds a finished run of a different config, which prr never overwrites; "
                          "choose another hydra.run.dir (or hydra.sweep.dir)")
    return summary


def write_hydra_record(run_dir: Path, cfg: DictConfig, hydra_cfg: DictConfig) -> None:
    """Hydra's record of a job in run_dir/.hydra, the three files Hydra itself writes when
    hydra.output_subdir is set. conf/config.yaml sets it to null so that they are written
    here, only once the run goes ahead: Hydra would write them before the job starts, over
    the record of a finished run that the job then refuses or skips (and results_store reads
    the run's group choices from .hydra/hydra.yaml)."""
    record = run_dir / ".hydra"
    write_text_atomic(record / "config.yaml", OmegaConf.to_yaml(cfg))
    write_text_atomic(record / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra_cfg}))
    write_text_atomic(record / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.overrides.task))


def run(cfg: DictConfig, run_dir: Path, hydra_cfg: DictConfig | None = None) -> dict[str, Any]:
    """hydra_cfg: the job's Hydra settings (HydraConfig.get()) when Hydra launched it,
    recorded in run_dir/.hydra once the run goes ahead."""
    validate(cfg)  # every problem at once, before anything loads
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    done = finished_run(run_dir, config_yaml)  # (every tensor-parallel rank skips or refuses alike)
    if done is not None:
        print(f"prr: {run_dir} already holds this run, complete; skipped")
        return done
    if worker_rank(cfg):  # a tensor-parallel rank other than 0: computes, writes nothing of the run
        return run_as_worker(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if hydra_cfg is not None:
        write_hydra_record(run_dir, cfg, hydra_cfg)
    write_text_atomic(run_dir / "config.yaml", config_yaml)
    write_json_atomic(run_dir / "provenance.json", provenance())  # git commit (dirty?), package versions
    write_json_atomic(run_dir / "summary.json", {"status": "running"})
    logger = instantiate(cfg.logger)
    ok = False
    try:
        logger.start(run_dir, OmegaConf.to_container(cfg, resolve=True), name=run_name(cfg))  # its failure: failed too
        with terminate_as_interrupt():
            # Scored tasks (many requests: accuracy, perplexity, lm-eval) take the evaluation path;
            # runtime.engine=graph decodes through the CUDA-graph engine.
            if is_evaluation_task(instantiate(cfg.task)):
                summary = evaluate_run(cfg, run_dir, logger)
            elif cfg.runtime.get("engine", "eager") == "graph":
                summary = graph_decode_run(cfg, run_dir, logger)
            else:
                summary = decode_run(cfg, run_dir, logger)
        ok = True
        return summary
    except BaseException as err:
        # Mark the run incomplete; the per-step records already flushed stay as they are.
        write_json_atomic(run_dir / "summary.json", {
            "status": "failed", "error": f"{type(err).__name__}: {err}",
            "records_kept": {p.name: count_lines(p) for p in sorted((run_dir / "records").glob("*.jsonl"))},
        })
        raise
    finally:
        logger.finish(ok)


def worker_rank(cfg: DictConfig) -> int:
    """This process's rank under runtime.tensor_parallel > 1 (torchrun's RANK), else 0."""
    return int(os.environ.get("RANK", "0")) if cfg.runtime.get("tensor_parallel", 1) > 1 else 0


def run_as_worker(cfg: DictConfig) -> dict[str, Any]:
    """A tensor-parallel rank > 0: the same decode in a private temporary directory, no logger,
    no log file, so only rank 0 writes the run dir (and its W&B run)."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
    with tempfile.TemporaryDirectory(prefix=f"prr-rank{worker_rank(cfg)}-") as scratch:
        return graph_decode_run(cfg, Path(scratch), NoLogger())


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(f"terminated by signal {signum} ({signal.Signals(signum).name})")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.endswith(b"\n"))


def run_name(cfg: DictConfig) -> str:
    return "-".join(OmegaConf.select(cfg, f"{g}._target_").rsplit(".", 1)[-1] for g in ("selector", "predictor", "budget"))


def decode_run(cfg: DictConfig, run_dir: Path, logger: Any) -> dict[str, Any]:
    r = build_run(cfg)
    settings, task, selector, predictor, budget = r.settings, r.task, r.selector, r.predictor, r.budget
    device, dtype, model, load_s, prompt, input_ids = r.device, r.dtype, r.model, r.load_s, r.prompt, r.input_ids
    mc = model.config
    prompt_len = input_ids.shape[1]
    try:
        cache = PagedKVCache(mc.num_layers, settings.batch_size, mc.num_kv_heads, mc.head_dim, settings.block_size,
                             prompt_len + task.max_new_tokens, dtype, device)
    except torch.OutOfMemoryError as err:
        cache_bytes = (2 * mc.num_layers * settings.batch_size * mc.num_kv_heads * mc.head_dim
                       * (prompt_len + task.max_new_tokens) * dtype.itemsize)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.decoder.parameters())
        raise MemoryError(
            f"out of memory on {device} allocating the KV cache: {cache_bytes / 2**30:.2f} GiB for {mc.num_layers} layers"
            f" x batch {settings.batch_size} x {mc.num_kv_heads} KV heads x {prompt_len + task.max_new_tokens} tokens x "
            f"head_dim {mc.head_dim} ({settings.dtype}), beside {weight_bytes / 2**30:.2f} GiB of weights; lower "
            "task.prompt_tokens, runtime.batch_size or the model's num_layers") from err
    ops = instantiate(cfg.backend)
    selection_backend = selector.set_backend(ops.name)
    backend = DSABackend(cache, mc.num_heads, selector, predictor, budget, mode=settings.mode,
                         repair_mode=settings.repair_mode, calibration_tokens=settings.calibration_tokens,
                         dense_metrics_every=settings.dense_metrics_every, check_serial=settings.check_serial, backend=ops.name)
    probe = StageProbe(selector, settings.repair_mode, settings.batch_size, mc.num_heads, mc.num_kv_heads,
                       mc.head_dim, settings.block_size, cache.max_tokens, dtype, device, backend=ops.name)
    budget_info = budget.setup(probe, selector.selected_blocks(cache.max_blocks), cache.max_blocks)
    log.info("prompt: %s (%d tokens); model %s loaded in %.1f s", prompt.description, prompt_len, model.name, load_s)

    steps_out = JsonlWriter(run_dir / "records" / "steps.jsonl")
    tokens_out = JsonlWriter(run_dir / "records" / "tokens.jsonl")
    generator = torch.Generator().manual_seed(cfg.seed)
    generated: list[torch.Tensor] = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        with progress_bar(mc.num_layers, f"prefill ({prompt_len} tokens)", "layer") as bar:
            logits = model.decoder(input_ids, 0, PrefillProgress(backend, bar))[:, -1]  # [B, V]
            bar.set_postfix_str("calibrating the predictor")
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
            check_finite(logits, step, backend)
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
