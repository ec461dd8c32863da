"""Accuracy study: does PRR preserve DSA's outputs, and what does each selector cost in accuracy?

    python experiments/accuracy_study.py                      # the committed CPU size (see --help)
    python experiments/accuracy_study.py --contexts 4096 --budgets 256,1024,2048 --samples 20
    python experiments/accuracy_study.py --model qwen2.5-coder-0.5b --tasks ruler:niah_single_1,ruler:vt \
        --contexts 8192,16384 --device cuda --dtype bfloat16      # RULER's own tasks (make ruler-data), a GPU
    ... --device cuda --dtype bfloat16 --engine graph            # decoded by the CUDA-graph engine

For every task x context length x sample, the prompt is prefilled once (dense, q/k/v kept)
and every config decodes from a replay of it (a fresh cache, selector metadata and
predictor state per config), greedy, through the sparse runtime:
  dense                                 the accuracy reference
  {quest, infllm, less, exact} x budget predictor=none: serial DSA
  {quest, infllm, less, exact} x budget predictor=ema, repair_mode=exact: PRR
  {quest, infllm, less, exact} x budget x --reuse predictor=none with a selection reuse (issue 53, an
                                        approximation): serial DSA beside it, e.g. --reuse layers:4,steps:4
Every selector attends the same number of tokens at a budget: --budgets are tokens, in blocks of
--block-size for quest, infllm, infllm_prr, less and exact; `indexer` (the lightning indexer, issue
52) selects tokens (runtime.block_size=1, selector.topk_tokens = the budget) and `infllm_v2` its
64-token blocks (runtime.block_size=64; a budget not a multiple of 64 is refused), both through
prr.selectors.study_overrides. The indexer runs its model's trained weights (`make train-indexer
MODEL=...`; refused without them) unless --indexer-weights random, and the dense prefill then
keeps the normed hidden states of its sparse layers for the replay.
Reported (a) PRR (ema, exact repair) vs serial DSA (none): token-identical samples, and for
every differing sample the first divergent step with serial DSA's top-1/top-2 logit margin
there and the largest PRR-vs-serial attention error of the run (runtime.check_serial);
(b) accuracy (RULER string match) of each selector, budget and reuse against dense, and the
fraction of samples whose tokens equal dense's.

Samples run sample-major (sample 0 of every task and context, then sample 1, ...), so a run
stopped by --time-budget leaves every cell with samples; with --batch-size R (graph engine)
R samples of a cell decode together, one per row of the cache. One Engine per config serves every
task and context (the graph engine captures its step once).

Writes <out>_samples.csv, the results store (one row per task, context, sample and config, each
with the command that made it; rewritten after every sample; --resume continues it across
runs, e.g. separate GPU sessions), <out>.csv (one row per task, context, selector, predictor,
budget, reuse: accuracy with its 95% interval and n) and <out>.json (sizes, timings, the differences).
"""

from __future__ import annotations

import argparse
import json
import math
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
from prr.evaluation import Engine, hidden_layers
from prr.intervals import score_interval
from prr.paths import write_json_atomic, write_text_atomic
from prr.run_inputs import DTYPES
from prr.selectors.study_overrides import budget_overrides, indexer_weight_overrides
from prr.tasks.ruler import task_overrides

ROOT = Path(__file__).resolve().parents[1]

SPARSE = ("quest", "infllm", "infllm_prr", "less", "exact", "indexer", "infllm_v2")
REUSE_KEYS = {"layers": "anchors", "steps": "every"}  # --reuse NAME:N sets reuse.<key>=N


def reuse_overrides(spec: str) -> list[str]:
    """--reuse's NAME or NAME:N (layers:4: every 4th sparse layer selects; steps:4: every 4th step)
    -> the config overrides of that reuse (prr/reuse.py)."""
    name, _, n = spec.partition(":")
    if name not in REUSE_KEYS or (n and not n.isdigit()):
        raise ValueError(f"--reuse {spec!r}: give NAME or NAME:N with NAME one of {list(REUSE_KEYS)} (e.g. layers:4)")
    return [f"reuse={name}", *([f"reuse.{REUSE_KEYS[name]}={n}"] if n else [])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tasks", default="ruler_niah,ruler_niah_multikey",
                   help="conf/task names (prr's RULER-style generators), or ruler:NAME for RULER's own task NAME")
    p.add_argument("--contexts", default="1024,2048", help="context lengths in tokens")
    p.add_argument("--samples", type=int, default=3, help="samples per task and context length")
    p.add_argument("--budgets", default="256,512", help="top-K budgets in tokens (selector.topk_blocks x block_size)")
    p.add_argument("--ema-budgets", default="256", help="budgets that also run predictor=ema ('' for none)")
    p.add_argument("--selectors", default="quest,infllm,less,exact", help=f"comma-separated, of {list(SPARSE)}")
    p.add_argument("--indexer-weights", default="trained", choices=["trained", "random"],
                   help="selector=indexer's weights: the model's trained indexer (`make train-indexer MODEL=...`; "
                        "refused when none is stored) or seeded random ones, whose accuracy is meaningless (an "
                        "untrained indexer picks tokens at random): for checking the plumbing only")
    p.add_argument("--reuse", default="",
                   help="selection reuses (issue 53) that also run with each selector and budget as serial DSA "
                        "(predictor=none), comma-separated NAME or NAME:N: layers:4 (every 4th sparse layer selects), "
                        "steps:4 (every 4th step; eager engine); '' for none")
    p.add_argument("--max-new-tokens", type=lambda v: 0 if v == "task" else int(v), default=10,
                   help="greedy tokens per sample (EOS ends it sooner); 'task': each task's own (RULER's "
                        "tokens_to_generate: niah 128, vt 30, cwe 120, fwe 50, qa 32)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dense-layers", default=None,
                   help="layers every sparse config attends densely, comma-separated ('' for none; default: each "
                        "selector's conf, layers 0-1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="the step's op backend")
    p.add_argument("--engine", default="eager", choices=["eager", "graph"],
                   help="runtime.engine: the research runtime (per-step records: PRR-vs-serial attention error) or "
                        "the CUDA-graph engine (hit rate from its device counters)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="graph engine: samples of one task and context decoded together, one per row of the cache "
                        "(runtime.batch_size; ragged rows). A row's hit rate and time are its batch's, per row")
    p.add_argument("--out", default=None, help="path stem of the results (default: experiments/results/cpu/accuracy)")
    p.add_argument("--resume", action="store_true",
                   help="continue OUT_samples.csv (the results store): finished (task, context, sample, config) rows "
                        "are kept and skipped; without it an existing store is refused")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which no new sample starts (the tables cover what finished; --resume continues)")
    p.add_argument("--report", type=Path, nargs="+", default=None,
                   help="only rebuild OUT.csv/.json from a cut-short run's _samples.csv (no model; --out required); "
                        "several stores (parallel runs over disjoint cells) are merged into OUT_samples.csv first")
    args = p.parse_args(argv)
    for spec in filter(None, args.reuse.split(",")):
        try:
            reuse_overrides(spec)
        except ValueError as err:
            p.error(str(err))
    if args.report is not None and args.out is None:
        p.error("--report needs --out (where the rebuilt tables go; never the committed default)")
    if args.batch_size < 1 or (args.batch_size > 1 and args.engine != "graph"):
        p.error(f"--batch-size {args.batch_size}: must be >= 1, and > 1 needs --engine graph (the research "
                "runtime decodes one request at a time)")
    args.out = args.out or str(ROOT / "experiments" / "results" / "cpu" / "accuracy")
    if args.report is None and not args.resume and Path(f"{args.out}_samples.csv").exists():
        p.error(f"{args.out}_samples.csv exists: pass --resume to continue it (finished samples are kept and "
                "skipped), or choose another --out")
    return args


def common_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides every config of the study shares (the selector's come after: `study_runs`)."""
    return [f"model={args.model}", "logger=none", f"runtime.block_size={args.block_size}",
            f"runtime.device={args.device}", f"runtime.dtype={args.dtype}", f"backend={args.backend}",
            "runtime.dense_metrics_every=1000000",  # no dense reference per step: accuracy is the point here
            f"runtime.engine={args.engine}", f"runtime.batch_size={args.batch_size}"]


def study_runs(args: argparse.Namespace) -> list[tuple[str, str, str, str, int | None, list[str]]]:
    """Every config of the study: (name, selector, predictor, reuse, budget tokens, overrides after
    `common_overrides`). Each selector's overrides at a budget come from one place, `selector_overrides`:
    the same tokens for every selector (prr.selectors.study_overrides), the indexer's weights, --dense-layers.
    A budget a selector's unit does not divide, or selector=indexer without trained weights (unless
    --indexer-weights random), exits with one line naming the fix."""
    budgets = [int(x) for x in args.budgets.split(",")]
    ema_budgets = [int(x) for x in args.ema_budgets.split(",") if x]
    selectors = args.selectors.split(",")
    bad = [s for s in selectors if s not in SPARSE]
    if bad:
        raise SystemExit(f"--selectors {bad} not in {SPARSE}")
    try:
        for sel in selectors:
            for b in budgets + ema_budgets:
                budget_overrides(sel, b, args.block_size)
    except ValueError as err:
        raise SystemExit(f"--budgets/--ema-budgets: {err}") from None
    weights = []  # selector=indexer's (its trained shape and dense layers, or random ones when asked)
    if "indexer" in selectors:
        model = compose_config(common_overrides(args) + task_overrides(args.tasks.split(",")[0])).model.name_or_path
        try:
            weights = indexer_weight_overrides(model, args.indexer_weights)
        except ValueError as err:
            raise SystemExit(f"--selectors indexer: {err}") from None
    dense = [] if args.dense_layers is None else [f"selector.dense_layers=[{args.dense_layers}]"]

    def selector_overrides(sel: str, budget: int) -> list[str]:
        """`sel` at `budget` tokens: its unit, top-K and (indexer) weights, then --dense-layers."""
        return [*budget_overrides(sel, budget, args.block_size), *(weights if sel == "indexer" else []), *dense]

    reuses = [spec for spec in args.reuse.split(",") if spec]
    runs: list[tuple[str, str, str, str, int | None, list[str]]] = [
        ("dense", "dense", "none", "none", None, ["selector=dense", "predictor=none"])]
    for sel in selectors:
        for b in budgets:
            chosen = selector_overrides(sel, b)
            runs.append((f"{sel}-none-{b}", sel, "none", "none", b, [*chosen, "predictor=none"]))
            runs += [(f"{sel}-none-{b}-{spec.replace(':', '')}", sel, "none", spec, b,
                      [*chosen, "predictor=none", *reuse_overrides(spec)]) for spec in reuses]
            if b in ema_budgets:
                check = ["runtime.check_serial=true"] if args.engine == "eager" else []  # (eager records only)
                runs.append((f"{sel}-ema-{b}", sel, "ema", "none", b, [*chosen, "predictor=ema",
                                                                        "predictor.calibrate=true",  # (as committed)
                                                                        "runtime.repair_mode=exact", *check]))
    return runs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report is not None:
        return report(args.report, Path(args.out), argv)
    tasks = args.tasks.split(",")
    contexts = [int(x) for x in args.contexts.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    ema_budgets = [int(x) for x in args.ema_budgets.split(",") if x]
    selectors = args.selectors.split(",")
    reuses = [spec for spec in args.reuse.split(",") if spec]
    common = common_overrides(args)
    runs = study_runs(args)  # (name, selector, predictor, reuse, budget tokens, overrides)
    command = " ".join(["python experiments/accuracy_study.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    store = Path(f"{args.out}_samples.csv")  # the results store: one row per (task, context, sample, config)
    rows: list[dict[str, Any]] = []
    if store.exists():  # (parse_args refused it without --resume)
        rows = pd.read_csv(store, keep_default_na=False, na_values=[""]).to_dict("records")
    done = {(r["task"], int(r["context_tokens"]), int(r["sample"]), r["config"]) for r in rows}
    t_start = time.perf_counter()
    first = compose_config(common + task_overrides(tasks[0]))
    settings = instantiate(first.runtime)
    model = instantiate(first.model).load(settings.dtype, settings.device)
    # the layers whose normed hidden states the dense prefill keeps: those a config's selector reads (indexer)
    keep = sorted({layer for _, sel, *_, over in runs if sel != "dense" for layer in hidden_layers(
        instantiate(compose_config(common + task_overrides(tasks[0]) + over).selector), model.config.num_layers)})
    # One Engine per config for every task and context (a graph engine captures its step once, at
    # the longest request: shorter ones run in the same graphs).
    capacity = max(contexts) + 64 + (args.max_new_tokens or 128)  # (128: RULER's longest tokens_to_generate)
    engines: dict[str, Engine] = {}
    decoded: set[str] = set()  # configs whose engine has decoded a batch in this process

    def engine(name: str, over: list[str]) -> Engine:
        if name not in engines:
            engines[name] = Engine(compose_config(common + task_overrides(tasks[0]) + over), model, capacity)
            engines[name].collect = args.engine == "eager"  # per-step rows; the graph engine counts on the device
        return engines[name]

    cells = [(task_name, ctx) for ctx in contexts for task_name in tasks]
    made = {cell: instantiate(compose_config(common + ["selector=dense", *task_overrides(cell[0]), f"task.context_tokens={cell[1]}",
                                                       f"task.num_samples={args.samples}",
                                                       f"task.max_new_tokens={args.max_new_tokens or 'null'}"]).task)
            for cell in cells}
    # sample-major in groups of --batch-size samples: every cell grows, a group decodes as one batch.
    # A cell's groups are cut from its samples still missing, so a resumed store gives full batches.
    size = args.batch_size
    missing = {cell: [i for i in range(args.samples) if any(
        (*cell, i, name) not in done for name, *_, budget, _ in runs if budget is None or budget < cell[1])]
        for cell in cells}
    todo = [(cell, missing[cell][start:start + size]) for start in range(0, args.samples, size) for cell in cells
            if missing[cell][start:start + size]]
    print(f"{sum(len(idx) for _, idx in todo)} samples to run in {len(todo)} batches ({len(done)} sample-configs "
          f"already in {store})", flush=True)
    for position, ((task_name, ctx), indices) in enumerate(todo):
        elapsed = time.perf_counter() - t_start
        if args.time_budget is not None and elapsed > args.time_budget:
            print(f"time budget {args.time_budget:.0f}s spent after {position} of {len(todo)} batches: stopping; "
                  f"--resume continues from {store}", flush=True)
            break
        task = made[task_name, ctx]
        base = engine("dense", runs[0][-1])
        samples = [task.make_sample(base.tokenizer, task.rng(index), index) for index in indices]
        ids = [base.encode_prompt(s.prompt, task.chat_template, s.gen_prefix) for s in samples]  # [1, T_b] each
        t0 = time.perf_counter()
        prefills = [base.prefill(x, hidden=keep) for x in ids]
        prefill_s = (time.perf_counter() - t0) / len(ids)
        ran = []
        for name, sel, pred, reuse, budget, over in runs:
            need = [j for j, index in enumerate(indices) if (task_name, ctx, index, name) not in done]
            if (budget is not None and budget >= ctx) or not need:
                continue  # the budget covers the whole context (nothing sparse), or finished earlier
            captures = name not in decoded  # its engine's first batch builds (on a GPU, captures) its step: timed too
            decoded.add(name)
            t0 = time.perf_counter()
            runner = engine(name, over)
            gens = runner.generate_batch([ids[j] for j in need], task.max_new_tokens, prefills=[prefills[j] for j in need])
            decode_s = (time.perf_counter() - t0) / len(need)  # the batch's wall time, per request
            for row, (j, gen) in enumerate(zip(need, gens, strict=True)):
                steps = pd.DataFrame(runner.request_rows)
                if args.engine == "graph":  # the row's own device counters (its steps past its EOS included)
                    counts = runner.pipeline.row_counts[row]
                    steps = pd.DataFrame([{"hits": counts["hits"], "selected_blocks": counts["selected"]}]
                                         if counts["selected"] else [])  # (no sparse layer: no rows, as eager)
                ran.append({
                    "task": task_name, "context_tokens": ctx, "sample": indices[j], "prompt_tokens": ids[j].shape[1],
                    "config": name, "selector": sel, "predictor": pred, "reuse": reuse, "budget_tokens": budget,
                    "score": task.score(gen.text, samples[j]), "prediction": gen.text,
                    "token_ids": json.dumps(gen.token_ids), "margins": json.dumps([round(m, 5) for m in gen.margins]),
                    "max_serial_relerr": float(steps["serial_relerr"].max()) if "serial_relerr" in steps else None,
                    "hit_rate": float(steps["hits"].sum() / max(steps["selected_blocks"].sum(), 1))
                    if len(steps) and pred == "ema" else None,
                    "decode_s": decode_s, "prefill_s": prefill_s, "batch_rows": len(need),
                    "includes_capture": captures, "command": command,
                })
        rows += ran
        # every finished batch kept, each row with its command; a stop mid-write keeps the last store
        write_text_atomic(store, pd.DataFrame(rows).to_csv(index=False))
        print(f"[{position + 1}/{len(todo)}] {task_name} ctx {ctx} samples {indices}: prefill {prefill_s:.2f}s each, "
              f"{len(ran)} decodes {sum(r['decode_s'] for r in ran):.1f}s ({time.perf_counter() - t_start:.0f}s so far)",
              flush=True)
    if not rows:
        print("no sample finished: no tables written")
        return
    per_sample = pd.DataFrame(rows)
    finished = per_sample.groupby(["task", "context_tokens"])["sample"].nunique().to_dict()
    write_results(Path(args.out), per_sample.drop(columns="command", errors="ignore"), command, {
        "model": args.model, "tasks": tasks, "contexts": contexts, "samples_per_task_context": args.samples,
        "finished_samples": {f"{t} {c}": int(n) for (t, c), n in finished.items()},
        "budgets_tokens": budgets, "ema_budgets_tokens": ema_budgets, "selectors": ["dense", *selectors], "reuse": reuses,
        "max_new_tokens": args.max_new_tokens or "each task's own", "block_size": args.block_size, "decoding": "greedy",
        "device": (f"{torch.cuda.get_device_name()} torch {torch.__version__}" if args.device.startswith("cuda") else
                   f"cpu {platform.machine()} torch {torch.__version__}, {torch.get_num_threads()} threads"),
        "dtype": args.dtype, "backend": args.backend, "engine": args.engine, "wall_s": time.perf_counter() - t_start,
        "commands_in_store": sorted(set(per_sample["command"].dropna())) if "command" in per_sample else []},
        samples=False)


def write_results(out: Path, per_sample: pd.DataFrame, command: str, meta: dict[str, Any], samples: bool = True) -> None:
    """<out>_samples.csv (with samples), <out>.csv (the table) and <out>.json (meta, PRR vs serial DSA)."""
    table, differences = summarize(per_sample)
    out.parent.mkdir(parents=True, exist_ok=True)
    if samples:
        per_sample.assign(command=command).to_csv(f"{out}_samples.csv", index=False)  # provenance in every row
    table.assign(command=command).to_csv(f"{out}.csv", index=False)
    ema = table[table.predictor == "ema"]
    write_json_atomic(Path(f"{out}.json"), {
        "command": command, **meta, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "prr_vs_serial": {
            "compared_samples": int(ema["samples"].sum()),
            "token_identical_samples": int(ema["identical_to_serial"].mul(ema["samples"]).round().sum()),
            "max_serial_relerr": float(ema["max_serial_relerr"].max()) if len(ema) else None,
            "differences": differences,
        },
    })
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"PRR exact vs serial DSA: {len(differences)} differing samples; wrote {out}.csv, {out}.json")


def report(stores: list[Path], out: Path, argv: list[str] | None) -> None:
    """Tables of a run cut short, from the per-sample file it kept (one row per finished sample and config).
    Several stores are merged first into <out>_samples.csv, every row with its own command; a
    (task, context, sample, config) in more than one keeps its first store's row."""
    if len(stores) == 1:
        samples_csv = stores[0]
        per_sample = pd.read_csv(samples_csv)
    else:
        parts = [pd.read_csv(path, keep_default_na=False, na_values=[""]) for path in stores]
        per_sample = pd.concat(parts, ignore_index=True).drop_duplicates(["task", "context_tokens", "sample", "config"])
        samples_csv = Path(f"{out}_samples.csv")
        write_text_atomic(samples_csv, per_sample.to_csv(index=False))
        print(f"merged {' + '.join(str(len(part)) for part in parts)} rows of {len(stores)} stores into "
              f"{len(per_sample)} in {samples_csv}")
        per_sample = pd.read_csv(samples_csv)
    missing = sorted({"task", "context_tokens", "sample", "config", "selector", "predictor", "budget_tokens", "score",
                      "token_ids", "margins", "max_serial_relerr", "hit_rate", "decode_s"} - set(per_sample.columns))
    if missing:
        raise SystemExit(f"{samples_csv} is not an accuracy_study samples file: no column(s) {missing}")
    source = per_sample.pop("command").dropna().unique().tolist() if "command" in per_sample else []
    command = " ".join(["python experiments/accuracy_study.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    finished = per_sample.groupby(["task", "context_tokens"])["sample"].nunique().to_dict()
    write_results(out, per_sample, command, {
        "rebuilt_from": str(samples_csv), "source_command": source[0] if source else None,
        "note": "tables of the samples the run finished before it was stopped",
        "finished_samples": {f"{t} {c}": int(n) for (t, c), n in finished.items()}}, samples=False)


def summarize(per_sample: pd.DataFrame) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """-> (one row per task/context/config, every PRR-vs-serial difference explained)."""
    key = ["task", "context_tokens", "sample"]
    # (rows of stores from before --reuse: none)
    per_sample = per_sample.assign(reuse=per_sample["reuse"].fillna("none") if "reuse" in per_sample else "none")
    dense = per_sample[per_sample.config == "dense"].set_index(key)["token_ids"]
    serial = per_sample[(per_sample.predictor == "none") & (per_sample.reuse == "none")].set_index(
        key + ["selector", "budget_tokens"])
    differences = []
    table = []
    for (task, ctx, _), group in per_sample.groupby(["task", "context_tokens", "config"], sort=False):
        first = group.iloc[0]
        same_dense = [tok == dense[(task, ctx, s)] for s, tok in zip(group["sample"], group["token_ids"], strict=True)]
        row = {"task": task, "context_tokens": ctx, "selector": first.selector, "predictor": first.predictor,
               "reuse": first.reuse, "budget_tokens": first.budget_tokens, "samples": len(group),
               "accuracy": group["score"].mean(),
               "same_tokens_as_dense": sum(same_dense) / len(group), "identical_to_serial": math.nan,
               "max_serial_relerr": group["max_serial_relerr"].max(), "hit_rate": group["hit_rate"].mean(),
               "decode_s_per_sample": group["decode_s"].mean()}
        interval = score_interval(group["score"].tolist())  # 95% over samples: Wilson for 0/1, else bootstrap
        row.update(accuracy_lo=interval.low, accuracy_hi=interval.high)
        if first.predictor == "ema":
            same = 0
            for _, r in group.iterrows():
                ref = serial.loc[(task, ctx, r["sample"], r["selector"], r["budget_tokens"])]
                a, b = json.loads(r["token_ids"]), json.loads(ref["token_ids"])
                if a == b:
                    same += 1
                    continue
                step = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                margins = json.loads(ref["margins"])
                differences.append({
                    "task": task, "context_tokens": int(ctx), "sample": int(r["sample"]), "selector": r["selector"],
                    "budget_tokens": int(r["budget_tokens"]), "first_divergent_step": step,
                    "serial_top2_margin_there": margins[step] if step < len(margins) else None,
                    "prr_max_serial_relerr": r["max_serial_relerr"], "prr_tokens": a, "serial_tokens": b,
                })
            row["identical_to_serial"] = same / len(group)
        elif first.reuse != "none":  # a reuse beside serial DSA: the samples whose tokens are serial's
            row["identical_to_serial"] = sum(
                tok == serial.loc[(task, ctx, s, first.selector, first.budget_tokens)]["token_ids"]
                for s, tok in zip(group["sample"], group["token_ids"], strict=True)) / len(group)
        table.append(row)
    return pd.DataFrame(table), differences


if __name__ == "__main__":
    main()
