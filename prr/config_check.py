"""Startup validation: every config group is checked against the class its `_target_`
names (unknown keys with the closest valid one, wrong types, bad values) and the groups
against each other and the model (top-K vs context, prompt vs model context), all before
any weights load. All problems are reported at once."""

from __future__ import annotations

import difflib
import importlib
import inspect
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

GROUPS = ("model", "selector", "predictor", "budget", "task", "logger", "runtime", "backend")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class ConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def resolve_target(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


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


def check_node(group: str, node: DictConfig) -> list[str]:
    """Keys and types of one group's node against its `_target_` signature."""
    if "_target_" not in node:
        return [f"{group}: no _target_ naming the class to build"]
    try:
        target = resolve_target(node._target_)
    except (ImportError, AttributeError) as err:
        return [f"{group}._target_={node._target_!r} cannot be imported: {err}"]
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
            problems.append(f"{group}.{key} is not an option of {target.__name__}{hint}")
        elif not _type_ok(value, hints.get(key, params[key].annotation)):
            problems.append(f"{group}.{key}={value!r} has the wrong type: expected {hints.get(key, params[key].annotation)}")
    for name, p in params.items():
        if p.default is inspect.Parameter.empty and name not in values:
            problems.append(f"{group}.{name} is required by {target.__name__}")
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
    from hydra.utils import instantiate

    built: dict[str, Any] = {}
    for group in GROUPS:
        try:
            built[group] = instantiate(cfg[group])
        except Exception as err:  # constructors raise ValueError with the bad value; Hydra wraps it
            cause = err.__cause__ or err
            problems.append(f"{group}: {cause}")
    if "runtime" in built:
        problems += built["runtime"].problems()
    if problems:
        raise ConfigError(problems)
    try:
        model = built["model"].describe()
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(problems + [f"model.name_or_path={cfg.model.name_or_path!r}: {err}"]) from None
    problems += cross_checks(built, model)
    if problems:
        raise ConfigError(problems)


def cross_checks(built: dict[str, Any], model: Any) -> list[str]:
    runtime, selector, task = built["runtime"], built["selector"], built["task"]
    problems = []
    prompt = task.prompt_tokens_upper_bound()
    total = prompt + task.max_new_tokens
    if total > model.max_position_embeddings:
        problems.append(f"prompt (up to {prompt} tokens) + task.max_new_tokens={task.max_new_tokens} = {total} exceeds "
                        f"the model's context of {model.max_position_embeddings} tokens")
    if runtime.block_size > getattr(task, "prompt_tokens", prompt):
        problems.append(f"runtime.block_size={runtime.block_size} exceeds the prompt of "
                        f"{getattr(task, 'prompt_tokens', prompt)} tokens")
    prompt_blocks = getattr(task, "prompt_tokens", prompt) // runtime.block_size
    from prr.selectors.dense import DenseSelector

    if not isinstance(selector, DenseSelector) and selector.topk_blocks >= prompt_blocks:
        problems.append(f"selector.topk_blocks={selector.topk_blocks} ({selector.topk_blocks * runtime.block_size} tokens) "
                        f"covers the whole prompt of {prompt_blocks} blocks: nothing is sparse; lower topk_blocks "
                        "or use selector=dense")
    predictor = built["predictor"]
    if getattr(predictor, "calibrate_on_prefill", False) and runtime.calibration_tokens <= predictor.burn_in_steps + 1:
        problems.append(f"runtime.calibration_tokens={runtime.calibration_tokens} leaves nothing to calibrate on after "
                        f"predictor.burn_in_steps={predictor.burn_in_steps}; raise it above {predictor.burn_in_steps + 1} "
                        "or set predictor.calibrate=false")
    if runtime.calibration_tokens > getattr(task, "prompt_tokens", prompt):
        problems.append(f"runtime.calibration_tokens={runtime.calibration_tokens} exceeds the prompt of "
                        f"{getattr(task, 'prompt_tokens', prompt)} tokens")
    if runtime.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            problems.append(f"runtime.device={runtime.device!r} but this torch ({torch.__version__}) sees no CUDA device; "
                            "use runtime=cpu (or leave runtime=auto to choose)")
    if built["backend"].name == "triton":
        from prr.runtime.engine_ops import triton_problems

        problems += triton_problems(runtime.device, model.head_dim, runtime.block_size)
        problems += selector.triton_problems() or []
    bad_layers = sorted(x for x in selector.dense_layers if not 0 <= x < model.num_layers)
    if bad_layers:
        problems.append(f"selector.dense_layers={bad_layers} outside the model's layers 0..{model.num_layers - 1}")
    budget = built["budget"]
    if budget.profiles and not bad_layers and set(range(model.num_layers)) <= set(selector.dense_layers):
        problems.append(f"selector.dense_layers={sorted(selector.dense_layers)} makes every layer of the model "
                        f"({model.num_layers}) dense: budget=profiled has no selection to time; use budget=fixed or "
                        "fewer dense_layers")
    if budget.profiles and not predictor.uses_budget:
        problems.append(f"predictor={type(predictor).__module__.rsplit('.', 1)[-1]} sets |P| itself (P = A) and "
                        "ignores the budget, but budget=profiled would size P from timings (the eager runtime speculated "
                        "on its |P| = 0: a hit rate of 0); use budget=fixed")
    name = type(predictor).__module__.rsplit(".", 1)[-1]
    if predictor.replays_selections and getattr(runtime, "engine", "eager") != "graph":
        problems.append(f"predictor={name} replays a serial pass recorded before decoding, which only "
                        f"runtime.engine=graph records (engine is {getattr(runtime, 'engine', 'eager')!r}): add "
                        "runtime.engine=graph")
    declared = predictor.declared_hit_rate
    if budget.profiles and declared is not None and getattr(budget, "stage_check", False) \
            and budget.hit_rate != declared:
        problems.append(f"budget=profiled checks PRR's stage with P holding budget.hit_rate={budget.hit_rate} of A, but "
                        f"predictor={name} holds {declared}: set budget.hit_rate={declared}")
    if callable(getattr(task, "evaluate", None)) and runtime.batch_size != 1:  # scored tasks (prr.evaluation)
        problems.append(f"runtime.batch_size={runtime.batch_size}: scored tasks decode one request at a time; "
                        "use runtime.batch_size=1")
    if model.num_heads % model.num_kv_heads:
        problems.append(f"model has {model.num_heads} query heads, not a multiple of {model.num_kv_heads} KV heads")
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
