"""Shared fixtures-by-function for the pipeline tests: random caches at odd sizes, and the
selector and predictor objects the graph-engine tests decode with."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml

from prr.cache import PagedKVCache
from prr.predictors import EmaMembershipPredictor, LastStepPredictor, Predictor
from prr.selectors import InfLLMSelector, QuestSelector
from prr.selectors.base import Selector


def random_cache(
    selector: Selector | None,
    length: int = 113,
    batch: int = 1,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 8,
    extra: int = 0,
    seed: int = 0,
) -> PagedKVCache:
    """A one-layer cache holding `length` random tokens (room for `extra` more)."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, batch, num_kv_heads, head_dim, block_size, length + extra)
    shape = (batch, num_kv_heads, length, head_dim)
    cache.append(0, torch.randn(shape, generator=g) * 2, torch.randn(shape, generator=g))
    if selector is not None:
        selector.update_metadata(cache, 0, 0, length)
    return cache


def instantiate_or_refuse_ruler(node):
    """instantiate(node), except task=ruler without RULER's data in the cache (`make ruler-data`, not
    part of `make test`): then the refusal, one message naming that command, is what is checked."""
    import pytest
    from hydra.utils import instantiate

    from prr.tasks.ruler_data import RulerDataError, check_present

    if str(node.get("_target_", "")) == "prr.tasks.ruler.RulerTask" and node.get("data_dir") is None:
        try:
            check_present()
        except RulerDataError:
            with pytest.raises(Exception, match="make ruler-data"):
                instantiate(node)
            return None
    return instantiate(node)


def eager_step(selector: Selector, predictor, cache: PagedKVCache, q: torch.Tensor, predicted_blocks: int,
               repair_mode: str = "exact", layer: int = 0, state=None):
    """One eager PRR step of `layer` as the research runtime runs it (PRRStep, stages one
    after the other, torch ops): q [B, Hkv, G, D], the cache holding this step's token ->
    (out [B, Hkv, G, D] fp32, A, P or None). state: the predictor's (default: a fresh one)."""
    from prr.runtime.prr_step import PRRStep
    from prr.runtime.timing import StageTimer

    b, h, g, d = q.shape
    engine = PRRStep.eager(cache, h * g, selector, predictor, "torch", repair_mode,
                                        StageTimer(torch.device("cpu")))
    if state is None:
        state = predictor.init_state(cache.num_layers, b, h, cache.max_blocks, "cpu")
    engine.schedule.adopt_state(state)
    lengths = torch.full((b,), cache.length(layer), dtype=torch.int32)
    num_blocks = torch.full((b,), cache.num_blocks(layer), dtype=torch.int32)
    out, selection = engine.sparse_attention(layer, q.reshape(b, h * g, d), lengths, num_blocks,
                                             predicted_blocks=predicted_blocks, fp32=True)
    return out.view(b, h, g, d), selection, engine.schedule.prediction(layer) if predicted_blocks else None


def graph_selector(name: str, topk_blocks: int, dense_layers: tuple[int, ...] = (0, 1)) -> Selector:
    """The graph-engine tests' selector: Quest (max over the GQA group) or InfLLM (sum, 4
    representatives per block), top-K `topk_blocks` with the sink block and the newest forced."""
    common = dict(topk_blocks=topk_blocks, sink_blocks=1, local_blocks=0, force_newest=True, dense_layers=dense_layers)
    if name == "quest":
        return QuestSelector(gqa_reduce="max", **common)
    if name == "infllm":
        return InfLLMSelector(gqa_reduce="sum", representatives=4, **common)
    raise ValueError(f"graph_selector: {name!r} is not quest or infllm")


def graph_predictor(name: str) -> Predictor | None:
    """The graph-engine tests' predictor: "ema_membership" (alpha 0.8), "last_step", or "fixed"
    (None: P set from outside)."""
    return {"ema_membership": lambda: EmaMembershipPredictor(alpha=0.8), "last_step": LastStepPredictor,
            "fixed": lambda: None}[name]()


CONF = Path(__file__).resolve().parents[1] / "conf"


def conf_target(group: str, option: str) -> str:
    """The `_target_` of conf/<group>/<option>.yaml, or of the option its defaults extend
    (predictor=ema_calibrated extends ema), read without composing (test collection)."""
    values = yaml.safe_load((CONF / group / f"{option}.yaml").read_text()) or {}
    if "_target_" in values:
        return values["_target_"]
    extended = [d for d in values.get("defaults", []) if isinstance(d, str) and d != "_self_"]
    if not extended:
        raise ValueError(f"conf/{group}/{option}.yaml has no _target_ and extends no option")
    return conf_target(group, extended[0])


def replays_selections(option: str) -> bool:
    """Whether predictor=<option> replays a serial pass recorded before decoding (bench_hit_rate,
    a benchmark tool: the graph engine alone records one; tests/test_bench_hit_rate.py checks it)."""
    from prr.config_check import resolve_target

    return bool(resolve_target(conf_target("predictor", option)).replays_selections)


def load_experiment(name: str) -> ModuleType:
    """experiments/<name>.py as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_compiles_for_sm90(script: str, extra_env: dict[str, str] | None = None) -> None:
    """Run `script` (it compiles kernels ahead of time for sm_90 through ptxas and prints "all
    compiled", else what failed) in a subprocess without TRITON_INTERPRET: the interpreter accepts
    code a GPU compile rejects. Skipped where triton has no NVIDIA backend."""
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    assert "all compiled" in done.stdout
