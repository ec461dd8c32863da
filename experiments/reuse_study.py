"""Selection reuse's accuracy cost against serial DSA, on the CPU (issue 53: `reuse=layers` and
`reuse=steps`, named approximations; prr/reuse.py):

    python experiments/reuse_study.py [--model smollm2-135m] [--context 1024] [--tasks niah_single_1,qa_1,vt] \
        [--samples 7] [--steps 8] [--topk 8] [--variants none,layers:2,layers:4,steps:4,steps:4:predicted] \
        [--out experiments/results/cpu/reuse_smollm2]

How: per RULER prompt (task=ruler, `make ruler-data`; --samples per task), one dense prefill is kept
(prr.evaluation.Engine.prefill) and replayed into the research runtime for every variant, which decodes
--steps tokens in shadow mode: attention stays dense, so every variant sees the same trajectory and
inputs, while Quest (top-K --topk blocks of 16, layers 0-1 dense) selects, the variant's reuse decides
which layers and steps select, and every step is dense-measured. Variants: `none` (serial DSA's A),
`layers:N` (anchors every N-th sparse layer), `steps:N` (select every N steps, between: the last A),
`steps:N:predicted` (between: EMA's top-|A| proposal). The EMA predictor runs at |P| = K in every
variant (exact repair: it changes no output), so its hit rate is against the A each variant attended.

Per (step, layer, KV head): attention-mass recall of the attended A (the share of the dense attention
mass inside it) and the output's relative error against dense attention. Each prompt's value is its
mean over those; a table row is the mean over prompts with a 95% percentile-bootstrap interval over
prompts, and the paired difference against `none` (the same prompts) with its interval. Writes OUT.csv
(one row per variant), OUT_prompts.csv (one per prompt and variant) and OUT.json (command, device,
versions, timings, selections skipped)."""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from hydra.utils import instantiate

from prr.config_check import compose_config
from prr.evaluation import Engine
from prr.intervals import bootstrap_mean
from prr.metrics import layer_step_rows
from prr.paths import write_json_atomic
from prr.reuse import LayerReuse, NoReuse, SelectionReuse, StepReuse
from prr.run_inputs import DTYPES
from prr.runtime.eager_run import EagerRuntime

RATES = ("mass_recall", "output_relerr", "hit_rate")


def reuse_of(variant: str) -> SelectionReuse:
    """none | layers:N | steps:N | steps:N:predicted -> the prr.reuse policy."""
    kind, *rest = variant.split(":")
    if kind == "none" and not rest:
        return NoReuse()
    if kind == "layers" and len(rest) == 1:
        return LayerReuse(int(rest[0]))
    if kind == "steps" and len(rest) in (1, 2):
        return StepReuse(int(rest[0]), rest[1] if len(rest) == 2 else "last")
    raise ValueError(f"--variants: {variant!r} is not none, layers:N, steps:N or steps:N:predicted")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=1024, help="RULER context tokens (>= 1024)")
    p.add_argument("--tasks", default="niah_single_1,qa_1,vt")
    p.add_argument("--samples", type=int, default=7, help="prompts per task")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--topk", type=int, default=8, help="Quest's top-K blocks (of 16 tokens)")
    p.add_argument("--variants", default="none,layers:2,layers:4,steps:4,steps:4:predicted")
    p.add_argument("--out", default="experiments/results/cpu/reuse_smollm2")
    args = p.parse_args(argv)
    try:
        args.reuse = {v: reuse_of(v) for v in args.variants.split(",")}
    except ValueError as err:
        p.error(str(err))
    if "none" not in args.reuse:
        p.error("--variants must include none (the serial DSA baseline the differences are against)")
    if args.context < 1024 or args.samples < 1 or args.steps < 1 or args.topk < 1:
        p.error(f"--context {args.context} must be >= 1024, --samples/--steps/--topk >= 1")
    return args


def decode(model: Any, prefill: Any, cfg: Any, reuse: SelectionReuse, steps: int) -> tuple[dict[str, float], int]:
    """One shadow-mode decode of `steps` tokens after the replayed prefill under `reuse` -> (the
    prompt's mean mass recall, output error and EMA hit rate over its (step, layer, KV head)s; the
    layer selections skipped)."""
    settings = instantiate(cfg.runtime)
    selector, predictor = instantiate(cfg.selector), instantiate(cfg.predictor)
    selector.bind_model(model.config)
    selector.set_backend("torch")
    prompt_len = prefill.input_ids.shape[1]
    runtime = EagerRuntime(model.decoder, settings, selector, predictor, instantiate(cfg.budget), "torch",
                           prompt_len + steps, DTYPES[settings.dtype], batch=1, reuse=reuse, mode="shadow",
                           repair_mode="exact", dense_metrics_every=1, check_serial=False)
    rows = []
    with torch.inference_mode():
        runtime.replay_prefill(prefill)
        runtime.finish_prefill()
        logits = prefill.last_logits
        for step in range(steps):  # shadow mode: the dense trajectory, the same in every variant
            logits, records, _, _ = runtime.step(logits[0].argmax().view(1), prompt_len + step, step)
            rows += [row for record in records for row in layer_step_rows(record)]
    frame = pd.DataFrame(rows)
    sparse = [not selector.is_dense_layer(i) for i in range(model.config.num_layers)]
    return ({"mass_recall": frame["mass_recall"].mean(), "output_relerr": frame["output_relerr"].mean(),
             "hit_rate": frame["hits"].sum() / frame["selected_blocks"].sum()},
            reuse.summary(sparse, steps)["selections_skipped"])


def table(prompts: pd.DataFrame) -> pd.DataFrame:
    """One row per variant: each rate's mean over prompts and 95% bootstrap interval, and the paired
    difference against `none` over the same prompts with its interval."""
    base = prompts[prompts.variant == "none"].set_index(["task", "sample"])
    rows = []
    for variant, group in prompts.groupby("variant", sort=False):
        row: dict[str, Any] = {"variant": variant, "prompts": len(group),
                               "selections_skipped_per_prompt": group["selections_skipped"].mean()}
        paired = group.set_index(["task", "sample"])
        for rate in RATES:
            row.update(bootstrap_mean(group[rate].tolist()).as_dict(rate))
            diff = (paired[rate] - base.loc[paired.index, rate]).tolist()
            row.update(bootstrap_mean(diff).as_dict(f"{rate}_minus_none"))
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = " ".join(["python experiments/reuse_study.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    common = [f"model={args.model}", "logger=none", "runtime=cpu", "runtime.engine=eager", "backend=torch",
              "task=ruler", f"task.context_tokens={args.context}", f"task.num_samples={args.samples}",
              "selector=quest", f"selector.topk_blocks={args.topk}", "predictor=ema", "budget=fixed",
              "budget.ratio=1.0", "runtime.mode=shadow"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    first = compose_config(common + ["task.name=" + args.tasks.split(",")[0]])
    model = instantiate(first.model).load("float32", "cpu")
    results: list[dict[str, Any]] = []
    tasks = {}  # task -> (cfg, engine, task, its samples)
    for task_name in args.tasks.split(","):
        cfg = compose_config(common + [f"task.name={task_name}"])
        engine, task = Engine(cfg, model, args.context + 256 + args.steps), instantiate(cfg.task)
        tasks[task_name] = (cfg, engine, task, task.samples(engine.tokenizer)[: args.samples])
    for index in range(args.samples):  # sample-major: a run cut short keeps every task alike
        for task_name, (cfg, engine, task, samples) in tasks.items():
            sample = samples[index]
            ids = engine.encode_prompt(sample.prompt, task.chat_template, sample.gen_prefix)  # [1, T]
            prefill = engine.prefill(ids)
            for variant, reuse in args.reuse.items():
                t0 = time.perf_counter()
                rates, skipped = decode(model, prefill, cfg, reuse, args.steps)
                results.append({"task": task_name, "sample": index, "prompt_tokens": ids.shape[1], "variant": variant,
                                **rates, "selections_skipped": skipped, "decode_s": round(time.perf_counter() - t0, 1)})
                print(f"{task_name} #{index} ({ids.shape[1]} tokens) {variant}: recall {rates['mass_recall']:.4f} "
                      f"error {rates['output_relerr']:.4f} hit {rates['hit_rate']:.3f} ({results[-1]['decode_s']} s, "
                      f"{time.perf_counter() - t_start:.0f} s so far)", flush=True)
            write(out, pd.DataFrame(results), command, args, time.perf_counter() - t_start)
    print(table(pd.DataFrame(results)).to_string(index=False, float_format=lambda x: f"{x:.4f}"))


def write(out: Path, prompts: pd.DataFrame, command: str, args: argparse.Namespace, wall_s: float) -> None:
    """The tables so far (a run cut short keeps its finished prompts)."""
    prompts.assign(command=command).to_csv(f"{out}_prompts.csv", index=False)
    table(prompts).assign(command=command).to_csv(f"{out}.csv", index=False)
    write_json_atomic(Path(f"{out}.json"), {
        "command": command, "model": args.model, "device": f"cpu {platform.machine()}", "dtype": "float32",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": round(wall_s, 1), "mode": "shadow (dense trajectory); every step dense-measured",
        "context_tokens": args.context, "steps": args.steps, "topk_blocks": args.topk, "block_size": 16,
        "selector": "quest (dense_layers [0, 1])", "predictor": "ema at |P| = K (exact repair: no effect on outputs)",
        "variants": args.variants.split(","), "prompts": int(prompts.groupby(["task", "sample"]).ngroups)})


if __name__ == "__main__":
    main()
