"""Temporal locality on real weights at long contexts: last-step overlap, EMA hit rate at
|P| = 1, 1.25, 1.5 and 2 × K, and attention-mass recall, per layer and per KV head.

    python experiments/locality_study.py --model qwen2.5-coder-0.5b --contexts 4096,8192 \
        [--tasks niah_multikey_2,qa_2] [--steps 64] [--topk 32,64,128] [--device cuda --dtype bfloat16] \
        [--out experiments/results/cpu/locality_long_qwen]

How: per RULER task (task=ruler, `make ruler-data`) and context length, each of --samples
prompts (samples 0..n-1) is prefilled once, dense, with its q/k/v kept (prr.evaluation.Engine.prefill). Every selector
variant (quest with the GQA max and with the sum, infllm, infllm_prr, exact, indexer, infllm_v2) × K
(blocks of --block-size) replays that prefill into a fresh cache and decodes --steps tokens through the research runtime
(DSABackend: the engine's step) in shadow mode: attention stays dense, so every variant sees
the same trajectory (the first variant's greedy tokens; the others are fed those tokens and
must reproduce its logits' argmax, which is checked), while the selector, the EMA predictor
(calibrated on the prefill tail as in a run) at |P| = K and the dense reference run beside
it. All layers are measured (selector.dense_layers=[]), but the trained indexer's dense layers (it has
no weights there; --indexer-weights random measures every layer). Every variant attends K × --block-size
tokens (prr.selectors.study_overrides): `indexer` (the lightning indexer, issue 52) selects tokens
(runtime.block_size=1, topk_tokens), `infllm_v2` 64-token blocks (a K × block not a multiple of 64
is refused); their rows count in those units (`unit_tokens`), their rates are fractions all the same.
The dense prefill keeps the normed hidden states of the indexer's sparse layers for its replay. A predictor wrapper asks EMA, before
each of its updates, for the P it would speculate at every |P|/K ratio, so one decode gives
the hit rate of every ratio (its |P| = K hits must equal the run's own: checked).
--engine graph decodes each variant through the graph engine instead (prr.runtime.study_decode:
the same replayed prefill and calibration, then engine steps, CUDA-graph replays on a GPU, with
the device study counters — the same hits per ratio, overlap, mass recall and output error per
layer and KV head, read once per decode; tests/test_study_counters.py holds them equal to this
probe's); the trajectory is fed by teacher forcing, and the tables are the same.

Writes OUT.csv (task x context x variant x K), OUT_per_layer.csv, OUT_per_head.csv (layer x KV
head), OUT_by_context.csv (over tasks) and OUT.json (command, device, versions, checks, the
weakest layers). Every rate of a table is the mean over its prompts (a prompt: one task's sample)
of that prompt's pooled rate (Σ hits / Σ selected over its steps, layers and heads), with a 95%
percentile-bootstrap interval over prompts (`<rate>_lo`, `<rate>_hi`; `prompts` = n), never over
steps, which are correlated within a prompt. Results survive a cut-short run: each finished
(task, context) is written at once.
"""

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

from prr.blocks import BlockSet
from prr.budget.fixed import FixedBudget
from prr.config_check import compose_config
from prr.evaluation import Engine, hidden_layers
from prr.intervals import means_over_prompts
from prr.metrics import layer_step_rows
from prr.paths import write_json_atomic
from prr.predictors.base import Predictor
from prr.run_inputs import DTYPES
from prr.runtime.eager_run import EagerRuntime
from prr.selectors.base import Selection
from prr.selectors.study_overrides import budget_overrides, indexer_weight_overrides, selector_unit
from prr.tasks.ruler import task_overrides

ROOT = Path(__file__).resolve().parents[1]

# variant name -> (selector, its other overrides) (all layers sparse: locality of every layer is measured)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "quest_max": ("quest", ["selector.gqa_reduce=max"]),
    "quest_sum": ("quest", ["selector.gqa_reduce=sum"]),
    "infllm": ("infllm", []),
    "infllm_prr": ("infllm_prr", []),
    "exact": ("exact", []),
    "indexer": ("indexer", []),  # + its weights' overrides (variant_overrides)
    "infllm_v2": ("infllm_v2", []),
}
DEFAULT_VARIANTS = ("quest_max", "quest_sum", "infllm", "infllm_prr", "exact")  # (the committed tables')


def variant_overrides(variant: str, topk: int, block_size: int, indexer_weights: list[str]) -> list[str]:
    """The config overrides of `variant` at K = `topk` blocks of `block_size` tokens (the same tokens for
    every variant: prr.selectors.study_overrides.budget_overrides). indexer_weights: the indexer's
    (`indexer_weight_overrides`), applied after the study's selector.dense_layers=[]."""
    selector, extra = VARIANTS[variant]
    return [*budget_overrides(selector, topk * block_size, block_size), *extra,
            *(indexer_weights if selector == "indexer" else [])]
RATIOS = (1.0, 1.25, 1.5, 2.0)
# every variant's predictor (the dense prefill's config has none: a value override of predictor=ema there
# would not compose)
EMA = ["predictor=ema", "predictor.calibrate=true"]  # (predictor=ema's default before issue 53: the committed results)


class RatioProbe(Predictor):
    """Wraps the run's predictor (changes nothing it does). Before each decode-step update it
    asks the wrapped predictor for the P it would propose under the fixed budget at every
    ratio (|P| = FixedBudget(ratio) of min(K, blocks); the state is then the one the step
    proposed from) and counts |P ∩ A| per KV head into `hits` (layer -> [R, 1, Hkv]).
    Batch 1 and history-only predictors (whose P depends on their state alone) only."""

    def __init__(self, inner: Predictor, ratios: tuple[float, ...], topk_blocks: int) -> None:
        if not inner.history_only or inner.needs_query or inner.needs_current_selection:
            raise ValueError(f"RatioProbe needs a history-only predictor; {type(inner).__name__} proposes from "
                             "this step's query or selection")
        self.inner, self.ratios, self.topk_blocks = inner, ratios, topk_blocks
        self.budgets = [FixedBudget(ratio=r) for r in ratios]
        self.speculates, self.uses_budget = inner.speculates, inner.uses_budget
        self.history_only, self.needs_query = inner.history_only, inner.needs_query
        self.needs_current_selection = inner.needs_current_selection
        self.num_blocks: dict[int, int] = {}
        self.hits: dict[int, torch.Tensor] = {}

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> Any:
        return self.inner.init_state(num_layers, batch, num_kv_heads, max_blocks, device)

    def calibrate(self, history: list[list[Selection] | None]) -> dict[str, Any]:
        return self.inner.calibrate(history)

    def rank(self, state: Any, layer: int, num_blocks: int | torch.Tensor) -> torch.Tensor:
        return self.inner.rank(state, layer, num_blocks)

    def propose(self, state: Any, layer: int, num_blocks: int | torch.Tensor, budget_blocks: int,
                current: Selection | None = None, query: torch.Tensor | None = None) -> BlockSet:
        self.num_blocks[layer] = int(num_blocks.max()) if isinstance(num_blocks, torch.Tensor) else int(num_blocks)
        return self.inner.propose(state, layer, num_blocks, budget_blocks, current,
                                  **({"query": query} if self.needs_query else {}))

    def update(self, state: Any, layer: int, selection: Selection) -> None:
        nb = self.num_blocks.pop(layer, None)  # None: the prefill tail's warm-up, not a decode step
        if nb is not None:
            if selection.scores.shape[0] != 1:
                raise ValueError(f"RatioProbe counts batch 1 only (one block count per step); got batch "
                                 f"{selection.scores.shape[0]}")
            n = selection.scores.shape[-1]
            a = selection.blocks.mask(n)
            per_ratio = []
            for budget in self.budgets:
                size = budget.predicted_blocks(layer, nb, min(self.topk_blocks, nb))  # a run's |P| at this ratio
                p = self.inner.propose(state, layer, nb, size).mask(n)
                per_ratio.append((a & p).sum(-1))
            self.hits[layer] = torch.stack(per_ratio).cpu()  # [R, B, Hkv]
        self.inner.update(state, layer, selection)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--contexts", default="4096", help="RULER context lengths in tokens (prompt = context - answer room)")
    p.add_argument("--tasks", default="niah_multikey_2,qa_2", help="RULER task names (task=ruler task.name=...)")
    p.add_argument("--steps", type=int, default=64, help="decode steps per prompt (no stop at EOS)")
    p.add_argument("--samples", type=int, default=1, help="prompts per task and context (RULER samples 0..n-1)")
    p.add_argument("--topk", default="32,64,128", help="K in blocks of --block-size")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {list(VARIANTS)}")
    p.add_argument("--indexer-weights", default="trained", choices=["trained", "random"],
                   help="the indexer variant's weights: the model's trained indexer (`make train-indexer MODEL=...`; "
                        "refused when none is stored) or seeded random ones, whose locality says nothing of a "
                        "trained indexer's: for checking the plumbing only")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="the step's op backend")
    p.add_argument("--engine", default="eager", choices=["eager", "graph"],
                   help="decode through the research runtime (per-step records, a ratio probe) or the graph engine "
                        "(its device study counters, read once per decode; CUDA graphs on a GPU)")
    p.add_argument("--out", required=True, help="path stem of the results files (OUT.csv, OUT.json, ...)")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if args.steps < 2 or args.samples < 1 or any(v not in VARIANTS for v in variants):
        p.error(f"--steps={args.steps} must be >= 2, --samples={args.samples} >= 1 and --variants={args.variants} "
                f"of {list(VARIANTS)}")
    try:
        for name in args.tasks.split(","):
            task_overrides(f"ruler:{name}")
        contexts, topks = [int(x) for x in args.contexts.split(",")], [int(x) for x in args.topk.split(",")]
    except ValueError as err:
        p.error(f"--tasks/--contexts/--topk: {err}")
    if min(contexts) < 1024 or min(topks) < 1:
        p.error(f"--contexts {contexts} must be >= 1024 (RULER) and --topk {topks} >= 1")
    try:
        for variant in variants:
            for k in topks:
                budget_overrides(VARIANTS[variant][0], k * args.block_size, args.block_size)
    except ValueError as err:
        p.error(f"--topk x --block-size: {err}")
    return args


def variant_runtime(model: Any, prefill: Any, cfg: Any, steps: int, probe: bool) -> EagerRuntime:
    """The research runtime of one variant (cfg's selector, predictor and budget; shadow mode, exact
    repair, every step dense-measured) with the kept prefill replayed into its fresh cache and the
    predictor calibrated and warmed on its tail. probe: the predictor wrapped in a RatioProbe."""
    mc, settings = model.config, instantiate(cfg.runtime)
    selector = instantiate(cfg.selector)
    selector.bind_model(mc)
    backend_name = instantiate(cfg.backend).name
    selector.set_backend(backend_name)
    predictor = instantiate(cfg.predictor)
    if probe:
        predictor = RatioProbe(predictor, RATIOS, selector.topk_blocks)
    prompt_len = prefill.input_ids.shape[1]
    runtime = EagerRuntime(model.decoder, settings, selector, predictor, instantiate(cfg.budget), backend_name,
                           prompt_len + steps, DTYPES[settings.dtype], batch=1, mode="shadow", repair_mode="exact",
                           dense_metrics_every=1, check_serial=False)
    with torch.inference_mode():
        runtime.replay_prefill(prefill)
        runtime.finish_prefill()
    return runtime


def decode_variant(model: Any, prefill: Any, cfg: Any, steps: int, tokens: list[int] | None,
                   engine: str = "eager") -> tuple[list[dict[str, Any]], list[int], int, int]:
    """One shadow-mode decode of `steps` tokens after the replayed prefill under cfg's selector
    with EMA at |P| = K (cfg's runtime.block_size). tokens: the trajectory to follow (None:
    greedy, this is the first). engine: "eager" (the research runtime, a RatioProbe around the
    predictor) or "graph" (the graph engine's study counters, `prr.runtime.study_decode`).
    -> (rows: eager one per step/layer/KV head, graph one per layer/KV head summed over the steps
    (`steps`, `measured` columns); the tokens, argmax disagreements with `tokens`, |P|=K hit
    mismatches between the run's own counts and the probe's or study counters' x1.0)."""
    if engine == "graph":
        return decode_variant_graph(model, prefill, cfg, steps, tokens)
    runtime = variant_runtime(model, prefill, cfg, steps, probe=True)
    probe = runtime.backend.predictor
    prompt_len = prefill.input_ids.shape[1]
    rows: list[dict[str, Any]] = []
    followed: list[int] = []
    disagree = mismatch = 0
    with torch.inference_mode():
        logits = prefill.last_logits
        for step in range(steps):
            greedy = int(logits[0].argmax())
            token = greedy if tokens is None else tokens[step]
            disagree += int(token != greedy)
            followed.append(token)
            logits, records, _, _ = runtime.step(torch.tensor([token]), prompt_len + step, step)
            for record in records:
                hits = probe.hits.pop(record.layer)  # [R, B, Hkv]
                for row in layer_step_rows(record):
                    for i, r in enumerate(RATIOS):
                        row[f"hits_x{r}"] = int(hits[i, row["batch"], row["kv_head"]])
                    mismatch += int(row["hits_x1.0"] != row["hits"])
                    rows.append({k: v for k, v in row.items() if not k.startswith("t_")})
    return rows, followed, disagree, mismatch


# study counter -> the eager rows' column of the same quantity
GRAPH_COLUMNS = {"selected": "selected_blocks", "predicted": "predicted_blocks", "overlap": "overlap_blocks"}


def decode_variant_graph(model: Any, prefill: Any, cfg: Any, steps: int,
                         tokens: list[int] | None) -> tuple[list[dict[str, Any]], list[int], int, int]:
    """`decode_variant` on the graph engine: the same replayed prefill and calibration, then the
    engine's decode with its study counters at every ratio of RATIOS (read once)."""
    from prr.runtime.study_decode import graph_study_decode, layer_head_rows

    runtime = variant_runtime(model, prefill, cfg, steps, probe=False)
    run = graph_study_decode(runtime, prefill.last_logits, steps, RATIOS, tokens)
    selector = runtime.backend.selector
    sparse = [i for i in range(model.config.num_layers) if not selector.is_dense_layer(i)]
    rows = [{GRAPH_COLUMNS.get(k, k): v for k, v in row.items() if not k.startswith("predicted_x")}
            for row in layer_head_rows(run.counters, sparse)]
    mismatch = sum(int(row["hits_x1.0"] != row["hits"]) for row in rows)
    return rows, run.tokens, run.disagreements, mismatch


RATES = ("last_step_overlap", *(f"ema_hit_x{r}" for r in RATIOS), "mass_recall", "output_relerr")
PROMPT = ["task", "sample"]  # one prompt: a task's sample


def pooled(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Σ-pooled rates per group (not means of ratios); mass recall and output error: means over
    the dense-measured (step, layer, KV head)s; selected_blocks: mean |A| per (step, layer, KV head);
    rows: how many. frame: one row per (step, layer, KV head) (the eager runtime's), or per
    (layer, KV head) with each column summed over `steps` steps, `measured` of them dense-measured
    (the graph engine's study counters)."""
    if "steps" not in frame:  # one step per row, dense-measured where it has a mass recall
        frame = frame.assign(steps=1, measured=frame["mass_recall"].notna().astype(int))
    g = frame.groupby(by, sort=False)
    sel, steps, measured = g["selected_blocks"].sum(), g["steps"].sum(), g["measured"].sum()
    out = pd.DataFrame({"last_step_overlap": g["overlap_blocks"].sum() / sel,
                        **{f"ema_hit_x{r}": g[f"hits_x{r}"].sum() / sel for r in RATIOS},
                        "mass_recall": g["mass_recall"].sum() / measured,
                        "output_relerr": g["output_relerr"].sum() / measured,
                        "selected_blocks": sel / steps, "rows": steps})
    return out.reset_index()


def over_prompts(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per group of `by`: each rate's mean over prompts of the prompt's pooled rate, with its 95%
    bootstrap interval over prompts (prr.intervals.means_over_prompts), `selected_blocks` and `rows`.
    frame: one row per (step, layer, KV head) with the PROMPT columns."""
    per_prompt = pooled(frame, by + [c for c in PROMPT if c not in by])
    table = means_over_prompts(per_prompt, by, RATES)
    extra = per_prompt.groupby(by, sort=False).agg(selected_blocks=("selected_blocks", "mean"), rows=("rows", "sum"))
    return table.join(extra, on=by)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    tasks, variants = args.tasks.split(","), args.variants.split(",")
    topks = [int(x) for x in args.topk.split(",")]
    runtime = [f"runtime.device={args.device}", f"runtime.dtype={args.dtype}", "runtime.engine=eager",
               f"runtime.block_size={args.block_size}", f"backend={args.backend}"]
    # (value overrides apply after the group choices: dense_layers=[] holds for every selector variant)
    common = [f"model={args.model}", "logger=none", *runtime, "task=ruler", "budget=fixed",
              "budget.ratio=1.0", "runtime.mode=shadow", "selector.dense_layers=[]"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python experiments/locality_study.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    t_start = time.perf_counter()
    first = compose_config(common + ["selector=dense", "predictor=none", f"task.context_tokens={contexts[0]}"])
    settings = instantiate(first.runtime)
    weights = []  # the indexer variant's (its trained shape and dense layers, or random ones when asked)
    if any(VARIANTS[v][0] == "indexer" for v in variants):
        try:
            weights = indexer_weight_overrides(first.model.name_or_path, args.indexer_weights)
        except ValueError as err:
            raise SystemExit(f"--variants indexer: {err}") from None
    model = instantiate(first.model).load(settings.dtype, settings.device)
    frames: list[pd.DataFrame] = []
    checks: list[dict[str, Any]] = []
    finished: list[str] = []  # "task context" done: a run cut short says which it has
    for ctx in contexts:
        for task_name in tasks:
            task_over = [f"task.name={task_name}", f"task.context_tokens={ctx}", f"task.num_samples={args.samples}"]
            dense = Engine(compose_config(common + task_over + ["selector=dense", "predictor=none"]), model, ctx + args.steps)
            task = instantiate(dense.cfg.task)
            for index, sample in enumerate(task.samples(dense.tokenizer)[: args.samples]):
                ids = dense.encode_prompt(sample.prompt, task.chat_template, sample.gen_prefix)  # [1, T]
                # K covering the context leaves nothing out: not measured
                configs = {(variant, k): compose_config(common + task_over + EMA + variant_overrides(
                    variant, k, args.block_size, weights)) for variant in variants for k in topks
                    if k * args.block_size < ids.shape[1]}
                keep = sorted({layer for cfg in configs.values()  # the hidden states a variant's selector reads
                               for layer in hidden_layers(instantiate(cfg.selector), model.config.num_layers)})
                t0 = time.perf_counter()
                prefill = dense.prefill(ids, hidden=keep)
                prefill_s = time.perf_counter() - t0
                tokens: list[int] | None = None  # each prompt's dense trajectory, shared by its variants
                for (variant, k), cfg in configs.items():
                    t0 = time.perf_counter()
                    rows, followed, disagree, mismatch = decode_variant(model, prefill, cfg, args.steps, tokens,
                                                                        args.engine)
                    tokens = tokens or followed
                    frames.append(pd.DataFrame(rows).assign(
                        model=args.model, task=task_name, sample=index, context_tokens=ctx,
                        prompt_tokens=ids.shape[1], variant=variant, topk_blocks=k))
                    checks.append({"task": task_name, "sample": index, "context_tokens": ctx, "variant": variant,
                                   "topk_blocks": k, "argmax_disagreements": disagree,
                                   "probe_hit_mismatches": mismatch, "decode_s": round(time.perf_counter() - t0, 1),
                                   "prefill_s": round(prefill_s, 1)})
                    last = pooled(frames[-1], ["variant"]).iloc[0]
                    print(f"{args.model} {task_name} #{index} {ctx} ({ids.shape[1]} prompt tokens) {variant} K={k}: "
                          f"overlap {last.last_step_overlap:.3f} EMA hit x1 {last['ema_hit_x1.0']:.3f} "
                          f"x2 {last['ema_hit_x2.0']:.3f} recall {last.mass_recall:.3f} "
                          f"({checks[-1]['decode_s']}s, {time.perf_counter() - t_start:.0f}s so far)", flush=True)
            finished.append(f"{task_name} {ctx}")
            if frames:
                write(out, pd.concat(frames, ignore_index=True), checks, command, args, time.perf_counter() - t_start,
                      {"planned": [f"{t} {c}" for c in contexts for t in tasks], "finished": finished})
    if not frames:
        raise SystemExit(f"nothing measured: every K of {topks} covers the prompts of contexts {contexts}")
    bad = [c for c in checks if c["argmax_disagreements"] or c["probe_hit_mismatches"]]
    print(f"checks: {len(checks)} decodes, {len(bad)} with a trajectory or probe mismatch: {bad}")
    print(pd.read_csv(f"{out}_by_context.csv").drop(columns="command").to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if bad:
        raise SystemExit(f"{len(bad)} decodes failed their checks (see {out}.json): the numbers are not valid")


def write(out: Path, frame: pd.DataFrame, checks: list[dict[str, Any]], command: str, args: argparse.Namespace,
          wall_s: float, progress: dict[str, list[str]]) -> None:
    key = ["model", "context_tokens", "variant", "topk_blocks"]
    tables = {"": over_prompts(frame, ["model", "task", "context_tokens", "variant", "topk_blocks"]),
              "_by_context": over_prompts(frame, key),
              "_per_layer": over_prompts(frame, key + ["layer"]),
              "_per_head": over_prompts(frame, key + ["layer", "kv_head"])}
    prompt_tokens = frame.groupby(["task", "context_tokens"])["prompt_tokens"].mean().rename("prompt_tokens")
    tables[""] = tables[""].join(prompt_tokens, on=["task", "context_tokens"])  # mean over the task's prompts
    units = {v: selector_unit(VARIANTS[v][0], args.block_size) for v in VARIANTS}  # tokens a selected_block holds
    for suffix, table in tables.items():
        table.assign(unit_tokens=table["variant"].map(units), command=command).to_csv(f"{out}{suffix}.csv", index=False)
    weakest = {}
    for (model, ctx, variant, k), group in tables["_per_layer"].groupby(key):
        low = group.nsmallest(3, "last_step_overlap")
        weakest[f"{model} {ctx} {variant} K={k}"] = [
            {"layer": int(r.layer), "last_step_overlap": round(float(r.last_step_overlap), 4),
             "ema_hit_x1.0": round(float(r["ema_hit_x1.0"]), 4), "mass_recall": round(float(r.mass_recall), 4)}
            for _, r in low.iterrows()]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu {platform.machine()}"
    write_json_atomic(Path(f"{out}.json"), {
        "command": command, "model": args.model, "device": device, "dtype": args.dtype, "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": round(wall_s, 1),
        "mode": "shadow (dense trajectory), all layers sparse-measured", "engine": args.engine, "steps": args.steps,
        "block_size": args.block_size, "ratios": list(RATIOS), "predictor": "ema (calibrated on the prefill tail)",
        **progress, "checks": checks, "weakest_layers_by_overlap": weakest})


if __name__ == "__main__":
    main()
