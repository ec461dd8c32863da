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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import Tensor

from prr.eos import eos_ids
from prr.run_inputs import DTYPES
from prr.run_records import RunRecords, step_rows, token_row
from prr.runtime.eager_run import EagerRuntime, eager_budget_setup
from prr.runtime.run_strategy import topk_label
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
        self.budget_info, self.device_name = eager_budget_setup(self.budget, selector, self.settings, model.decoder,
                                                                self.max_tokens, self.dtype, self.ops.name)
        self.topk_blocks = topk_label(selector)
        self.eos_ids = set(eos_ids(mc))
        self.request = -1  # index of the current request: the records' `sample` column
        self.run_dir = run_dir
        self.collect = False  # True: keep the current request's step rows in self.request_rows (studies)
        self.request_rows: list[dict[str, Any]] = []
        self.records = RunRecords(run_dir, samples=True) if run_dir is not None else None

    def _selector(self) -> Any:
        selector = instantiate(self.cfg.selector)
        selector.bind_model(self.model.config)
        return selector

    def close(self) -> None:
        if self.records is not None:
            self.records.close()

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
        if self.records is not None:
            self.records.samples.write([{"sample": self.request, **row}])

    # --- prefill ------------------------------------------------------------------------
    def prefill(self, input_ids: Tensor) -> Prefill:
        """Dense prefill of input_ids [1, T] (T >= 2), q/k/v kept for replay into any config."""
        if input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
            raise ValueError(f"prefill needs input_ids [1, T >= 2], got {tuple(input_ids.shape)}")
        capture = CapturingAttention(1.0 / self.model.config.head_dim ** 0.5)
        with torch.inference_mode():
            logits = self.model.decoder(input_ids.to(self.device), 0, capture, last_logits_only=True)[:, -1]
        return Prefill(input_ids, logits, capture.qkv)

    def _runtime(self, total_tokens: int) -> EagerRuntime:
        """A fresh runtime for one request of total_tokens: its own cache, selector and predictor."""
        mc = self.model.config
        if total_tokens > self.max_tokens:
            raise ValueError(f"a request of {total_tokens} tokens exceeds this engine's {self.max_tokens} "
                             f"(model context {mc.max_position_embeddings}); shorten the prompt")
        selector = self._selector()
        selector.set_backend(self.ops.name)
        return EagerRuntime(self.model.decoder, self.settings, selector, instantiate(self.cfg.predictor), self.budget,
                            self.ops.name, total_tokens, self.dtype)

    def _start(self, input_ids: Tensor, new_tokens: int, prefill: Prefill | None,
               all_logits: bool = False) -> tuple[EagerRuntime, Tensor]:
        """A fresh runtime holding the prompt -> (runtime, logits [1, V] at the last prompt
        position; [T, V] at every position with all_logits)."""
        self.request += 1
        self.request_rows = []
        runtime = self._runtime(input_ids.shape[1] + new_tokens)
        with torch.inference_mode():
            if prefill is None:
                logits = runtime.prefill(input_ids, all_logits=all_logits, last_logits_only=not all_logits)
            else:
                if not torch.equal(prefill.input_ids, input_ids):
                    raise ValueError("the Prefill given was made from other input_ids")
                runtime.replay_prefill(prefill.qkv)  # same q/k/v: selector metadata and tail rebuilt
                logits = prefill.last_logits
            runtime.finish_prefill()
        return runtime, logits

    def _step(self, runtime: EagerRuntime, token: int, position: int, step: int) -> Tensor:
        """One decode step of `token` at `position` -> logits [1, V]; records written."""
        with torch.inference_mode():
            logits, records, wall, measure_s = runtime.step(torch.tensor([token]), position, step)
        if self.records is not None or self.collect:
            rows = step_rows(records, sample=self.request)
            if self.collect:
                self.request_rows += rows
        if self.records is not None:
            self.records.steps.write(rows)
            self.records.tokens.write([token_row(step, token, wall, measure_s, sample=self.request)])
        return logits.float()

    # --- requests -----------------------------------------------------------------------
    def generate(self, input_ids: Tensor, max_new_tokens: int, stop: tuple[str, ...] = (),
                 prefill: Prefill | None = None) -> Generation:
        """Greedy decoding of up to max_new_tokens after input_ids [1, T]; stops at EOS or when
        the text holds a stop string (cut there)."""
        runtime, logits = self._start(input_ids, max_new_tokens, prefill)
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
            logits = self._step(runtime, token, prompt_len + step, step)
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
            runtime, both = self._start(input_ids, len(continuation) - 1, None, all_logits=True)  # [2, V]
            logprobs.append(float(torch.log_softmax(both[0].float(), -1)[continuation[0]]))
            greedy = int(both[0].argmax()) == continuation[0]
            logits, continuation, offset = both[1:], continuation[1:], 1
        else:
            runtime, logits = self._start(input_ids, len(continuation), prefill)
            offset = 0
        prompt_len = input_ids.shape[1]
        for i, token in enumerate(continuation):
            logp = torch.log_softmax(logits[0].float(), -1)
            logprobs.append(float(logp[token]))
            greedy = greedy and int(logits[0].argmax()) == token
            if i + 1 < len(continuation):
                logits = self._step(runtime, token, prompt_len + i, i + offset)
        return sum(logprobs), greedy, logprobs
