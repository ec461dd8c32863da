"""Predictors against EMA at equal speculation budget, on the default model.

    python experiments/predictor_study.py [--steps 128] [--ratios 1.0 1.25 1.5]
                                          [--tasks long_text ruler_... ruler:NAME] [--out experiments/results/cpu/predictor_study]
    python experiments/predictor_study.py --model qwen2.5-coder-0.5b --tasks ruler:qa_2 --context-tokens 32768 \
        --device cuda --dtype bfloat16 --out experiments/results/h200/predictor_study_qwen_32k   # a GPU

How: one shadow-mode decode per task (attention stays dense, so the trajectory does not
depend on the predictor) is captured through the ordinary runtime (DSABackend and its
PRRStep): the prefill-tail selections the predictor is calibrated and warmed on, and
per decode step and sparse layer the query q [B, Hkv, G, D], the context size and the
selection A. Every predictor option × |P| ratio is then replayed on that trace through its
public interface in the runtime's order (calibrate, init_state, warm-up updates; then per
step, layer by layer: propose(|P|) then update), so all predictors see identical inputs and
a replay costs no model forward. Check: the captured run itself ran `ema` at |P| = K, and
its replay must reproduce that run's hits exactly (recorded in the JSON).

|P| = round(ratio × K) (K = selector.topk_blocks, the fixed budget's rule). Per predictor,
ratio and layer: hit rate |P∩A|/|A|, precision |P∩A|/|P|, misses |A\\P| per step; cost: the
median wall time of propose and of update per layer-step on this CPU (one thread) and the
predictor state's bytes.

--engine graph decodes each prompt once per predictor through the graph engine instead
(prr.runtime.study_decode; CUDA-graph replays on a GPU): the same prefill, calibration and
warm-up, then the engine's device study counters give, per layer, the hits, |A| and |P| of the
predictor's proposal at every ratio (from the state each step's P came from, exactly what the
replay proposes: tests/test_study_counters.py), read once per decode; the first predictor's
greedy tokens are fed to the others. Its check: each engine's own |P| = K hits equal its
counters' at ratio 1.0. Not timed there (propose_us / update_us are NaN: see
experiments/bench_predictors.py).

--samples N captures N prompts per generated task (its seed, seed + 1, ...). Every rate of a table
(hit rate, precision, misses per step) is the mean over prompts of the prompt's pooled rate, with a
95% bootstrap interval over prompts (<rate>_lo, <rate>_hi; prompts = n; one prompt: no width).

Every prompt's rows go into a results store as soon as it is measured (OUT_store.csv.gz, with
OUT_store.json: the run's config and each prompt's description and checks), so a run cut short
loses nothing: --resume continues it (its prompts skipped; another config is refused), and
--time-budget S starts no prompt after S seconds. Prompts run sample by sample across the tasks,
so a cut run leaves every task with prompts. The model is loaded once; with --engine graph each
prompt is prefilled once (dense, q/k/v kept) and replayed into each predictor's runtime.

Writes OUT.csv (task × predictor × ratio), OUT_per_layer.csv, OUT_by_predictor.csv (predictor ×
ratio over every task's prompts), OUT_per_prompt.csv (each prompt's rates), OUT.json (command, date, versions, the replay checks, rows) and
the figure analysis/figures/predictor_hit_rate_vs_budget.{png,pdf}, all from the store.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from prr.blocks import BlockSet
from prr.config_check import compose_config, validate
from prr.intervals import means_over_prompts
from prr.paths import strict_json_dumps
from prr.predictors.base import Predictor
from prr.run_inputs import DTYPES
from prr.runtime.eager_run import EagerRuntime, next_token
from prr.selectors.base import Selection
from prr.tasks.ruler import task_overrides

ROOT = Path(__file__).resolve().parents[1]

# name -> Hydra overrides of the predictor group. `ema`: one calibrated triple for all layers
# (predictor=ema's default before issue 53, the results' "ema (default)"); ema_fixed: the same EMA
# uncalibrated (plain predictor=ema since issue 53); ema_calibrated: per layer.
PREDICTORS: dict[str, list[str]] = {
    "last_step": ["predictor=last_step"],
    "ema_fixed": ["predictor=ema", "predictor.calibrate=false"],
    "ema": ["predictor=ema", "predictor.calibrate=true"],  # (the default before issue 53)
    "ema_calibrated": ["predictor=ema_calibrated"],
    "spin": ["predictor=spin"],
    "spin_no_explore": ["predictor=spin", "predictor.explore=0.0"],
    "query_similarity": ["predictor=query_similarity"],
    # control: only the 2 latest queries cached, so similarity search has nothing older to find
    "query_similarity_last2": ["predictor=query_similarity", "predictor.cache_size=2"],
    "cross_layer": ["predictor=cross_layer"],
    "cross_layer_ema": ["predictor=cross_layer", "predictor.temporal_weight=0.5"],
    # the graph engine's predictor (runtime.engine=graph): EMA of selection membership
    "ema_membership": ["predictor=ema_membership"],
    "ema_membership_a0.5": ["predictor=ema_membership", "predictor.alpha=0.5"],
}
RULER_TASKS = ("ruler_niah_multikey", "ruler_vt")  # retrieval and multi-hop tracing; run when their configs exist
CAPTURE_PREDICTOR = "ema"  # what the captured run itself speculates with (|P| = K): the replay check


@dataclass
class LayerStep:
    layer: int
    num_blocks: int
    query: torch.Tensor  # [B, Hkv, G, D]
    selection: Selection  # A


@dataclass
class Trace:
    history: list[list[Selection] | None] = field(default_factory=list)  # prefill tail per layer; None: dense
    steps: list[list[LayerStep]] = field(default_factory=list)  # [decode step][sparse layer, in order]
    live_hits: int = 0  # the captured run's own |P∩A| summed (CAPTURE_PREDICTOR at |P| = K)
    live_selected: int = 0


class Tracer(Predictor):
    """Wraps the run's predictor and records what the runtime hands it; changes nothing."""

    needs_query = True

    def __init__(self, inner: Predictor, trace: Trace) -> None:
        self.inner, self.trace = inner, trace
        self.query: dict[int, torch.Tensor] = {}
        self.num_blocks: dict[int, int] = {}
        self.decoding = False
        self.step = -1

    def init_state(self, num_layers: int, batch: int, num_kv_heads: int, max_blocks: int, device: Any) -> Any:
        return self.inner.init_state(num_layers, batch, num_kv_heads, max_blocks, device)

    def calibrate(self, history: list[list[Selection] | None]) -> dict[str, Any]:
        self.trace.history = history
        return self.inner.calibrate(history)

    def rank(self, state: Any, layer: int, num_blocks: int) -> torch.Tensor:
        return self.inner.rank(state, layer, num_blocks)

    def propose(self, state: Any, layer: int, num_blocks: int, budget_blocks: int, current: Selection | None = None,
                query: torch.Tensor | None = None) -> BlockSet:
        self.decoding = True
        self.query[layer], self.num_blocks[layer] = query.clone(), num_blocks
        return self.inner.propose(state, layer, num_blocks, budget_blocks, current)

    def update(self, state: Any, layer: int, selection: Selection) -> None:
        if self.decoding:
            self.trace.steps[-1].append(LayerStep(layer, self.num_blocks.pop(layer), self.query.pop(layer), selection))
        self.inner.update(state, layer, selection)


def task_config(task: str, steps: int, overrides: list[str], sample: int, predictor: str) -> Any:
    """The composed, validated config of one shadow-mode decode of `task` (a spec of
    prr.tasks.ruler.task_overrides) with the named predictor of PREDICTORS at |P| = K, under the
    overrides (model, device, context); sample s > 0: the task generated with its seed + s."""
    cfg = compose_config([*task_overrides(task), "runtime.mode=shadow", *PREDICTORS[predictor], "budget=fixed",
                          "budget.ratio=1.0", "logger=none", *overrides], check=False)
    OmegaConf.update(cfg, "task.max_new_tokens", steps)
    if sample:
        if "seed" not in cfg.task:
            raise ValueError(f"task {task} has one prompt (no task.seed): --samples > 1 needs generated tasks (ruler_*)")
        OmegaConf.update(cfg, "task.seed", cfg.task.seed + sample)
    if "stop_at_eos" in cfg.task:
        OmegaConf.update(cfg, "task.stop_at_eos", False)  # a fixed number of steps per task
    validate(cfg)
    return cfg


def shadow_runtime(cfg: Any, model: Any, predictor: Predictor, prompt: Any = None) -> tuple[EagerRuntime, Any, Any]:
    """The research runtime of cfg in shadow mode (every step dense-measured) around `predictor`,
    with the task's prompt (built here unless given: it does not depend on the predictor)
    -> (the runtime, the task object, the prompt batch)."""
    settings, task_obj, selector, budget = (instantiate(cfg[g]) for g in ("runtime", "task", "selector", "budget"))
    mc = model.config
    selector.bind_model(mc)
    if prompt is None:
        prompt = task_obj.build(model.tokenizer, mc.vocab_size, settings.batch_size)
    runtime = EagerRuntime(model.decoder, settings, selector, predictor, budget, instantiate(cfg.backend).name,
                           prompt.input_ids.shape[1] + task_obj.max_new_tokens, DTYPES[settings.dtype], mode="shadow",
                           dense_metrics_every=1, check_serial=False)
    return runtime, task_obj, prompt


def load_model(overrides: list[str] | Any) -> Any:
    """The model of the overrides (model, device, dtype) or of a composed config, loaded once per
    run: every prompt and predictor decodes through it."""
    cfg = compose_config(["logger=none", *overrides], check=False) if isinstance(overrides, list) else overrides
    settings = instantiate(cfg.runtime)
    return instantiate(cfg.model).load(settings.dtype, settings.device)


def capture(task: str, steps: int, overrides: list[str], sample: int = 0,
            model: Any = None) -> tuple[Trace, dict[str, Any]]:
    """One shadow-mode decode of `task` (a spec of prr.tasks.ruler.task_overrides) under the
    overrides (model, device, context); sample s > 0: the task generated with its seed + s (another
    prompt; tasks without a seed have one prompt). model: the overrides' model, loaded (None: load
    it here). -> its trace and a description."""
    cfg = task_config(task, steps, overrides, sample, CAPTURE_PREDICTOR)
    settings = instantiate(cfg.runtime)
    model = model if model is not None else load_model(cfg)
    mc = model.config
    trace = Trace()
    tracer = Tracer(instantiate(cfg.predictor), trace)
    torch.manual_seed(cfg.seed)  # (before the selector is built: random feature maps draw from it)
    runtime, task_obj, prompt = shadow_runtime(cfg, model, tracer)
    selector = runtime.backend.selector
    prompt_len = prompt.input_ids.shape[1]
    generator = torch.Generator().manual_seed(cfg.seed)
    with torch.inference_mode():
        logits = runtime.prefill(prompt.input_ids)
        runtime.finish_prefill()
        for step in range(task_obj.max_new_tokens):
            token = next_token(logits, task_obj.temperature, task_obj.top_p, generator)
            trace.steps.append([])
            logits, records, _, _ = runtime.step(token, prompt_len + step, step)
            for r in records:
                trace.live_hits += int((r.selected & r.predicted).sum())
                trace.live_selected += int(r.selected.sum())
    info = {"task": task, "sample": sample, "prompt": prompt.description, "prompt_tokens": prompt_len, "decode_steps": len(trace.steps),
            "topk_blocks": selector.topk_blocks, "block_size": settings.block_size, "selector": cfg.selector._target_,
            "sparse_layers": len(trace.steps[0]), "num_layers": mc.num_layers, "model": model.name}
    return trace, info


def graph_capture(task: str, steps: int, overrides: list[str], sample: int, names: list[str],
                  ratios: list[float], model: Any = None) -> tuple[dict[tuple[str, float], pd.DataFrame],
                                                                  dict[tuple[str, float], dict], dict[str, Any]]:
    """`--engine graph`: the task's prompt built and prefilled once (dense, q/k/v kept:
    prr.evaluation.kept_prefill), then per predictor of `names` one shadow-mode decode through
    the graph engine (prr.runtime.study_decode: the kept prefill replayed into the research
    runtime and calibrated there, then engine steps with the device study counters at every
    ratio, read once), the first
    predictor's greedy tokens fed to the others (teacher forcing; shadow mode: the same dense
    trajectory). -> ({(predictor, ratio): one row per sparse layer, summed over the steps, in
    `replay`'s columns (propose_us / update_us: not timed here, NaN)}, {(predictor, ratio): state
    bytes and calibration}, a description with each predictor's check: the engine's own |P| = K
    hits equal the study counters' at ratio 1.0)."""
    from prr.evaluation import hidden_layers, kept_prefill
    from prr.runtime.study_decode import graph_study_decode

    frames, extras, checks = {}, {}, {}
    tokens: list[int] | None = None
    info = prompt = prefill = None
    for name in names:
        cfg = task_config(task, steps, overrides, sample, name)
        model = model if model is not None else load_model(cfg)
        predictor = instantiate(cfg.predictor)
        torch.manual_seed(cfg.seed)  # (before the selector is built, as `capture` does)
        runtime, task_obj, prompt = shadow_runtime(cfg, model, predictor, prompt)
        if task_obj.temperature != 0:
            raise ValueError(f"--engine graph decodes greedily; task {task} samples (task.temperature="
                             f"{task_obj.temperature})")
        if prefill is None:  # one dense prefill per prompt; each predictor's runtime replays it
            # (with the normed hidden states of the selector's sparse layers where it reads them: the indexer)
            prefill = kept_prefill(model, prompt.input_ids, runtime.device,
                                   hidden_layers(runtime.backend.selector, model.config.num_layers))
        with torch.inference_mode():
            runtime.replay_prefill(prefill)
            calibration = runtime.finish_prefill()
        run = graph_study_decode(runtime, prefill.last_logits, task_obj.max_new_tokens, tuple(ratios), tokens)
        tokens = tokens or run.tokens
        selector = runtime.backend.selector
        prompt_len, k, bs = prompt.input_ids.shape[1], selector.topk_blocks, runtime.cache.block_size
        sparse = [i for i in range(model.config.num_layers) if not selector.is_dense_layer(i)]
        heads = run.counters["steps"][sparse].sum(-1) * runtime.cache.batch  # [sparse layers]: layer-steps × KV heads
        blocks = [(prompt_len + t + bs) // bs for t in range(len(run.tokens))]  # each step's context in blocks
        for ratio in ratios:
            budget = statistics.fmean(min(round(ratio * min(k, nb)), nb) for nb in blocks)  # FixedBudget's rule
            frames[name, ratio] = pd.DataFrame({
                "layer": sparse, "budget_blocks": budget,
                "hits": run.counters[f"hits_x{ratio}"][sparse].sum(-1).long().tolist(),
                "selected": run.counters["selected"][sparse].sum(-1).long().tolist(),
                "predicted": run.counters[f"predicted_x{ratio}"][sparse].sum(-1).long().tolist(),
                "heads": heads.long().tolist(), "propose_us": float("nan"), "update_us": float("nan")})
            extras[name, ratio] = {"state_bytes": state_bytes(runtime.backend.predictor_state),
                                   **{c: v for c, v in calibration.items() if not isinstance(v, list)}}
        if 1.0 in ratios and predictor.speculates:
            engine_hits, study_hits = int(run.counters["hits"].sum()), int(run.counters["hits_x1.0"].sum())
            checks[name] = {"live_hits": engine_hits, "replay_hits": study_hits,
                            "live_selected": int(run.counters["selected"].sum()), "argmax_disagreements": run.disagreements}
            if engine_hits != study_hits:
                raise RuntimeError(f"{name} on {task}: the engine's own |P| = K hits ({engine_hits}) differ from its study "
                                   f"counters' at ratio 1.0 ({study_hits})")
        info = info or {"task": task, "sample": sample, "prompt": prompt.description, "prompt_tokens": prompt_len,
                        "decode_steps": len(run.tokens), "topk_blocks": k, "block_size": bs,
                        "selector": cfg.selector._target_, "sparse_layers": len(sparse),
                        "num_layers": model.config.num_layers, "model": model.name, "engine": "graph"}
    info["engine_checks"] = checks  # per predictor: the engine's own hits at |P| = K against the study's x1.0
    if CAPTURE_PREDICTOR in checks:
        info["replay_check"] = checks[CAPTURE_PREDICTOR]
    return frames, extras, info


def state_bytes(state: Any) -> int:
    """Bytes of every tensor reachable from a predictor state (dataclasses, dicts, lists)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if dataclasses.is_dataclass(state):
        return sum(state_bytes(getattr(state, f.name)) for f in dataclasses.fields(state))
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def replay(trace: Trace, predictor: Predictor, ratio: float, topk_blocks: int) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Run `predictor` over the trace in the runtime's order at |P| = round(ratio·K).
    -> one row per (step, layer) with hits/selected/predicted summed over batch and KV heads,
    and the calibration record."""
    steps0 = trace.steps[0][0].selection.blocks  # shapes from the first step
    batch, heads = steps0.indices.shape[:2]
    max_blocks = trace.steps[0][0].selection.scores.shape[-1]
    calibration = predictor.calibrate(trace.history)
    state = predictor.init_state(len(trace.history), batch, heads, max_blocks, steps0.indices.device)
    for layer, selections in enumerate(trace.history):
        for selection in selections or []:
            predictor.update(state, layer, selection)
    query_kw = getattr(predictor, "needs_query", False)
    rows = []
    for step, layer_steps in enumerate(trace.steps):
        for ls in layer_steps:
            budget = min(round(ratio * min(topk_blocks, ls.num_blocks)), ls.num_blocks)  # FixedBudget's rule
            t0 = time.perf_counter()
            predicted = predictor.propose(state, ls.layer, ls.num_blocks, budget, None,
                                          **({"query": ls.query} if query_kw else {}))
            t1 = time.perf_counter()
            predictor.update(state, ls.layer, ls.selection)
            t2 = time.perf_counter()
            a, p = ls.selection.blocks.mask(max_blocks), predicted.mask(max_blocks)
            hits = int((a & p).sum())
            rows.append({"step": step, "layer": ls.layer, "budget_blocks": budget, "hits": hits,
                         "selected": int(a.sum()), "predicted": int(p.sum()), "heads": batch * heads,
                         "propose_us": (t1 - t0) * 1e6, "update_us": (t2 - t1) * 1e6})
    calibration = {k: v for k, v in calibration.items() if not isinstance(v, list)}  # per-layer lists: too long
    return pd.DataFrame(rows), {"state_bytes": state_bytes(state), **calibration}


def aggregate(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    g = frame.groupby(by, sort=False)
    out = pd.DataFrame({
        "budget_blocks": g["budget_blocks"].mean(),
        "predicted_blocks": g["predicted"].sum() / g["heads"].sum(),  # mean |P| per layer-step and KV head
        "hit_rate": g["hits"].sum() / g["selected"].sum(),
        "precision": g["hits"].sum() / g["predicted"].sum(),
        "misses_per_step": (g["selected"].sum() - g["hits"].sum()) / g["heads"].sum(),  # |A\P| per layer-step, KV head
    })
    return out.reset_index()


RATES = ("hit_rate", "precision", "misses_per_step")


def over_prompts(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per group of `by`: `aggregate`'s rates pooled within each prompt (task, sample), then their
    mean over prompts with a 95% bootstrap interval over prompts (prr.intervals.means_over_prompts),
    never over steps (correlated within a prompt); budget_blocks and predicted_blocks: means."""
    per_prompt = aggregate(frame, by + [c for c in ("task", "sample") if c not in by])
    sizes = per_prompt.groupby(by, sort=False)[["budget_blocks", "predicted_blocks"]].mean()
    return sizes.join(means_over_prompts(per_prompt, by, RATES).set_index(by)).reset_index()


def measure_prompt(args: argparse.Namespace, task: str, sample: int, overrides: list[str], model: Any
                   ) -> tuple[dict[tuple[str, float], pd.DataFrame], dict[tuple[str, float], dict], dict[str, Any]]:
    """One prompt (task's sample) through every predictor of args at every ratio -> ({(predictor,
    ratio): its rows (graph: one per sparse layer, summed over the steps; eager: one per step and
    sparse layer)}, {(predictor, ratio): state bytes and calibration}, the prompt's description with
    its checks). Raises when the eager replay of CAPTURE_PREDICTOR does not reproduce the live run."""
    if args.engine == "graph":  # every predictor decoded, its counters read: the same frames as replays
        return graph_capture(task, args.steps, overrides, sample, args.predictors, args.ratios, model)
    trace, info = capture(task, args.steps, overrides, sample, model)
    frames, extras = {}, {}
    for name in args.predictors:
        for ratio in args.ratios:
            predictor = instantiate(compose_config(PREDICTORS[name], check=False).predictor)
            with torch.inference_mode():  # as in a run (the trace's tensors are inference tensors)
                frames[name, ratio], extras[name, ratio] = replay(trace, predictor, ratio, info["topk_blocks"])
            if name == CAPTURE_PREDICTOR and ratio == 1.0:
                info["replay_check"] = {"live_hits": trace.live_hits, "replay_hits": int(frames[name, ratio]["hits"].sum()),
                                        "live_selected": trace.live_selected,
                                        "replay_selected": int(frames[name, ratio]["selected"].sum())}
    check = info.get("replay_check")
    print(f"replay check ({CAPTURE_PREDICTOR} at |P| = K, live run vs replay): {check}", flush=True)
    if check and check["live_hits"] != check["replay_hits"]:
        raise RuntimeError(f"replay of {CAPTURE_PREDICTOR} does not reproduce the live run on {task}: {check}")
    return frames, extras, info


class PromptStore:
    """The study's results store, so that a run cut short (a device call's limit, --time-budget)
    loses nothing and --resume continues it: OUT_store.csv.gz holds every measured prompt's rows
    (appended, one gzip member per prompt), OUT_store.json the run's config and each prompt's
    description (rewritten after the rows: a prompt counts as done only once both are written)."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        self.frames_path = out.parent / f"{out.name}_store.csv.gz"
        self.meta_path = out.parent / f"{out.name}_store.json"
        self.config = config
        self.meta: dict[str, Any] = {"config": config, "prompts": []}

    def open(self, resume: bool) -> None:
        """Start a new store, or (resume) continue the existing one of the same config. Raises
        ValueError for an existing store without resume, or one of another config."""
        exists = self.meta_path.exists() or self.frames_path.exists()
        if exists and not resume:
            raise ValueError(f"{self.frames_path} exists: pass --resume to continue it (its prompts are kept and "
                             "skipped), or choose another --out")
        if not exists:
            self.frames_path.parent.mkdir(parents=True, exist_ok=True)
            return
        if not self.meta_path.exists():  # rows without their descriptions: a run killed mid-first-prompt
            self.frames_path.unlink()
            return
        self._read_meta("--resume")
        if self.frames_path.exists():  # drop the rows of a prompt whose description was never written
            rows = pd.read_csv(self.frames_path)
            kept = self._described(rows)
            if len(kept) < len(rows):
                with gzip.open(self.frames_path, "wt") as f:
                    kept.to_csv(f, index=False)

    def _read_meta(self, what: str) -> None:
        """Load the stored descriptions; ValueError when the store was made with another config."""
        meta = json.loads(self.meta_path.read_text())
        differ = {k: (meta["config"].get(k), v) for k, v in self.config.items() if meta["config"].get(k) != v}
        if differ:
            raise ValueError(f"{what}: {self.meta_path} was made with another config "
                             f"({', '.join(f'{k}: stored {a!r}, now {b!r}' for k, (a, b) in differ.items())}); "
                             "pass the same options, or choose another --out")
        self.meta = meta

    def merge(self, stem: Path) -> None:
        """Fold another run's store (the same config, none of this store's prompts) into this one."""
        other = PromptStore(stem, self.config)
        if not other.meta_path.exists():
            raise ValueError(f"--merge {stem}: no {other.meta_path}")
        other._read_meta(f"--merge {stem}")  # read only: nothing is written into the other run's files
        overlap = other.done & self.done
        if overlap:
            raise ValueError(f"--merge {stem}: prompts {sorted(overlap)} are in both stores")
        rows = other.frames()
        header = not self.frames_path.exists()
        if not header:  # appended under this store's header, in its column order
            rows = rows[pd.read_csv(self.frames_path, nrows=0).columns]
        with gzip.open(self.frames_path, "at") as f:
            rows.to_csv(f, index=False, header=header)
        self.meta["prompts"] += other.prompts()
        self._write_meta()

    def _write_meta(self) -> None:
        tmp = self.meta_path.with_suffix(".json.tmp")
        tmp.write_text(strict_json_dumps(self.meta, indent=1, default=float) + "\n")
        tmp.replace(self.meta_path)

    @property
    def done(self) -> set[tuple[str, int]]:
        return {(p["task"], p["sample"]) for p in self.meta["prompts"]}

    def add(self, task: str, sample: int, frames: dict[tuple[str, float], pd.DataFrame],
            extras: dict[tuple[str, float], dict], info: dict[str, Any], command: str) -> None:
        """One prompt's rows and description, each row with the command that made it."""
        rows = pd.concat([f.assign(task=task, sample=sample, predictor=k[0], ratio=k[1]) for k, f in frames.items()],
                         ignore_index=True).assign(command=command)
        header = not self.frames_path.exists()
        with gzip.open(self.frames_path, "at") as f:
            rows.to_csv(f, index=False, header=header)
        info = {**info, "task": task, "sample": sample, "extras": {f"{k[0]}|{k[1]}": v for k, v in extras.items()}}
        self.meta["prompts"].append(info)
        self._write_meta()

    def frames(self) -> pd.DataFrame:
        """Every done prompt's rows (empty without any)."""
        if not self.frames_path.exists():
            return pd.DataFrame(columns=["task", "sample", "predictor", "ratio"])
        return self._described(pd.read_csv(self.frames_path))

    def _described(self, rows: pd.DataFrame) -> pd.DataFrame:
        """The rows of prompts whose description was written (the done ones)."""
        if not self.done:
            return rows.iloc[0:0]
        done = pd.MultiIndex.from_tuples(sorted(self.done), names=["task", "sample"])
        return rows[pd.MultiIndex.from_frame(rows[["task", "sample"]]).isin(done)].reset_index(drop=True)

    def prompts(self) -> list[dict[str, Any]]:
        return list(self.meta["prompts"])


def versions() -> dict[str, str]:
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "prr_commit": commit}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/cpu/predictor_study")
    parser.add_argument("--steps", type=int, default=128, help="decode steps per task")
    parser.add_argument("--samples", type=int, default=1,
                        help="prompts per task (generated tasks: seeds seed..seed+n-1; each rate: mean over prompts, 95%% interval)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.0, 1.25, 1.5], help="|P| / K")
    parser.add_argument("--tasks", nargs="+", default=None,
                        help=f"task options or ruler:NAME (default: long_text and those of {list(RULER_TASKS)} in conf/task/)")
    parser.add_argument("--model", default=None, help="model option (default: the config's)")
    parser.add_argument("--context-tokens", type=int, default=None, help="task.context_tokens of RULER tasks")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--figures", type=Path, default=ROOT / "analysis/figures", help="where the figure goes")
    parser.add_argument("--no-figures", action="store_true", help="no figure (a machine without matplotlib)")
    parser.add_argument("--predictors", nargs="+", default=list(PREDICTORS), choices=list(PREDICTORS))
    parser.add_argument("--engine", default="eager", choices=["eager", "graph"],
                        help="eager: one traced decode per prompt, every predictor replayed on the host (timed); "
                             "graph: one graph-engine decode per predictor with the device study counters (untimed)")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override of every decode's config, repeatable (e.g. --set selector.topk_blocks=64)")
    parser.add_argument("--resume", action="store_true",
                        help="continue OUT_store.csv.gz (the per-prompt results store): its prompts are kept and skipped; "
                             "without it an existing store is refused")
    parser.add_argument("--merge", type=Path, nargs="+", default=[], metavar="STEM",
                        help="first fold these runs' stores (STEM_store.csv.gz/.json: the same config, other prompts, "
                             "e.g. parallel runs over different tasks) into OUT's; with --time-budget 0 only the tables "
                             "are rebuilt")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no new prompt starts (the tables cover what finished; --resume continues)")
    args = parser.parse_args(argv)
    tasks = args.tasks or ["long_text", *(t for t in RULER_TASKS if (ROOT / "conf/task" / f"{t}.yaml").is_file())]
    missing = [t for t in tasks if not t.startswith("ruler:") and not (ROOT / "conf/task" / f"{t}.yaml").is_file()]
    for task in tasks:
        if task.startswith("ruler:"):
            try:
                task_overrides(task)
            except ValueError as err:
                parser.error(str(err))
    if args.context_tokens is not None and not any(t.startswith("ruler:") for t in tasks):
        parser.error(f"--context-tokens={args.context_tokens} applies to ruler:NAME tasks only; tasks are {tasks}")
    if missing or args.steps < 1 or args.samples < 1 or any(r <= 0 for r in args.ratios):
        parser.error(f"unknown tasks {missing} (see conf/task/), or --steps={args.steps} < 1, or --samples="
                     f"{args.samples} < 1, or a ratio <= 0: {args.ratios}")
    torch.set_num_threads(1)  # cost numbers per predictor, not per thread pool; the machine is shared
    overrides = [f"runtime.device={args.device}", f"runtime.dtype={args.dtype}", "runtime.engine=eager",
                 *([f"model={args.model}"] if args.model else []), *args.extra]
    def task_extra(task: str) -> list[str]:
        return [f"task.context_tokens={args.context_tokens}"] if args.context_tokens and task.startswith("ruler:") else []

    for task in tasks:  # a bad --set (or model, or a prompt too long for it) is one line before any work
        try:
            task_config(task, args.steps, overrides + task_extra(task), 0, args.predictors[0])
        except Exception as err:  # ConfigError, or Hydra's own for an unknown key or option
            parser.error(f"task {task} with --set {args.extra}: {err}")

    store = PromptStore(args.out, {"model": args.model, "context_tokens": args.context_tokens, "steps": args.steps,
                                   "device": torch.device(args.device).type, "dtype": args.dtype, "engine": args.engine,
                                   "predictors": args.predictors, "ratios": args.ratios, "set": args.extra})
    try:
        store.open(args.resume or bool(args.merge))
        for stem in args.merge:
            store.merge(stem)
    except ValueError as err:  # an existing store without --resume, one of another config, overlapping prompts
        parser.error(str(err))
    command = "python " + " ".join(["experiments/predictor_study.py", *argv] if argv is not None else sys.argv)
    model = None  # loaded for the first prompt measured (none: the tables are rebuilt from the store)
    start, notes, failed = time.perf_counter(), [], set()
    # prompt-major: a run stopped by --time-budget leaves every task with prompts
    todo = [(task, sample) for sample in range(args.samples) for task in tasks if (task, sample) not in store.done]
    print(f"{len(todo)} prompts to measure ({len(store.done)} already in {store.frames_path})", flush=True)
    for position, (task, sample) in enumerate(todo):
        if task in failed:
            continue
        if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
            print(f"time budget {args.time_budget:.0f}s spent after {position} of {len(todo)} prompts: stopping; "
                  f"--resume continues from {store.frames_path}", flush=True)
            break
        t0 = time.perf_counter()
        model = model if model is not None else load_model(overrides)
        try:
            found, found_extras, info = measure_prompt(args, task, sample, overrides + task_extra(task), model)
        except Exception as err:  # one task's failure (e.g. a config in flux) must not lose the others
            notes.append(f"task {task} sample {sample} not measured: {type(err).__name__}: {err}")
            print(notes[-1], flush=True)
            failed.add(task)
            continue
        info["capture_s"] = round(time.perf_counter() - t0, 1)
        print(f"measured {task} #{sample} ({args.engine}): {info}", flush=True)
        store.add(task, sample, found, found_extras, info, command)

    frames, captures = store.frames(), store.prompts()
    summary_rows, layer_frames = [], []
    for (task, name, ratio), frame in frames.groupby(["task", "predictor", "ratio"], sort=False):
        first = next(c for c in captures if c["task"] == task)  # state bytes and calibration: the first prompt's
        steps = sum(c["decode_steps"] for c in captures if c["task"] == task)
        row = over_prompts(frame, ["task", "predictor", "ratio"]).iloc[0].to_dict()
        row.update(propose_us=frame["propose_us"].median(), update_us=frame["update_us"].median(),
                   misses_per_decode_step=(frame["selected"].sum() - frame["hits"].sum()) / steps,
                   **first["extras"][f"{name}|{ratio}"])
        summary_rows.append(row)
        layer_frames.append(over_prompts(frame, ["task", "predictor", "ratio", "layer"]))
        print(f"  {task} {name:18s} x{ratio:<5} hit {row['hit_rate']:.4f} [{row['hit_rate_lo']:.4f}, "
              f"{row['hit_rate_hi']:.4f}] (n={row['prompts']}) precision {row['precision']:.4f} "
              f"misses/step {row['misses_per_step']:.2f} propose {row['propose_us']:.0f} us", flush=True)
    if not summary_rows:
        raise SystemExit("no task was measured: " + "; ".join(notes))
    table = pd.DataFrame(summary_rows)
    per_layer = pd.concat(layer_frames, ignore_index=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.assign(command=command).to_csv(args.out.with_suffix(".csv"), index=False)  # provenance in every row
    per_layer.assign(command=command).to_csv(args.out.parent / f"{args.out.name}_per_layer.csv", index=False)
    by_predictor = over_prompts(frames, ["predictor", "ratio"])  # every task's prompts
    by_predictor.assign(command=command).to_csv(args.out.parent / f"{args.out.name}_by_predictor.csv", index=False)
    # each prompt's pooled rates: what the intervals resample, and what paired comparisons between
    # predictors need (the store holds them too, but the eager store is too large to commit)
    per_prompt = aggregate(frames, ["task", "sample", "predictor", "ratio"])
    per_prompt.assign(command=command).to_csv(args.out.parent / f"{args.out.name}_per_prompt.csv", index=False)
    if not any(t.startswith(("ruler_", "ruler:")) for t in tasks):
        notes.append("no RULER-style task config existed: real text only")
    record = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": (torch.cuda.get_device_name() if args.device.startswith("cuda") else
                         f"cpu {platform.machine()}, 1 torch thread (shared machine)"), "dtype": args.dtype, **versions(),
              "mode": "shadow", "engine": args.engine, "capture_predictor": CAPTURE_PREDICTOR, "predictors": {n: PREDICTORS[n] for n in args.predictors},
              "ratios": args.ratios, "captures": captures, "notes": notes, "rows": summary_rows}
    args.out.with_suffix(".json").write_text(strict_json_dumps(record, indent=1, default=float) + "\n")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))

    if args.no_figures:
        return
    from prr.analysis.predictor_figures import save_hit_rate_vs_budget

    for path in save_hit_rate_vs_budget(table, args.figures):
        print("figure:", path)


if __name__ == "__main__":
    main()
