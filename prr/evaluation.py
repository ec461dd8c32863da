"""Many requests through one config's DSA/PRR runtime: the engine behind scored tasks
(RULER-style generators, perplexity, lm-eval) and the `prr` lm-eval model.

Each request gets a fresh KV cache, selector and predictor (samples never share state);
the model and the speculation budget are set up once. The prefill is dense (as in the
runner), so sparse attention and PRR act on every decoded token: generated tokens, and
continuation tokens fed one at a time when a continuation is scored.

Records, when the engine has a run dir: records/steps.jsonl and records/tokens.jsonl as in
a decode run plus a `sample` column (the request's index), records/samples.jsonl (one row
per scored sample), flushed as they come.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from prr.cache import PagedKVCache
from prr.metrics import layer_step_rows, per_layer, summarize
from prr.paths import write_json_atomic, write_text_atomic
from prr.run_inputs import DTYPES
from prr.runtime.dsa_backend import DSABackend, check_finite
from prr.runtime.probe import StageProbe
from prr.selectors.dense import DenseSelector
from prr.sinks import JsonlWriter, read_jsonl
from prr.summary_table import format_summary
from prr.tasks.base import Task
from prr.tasks.samples import ByteTokenizer


def is_evaluation_task(task: Task) -> bool:
    """Tasks scored over many requests implement `evaluate(engine) -> metrics`."""
    return callable(getattr(task, "evaluate", None))


@dataclass
class Prefill:
    """A dense prefill, kept so several configs can decode from it without recomputing it.
    qkv[layer] = (q [1, Hq, T, D], k [1, Hkv, T, D], v [1, Hkv, T, D]), post-RoPE."""

    input_ids: Tensor  # [1, T]
    last_logits: Tensor  # [1, V]
    qkv: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)


class CapturingAttention:
    """Dense causal attention that keeps every layer's q/k/v (for Prefill replay)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.qkv: list[tuple[Tensor, Tensor, Tensor]] = []

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [B, Hq, T, D], k, v: [B, Hkv, T, D] -> [B, Hq, T, D]; the same op as DSABackend.prefill
        self.qkv.append((q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        raise RuntimeError("CapturingAttention only prefills")


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    margins: list[float]  # top-1 minus top-2 logit at each generated token: near-ties explain flips


class Engine:
    """Decode requests under one config (model, selector, predictor, budget, runtime, backend)."""

    def __init__(self, cfg: DictConfig, model: Any, max_tokens: int, run_dir: Path | None = None) -> None:
        """max_tokens: the longest request (prompt + new tokens) this engine will see."""
        self.cfg = cfg
        self.settings = instantiate(cfg.runtime)
        if self.settings.batch_size != 1:
            raise ValueError(f"runtime.batch_size={self.settings.batch_size}: scored tasks decode one request at a "
                             "time; use runtime.batch_size=1")
        self.model = model
        self.tokenizer = model.tokenizer if model.tokenizer is not None else ByteTokenizer()
        mc = model.config
        if model.tokenizer is None and mc.vocab_size < 256:
            raise ValueError(f"model {model.name!r} has no tokenizer and a vocab of {mc.vocab_size} < 256 byte ids")
        self.device = torch.device(self.settings.device)
        self.dtype = DTYPES[self.settings.dtype]
        self.ops = instantiate(cfg.backend)
        self.budget = instantiate(cfg.budget)
        self.max_tokens = min(max_tokens, mc.max_position_embeddings)
        selector = self._selector()
        self.selection_backend = selector.set_backend(self.ops.name)
        probe = StageProbe(selector, self.settings.repair_mode, 1, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                           self.settings.block_size, self.max_tokens, self.dtype, self.device, backend=self.ops.name)
        max_blocks = -(-self.max_tokens // self.settings.block_size)
        self.budget_info = self.budget.setup(probe, selector.selected_blocks(max_blocks), max_blocks)
        self.device_name = probe.device_name
        self.topk_blocks = "all" if isinstance(selector, DenseSelector) else selector.topk_blocks
        eos = mc.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        self.request = -1  # index of the current request: the records' `sample` column
        self.steps_out = self.tokens_out = self.samples_out = None
        self.run_dir = run_dir
        self.collect = False  # True: keep the current request's step rows in self.request_rows (studies)
        self.request_rows: list[dict[str, Any]] = []
        if run_dir is not None:
            self.steps_out = JsonlWriter(run_dir / "records" / "steps.jsonl")
            self.tokens_out = JsonlWriter(run_dir / "records" / "tokens.jsonl")
            self.samples_out = JsonlWriter(run_dir / "records" / "samples.jsonl")

    def _selector(self) -> Any:
        selector = instantiate(self.cfg.selector)
        selector.bind_model(self.model.config)
        return selector

    def close(self) -> None:
        for w in (self.steps_out, self.tokens_out, self.samples_out):
            if w is not None:
                w.close()

    # --- text ---------------------------------------------------------------------------
    def encode_prompt(self, text: str, chat_template: bool, gen_prefix: str = "") -> Tensor:
        """-> [1, T] ids of the user message (templated when the tokenizer has one) + gen_prefix."""
        from prr.model.prompt import encode_prompt

        ids = encode_prompt(self.tokenizer, text, use_chat_template=chat_template)
        if gen_prefix:
            extra = self.tokenizer(gen_prefix, add_special_tokens=False)["input_ids"]
            ids = torch.cat([ids, torch.tensor([extra], dtype=torch.long)], 1)
        return ids

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def log_sample(self, row: dict[str, Any]) -> None:
        if self.samples_out is not None:
            self.samples_out.write([{"sample": self.request, **row}])

    # --- prefill ------------------------------------------------------------------------
    def prefill(self, input_ids: Tensor) -> Prefill:
        """Dense prefill of input_ids [1, T] (T >= 2), q/k/v kept for replay into any config."""
        if input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
            raise ValueError(f"prefill needs input_ids [1, T >= 2], got {tuple(input_ids.shape)}")
        capture = CapturingAttention(1.0 / self.model.config.head_dim ** 0.5)
        with torch.inference_mode():
            logits = self.model.decoder(input_ids.to(self.device), 0, capture, last_logits_only=True)[:, -1]
        return Prefill(input_ids, logits, capture.qkv)

    def _backend(self, total_tokens: int) -> DSABackend:
        mc, s = self.model.config, self.settings
        if total_tokens > self.max_tokens:
            raise ValueError(f"a request of {total_tokens} tokens exceeds this engine's {self.max_tokens} "
                             f"(model context {mc.max_position_embeddings}); shorten the prompt")
        selector = self._selector()
        selector.set_backend(self.ops.name)
        cache = PagedKVCache(mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, s.block_size, total_tokens,
                             self.dtype, self.device)
        return DSABackend(cache, mc.num_heads, selector, instantiate(self.cfg.predictor), self.budget, mode=s.mode,
                          repair_mode=s.repair_mode, calibration_tokens=s.calibration_tokens,
                          dense_metrics_every=s.dense_metrics_every, check_serial=s.check_serial, backend=self.ops.name)

    def _start(self, input_ids: Tensor, new_tokens: int, prefill: Prefill | None,
               all_logits: bool = False) -> tuple[DSABackend, Tensor]:
        """A fresh backend holding the prompt -> (backend, logits [1, V] at the last prompt
        position; [T, V] at every position with all_logits)."""
        self.request += 1
        self.request_rows = []
        backend = self._backend(input_ids.shape[1] + new_tokens)
        with torch.inference_mode():
            if prefill is None:
                logits = self.model.decoder(input_ids.to(self.device), 0, backend, last_logits_only=not all_logits)
                logits = logits[0] if all_logits else logits[:, -1]
            else:
                if not torch.equal(prefill.input_ids, input_ids):
                    raise ValueError("the Prefill given was made from other input_ids")
                for layer, (q, k, v) in enumerate(prefill.qkv):  # same q/k/v: selector metadata and tail rebuilt
                    backend.prefill(layer, q, k, v)
                logits = prefill.last_logits
            backend.finish_prefill()
        return backend, logits

    def _step(self, backend: DSABackend, token: int, position: int, step: int) -> Tensor:
        """One decode step of `token` at `position` -> logits [1, V]; records written."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self.model.decoder(torch.tensor([[token]], device=self.device), position, backend)[:, -1]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        latency = time.perf_counter() - t0
        records, measure_s = backend.end_step()
        check_finite(logits, step, backend)
        if self.steps_out is not None or self.collect:
            rows = [{"sample": self.request, **row} for r in records for row in layer_step_rows(r)]
            if self.collect:
                self.request_rows += rows
        if self.steps_out is not None:
            self.steps_out.write(rows)
            self.tokens_out.write([{"sample": self.request, "step": step, "token": token, "wall_s": latency,
                                    "measure_s": measure_s, "latency_s": latency - measure_s}])
        return logits.float()

    # --- requests -----------------------------------------------------------------------
    def generate(self, input_ids: Tensor, max_new_tokens: int, stop: tuple[str, ...] = (),
                 prefill: Prefill | None = None) -> Generation:
        """Greedy decoding of up to max_new_tokens after input_ids [1, T]; stops at EOS or when
        the text holds a stop string (cut there)."""
        backend, logits = self._start(input_ids, max_new_tokens, prefill)
        prompt_len = input_ids.shape[1]
        tokens: list[int] = []
        margins: list[float] = []
        for step in range(max_new_tokens):
            top2 = logits[0].float().topk(2).values
            token = int(logits[0].argmax())
            tokens.append(token)
            margins.append(float(top2[0] - top2[1]))
            if token in self.eos_ids or (stop and any(s in self.decode_text(tokens) for s in stop)):
                break
            if step == max_new_tokens - 1:
                break  # the last token needs no decode step of its own
            logits = self._step(backend, token, prompt_len + step, step)
        text = self.decode_text(tokens)
        for s in stop:
            if s and s in text:
                text = text[: text.index(s)]
        return Generation(tokens, text, margins)

    def score(self, input_ids: Tensor, continuation: list[int], prefill: Prefill | None = None) -> tuple[float, bool, list[float]]:
        """log p(continuation | input_ids [1, T]) with continuation tokens fed one decode step at
        a time -> (sum of log-probs, whether greedy decoding yields it, per-token log-probs)."""
        if not continuation:
            raise ValueError("an empty continuation has no log-likelihood")
        logprobs, greedy = [], True
        if input_ids.shape[1] == 1:
            # The prefill needs 2 tokens: the first continuation token joins it, its log-prob read at position 0.
            if prefill is not None:
                raise ValueError("a one-token context is prefilled together with its first continuation token")
            input_ids = torch.cat([input_ids, torch.tensor([continuation[:1]], dtype=input_ids.dtype)], 1)
            backend, both = self._start(input_ids, len(continuation) - 1, None, all_logits=True)  # [2, V]
            logprobs.append(float(torch.log_softmax(both[0].float(), -1)[continuation[0]]))
            greedy = int(both[0].argmax()) == continuation[0]
            logits, continuation, offset = both[1:], continuation[1:], 1
        else:
            backend, logits = self._start(input_ids, len(continuation), prefill)
            offset = 0
        prompt_len = input_ids.shape[1]
        for i, token in enumerate(continuation):
            logp = torch.log_softmax(logits[0].float(), -1)
            logprobs.append(float(logp[token]))
            greedy = greedy and int(logits[0].argmax()) == token
            if i + 1 < len(continuation):
                logits = self._step(backend, token, prompt_len + i, i + offset)
        return sum(logprobs), greedy, logprobs


def evaluate_run(cfg: DictConfig, run_dir: Path, logger: Any) -> dict[str, Any]:
    """The runner's path for scored tasks: every request through one engine, then the task's
    metrics (accuracy, perplexity, lm-eval scores) in summary.json and the logger."""
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
    layers = per_layer(steps)
    layers.to_csv(run_dir / "layers.csv", index=False)
    samples = read_jsonl(run_dir / "records" / "samples.jsonl")
    if "prediction" in samples:
        write_text_atomic(run_dir / "generation.txt", "".join(
            f"sample {r['sample']}: {r['prediction']!r} (answers {r.get('answers')}, score {r.get('score')})\n"
            for r in samples.to_dict("records")))
    summary = {
        "status": "complete",
        "model": model.name,
        "task": cfg.task._target_.rsplit(".", 1)[-1],
        "selector": OmegaConf.to_container(cfg.selector, resolve=True),
        "predictor": OmegaConf.to_container(cfg.predictor, resolve=True),
        "budget": OmegaConf.to_container(cfg.budget, resolve=True),
        "mode": settings.mode,
        "repair_mode": settings.repair_mode,
        "backend": engine.ops.name,
        "selection_backend": engine.selection_backend,
        "device": engine.device_name,
        "prompt_tokens": getattr(task, "prompt_tokens", None),
        "block_size": settings.block_size,
        "topk_blocks": engine.topk_blocks,
        "model_load_s": load_s,
        "eval_s": eval_s,
        "budget_setup": engine.budget_info,
        **metrics,
        **summarize(steps, tokens),
    }
    write_json_atomic(run_dir / "summary.json", summary)
    logger.log_run(summary, layers, steps)
    print(format_summary(summary, layers) if not steps.empty else "")
    print("  task metrics               " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in metrics.items()))
    return summary
