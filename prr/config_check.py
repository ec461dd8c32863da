"""Startup validation: every config group is checked against the class its `_target_`
names (unknown keys with the closest valid one, wrong types, bad values) and the groups
against each other and the model (top-K vs context, prompt vs model context), all before
any weights load. All problems are reported at once.

`problems_before_torch` runs the part of these checks that needs no torch (run.py refuses
what it finds before importing torch, in well under a second); `validate` runs them all. So
run.py reports every problem in two rounds at most: those found before torch, then the runtime
and backend groups' (prr/runtime/* imports torch). Each check is defined once: the torch-free
classes of CHECKED_BEFORE_TORCH are the constructors the configured classes inherit, and
`validate` runs the same cross-checks."""

from __future__ import annotations

import difflib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from prr.cli_exits import ConfigError as ConfigError  # callers import it from here too
from prr.model.describe import is_random_init

GROUPS = ("model", "selector", "predictor", "budget", "reuse", "task", "logger", "runtime", "backend")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# `_target_` -> the class its options are checked as before torch is imported: the target itself
# where its module imports no torch, else the torch-free class whose constructor the target
# inherits unchanged (tests/test_config.py holds both true). A shortcut for prr's own options, not
# a registry: a target not named here (a new selector or predictor, one from a package of your own
# on hydra.searchpath, the backend group, selector=less) is found without importing it before
# torch (`unimportable_target`: one line when it cannot be) and checked by its own constructor in
# `validate`, once torch is imported, as are the runtime's cross-checks. Nothing to add here.
_SELECTOR_OPTIONS = "prr.selectors.options."
_PREDICTOR_OPTIONS = "prr.predictors.options."
CHECKED_BEFORE_TORCH = {
    "prr.model.spec.ModelSpec": "prr.model.spec.ModelSpec",
    "prr.runtime.settings.RuntimeSettings": "prr.runtime.settings.RuntimeSettings",
    "prr.selectors.dense.DenseSelector": _SELECTOR_OPTIONS + "DenseSelectorOptions",
    "prr.selectors.exact.ExactSelector": _SELECTOR_OPTIONS + "SelectorOptions",
    "prr.selectors.quest.QuestSelector": _SELECTOR_OPTIONS + "SelectorOptions",
    "prr.selectors.infllm.InfLLMSelector": _SELECTOR_OPTIONS + "InfLLMSelectorOptions",
    "prr.selectors.infllm_v2.InfLLMV2Selector": _SELECTOR_OPTIONS + "InfLLMV2SelectorOptions",
    "prr.selectors.indexer.IndexerSelector": _SELECTOR_OPTIONS + "IndexerSelectorOptions",
    "prr.predictors.bench_hit_rate.BenchHitRatePredictor": _PREDICTOR_OPTIONS + "BenchHitRatePredictorOptions",
    "prr.predictors.cross_layer.CrossLayerPredictor": _PREDICTOR_OPTIONS + "CrossLayerPredictorOptions",
    "prr.predictors.ema.EmaPredictor": _PREDICTOR_OPTIONS + "EmaPredictorOptions",
    "prr.predictors.ema_membership.EmaMembershipPredictor": _PREDICTOR_OPTIONS + "EmaMembershipPredictorOptions",
    "prr.predictors.last_step.LastStepPredictor": _PREDICTOR_OPTIONS + "PredictorOptions",
    "prr.predictors.none.NoPredictor": _PREDICTOR_OPTIONS + "PredictorOptions",
    "prr.predictors.oracle.OraclePredictor": _PREDICTOR_OPTIONS + "OraclePredictorOptions",
    "prr.predictors.query_similarity.QuerySimilarityPredictor": _PREDICTOR_OPTIONS + "QuerySimilarityPredictorOptions",
    "prr.predictors.spin.SpinPredictor": _PREDICTOR_OPTIONS + "SpinPredictorOptions",
    **{t: t for t in (
        "prr.budget.adaptive.AdaptiveBudget", "prr.budget.fixed.FixedBudget", "prr.budget.profiled.ProfiledBudget",
        "prr.reuse.NoReuse", "prr.reuse.LayerReuse", "prr.reuse.StepReuse",
        "prr.sinks.AutoLogger", "prr.sinks.NoLogger", "prr.sinks.WandbLogger",
        "prr.tasks.lm_eval_task.LmEvalTask", "prr.tasks.long_text.LongTextTask", "prr.tasks.niah.NeedleTask",
        "prr.tasks.perplexity.PerplexityTask", "prr.tasks.qa.ClozeQATask", "prr.tasks.ruler.RulerTask",
        "prr.tasks.variable_tracking.VariableTrackingTask", "prr.tasks.word_extraction.CommonWordsTask",
        "prr.tasks.word_extraction.FrequentWordsTask")},
}


def resolve_target(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def unimportable_target(group: str, target: Any) -> str | None:
    """Why `<group>._target_` cannot name a class to import, in one line, or None. Found without
    importing anything (run.py's round before torch; parent packages already imported are read, not
    run): a value that is no dotted path, or a module missing from sys.path. A module that is there
    but fails to import, or lacks the class, `check_node` reports when it imports it."""
    if not isinstance(target, str) or not all(target.split(".")) or "." not in target:
        return f"{group}._target_={target!r} is not a dotted path module.Class (e.g. prr.selectors.quest.QuestSelector)"
    parts = target.split(".")[:-1]  # the module's
    spec = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = loaded.__spec__
        elif depth == 1:
            spec = importlib.util.find_spec(name)  # a top-level name: found on sys.path, not imported
        elif spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
        else:
            return (f"{group}._target_={target!r} cannot be imported: {'.'.join(parts[:depth - 1])!r} is a module, "
                    f"not a package holding {name!r}")
        if spec is None:
            where = ("on sys.path (a package of your own: pip install -e it, or add the folder holding it to "
                     "PYTHONPATH)") if depth == 1 else f"in package {'.'.join(parts[:depth - 1])!r}"
            return f"{group}._target_={target!r} cannot be imported: no module named {name!r} {where}"
    return None


def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence, typing.Sequence) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple, ListConfig)):
            return False
        args = typing.get_args(annotation)
        return not args or all(_type_ok(v, args[0]) for v in value)
    return True  # annotations we do not check (e.g. dicts) pass


def check_node(group: str, node: DictConfig, checked_as: str | None = None) -> list[str]:
    """Keys and types of one group's node against its `_target_` signature (or checked_as's,
    the torch-free class whose constructor the target inherits: CHECKED_BEFORE_TORCH)."""
    if "_target_" not in node:
        return [f"{group}: no _target_ naming the class to build"]
    unimportable = unimportable_target(group, node._target_)
    if unimportable:
        return [unimportable]
    try:
        target = resolve_target(checked_as or node._target_)
    except Exception as err:  # noqa: BLE001 - whatever importing the module raises (SyntaxError too), in one line
        return [f"{group}._target_={node._target_!r} cannot be imported: {type(err).__name__}: {err}"]
    configured = node._target_.rpartition(".")[2]  # the class messages name
    signature = inspect.signature(target)
    hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    params = {n: p for n, p in signature.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    problems = []
    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict)
    for key, value in values.items():
        if key.startswith("_"):
            continue
        if key not in params:
            close = [p for p in params if key in p] or difflib.get_close_matches(key, params, n=1, cutoff=0.5)
            hint = f"; did you mean {group}.{close[0]}?" if close else f"; valid keys: {sorted(params)}"
            problems.append(f"{group}.{key} is not an option of {configured}{hint}")
        elif not _type_ok(value, hints.get(key, params[key].annotation)):
            problems.append(f"{group}.{key}={value!r} has the wrong type: expected {hints.get(key, params[key].annotation)}")
    for name, p in params.items():
        if p.default is inspect.Parameter.empty and name not in values:
            problems.append(f"{group}.{name} is required by {configured}")
    return problems


def problems_before_torch(cfg: DictConfig) -> list[str]:
    """What `validate` would find without importing torch: the keys, types and values of each
    group CHECKED_BEFORE_TORCH names (built as its torch-free class), whether the other groups'
    targets can be found (not imported: `unimportable_target`), then, when the model,
    selector, predictor, budget and task all are, the model and the cross-checks among them.
    [] does not mean valid: `validate` checks the rest (runtime, backend, their cross-checks)."""
    checked = {g: CHECKED_BEFORE_TORCH[cfg[g]._target_] for g in GROUPS
               if g in cfg and cfg[g].get("_target_") in CHECKED_BEFORE_TORCH}
    problems = [p for group, checked_as in checked.items() for p in check_node(group, cfg[group], checked_as)]
    # the other targets (prr's that import torch, yours): their constructors check them in `validate`
    problems += [p for g in GROUPS if g in cfg and g not in checked and "_target_" in cfg[g]
                 for p in [unimportable_target(g, cfg[g]._target_)] if p]
    if problems:
        return problems
    built, problems = build_groups(cfg, checked)
    if "runtime" in built:  # its own values; its cross-checks (device, engine, kernels) need torch
        problems += built["runtime"].problems()
    if problems or not {"model", "selector", "predictor", "budget", "task"} <= built.keys():
        return problems
    model, problems = describe_model(cfg, built["model"])
    if problems:
        return problems
    problems = model_cross_checks(cfg, built, model)
    if "runtime" in built:  # the runtime's values against the prompt, and a device this machine cannot have
        problems += prompt_size_checks(built) + device_checks_before_torch(cfg, built["runtime"])
        problems += reuse_checks(cfg, built, model)
    return problems


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError listing every problem; returns quietly when the config is runnable."""
    problems: list[str] = []
    for group in GROUPS:
        if group not in cfg:
            problems.append(f"config group {group!r} is missing")
            continue
        problems += check_node(group, cfg[group])
    if problems:
        raise ConfigError(problems)
    built, problems = build_groups(cfg, dict.fromkeys(GROUPS))
    if "runtime" in built:
        problems += built["runtime"].problems()
    if problems:
        raise ConfigError(problems)
    model, problems = describe_model(cfg, built["model"])
    if problems:
        raise ConfigError(problems)
    problems += model_cross_checks(cfg, built, model) + runtime_cross_checks(cfg, built, model)
    if problems:
        raise ConfigError(problems)


def build_groups(cfg: DictConfig, groups: dict[str, str | None]) -> tuple[dict[str, Any], list[str]]:
    """Each group instantiated as the class `groups` names (None: its `_target_`), and the
    problems: a constructor's ValueError (which names the bad value) as `<group>: <message>`."""
    from hydra.utils import instantiate

    built: dict[str, Any] = {}
    problems = []
    for group, checked_as in groups.items():
        node = cfg[group]
        if checked_as is not None:  # the same values, built as the torch-free class
            node = {**OmegaConf.to_container(node, resolve=True), "_target_": checked_as}
        try:
            built[group] = instantiate(node)
        except Exception as err:  # constructors raise ValueError with the bad value; Hydra wraps it
            cause = err.__cause__ or err
            problems.append(f"{group}: {cause}")
    return built, problems


def describe_model(cfg: DictConfig, spec: Any) -> tuple[Any, list[str]]:
    """(the model's config, read without loading weights, or None; the problem naming the path)."""
    try:
        return spec.describe(), []
    except (FileNotFoundError, ValueError) as err:
        return None, [f"model.name_or_path={cfg.model.name_or_path!r}: {err}"]


def option_name(cfg: DictConfig, group: str) -> str:
    """The option a group's `_target_` module is named after (prr.predictors.oracle... -> oracle)."""
    return str(cfg[group]._target_).rsplit(".", 2)[-2]


def model_cross_checks(cfg: DictConfig, built: dict[str, Any], model: Any) -> list[str]:
    """The groups against each other and the model, without the runtime and backend groups (run
    before torch is imported too: `problems_before_torch`)."""
    selector, task, predictor, budget = built["selector"], built["task"], built["predictor"], built["budget"]
    problems = []
    prompt = task.prompt_tokens_upper_bound()
    total = prompt + task.max_new_tokens
    if total > model.max_position_embeddings:
        problems.append(f"prompt (up to {prompt} tokens) + task.max_new_tokens={task.max_new_tokens} = {total} exceeds "
                        f"the model's context of {model.max_position_embeddings} tokens")
    bad_layers = sorted(x for x in selector.dense_layers if not 0 <= x < model.num_layers)
    if bad_layers:
        problems.append(f"selector.dense_layers={bad_layers} outside the model's layers 0..{model.num_layers - 1}")
    problems += budget.config_problems(selector, predictor, model, option_name(cfg, "predictor"))
    prompt_file = getattr(task, "prompt_file", None)
    if prompt_file and is_random_init(cfg.model.name_or_path):  # else found only once the model loads
        from prr.tasks.long_text import prompt_file_needs_a_tokenizer

        problems.append(prompt_file_needs_a_tokenizer(prompt_file, f"model.name_or_path={cfg.model.name_or_path!r} "
                                                      "is a random-init model, which decodes seeded random token ids"))
    if model.num_heads % model.num_kv_heads:
        problems.append(f"model has {model.num_heads} query heads, not a multiple of {model.num_kv_heads} KV heads")
    return problems


def prompt_size_checks(built: dict[str, Any]) -> list[str]:
    """The runtime's block size and calibration tokens and the selector's top-K against the prompt's
    size (the task's own numbers: no tokenizer needed), run before torch is imported too."""
    runtime, selector, task, predictor = built["runtime"], built["selector"], built["task"], built["predictor"]
    problems = []
    prompt = getattr(task, "prompt_tokens", task.prompt_tokens_upper_bound())
    if runtime.block_size > prompt:
        problems.append(f"runtime.block_size={runtime.block_size} exceeds the prompt of {prompt} tokens")
    problems += selector.block_size_problems(runtime.block_size)  # a selector whose paper fixes its blocks
    prompt_blocks = prompt // runtime.block_size
    if not selector.selects_every_block and selector.topk_blocks >= prompt_blocks:
        name = selector.topk_option
        problems.append(f"selector.{name}={selector.topk_blocks} ({selector.topk_blocks * runtime.block_size} tokens) "
                        f"covers the whole prompt of {prompt_blocks} blocks: nothing is sparse; lower {name} "
                        "or use selector=dense")
    if getattr(predictor, "calibrate_on_prefill", False) and runtime.calibration_tokens <= predictor.burn_in_steps + 1:
        problems.append(f"runtime.calibration_tokens={runtime.calibration_tokens} leaves nothing to calibrate on after "
                        f"predictor.burn_in_steps={predictor.burn_in_steps}; raise it above {predictor.burn_in_steps + 1} "
                        "or set predictor.calibrate=false")
    if runtime.calibration_tokens > prompt:
        problems.append(f"runtime.calibration_tokens={runtime.calibration_tokens} exceeds the prompt of {prompt} tokens")
    return problems


def reuse_checks(cfg: DictConfig, built: dict[str, Any], model: Any) -> list[str]:
    """The reuse group against the model's sparse layers, the predictor and the engine
    (`prr.reuse.SelectionReuse.problems`), run before torch is imported too."""
    reuse = built.get("reuse")
    if reuse is None or not hasattr(reuse, "problems"):  # a reuse class of your own: its constructor checks it
        return []
    dense = set(built["selector"].dense_layers)
    sparse = [i not in dense for i in range(model.num_layers)]
    return reuse.problems(sparse, option_name(cfg, "predictor"), getattr(built["runtime"], "engine", "eager"))


def device_checks_before_torch(cfg: DictConfig, runtime: Any) -> list[str]:
    """runtime.device=cuda on a machine with no GPU driver, and backend=triton off CUDA, found
    without importing torch (prr.gpu_probe): importing torch to ask took 1-1.5 s of a 2-3 s refusal.
    A machine with a driver is left to `validate`, which asks torch itself."""
    from prr.gpu_probe import missing_gpu_driver

    problems = []
    missing = missing_gpu_driver() if runtime.device.startswith("cuda") else None
    if missing:
        problems.append(f"runtime.device={runtime.device!r} but this machine has no GPU driver ({missing}), so torch "
                        "sees no CUDA device; use runtime=cpu (or leave runtime=auto to choose)")
    if OmegaConf.select(cfg, "backend.name") == "triton" and not missing:
        # the words of prr.runtime.engine_ops.triton_problems, which `validate` runs once torch is imported
        if not installed("triton"):
            problems.append("backend=triton needs the triton package (pip install triton), or use backend=torch")
        elif not runtime.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
            problems.append(f"backend=triton runs on a CUDA device (runtime.device={runtime.device!r}); on a CPU only "
                            "under TRITON_INTERPRET=1, for tests. Use backend=torch on the CPU")
    return problems


def installed(module: str) -> bool:
    """Whether `module` can be imported, asked without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds None for it (made unimportable)
        return False


def runtime_cross_checks(cfg: DictConfig, built: dict[str, Any], model: Any) -> list[str]:
    """The groups against the runtime and backend groups (prr/runtime/*, which import torch)."""
    runtime, selector, task, predictor = built["runtime"], built["selector"], built["task"], built["predictor"]
    problems = prompt_size_checks(built) + reuse_checks(cfg, built, model)
    if runtime.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            problems.append(f"runtime.device={runtime.device!r} but this torch ({torch.__version__}) sees no CUDA device; "
                            "use runtime=cpu (or leave runtime=auto to choose)")
    if built["backend"].name == "triton":
        from prr.runtime.engine_ops import triton_problems

        problems += triton_problems(runtime.device, model.head_dim, runtime.block_size)
        problems += selector.triton_problems() or []
    if predictor.replays_selections and getattr(runtime, "engine", "eager") != "graph":
        problems.append(f"predictor={option_name(cfg, 'predictor')} replays a serial pass recorded before decoding, "
                        f"which only runtime.engine=graph records (engine is {getattr(runtime, 'engine', 'eager')!r}): "
                        "add runtime.engine=graph")
    if callable(getattr(task, "evaluate", None)) and runtime.batch_size != 1:  # scored tasks (prr.evaluation)
        if getattr(runtime, "engine", "eager") != "graph":
            problems.append(f"runtime.batch_size={runtime.batch_size}: the research runtime decodes scored tasks one "
                            "request at a time; use runtime.batch_size=1, or runtime.engine=graph for batches")
        elif not getattr(task, "batches_requests", False):
            problems.append(f"runtime.batch_size={runtime.batch_size}: task={option_name(cfg, 'task')} sends one "
                            "request at a time; use runtime.batch_size=1")
    if getattr(runtime, "engine", "eager") == "graph":
        from prr.runtime.graph_run import graph_problems

        problems += graph_problems(built, model)
    return problems


def compose_config(overrides: list[str], check: bool = True) -> DictConfig:
    """Hydra overrides -> the composed config over conf/ (what `run.py` would run), validated
    unless check=False (ConfigError lists every problem). For scripts and tools outside run.py."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # called from inside a Hydra app (run.py task=lm_eval)
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if check:
        validate(cfg)
    return cfg
