"""The one run driver: build -> prefill -> decode (or score) loop -> records -> summary, for
`run.py` (prr/runner.py hands it the run dir), scored tasks and `prr-lm-eval` (through
`prr.evaluation.Engine`), and the studies.

A decode run goes through a runtime strategy:
- `EagerDecode` (prr/runtime/eager_decode.py): the research runtime, one step per host look,
  per-(step, layer, row, KV head) records, sampling;
- `GraphDecode` (prr/runtime/graph_run.py, `runtime.engine=graph`): the CUDA-graph engine,
  windows of replays, device counters read once per window.
Each offers `prefill() -> the first token [B]`, `decode(n) -> Window`, `window` (steps between
host looks) and `results(steps)`. The driver owns the loop, EOS (prr/eos.py), tokens.jsonl,
layers.csv, generation.txt, summary.json, the logger and the printed table.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from prr.eos import eos_ids, steps_until_eos
from prr.metrics import per_layer, summarize
from prr.paths import write_json_atomic, write_text_atomic
from prr.run_records import token_row
from prr.runtime.run_strategy import DecodeStrategy
from prr.sinks import JsonlWriter, read_jsonl
from prr.summary_table import format_summary


def run_summary(cfg: DictConfig, model: str, *, mode: str, repair_mode: str, device: str,
                prompt_tokens: int | None, block_size: int, topk_blocks: int | str, model_load_s: float,
                budget_setup: dict[str, Any], provenance: dict[str, Any] | None = None, task: str | None = None,
                ops: dict[str, Any] | None = None, rows: dict[str, Any] | None = None,
                sizes: dict[str, Any] | None = None, timing: dict[str, Any] | None = None,
                results: dict[str, Any] | None = None, reuse: dict[str, Any] | None = None) -> dict[str, Any]:
    """summary.json of a complete run, its keys in one order for every runtime; the optional
    sections are a runtime's own (provenance before the model, ops after the repair mode, rows
    after the prompt, sizes after top-K, timing after the load, results last). reuse: the
    selection reuse's counts (`prr.reuse.SelectionReuse.summary`), after the budget, with the
    reuse group's options; a run without reuse (reuse=none) has no such key."""
    groups = {g: OmegaConf.to_container(cfg[g], resolve=True) for g in ("selector", "predictor", "budget")}
    if reuse is not None and reuse["policy"] != "none":
        groups["reuse"] = {**OmegaConf.to_container(cfg.reuse, resolve=True), **reuse}
    return {"status": "complete", **(provenance or {}), "model": model, **({"task": task} if task else {}),
            **groups, "mode": mode, "repair_mode": repair_mode, **(ops or {}), "device": device,
            "prompt_tokens": prompt_tokens, **(rows or {}), "block_size": block_size, "topk_blocks": topk_blocks,
            **(sizes or {}), "model_load_s": model_load_s, **(timing or {}), "budget_setup": budget_setup,
            **(results or {})}


def finish(run_dir: Path, summary: dict[str, Any], layers: Any, steps: Any, logger: Any,
           layers_csv: Any = None) -> dict[str, Any]:
    """A complete run's last files: layers.csv (layers_csv: the frame written, default layers)
    and summary.json; the logger's record."""
    (layers if layers_csv is None else layers_csv).to_csv(run_dir / "layers.csv", index=False)
    write_json_atomic(run_dir / "summary.json", summary)
    logger.log_run(summary, layers, steps)
    return summary


def write_generation(run_dir: Path, tokenizer: Any, description: str, token_ids: torch.Tensor) -> None:
    """generation.txt: the prompt's description and row 0's generated text (ids without a tokenizer)."""
    text = tokenizer.decode(token_ids[0].tolist()) if tokenizer is not None else None
    write_text_atomic(run_dir / "generation.txt", f"prompt: {description}\n\n{text or token_ids[0].tolist()}\n")


def decode(cfg: DictConfig, run_dir: Path, logger: Any) -> dict[str, Any]:
    """A decode run of the config's prompt on its runtime (runtime.engine: eager or graph)."""
    from prr.run_inputs import build_run

    if cfg.runtime.get("engine", "eager") == "graph":
        from prr.runtime.graph_run import GraphDecode, tensor_parallel_group

        tp = tensor_parallel_group(instantiate(cfg.runtime))  # (first: each rank loads onto its own GPU)
        runtime: DecodeStrategy = GraphDecode(cfg, build_run(cfg), tp)
    else:
        from prr.runtime.eager_decode import EagerDecode

        runtime = EagerDecode(cfg, build_run(cfg), run_dir)
    return decode_with(runtime, cfg, run_dir, logger)


def decode_with(runtime: DecodeStrategy, cfg: DictConfig, run_dir: Path, logger: Any) -> dict[str, Any]:
    """The decode loop over a strategy: prefill, windows of steps until max_new_tokens or EOS,
    tokens.jsonl, generation.txt, then the summary."""
    inputs = runtime.inputs
    tokens_out = JsonlWriter(run_dir / "records" / "tokens.jsonl")
    first = runtime.prefill()  # [B]: the token step 0 reads
    eos = eos_ids(inputs.model.config)
    steps, done, read = inputs.task.max_new_tokens, 0, [first.view(-1, 1).cpu()]
    with torch.inference_mode(), tqdm(total=steps, desc=runtime.progress_label, unit="tok") as bar:
        while done < steps:
            window = runtime.decode(min(runtime.window, steps - done))
            n = len(window.wall_s)
            read.append(window.tokens)
            # the window's tokens read: the first token, then each step's output but the last one's
            seen = torch.cat(read, 1)[:, : done + n]
            stop = steps_until_eos(seen, eos) if inputs.task.stop_at_eos else None
            kept = n if stop is None else stop - done
            variants = window.variants or [None] * n
            tokens_out.write([token_row(done + i, int(seen[0, done + i]), window.wall_s[i], window.measure_s[i],
                                        variant=variants[i]) for i in range(kept)])
            bar.update(n)
            done += kept
            if stop is not None:
                break
    tokens_out.close()
    token_ids = torch.cat(read, 1)[:, :done]  # [B, steps]: the token each step read
    write_generation(run_dir, inputs.model.tokenizer, inputs.prompt.description, token_ids)
    results = runtime.results(token_ids)
    summary = run_summary(cfg, inputs.model.name, model_load_s=inputs.load_s, reuse=reuse_counts(inputs, done),
                          **results.summary)
    finish(run_dir, summary, results.layers, results.steps, logger, results.layers_csv)
    print(format_summary(summary, results.layers))
    return summary


def reuse_counts(inputs: Any, steps: int) -> dict[str, Any] | None:
    """The selections the decode's `steps` steps made and skipped by its selection reuse (None: none)."""
    if inputs.reuse is None:
        return None
    sparse = [not inputs.selector.is_dense_layer(i) for i in range(inputs.model.config.num_layers)]
    return inputs.reuse.summary(sparse, steps)


def score(cfg: DictConfig, run_dir: Path, logger: Any) -> dict[str, Any]:
    """A scored task's run: every request through one `prr.evaluation.Engine`, then the task's
    metrics (accuracy, perplexity, lm-eval scores) in summary.json and the logger."""
    from prr.evaluation import Engine

    torch.manual_seed(cfg.seed)
    task = instantiate(cfg.task)
    settings = instantiate(cfg.runtime)
    t0 = time.perf_counter()
    model = instantiate(cfg.model).load(settings.dtype, settings.device)
    load_s = time.perf_counter() - t0
    engine = Engine(cfg, model, task.prompt_tokens_upper_bound() + task.max_new_tokens, run_dir)
    t0 = time.perf_counter()
    try:
        metrics = task.evaluate(engine)
    finally:
        engine.close()
    eval_s = time.perf_counter() - t0
    steps = read_jsonl(run_dir / "records" / "steps.jsonl")
    tokens = read_jsonl(run_dir / "records" / "tokens.jsonl")
    samples = read_jsonl(run_dir / "records" / "samples.jsonl")
    if "prediction" in samples:
        write_text_atomic(run_dir / "generation.txt", "".join(
            f"sample {r['sample']}: {r['prediction']!r} (answers {r.get('answers')}, score {r.get('score')})\n"
            for r in samples.to_dict("records")))
    summary = run_summary(
        cfg, model.name, task=cfg.task._target_.rsplit(".", 1)[-1], mode=settings.mode,
        repair_mode=settings.repair_mode, ops={"backend": engine.ops.name, "selection_backend": engine.selection_backend},
        device=engine.device_name, prompt_tokens=getattr(task, "prompt_tokens", None), block_size=settings.block_size,
        topk_blocks=engine.topk_blocks, model_load_s=load_s, timing={"eval_s": eval_s}, reuse=engine.reuse_counts(),
        budget_setup=engine.budget_info, results={**metrics, **summarize(steps, tokens), **engine.results()})
    layers = per_layer(steps)
    finish(run_dir, summary, layers, steps, logger)
    print(format_summary(summary, layers) if not steps.empty else "")
    print("  task metrics               " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in metrics.items()))
    return summary
