"""Many requests through one config's DSA/PRR runtime: the engine behind scored tasks
(RULER-style generators, perplexity, lm-eval) and the `prr` lm-eval model.

`Engine` is the one driver of a request (prefill, the greedy loop with EOS and stop strings,
scoring, records); the run's pipeline (prr/runtime/pipeline.py, `build_pipeline`, chosen by
runtime.engine) prefills and runs the steps:
- `EagerPipeline` (eager): the research runtime, a fresh KV cache, selector and predictor per
  request, one step per host look, per-(step, layer, row, KV head) records;
- `GraphPipeline` (graph, prr/runtime/graph_pipeline.py): one CUDA-graph engine per Engine,
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
from prr.runtime.pipeline import build_pipeline
from prr.runtime.run_strategy import Steps
from prr.tasks.base import Task
from prr.tasks.samples import ByteTokenizer


def is_evaluation_task(task: Task) -> bool:
    """Tasks scored over many requests implement `evaluate(engine) -> metrics`."""
    return callable(getattr(task, "evaluate", None))


@dataclass
class Prefill:
    """A dense prefill, kept so several configs can decode from it without recomputing it
    (`EagerRuntime.replay_prefill`). qkv[layer] = (q [1, Hq, T, D], k [1, Hkv, T, D], v [1, Hkv,
    T, D]), post-RoPE; hidden[layer] = the layer's normed hidden states [1, T, H] (its attention
    input after RMSNorm), kept only for the layers asked for (`hidden_layers`: a selector that
    reads them, the lightning indexer, needs its sparse layers')."""

    input_ids: Tensor  # [1, T]
    last_logits: Tensor  # [1, V]
    qkv: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)
    hidden: dict[int, Tensor] = field(default_factory=dict)


def hidden_layers(selector: Any, num_layers: int) -> list[int]:
    """The layers whose normed hidden states a kept prefill must keep for `selector` to replay
    it: its sparse layers where it reads them (`Selector.needs_hidden`), else none."""
    if not selector.needs_hidden:
        return []
    return [i for i in range(num_layers) if not selector.is_dense_layer(i)]


class CapturingAttention:
    """Dense causal attention that keeps every layer's q/k/v, and the normed hidden states of
    `hidden_layers` (for Prefill replay)."""

    def __init__(self, scale: float, hidden_layers: list[int] | tuple[int, ...] = ()) -> None:
        self.scale = scale
        self.qkv: list[tuple[Tensor, Tensor, Tensor]] = []
        self.keep = set(hidden_layers)
        self.hidden: dict[int, Tensor] = {}

    def hidden_hook(self, prefill: bool):
        """The decoder's callback for each layer's normed hidden state x [B, T, H] (kept for the
        layers asked for), or None: no layer asked, no extra norm."""
        if not self.keep:
            return None

        def keep(layer: int, x: Tensor) -> None:
            if layer in self.keep:
                self.hidden[layer] = x

        return keep

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [B, Hq, T, D], k, v: [B, Hkv, T, D] -> [B, Hq, T, D]; the same op as DSABackend.prefill
        self.qkv.append((q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        raise RuntimeError("CapturingAttention only prefills")


def kept_prefill(model: Any, input_ids: Tensor, device: torch.device | str,
                 hidden_layers: list[int] | tuple[int, ...] = ()) -> Prefill:
    """Dense prefill of input_ids [1, T] (T >= 2) through model's decoder on `device`, q/k/v kept
    for replay into any config (EagerRuntime.replay_prefill, prefill_rows), and the normed hidden
    states of `hidden_layers` ([1, T, H] each: only for configs whose selector reads them,
    `hidden_layers(selector, L)`)."""
    if input_ids.shape[0] != 1 or input_ids.shape[1] < 2:
        raise ValueError(f"prefill needs input_ids [1, T >= 2], got {tuple(input_ids.shape)}")
    capture = CapturingAttention(1.0 / model.config.head_dim ** 0.5, hidden_layers)
    with torch.inference_mode():
        logits = model.decoder(input_ids.to(device), 0, capture, last_logits_only=True)[:, -1]
    return Prefill(input_ids, logits, capture.qkv, capture.hidden)


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    margins: list[float]  # top-1 minus top-2 logit at each generated token: near-ties explain flips


class Engine:
    """Decode requests under one config (model, selector, predictor, budget, runtime, backend, reuse):
    the prefill, the greedy / EOS / stop-string loop, scoring and the records, over a request
    pipeline chosen by runtime.engine: `EagerPipeline` (the research runtime, one request at a
    time) or `GraphPipeline` (the CUDA-graph engine, prr/runtime/graph_pipeline.py: batches of
    runtime.batch_size requests, ragged rows)."""

    def __init__(self, cfg: DictConfig, model: Any, max_tokens: int, run_dir: Path | None = None) -> None:
        """max_tokens: the longest request (prompt + new tokens) this engine will see."""
        self.cfg = cfg
        self.settings = instantiate(cfg.runtime)
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
        self.request = -1  # index of the last request started: the records' `sample` column
        self.requests: list[int] = []  # the current batch's requests, one per row
        self.run_dir = run_dir
        self.collect = False  # True: keep the current request's step rows in self.request_rows (studies)
        self.request_rows: list[dict[str, Any]] = []
        self.reuse = instantiate(cfg.reuse) if "reuse" in cfg else None  # the selection reuse (prr.reuse), as run.py's
        selector = instantiate(cfg.selector)
        self.sparse = [not selector.is_dense_layer(i) for i in range(mc.num_layers)]  # per layer: whether it selects
        self.hidden_layers = hidden_layers(selector, mc.num_layers)  # what this config's replay needs kept
        self.reused = {"selections_made": 0, "selections_skipped": 0}  # the reuse's counts over every batch so far
        self.pipeline = build_pipeline(cfg, model, self.settings, self.budget, self.ops, self.max_tokens, self.dtype,
                                       self.reuse)
        self.selection_backend = self.pipeline.selection_backend
        self.budget_info, self.device_name = self.pipeline.budget_info, self.pipeline.device_name
        self.topk_blocks = self.pipeline.topk_blocks
        self.records = RunRecords(run_dir, samples=True) if run_dir is not None else None

    def close(self) -> None:
        if self.records is not None:
            self.records.close()

    def results(self) -> dict[str, Any]:
        """The request strategy's own numbers for the summary (the graph engine's pooled counters)."""
        return self.pipeline.results()

    def reuse_counts(self) -> dict[str, Any] | None:
        """The layer selections every batch's decode steps made and skipped by the selection reuse
        (`prr.reuse.SelectionReuse.summary`, summed over batches: each decodes from step 0), or
        None without a reuse group. A batch's rows and KV heads count as one, as in run.py's decode."""
        return None if self.reuse is None else {"policy": self.reuse.name, **self.reused}

    def _count_reuse(self, steps: int) -> None:
        """A batch ran `steps` decode steps (from step 0): the selections its reuse made and skipped."""
        if self.reuse is not None and steps > 0:
            counts = self.reuse.summary(self.sparse, steps)
            for key in self.reused:
                self.reused[key] += counts[key]

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

    @property
    def rows(self) -> int:
        """Requests decoded together (runtime.batch_size on the graph engine; 1 on the eager one)."""
        return self.pipeline.rows

    def log_sample(self, row: dict[str, Any], sample: int | None = None) -> None:
        """samples.jsonl's row of request `sample` (default: the last one started)."""
        if self.records is not None:
            self.records.samples.write([{"sample": self.request if sample is None else sample, **row}])

    # --- prefill ------------------------------------------------------------------------
    def prefill(self, input_ids: Tensor, hidden: list[int] | None = None) -> Prefill:
        """Dense prefill of input_ids [1, T] (T >= 2), q/k/v kept for replay into any config, and
        the normed hidden states of the layers `hidden` (default: those this config's selector
        reads, `hidden_layers`; a study replaying into other configs names theirs)."""
        return kept_prefill(self.model, input_ids, self.device, self.hidden_layers if hidden is None else hidden)

    def _batches(self, prompt_lengths: list[int], new_tokens: list[int]) -> list[list[int]]:
        """Requests (in order) grouped into batches of at most the strategy's rows whose longest
        prompt plus most new tokens fit the engine (every row runs the batch's steps)."""
        out: list[list[int]] = []
        for i, (t, n) in enumerate(zip(prompt_lengths, new_tokens, strict=True)):
            if t + n > self.max_tokens:
                raise ValueError(f"a request of {t + n} tokens exceeds this engine's {self.max_tokens} (model "
                                 f"context {self.model.config.max_position_embeddings}); shorten the prompt")
            last = out[-1] if out else None
            if last is None or len(last) == self.pipeline.rows or \
                    max(t, *(prompt_lengths[j] for j in last)) + max(n, *(new_tokens[j] for j in last)) > self.max_tokens:
                out.append([i])
            else:
                last.append(i)
        return out

    def _start(self, prompts: list[Tensor], new_tokens: list[int], prefills: list[Prefill | None]) -> Tensor:
        """A batch of prompts ([1, T_b] each) prefilled into the request strategy's runtime, row b
        of its cache each (rows past the batch repeat its last prompt) -> logits [R, V] at each
        prompt's last position."""
        self.request += len(prompts)
        self.requests = list(range(self.request - len(prompts) + 1, self.request + 1))  # the rows' sample indices
        self.request_rows = []
        for ids, prefill in zip(prompts, prefills, strict=True):
            if prefill is not None and not torch.equal(prefill.input_ids, ids):
                raise ValueError("the Prefill given was made from other input_ids")
        rows, given = self.pipeline.rows, len(prompts)
        pad = rows - given if rows > 1 else 0  # (rows past the batch repeat its last prompt)
        prompts, prefills = prompts + prompts[-1:] * pad, prefills + prefills[-1:] * pad
        kept = list(prefills)  # (the pipeline replays each kept prefill's q/k/v and hidden states)
        logits = self.pipeline.prefill(prompts, kept, max(new_tokens))
        if isinstance(logits, list):  # a kept prefill's rows: its logits
            logits = torch.cat([c if c is not None else p.last_logits for c, p in zip(logits, prefills, strict=True)])
        logits = logits[:given]  # [R, V]
        return logits.float()

    def _record(self, steps: Steps, kept: int, sample: int, first_step: int) -> None:
        """The first `kept` steps of one request into the records (and request_rows when collecting)."""
        if self.records is None and not self.collect:
            return
        if self.collect and steps.records is None:
            raise ValueError(f"collect=True keeps per-head step records, which runtime.engine={self.pipeline.label} "
                             "does not write; use runtime.engine=eager")
        rows = [] if steps.records is None else step_rows([r for rs in steps.records[:kept] for r in rs],
                                                          sample=sample)
        if self.collect:
            self.request_rows += rows
        if self.records is not None:
            if rows:
                self.records.steps.write(rows)
            self.records.tokens.write([token_row(first_step + i, steps.read[i], steps.wall_s[i], steps.measure_s[i],
                                                 sample=sample) for i in range(kept)])

    # --- requests -----------------------------------------------------------------------
    def _ended(self, tokens: list[int], stop: tuple[str, ...]) -> bool:
        return tokens[-1] in self.eos_ids or bool(stop and any(s in self.decode_text(tokens) for s in stop))

    def generate(self, input_ids: Tensor, max_new_tokens: int, stop: tuple[str, ...] = (),
                 prefill: Prefill | None = None) -> Generation:
        """Greedy decoding of up to max_new_tokens after input_ids [1, T]; stops at EOS or when
        the text holds a stop string (cut there)."""
        return self.generate_batch([input_ids], max_new_tokens, stop, [prefill])[0]

    def generate_batch(self, prompts: list[Tensor], max_new_tokens: int, stop: tuple[str, ...] = (),
                       prefills: list[Prefill | None] | None = None) -> list[Generation]:
        """`generate` for each prompt ([1, T_b], lengths may differ), decoded together in batches
        of the strategy's rows (graph: runtime.batch_size). The host looks at tokens every window
        of steps (graph: 16); a row's steps past its end are not kept."""
        prefills = prefills if prefills is not None else [None] * len(prompts)
        out: list[Generation] = []
        for batch in self._batches([p.shape[1] for p in prompts], [max_new_tokens] * len(prompts)):
            out += self._generate_rows([prompts[i] for i in batch], max_new_tokens, stop, [prefills[i] for i in batch])
        return out

    def _generate_rows(self, prompts: list[Tensor], max_new_tokens: int, stop: tuple[str, ...],
                       prefills: list[Prefill | None]) -> list[Generation]:
        logits = self._start(prompts, [max_new_tokens] * len(prompts), prefills)  # [R, V]
        top2 = logits.topk(2, -1).values
        tokens = [[int(t)] for t in logits.argmax(-1)]
        margins = [[float(m)] for m in top2[:, 0] - top2[:, 1]]
        ended = [self._ended(t, stop) for t in tokens]
        made = 1  # tokens each row has had (the last one needs no decode step of its own)
        try:
            while not all(ended) and made < max_new_tokens:
                n = min(self.pipeline.window, max_new_tokens - made)
                for r, steps in enumerate(self.pipeline.steps([t[-1] for t in tokens], n, None, made - 1)):
                    kept = 0
                    for token, margin in zip(steps.chosen, steps.margins, strict=True):
                        if ended[r]:
                            break
                        tokens[r].append(token)
                        margins[r].append(margin)
                        kept += 1
                        ended[r] = self._ended(tokens[r], stop)
                    self._record(steps, kept, self.requests[r], made - 1)
                made += n
        finally:
            self.pipeline.end()
        self._count_reuse(made - 1)
        out = []
        for ids, m in zip(tokens, margins, strict=True):
            text = self.decode_text(ids)
            for s in stop:
                if s and s in text:
                    text = text[: text.index(s)]
            out.append(Generation(ids, text, m))
        return out

    def score(self, input_ids: Tensor, continuation: list[int], prefill: Prefill | None = None) -> tuple[float, bool, list[float]]:
        """log p(continuation | input_ids [1, T]) with continuation tokens fed one decode step at
        a time (teacher forcing) -> (sum of log-probs, whether greedy decoding yields it,
        per-token log-probs)."""
        return self.score_batch([(input_ids, continuation)], [prefill])[0]

    def score_batch(self, requests: list[tuple[Tensor, list[int]]], prefills: list[Prefill | None] | None = None
                    ) -> list[tuple[float, bool, list[float]]]:
        """`score` for each (input_ids [1, T_b], continuation) request, scored together in
        batches of the strategy's rows (graph: runtime.batch_size; ragged rows, each fed its
        own continuation; the host reads each batch's log-probs once)."""
        prefills = prefills if prefills is not None else [None] * len(requests)
        rows = []  # (prompt, tokens its decode steps score, log-prob and greedy flag of a one-token context's first)
        for (ids, continuation), prefill in zip(requests, prefills, strict=True):
            if not continuation:
                raise ValueError("an empty continuation has no log-likelihood")
            first = None
            if ids.shape[1] == 1:
                # The prefill needs 2 tokens: the first continuation token joins it, its log-prob
                # that of a one-token dense forward (the prompt's first position).
                if prefill is not None:
                    raise ValueError("a one-token context is prefilled together with its first continuation token")
                from prr.model.dense import DenseAttention

                with torch.inference_mode():  # (one token: a decode step at position 0 over an empty cache)
                    one = self.model.decoder(ids.to(self.device), 0, DenseAttention(self.model.config.num_layers),
                                             last_logits_only=True)[0, -1].float()  # [V]
                first = (float(torch.log_softmax(one, -1)[continuation[0]]), int(one.argmax()) == continuation[0])
                ids, continuation = torch.cat([ids, torch.tensor([continuation[:1]], dtype=ids.dtype)], 1), continuation[1:]
            rows.append((ids, continuation, first))
        out = []
        for batch in self._batches([rows[i][0].shape[1] for i in range(len(rows))], [len(r[1]) for r in rows]):
            out += self._score_rows([rows[i] for i in batch], [prefills[i] for i in batch])
        return out

    def _score_rows(self, rows: list, prefills: list[Prefill | None]) -> list[tuple[float, bool, list[float]]]:
        logits = self._start([r[0] for r in rows], [len(r[1]) for r in rows], prefills)  # [R, V]
        logprobs = [[] if first is None else [first[0]] for _, _, first in rows]
        greedy = [[] if first is None else [first[1]] for _, _, first in rows]
        for r, (_, continuation, _) in enumerate(rows):
            if continuation:
                logprobs[r].append(float(torch.log_softmax(logits[r], -1)[continuation[0]]))
                greedy[r].append(int(logits[r].argmax()) == continuation[0])
        n = max(len(c) for _, c, _ in rows) - 1  # step i reads continuation[i]: the log-prob of continuation[i + 1]
        try:
            if n > 0:  # rows with shorter continuations run greedy steps past theirs, not kept
                forced = [c[1:] + [-1] * (n - len(c[1:])) for _, c, _ in rows]
                first = [c[0] if c else ids[0, -1].item() for ids, c, _ in rows]
                for r, steps in enumerate(self.pipeline.steps(first, n, forced)):
                    kept = max(len(rows[r][1]) - 1, 0)
                    logprobs[r] += steps.logprobs[:kept]
                    greedy[r] += steps.greedy[:kept]
                    self._record(steps, kept, self.requests[r], 0 if rows[r][2] is None else 1)
        finally:
            self.pipeline.end()
        self._count_reuse(n)
        return [(sum(lp), all(g), lp) for lp, g in zip(logprobs, greedy, strict=True)]
