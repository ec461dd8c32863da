"""Many requests through one config's DSA/PRR runtime: the engine behind scored tasks
(RULER-style generators, perplexity, lm-eval) and the `prr` lm-eval model.

`Engine` is the one driver of a request (prefill, the greedy loop with EOS and stop strings,
scoring, records); a request strategy runs its steps, chosen by runtime.engine:
- `EagerRequests` (eager): the research runtime, a fresh KV cache, selector and predictor per
  request, one step per host look, per-(step, layer, row, KV head) records;
- `GraphRequests` (graph, prr/runtime/graph_requests.py): one CUDA-graph engine per Engine,
  its cache and state reset in place per request, windows of captured steps.
Samples never share state; the model and the speculation budget are set up once. The
prefill is dense (as in the runner), so sparse attention and PRR act on every decoded token:
generated tokens, and continuation tokens fed one step at a time (teacher forcing) when a
continuation is scored.

Records, when the engine has a run dir: records/steps.jsonl (eager only) and records/tokens.jsonl
as in a decode run plus a `sample` column (the request's index), records/samples.jsonl (one row
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


@dataclass
class Steps:
    """What n decode steps of one request wrote, per step: the token it read, the token it
    chose (greedy, or the forced one when scoring), that token's log-probability, whether it is
    the argmax, the top-1 minus top-2 logit, wall time and untimed measurement work; `records`:
    the eager runtime's per-(layer, row, KV head) records of each step (None on the graph engine)."""

    read: list[int] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    measure_s: list[float] = field(default_factory=list)
    records: list[list[Any]] | None = None


class EagerRequests:
    """Engine's request strategy on the research runtime (`runtime.engine=eager`): a fresh
    EagerRuntime per request (its own cache, selector and predictor), one step per host look,
    per-(step, layer, row, KV head) records. (The graph engine's: prr/runtime/graph_requests.py.)"""

    label = "eager"
    window = 1

    def __init__(self, owner: Engine) -> None:
        self.owner = owner
        selector = owner.new_selector()
        self.selection_backend = selector.set_backend(owner.ops.name)
        self.budget_info, self.device_name = eager_budget_setup(owner.budget, selector, owner.settings,
                                                                owner.model.decoder, owner.max_tokens, owner.dtype,
                                                                owner.ops.name)
        self.topk_blocks = topk_label(selector)
        self.runtime: EagerRuntime | None = None
        self.position = 0  # the position of the token the next step reads

    def open(self, total_tokens: int) -> EagerRuntime:
        """A fresh runtime for one request of total_tokens."""
        o = self.owner
        selector = o.new_selector()
        selector.set_backend(o.ops.name)
        self.runtime = EagerRuntime(o.model.decoder, o.settings, selector, instantiate(o.cfg.predictor), o.budget,
                                    o.ops.name, total_tokens, o.dtype)
        return self.runtime

    def begin(self, eager: EagerRuntime, length: int) -> None:
        self.position = length

    def steps(self, first: int, n: int, forced: list[int] | None) -> Steps:
        """n steps: step 0 reads `first`, step i > 0 the token step i - 1 chose (forced[i - 1],
        or its greedy token)."""
        out, token = Steps(records=[]), first
        for i in range(n):
            with torch.inference_mode():
                logits, records, wall, measure_s = self.runtime.step(torch.tensor([token]), self.position,
                                                                     self.owner.step + i)
                row = logits[0].float()  # [V]
                top2 = row.topk(2).values
                best = int(row.argmax())
                chosen = forced[i] if forced is not None else best
                out.logprobs.append(float(torch.log_softmax(row, -1)[chosen]))
            out.read.append(token)
            out.chosen.append(chosen)
            out.greedy.append(best == chosen)
            out.margins.append(float(top2[0] - top2[1]))
            out.wall_s.append(wall)
            out.measure_s.append(measure_s)
            out.records.append(records)
            self.position += 1
            token = chosen
        return out

    def end(self) -> None:
        self.runtime = None

    def results(self) -> dict[str, Any]:
        return {"engine": "eager"}  # (hit rates and timings: from the step records)


class Engine:
    """Decode requests under one config (model, selector, predictor, budget, runtime, backend):
    the prefill, the greedy / EOS / stop-string loop, scoring and the records, over a request
    strategy chosen by runtime.engine: `EagerRequests` (the research runtime) or `GraphRequests`
    (the CUDA-graph engine, prr/runtime/graph_requests.py)."""

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
        self.eos_ids = set(eos_ids(mc))
        self.request = -1  # index of the current request: the records' `sample` column
        self.step = 0  # the current request's next decode step (the records' `step`)
        self.run_dir = run_dir
        self.collect = False  # True: keep the current request's step rows in self.request_rows (studies)
        self.request_rows: list[dict[str, Any]] = []
        engine = self.settings.engine
        if engine == "graph":
            from prr.runtime.graph_requests import GraphRequests

            self.runtime: EagerRequests | GraphRequests = GraphRequests(self)
        elif engine == "eager":
            self.runtime = EagerRequests(self)
        else:
            raise ValueError(f"runtime.engine={engine!r} is not one of ['eager', 'graph']")
        self.selection_backend = self.runtime.selection_backend
        self.budget_info, self.device_name = self.runtime.budget_info, self.runtime.device_name
        self.topk_blocks = self.runtime.topk_blocks
        self.records = RunRecords(run_dir, samples=True) if run_dir is not None else None

    def new_selector(self) -> Any:
        selector = instantiate(self.cfg.selector)
        selector.bind_model(self.model.config)
        return selector

    def close(self) -> None:
        if self.records is not None:
            self.records.close()

    def results(self) -> dict[str, Any]:
        """The request strategy's own numbers for the summary (the graph engine's pooled counters)."""
        return self.runtime.results()

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

    def _start(self, input_ids: Tensor, new_tokens: int, prefill: Prefill | None, all_logits: bool = False,
               first_step: int = 0) -> Tensor:
        """The prompt input_ids [1, T] prefilled into the request strategy's runtime -> logits
        [1, V] at the last prompt position ([T, V] at every position with all_logits)."""
        self.request += 1
        self.request_rows = []
        self.step = first_step
        mc = self.model.config
        total_tokens = input_ids.shape[1] + new_tokens
        if total_tokens > self.max_tokens:
            raise ValueError(f"a request of {total_tokens} tokens exceeds this engine's {self.max_tokens} "
                             f"(model context {mc.max_position_embeddings}); shorten the prompt")
        runtime = self.runtime.open(total_tokens)
        with torch.inference_mode():
            if prefill is None:
                logits = runtime.prefill(input_ids, all_logits=all_logits, last_logits_only=not all_logits)
            else:
                if not torch.equal(prefill.input_ids, input_ids):
                    raise ValueError("the Prefill given was made from other input_ids")
                runtime.replay_prefill(prefill.qkv)  # same q/k/v: selector metadata and tail rebuilt
                logits = prefill.last_logits
            runtime.finish_prefill()
            self.runtime.begin(runtime, input_ids.shape[1])
        return logits.float()

    def _record(self, steps: Steps, kept: int) -> None:
        """The first `kept` of these steps into the records (and request_rows when collecting);
        the request's step count moves past every step that ran."""
        first = self.step
        self.step += len(steps.read)
        if self.records is None and not self.collect:
            return
        if self.collect and steps.records is None:
            raise ValueError(f"collect=True keeps per-head step records, which runtime.engine={self.runtime.label} "
                             "does not write; use runtime.engine=eager")
        rows = [] if steps.records is None else step_rows([r for rs in steps.records[:kept] for r in rs],
                                                          sample=self.request)
        if self.collect:
            self.request_rows += rows
        if self.records is not None:
            if rows:
                self.records.steps.write(rows)
            self.records.tokens.write([token_row(first + i, steps.read[i], steps.wall_s[i], steps.measure_s[i],
                                                 sample=self.request) for i in range(kept)])

    # --- requests -----------------------------------------------------------------------
    def _ended(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        return tokens[-1] in self.eos_ids or bool(stop and any(s in self.decode_text(tokens) for s in stop))

    def generate(self, input_ids: Tensor, max_new_tokens: int, stop: tuple[str, ...] = (),
                 prefill: Prefill | None = None) -> Generation:
        """Greedy decoding of up to max_new_tokens after input_ids [1, T]; stops at EOS or when
        the text holds a stop string (cut there). The host looks at tokens every window of
        steps (the graph engine's: 16; steps past the end are not kept)."""
        logits = self._start(input_ids, max_new_tokens, prefill)[0]  # [V]
        top2 = logits.topk(2).values
        tokens, margins = [int(logits.argmax())], [float(top2[0] - top2[1])]
        ended = self._ended(tokens, stop)
        try:
            while not ended and len(tokens) < max_new_tokens:  # the last token needs no decode step of its own
                steps = self.runtime.steps(tokens[-1], min(self.runtime.window, max_new_tokens - len(tokens)), None)
                kept = 0
                for token, margin in zip(steps.chosen, steps.margins, strict=True):
                    tokens.append(token)
                    margins.append(margin)
                    kept += 1
                    if self._ended(tokens, stop):
                        ended = True
                        break
                self._record(steps, kept)
        finally:
            self.runtime.end()
        text = self.decode_text(tokens)
        for s in stop:
            if s and s in text:
                text = text[: text.index(s)]
        return Generation(tokens, text, margins)

    def score(self, input_ids: Tensor, continuation: list[int], prefill: Prefill | None = None) -> tuple[float, bool, list[float]]:
        """log p(continuation | input_ids [1, T]) with continuation tokens fed one decode step at
        a time (teacher forcing) -> (sum of log-probs, whether greedy decoding yields it,
        per-token log-probs)."""
        if not continuation:
            raise ValueError("an empty continuation has no log-likelihood")
        logprobs, greedy = [], []
        if input_ids.shape[1] == 1:
            # The prefill needs 2 tokens: the first continuation token joins it, its log-prob read at position 0.
            if prefill is not None:
                raise ValueError("a one-token context is prefilled together with its first continuation token")
            input_ids = torch.cat([input_ids, torch.tensor([continuation[:1]], dtype=input_ids.dtype)], 1)
            both = self._start(input_ids, len(continuation) - 1, None, all_logits=True, first_step=1)  # [2, V]
            logprobs.append(float(torch.log_softmax(both[0], -1)[continuation[0]]))
            greedy.append(int(both[0].argmax()) == continuation[0])
            logits, continuation = both[1], continuation[1:]
        else:
            logits = self._start(input_ids, len(continuation), prefill)[0]  # [V]
        try:
            if continuation:
                logprobs.append(float(torch.log_softmax(logits, -1)[continuation[0]]))
                greedy.append(int(logits.argmax()) == continuation[0])
            if len(continuation) > 1:  # step i reads continuation[i]: the log-prob of continuation[i + 1]
                steps = self.runtime.steps(continuation[0], len(continuation) - 1, continuation[1:])
                logprobs += steps.logprobs
                greedy += steps.greedy
                self._record(steps, len(steps.read))
        finally:
            self.runtime.end()
        return sum(logprobs), all(greedy), logprobs
