"""The lm-eval model `prr`: lm-eval's requests decoded through our DSA/PRR runtime.

    prr-lm-eval --model prr --model_args model=smollm2-135m,selector=quest,predictor=ema \
        --tasks prr_niah --limit 4       (prr/tasks/lm_eval_tasks is on the include path unless one is given)
    python -m prr.lm_eval_model ...   (the same)

Every model_args key is a Hydra override of conf/ (`selector=quest`, `selector.topk_blocks=16`,
`runtime.block_size=32`, `model=tiny-random`), composed and validated as `python run.py` does.

Why a wrapper command: lm-eval 0.4.x finds models only in its own registry (MODEL_MAPPING in
lm_eval.models, filled at import) and has no plugin entry points, so `lm_eval --model prr`
cannot see a model that nothing imported. `prr-lm-eval` (console script) and
`python -m prr.lm_eval_model` import this module (registering `prr`) and then run lm-eval's
own CLI with the same arguments. In Python, `import prr.lm_eval_model` before
`lm_eval.simple_evaluate(model="prr", ...)` is enough.

Request semantics (decode-time sparsity, as in DSA deployments): the context is prefilled
densely; continuation tokens (loglikelihood) and generated tokens (generate_until) go
through the selector/PRR path one decode step at a time. A one-token loglikelihood
continuation is therefore predicted from the dense prefill alone. loglikelihood_rolling
uses lm-eval's rolling windows of max_length tokens, each scored the same way.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401 - lm-eval fills its own registry only while it is empty: fill it first
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import model_registry
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

log = logging.getLogger("prr")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
LOCAL_TASKS = Path(__file__).resolve().parent / "tasks" / "lm_eval_tasks"


def compose_config(overrides: dict[str, Any]) -> Any:
    """model_args -> the validated prr config (Hydra compose over conf/, logger=none)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from prr.config_check import validate

    args = [f"{k}={_hydra_value(v)}" for k, v in overrides.items()]
    if not any(a.startswith("logger=") for a in args):
        args.append("logger=none")
    if GlobalHydra.instance().is_initialized():  # inside `python run.py task=lm_eval`
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=args)
    validate(cfg)
    return cfg


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


class PRRLM(LM):
    def __init__(self, engine: Any = None, batch_size: int | str = 1, max_batch_size: int | None = None,
                 device: str | None = None, max_length: int | None = None, max_gen_toks: int = 256,
                 **overrides: Any) -> None:
        """engine: a prr.evaluation.Engine (from `python run.py task=lm_eval`), or None to build
        one from `overrides` (Hydra overrides: selector=quest, model=tiny-random, ...); then
        task.context_tokens (default 2048) + task.max_new_tokens (64) bound every request."""
        super().__init__()
        if str(batch_size) not in ("1", "auto"):
            raise ValueError(f"batch_size={batch_size}: the prr model decodes one request at a time; use 1")
        if engine is None:
            if device is not None:  # prr's runtime group owns the device: runtime.device in model_args
                log.warning("lm-eval's device=%s is not used; the prr model runs on runtime.device", device)
            # The lm_eval task's options size requests (task.context_tokens, task.max_new_tokens).
            overrides = {"task": "lm_eval", **overrides}
            cfg = compose_config(overrides)
            from hydra.utils import instantiate

            from prr.evaluation import Engine

            settings, task = instantiate(cfg.runtime), instantiate(cfg.task)
            model = instantiate(cfg.model).load(settings.dtype, settings.device)
            engine = Engine(cfg, model, task.context_tokens + task.max_new_tokens)
            max_gen_toks = task.max_new_tokens
        elif overrides:
            raise ValueError(f"model_args {sorted(overrides)} given with an engine: set them in the run's config")
        self.engine = engine
        self.max_length = min(max_length or engine.max_tokens, engine.max_tokens)
        self.max_gen_toks = max_gen_toks
        tok = engine.tokenizer
        eos, bos = engine.model.config.eos_token_id, engine.model.config.bos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        # lm-eval's "prefix token" (empty contexts, first rolling window): BOS, else EOS, else id 0 (bytes).
        self.prefix_token_id = bos if bos is not None else eos if eos is not None else 0
        self._tok = tok

    # --- helpers ------------------------------------------------------------------------
    def tok_encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def _context(self, ids: list[int], room: int, min_tokens: int = 1) -> torch.Tensor:
        """Left-truncated to `room` tokens; the prefix token pads it to min_tokens. -> [1, T]"""
        ids = ids[-room:] if room > 0 else []
        while len(ids) < min_tokens:
            ids = [self.prefix_token_id] + ids
        return torch.tensor([ids], dtype=torch.long)

    @property
    def tokenizer_name(self) -> str:
        return self.engine.model.name

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self._tok, "chat_template", None):
            raise ValueError(f"model {self.engine.model.name!r} has no chat template; drop --apply_chat_template")
        return self._tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    # --- lm-eval's three request types -------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for request in tqdm(requests, desc="prr loglikelihood", disable=disable_tqdm):
            context, continuation = request.args
            if context:
                whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
                cont = whole[len(ctx):] if whole[: len(ctx)] == ctx else self.tok_encode(continuation)
            else:
                ctx, cont = [self.prefix_token_id], self.tok_encode(continuation)
            cont = cont[-(self.max_length - 2):]
            logprob, greedy, _ = self.engine.score(self._context(ctx, self.max_length - len(cont)), cont)
            out.append((logprob, greedy))
            self.cache_hook.add_partial("loglikelihood", request.args, (logprob, greedy))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in tqdm(requests, desc="prr loglikelihood_rolling", disable=disable_tqdm):
            (text,) = request.args
            windows = map(make_disjoint_window, get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length - 1, 1))
            total = 0.0
            for ctx, pred in windows:
                total += self.engine.score(self._context(ctx, self.max_length - len(pred)), pred)[0]
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in tqdm(requests, desc="prr generate_until", disable=disable_tqdm):
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            if kwargs.pop("do_sample", False) or float(kwargs.pop("temperature", 0.0) or 0.0) > 0:
                raise ValueError("the prr model decodes greedily; set do_sample=false, temperature=0 in gen_kwargs")
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            # Generation prefills the context alone, which needs 2 tokens: a shorter one gets the prefix token.
            ids = self._context(self.tok_encode(context), self.max_length - max_gen, min_tokens=2)
            text = self.engine.generate(ids, max_gen, stop=tuple(until)).text
            out.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return out


# Registered by name (a lazy "module:class" target), so `python -m prr.lm_eval_model`, which runs
# this file as __main__ and later imports it as prr.lm_eval_model, registers one and the same target.
if model_registry.get("prr", None) is None:
    model_registry.register("prr", target="prr.lm_eval_model:PRRLM")


def main(argv: list[str] | None = None) -> None:
    """`prr-lm-eval` / `python -m prr.lm_eval_model`: lm-eval's CLI with the `prr` model registered."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in args and any(a in ("--tasks", "-t") for a in args):
        args += ["--include_path", str(LOCAL_TASKS)]  # prr's local tasks (prr_niah, prr_vt, prr_qa) by default
    sys.argv = [sys.argv[0], *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
