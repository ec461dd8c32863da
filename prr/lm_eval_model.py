"""The lm-eval model `prr`: lm-eval's requests decoded through our DSA/PRR runtime.

    prr-lm-eval --model prr --model_args model=smollm2-135m,selector=quest,predictor=ema \
        --tasks prr_niah --limit 4       (prr/tasks/lm_eval_tasks is on the include path, with any given)
    python -m prr.lm_eval_model ...   (the same)

Every model_args key is a Hydra override of conf/ (`selector=quest`, `selector.topk_blocks=16`,
`runtime.block_size=32`, `model=tiny-random`), composed and validated as `python run.py` does,
except max_length: the longest request in tokens (default: the model's context). Longer
requests lose their oldest context tokens: a warning gives their count, and lm-eval's
results file holds it (config.truncated_requests) next to the resolved prr config
(config.prr_config: model, selector, predictor, budget, runtime, ...) and config.max_length.

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
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import lm_eval.models  # noqa: F401 - lm-eval fills its own registry only while it is empty: fill it first
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import model_registry
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from prr.eos import eos_ids

log = logging.getLogger("prr")
LOCAL_TASKS = Path(__file__).resolve().parent / "tasks" / "lm_eval_tasks"
# prr-lm-eval's --device when none is given (lm-eval's own default, cuda:0, would read as the
# user's choice): the prr model runs on runtime.device, recorded in the results' prr_config.
DEVICE_FROM_RUNTIME = "runtime.device"


def compose_config(overrides: dict[str, Any], check: bool = True) -> Any:
    """model_args -> the prr config (Hydra compose over conf/, logger=none), validated unless check=False."""
    from prr.config_check import CONF_DIR
    from prr.config_check import compose_config as compose_overrides
    from prr.override_check import check_overrides

    args = [f"{k}={_hydra_value(v)}" for k, v in overrides.items()]
    if not any(a.startswith("logger=") for a in args):
        args.append("logger=none")
    # run.py's check first: a misspelled option or key in one line with its closest name (BadOverride,
    # a ValueError), where Hydra's compose says "Could not find" without one
    check_overrides(args, CONF_DIR, "config", multirun=False)
    return compose_overrides(args, check)


def compose_lm_eval_config(overrides: dict[str, Any], max_length: int | None) -> tuple[Any, int]:
    """model_args -> (the validated config of task=lm_eval, the request limit in tokens).

    The limit is max_length if given, else task.context_tokens + task.max_new_tokens if
    task.context_tokens is given, else the model's context: lm-eval's long prompts are not cut
    below what the model can attend to."""
    overrides = {"task": "lm_eval", **overrides}
    if max_length is not None and "task.context_tokens" in overrides:
        raise ValueError(f"max_length={max_length} and task.context_tokens={overrides['task.context_tokens']} both "
                         "set the request limit: give only max_length (it counts the new tokens too)")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)):
        raise ValueError(f"max_length={max_length!r} is not a whole number of tokens")
    if max_length is None and "task.context_tokens" in overrides:
        cfg = compose_config(overrides)  # validation checks the sum against the model's context
        return cfg, cfg.task.context_tokens + cfg.task.max_new_tokens
    from hydra.utils import instantiate

    cfg = compose_config(overrides, check=False)  # the model's context sizes task.context_tokens, validated below
    try:
        model_context = instantiate(cfg.model).describe().max_position_embeddings
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"model.name_or_path={cfg.model.name_or_path!r}: {err}") from None
    limit = model_context if max_length is None else max_length
    if limit > model_context:
        raise ValueError(f"max_length={max_length} exceeds the context of model {cfg.model.name_or_path!r} "
                         f"({model_context} tokens); use at most {model_context} (the default)")
    new_tokens = cfg.task.max_new_tokens
    if limit < new_tokens + 2:  # a request keeps at least 2 context tokens (the prefill's minimum)
        raise ValueError(f"max_length={max_length} leaves no room for a context after task.max_new_tokens="
                         f"{new_tokens}; use at least {new_tokens + 2}")
    return compose_config({**overrides, "task.context_tokens": limit - new_tokens}), limit


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


class PRRLM(LM):
    model_loads_started = 0  # prr-lm-eval: an error before the first one is an argument's

    def __init__(self, engine: Any = None, batch_size: int | str = 1, max_batch_size: int | None = None,
                 device: str | None = None, max_length: int | None = None, max_gen_toks: int = 256,
                 **overrides: Any) -> None:
        """engine: a prr.evaluation.Engine (from `python run.py task=lm_eval`), or None to build
        one from `overrides` (Hydra overrides: selector=quest, model=tiny-random, ...).
        max_length: the longest request (context + continuation or generated tokens); a longer
        one loses its oldest context tokens, counted in truncated_requests and warned about.
        Without an engine it defaults to the model's context (max_position_embeddings), or to
        task.context_tokens + task.max_new_tokens when task.context_tokens is given."""
        super().__init__()
        if str(batch_size) not in ("1", "auto"):
            raise ValueError(f"batch_size={batch_size}: the prr model batches requests by runtime.batch_size "
                             "(runtime.engine=graph); use 1")
        if engine is None:
            # prr's runtime group owns the device (runtime.device in model_args); prr-lm-eval passes
            # DEVICE_FROM_RUNTIME when no --device was given, in place of lm-eval's default cuda:0.
            if device is not None and device != DEVICE_FROM_RUNTIME:
                log.warning("prr: lm-eval's device=%s is not used; the prr model runs on runtime.device "
                            "(set it in --model_args, e.g. runtime.device=cuda)", device)
            cfg, max_length = compose_lm_eval_config(overrides, max_length)
            from hydra.utils import instantiate

            from prr.evaluation import Engine

            settings, task = instantiate(cfg.runtime), instantiate(cfg.task)
            PRRLM.model_loads_started += 1  # past this point, a failure is the run's, not an argument's (main)
            model = instantiate(cfg.model).load(settings.dtype, settings.device)
            engine = Engine(cfg, model, max_length)
            max_gen_toks = task.max_new_tokens
            self.limit_setting = "max_length in --model_args"
        elif overrides:
            raise ValueError(f"model_args {sorted(overrides)} given with an engine: set them in the run's config")
        elif max_length is not None and max_length > engine.max_tokens:
            raise ValueError(f"max_length={max_length} exceeds the engine's {engine.max_tokens} tokens")
        else:
            self.limit_setting = "task.context_tokens"  # run.py task=lm_eval sizes the engine from it
        self.engine = engine
        self.max_length = engine.max_tokens if max_length is None else max_length
        self.max_gen_toks = max_gen_toks
        self.truncated_requests = 0  # requests that lost context tokens to max_length (all request types)
        tok = engine.tokenizer
        ends, bos = eos_ids(engine.model.config), engine.model.config.bos_token_id
        eos = ends[0] if ends else None
        # lm-eval's "prefix token" (empty contexts, first rolling window): BOS, else EOS, else id 0 (bytes).
        self.prefix_token_id = bos if bos is not None else eos if eos is not None else 0
        self._tok = tok

    def get_model_info(self) -> dict[str, Any]:
        """lm-eval's simple_evaluate adds this to the results' `config` (so to results_*.json)
        after the run: the resolved prr config, the request limit and how many requests it cut."""
        from omegaconf import OmegaConf

        return {"prr_config": OmegaConf.to_container(self.engine.cfg, resolve=True), "max_length": self.max_length,
                "truncated_requests": self.truncated_requests}

    # --- helpers ------------------------------------------------------------------------
    def tok_encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def _context(self, ids: list[int], room: int, min_tokens: int = 1) -> tuple[torch.Tensor, bool]:
        """The last `room` tokens of ids (left-truncation), padded with the prefix token to
        min_tokens -> ([1, T], whether tokens were dropped)."""
        kept = ids[-room:] if room > 0 else []
        cut = len(kept) < len(ids)
        while len(kept) < min_tokens:
            kept = [self.prefix_token_id] + kept
        return torch.tensor([kept], dtype=torch.long), cut

    def _report_truncated(self, request_type: str, cut: int, total: int) -> None:
        """One warning per call (lm-eval makes one call per request type), not one per request."""
        if not cut:
            return
        self.truncated_requests += cut
        context = self.engine.model.config.max_position_embeddings
        fix = (f"raise {self.limit_setting} (up to the model's context of {context})"
               if self.max_length < context else f"the model's context is {context} tokens")
        log.warning("prr: %d of %d %s requests exceed max_length=%d tokens and lost their oldest context tokens; %s",
                    cut, total, request_type, self.max_length, fix)

    @property
    def tokenizer_name(self) -> str:
        return self.engine.model.name

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self._tok, "chat_template", None):
            raise ValueError(f"model {self.engine.model.name!r} has no chat template; drop --apply_chat_template")
        # add_generation_prompt=False: lm-eval's last message is the assistant's gen_prefix (RULER's answer
        # prefix, "Answer:"), which the model must continue, not a closed turn (as lm-eval's HF model does)
        return self._tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=not add_generation_prompt)

    # --- lm-eval's three request types -------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        scored, cut = [], 0  # (context [1, T], continuation ids) per request
        for request in requests:
            context, continuation = request.args
            if context:
                whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
                cont = whole[len(ctx):] if whole[: len(ctx)] == ctx else self.tok_encode(continuation)
            else:
                ctx, cont = [self.prefix_token_id], self.tok_encode(continuation)
            kept = cont[-(self.max_length - 2):]
            ids, context_cut = self._context(ctx, self.max_length - len(kept))
            cut += context_cut or len(kept) < len(cont)
            scored.append((ids, kept))
        out = []
        for (logprob, greedy, _), request in zip(self._score(scored, "prr loglikelihood", disable_tqdm), requests,
                                                 strict=True):
            out.append((logprob, greedy))
            self.cache_hook.add_partial("loglikelihood", request.args, (logprob, greedy))
        self._report_truncated("loglikelihood", cut, len(requests))
        return out

    def _score(self, scored: list[tuple[torch.Tensor, list[int]]], desc: str, disable_tqdm: bool) -> list:
        """engine.score_batch over (context [1, T], continuation) requests, a batch of the engine's
        rows (runtime.batch_size on the graph engine) at a time."""
        rows, out = self.engine.rows, []
        with tqdm(total=len(scored), desc=desc, disable=disable_tqdm) as bar:
            for start in range(0, len(scored), rows):
                out += self.engine.score_batch(scored[start : start + rows])
                bar.update(len(scored[start : start + rows]))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        scored, owner = [], []  # every request's windows, and the request each belongs to
        for i, request in enumerate(requests):
            (text,) = request.args
            windows = map(make_disjoint_window, get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length - 1, 1))
            for ctx, pred in windows:  # each window fits max_length: nothing is cut
                scored.append((self._context(ctx, self.max_length - len(pred))[0], pred))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _, _) in zip(owner, self._score(scored, "prr loglikelihood_rolling", disable_tqdm),
                                      strict=True):
            totals[i] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        prepared, cut = [], 0  # (context [1, T], max new tokens, stop strings) per request
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            if kwargs.pop("do_sample", False) or float(kwargs.pop("temperature", 0.0) or 0.0) > 0:
                raise ValueError("the prr model decodes greedily; set do_sample=false, temperature=0 in gen_kwargs")
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            # Generation prefills the context alone, which needs 2 tokens: a shorter one gets the prefix token.
            ids, context_cut = self._context(self.tok_encode(context), self.max_length - max_gen, min_tokens=2)
            cut += context_cut
            prepared.append((ids, max_gen, tuple(until)))
        out: list[str] = []
        with tqdm(total=len(requests), desc="prr generate_until", disable=disable_tqdm) as bar:
            start = 0
            while start < len(prepared):  # consecutive requests of the same settings, up to the engine's rows
                end = start + 1
                while end < len(prepared) and end - start < self.engine.rows and \
                        prepared[end][1:] == prepared[start][1:]:
                    end += 1
                _, max_gen, until = prepared[start]
                out += [g.text for g in self.engine.generate_batch([p[0] for p in prepared[start:end]], max_gen,
                                                                   stop=until)]
                bar.update(end - start)
                start = end
        for request, text in zip(requests, out, strict=True):
            self.cache_hook.add_partial("generate_until", request.args, text)
        self._report_truncated("generate_until", cut, len(requests))
        return out


# Registered by name (a lazy "module:class" target), so `python -m prr.lm_eval_model`, which runs
# this file as __main__ and later imports it as prr.lm_eval_model, registers one and the same target.
if model_registry.get("prr", None) is None:
    model_registry.register("prr", target="prr.lm_eval_model:PRRLM")


def with_local_tasks(user_paths: str | list[str] | None) -> list[str]:
    """lm-eval's include path: prr's local tasks, then the user's folders (a later folder wins
    a task name both define, in lm-eval's TaskManager, which takes a list)."""
    user = [] if user_paths is None else [user_paths] if isinstance(user_paths, (str, Path)) else list(user_paths)
    folders = [Path(path).expanduser() for path in user]
    for path, folder in zip(user, folders, strict=True):
        if not folder.is_dir():  # lm-eval would skip it and then find no task in it
            raise ValueError(f"include_path {path!r} is not a directory; give a folder of lm-eval task YAML files")
    # prr's folder once: given again, lm-eval would index it twice and warn that each task overrides itself
    return [str(LOCAL_TASKS), *(str(f) for f in folders if f.resolve() != LOCAL_TASKS)]


def main(argv: list[str] | None = None) -> None:
    """`prr-lm-eval` / `python -m prr.lm_eval_model`: lm-eval's CLI (its parser, then its run)
    with the `prr` model registered, and with these changes to the parsed arguments:
    include_path is prr's local tasks plus the user's folder (--include_path DIR or =DIR, or
    the --config YAML's), and the prr model gets DEVICE_FROM_RUNTIME when no --device is given.
    HF_DATASETS_OFFLINE=1 unless set: hub tasks (LongBench, ...) need HF_DATASETS_OFFLINE=0.
    A bad argument (unknown task, a model_args typo, max_length above the model's context)
    ends in one line on stderr and exit status 2, before the model loads."""
    # datasets reads this once, at its import (not done yet): local tasks need no hub, and without
    # it datasets still tries the network. HF_HUB_OFFLINE is left alone: hub models may need the hub.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from hydra.errors import HydraException
    from lm_eval._cli import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.utils import setup_logging

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    setup_logging()
    cli = HarnessCLI()
    args = cli.parse_args()  # inserts lm-eval's `run` when no subcommand is named, as lm-eval does
    try:
        from_yaml = EvaluatorConfig.load_yaml_config(args.config) if getattr(args, "config", None) else {}
        if hasattr(args, "include_path"):  # run, ls and validate
            args.include_path = with_local_tasks(args.include_path or from_yaml.get("include_path"))
    except (ValueError, FileNotFoundError) as err:
        exit_on_argument_error(err)
    if (getattr(args, "model", None) or from_yaml.get("model")) != "prr":
        hint = "" if getattr(args, "model", None) else " (and no --model prr: lm-eval's default model would run)"
        try:
            cli.execute(args)  # another lm-eval model, or ls/validate: lm-eval's own behaviour
        except ValueError as err:  # lm-eval's argument errors (an unknown task): one line, as for --model prr
            exit_on_argument_error(ValueError(f"{err}{hint}"))
        return
    if not (args.device or from_yaml.get("device")):
        args.device = DEVICE_FROM_RUNTIME
    loads_before = PRRLM.model_loads_started
    try:
        cli.execute(args)
    except (ValueError, FileNotFoundError, HydraException) as err:
        if PRRLM.model_loads_started > loads_before:
            raise  # the run's own failure, past the arguments: its traceback is the useful part
        exit_on_argument_error(err)


def exit_on_argument_error(err: Exception) -> NoReturn:
    message = " ".join(str(err).split())
    if err.__cause__ is not None:  # Hydra's override errors name the reason only in their cause
        message += f" ({str(err.__cause__).strip().splitlines()[0]})"
    print(f"prr-lm-eval: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    # Run as prr.lm_eval_model, the module whose PRRLM lm-eval builds (its registry names that
    # module), so that main() sees PRRLM.model_loads_started of the model that ran.
    from prr.lm_eval_model import main as prr_lm_eval

    prr_lm_eval()
