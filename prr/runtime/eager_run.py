"""The research runtime: the model's eager forward over a paged KV cache,
attention through `DSABackend` (prefill dense, decode through the PRR step, timed stage by
stage, with per-(step, layer, row, KV head) records).

The one place a run builds a `DSABackend`: the main command's eager decode, the graph engine's
prefill and every scored request (the pipelines, prr/runtime/eager_pipeline.py and graph_pipeline.py) and the
studies (experiments/) go through `EagerRuntime`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import Tensor

from prr.cache import PagedKVCache
from prr.runtime.dsa_backend import DSABackend, check_finite
from prr.runtime.probe import StageProbe
from prr.step_record import LayerStepRecord

log = logging.getLogger("prr")


def calibration_line(info: dict[str, Any]) -> str:
    """A predictor's calibration info in one line; the parameters the config gave are marked kept
    (ema: `alpha=0.5 (kept), stickiness=4.0, recency=0.0, calibration_hit_rate=0.81, ...`)."""
    kept = info.get("kept", [])
    return ", ".join(f"{key}={value}{' (kept)' if key in kept else ''}" for key, value in info.items() if key != "kept")


def next_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator) -> Tensor:
    """logits: [B, V] -> token ids [B]; greedy when temperature == 0."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest set reaching top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(sorted_probs.cpu(), 1, generator=generator).to(order.device)
    return order.gather(-1, choice).squeeze(-1)


def kv_cache(decoder: Any, batch: int, block_size: int, max_tokens: int, dtype: torch.dtype,
             device: torch.device) -> PagedKVCache:
    """The run's paged KV cache for `decoder`'s layers; out of memory: the sizes, named."""
    mc = decoder.config
    try:
        return PagedKVCache(mc.num_layers, batch, mc.num_kv_heads, mc.head_dim, block_size, max_tokens, dtype, device)
    except torch.OutOfMemoryError as err:
        cache_bytes = 2 * mc.num_layers * batch * mc.num_kv_heads * mc.head_dim * max_tokens * dtype.itemsize
        weight_bytes = sum(p.numel() * p.element_size() for p in decoder.parameters())
        raise MemoryError(
            f"out of memory on {device} allocating the KV cache: {cache_bytes / 2**30:.2f} GiB for {mc.num_layers} layers"
            f" x batch {batch} x {mc.num_kv_heads} KV heads x {max_tokens} tokens x "
            f"head_dim {mc.head_dim} ({str(dtype).removeprefix('torch.')}), beside {weight_bytes / 2**30:.2f} GiB of "
            "weights; lower task.prompt_tokens, runtime.batch_size or the model's num_layers") from err


def replay_into(backend: DSABackend, kept: Any) -> None:
    """A kept dense prefill (prr.evaluation.Prefill: `qkv` per layer, `hidden` {layer: [1, T, H]})
    into `backend` (a runtime's, or a row view's), layer by layer as the prefill ran: the layer's
    normed hidden states to a selector that reads them (`DSABackend.hidden_hook`: the lightning
    indexer), then its q/k/v (`absorb_prefill`)."""
    hook = backend.hidden_hook(True)
    if hook is not None:
        missing = [i for i in range(len(kept.qkv)) if not backend.selector.is_dense_layer(i) and i not in kept.hidden]
        if missing:
            raise ValueError(f"selector {type(backend.selector).__name__} reads each sparse layer's normed hidden "
                             f"states, and this kept prefill has none for layers {missing}: keep them "
                             "(prr.evaluation.kept_prefill(hidden_layers=hidden_layers(selector, L)); Engine.prefill "
                             "keeps its own selector's)")
    for layer, (q, k, v) in enumerate(kept.qkv):
        if hook is not None and layer in kept.hidden:
            hook(layer, kept.hidden[layer])
        backend.absorb_prefill(layer, q, k, v)


def eager_budget_setup(budget: Any, selector: Any, settings: Any, decoder: Any, max_tokens: int,
                       dtype: torch.dtype, backend: str) -> tuple[dict[str, Any], str]:
    """The budget set up for the eager step (its `StageProbe`: the eager stages, timed on this
    device) -> (what it decided, for the summary; the device's name)."""
    mc, device = decoder.config, torch.device(settings.device)
    probe = StageProbe(selector, settings.repair_mode, settings.batch_size, mc.num_heads, mc.num_kv_heads,
                       mc.head_dim, settings.block_size, max_tokens, dtype, device, backend=backend)
    max_blocks = -(-max_tokens // settings.block_size)
    return budget.setup(probe, selector.selected_blocks(max_blocks), max_blocks), probe.device_name


class EagerRuntime:
    """One request (or one run's batch) through the research runtime: a cache of `max_tokens`
    per row, the run's selector / predictor / budget objects, its settings (runtime group) and
    op backend. `changes` override settings for this runtime (the graph engine's prefill, the
    studies' shadow decodes). cache: an empty PagedKVCache to prefill into instead of a new one
    (the graph engine's scored requests reuse one cache, and the graphs captured over it).
    reuse: the decode's selection reuse (prr.reuse; default none)."""

    def __init__(self, decoder: Any, settings: Any, selector: Any, predictor: Any, budget: Any, backend: str,
                 max_tokens: int, dtype: torch.dtype, batch: int | None = None, cache: PagedKVCache | None = None,
                 reuse: Any = None, **changes: Any) -> None:
        self.decoder, self.backend_name = decoder, backend
        self.device = torch.device(settings.device)
        self.cache = cache if cache is not None else kv_cache(decoder, settings.batch_size if batch is None else batch,
                                                              settings.block_size, max_tokens, dtype, self.device)
        options = {"mode": settings.mode, "repair_mode": settings.repair_mode,
                   "calibration_tokens": settings.calibration_tokens,
                   "dense_metrics_every": settings.dense_metrics_every, "check_serial": settings.check_serial,
                   "reuse": reuse, **changes}
        self.parts = (selector, predictor, budget, options)
        self.backend = self.attention(self.cache)

    def attention(self, cache: PagedKVCache) -> DSABackend:
        """The DSA/PRR attention of this runtime over `cache` (the runtime's own, or a row view of
        it: a ragged batch prefills row by row)."""
        selector, predictor, budget, options = self.parts
        return DSABackend(cache, self.decoder.config.num_heads, selector, predictor, budget, backend=self.backend_name,
                          **options)

    def prefill(self, input_ids: Tensor, attention: Any = None, all_logits: bool = False,
                last_logits_only: bool = False) -> Tensor:
        """input_ids [B, T] through the dense prefill -> logits [B, V] at the last position
        ([T, V] of row 0 with all_logits). attention: the backend to prefill through (default
        this runtime's; a progress wrapper, or a row's)."""
        logits = self.decoder(input_ids.to(self.device), 0, self.backend if attention is None else attention,
                              last_logits_only=last_logits_only)
        return logits[0] if all_logits else logits[:, -1]

    def prefill_rows(self, prompts: list[Tensor], kept: list[Any] | None = None) -> tuple[list[Tensor | None], list]:
        """A ragged batch prefilled row by row: prompts[b] [1, T_b] into row b of the cache
        (`PagedKVCache.row`: its own length and metadata), or kept[b] (a kept dense prefill,
        `replay_prefill`'s) replayed there; the cache's host length is then the
        longest row's. -> (logits [1, V] at each row's last position, None for replayed rows;
        the prefill tails' selections per layer stacked over rows, the shortest tail's number of
        steps: `finish_prefill`'s history)."""
        from prr.selectors.base import stack_rows

        kept = kept if kept is not None else [None] * len(prompts)
        if len(prompts) != self.cache.batch or len(kept) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts ({len(kept)} kept prefills) for a cache of {self.cache.batch} rows")
        rows, logits = [], []
        for b, (ids, prefill) in enumerate(zip(prompts, kept, strict=True)):
            rows.append(self.attention(self.cache.row(b)))
            if prefill is None:
                logits.append(self.prefill(ids, rows[-1], last_logits_only=True))  # [1, V]
            else:
                replay_into(rows[-1], prefill)
                logits.append(None)
        layers = self.cache.num_layers
        for layer in range(layers):
            self.cache.set_length(layer, max(int(ids.shape[1]) for ids in prompts))
        # Rows shorter than the tail (runtime.calibration_tokens) have fewer tail steps: every row's
        # last `steps` are stacked, aligned at the prompts' ends.
        history = []
        for layer in range(layers):
            if rows[0].history[layer] is None:
                history.append(None)
                continue
            steps = min(len(r.history[layer]) for r in rows)
            history.append([stack_rows(list(step)) for step in
                            zip(*(r.history[layer][len(r.history[layer]) - steps :] for r in rows), strict=True)])
        return logits, history

    def replay_prefill(self, kept: Any) -> None:
        """A kept dense prefill (prr.evaluation.Prefill) into this runtime: cache, selector
        metadata and the prefill tail's selections rebuilt as a prefill would (`replay_into`)."""
        replay_into(self.backend, kept)

    def finish_prefill(self, history: Any = None, calibrate_on: Any = None, phase: Any = None) -> dict[str, Any]:
        """Calibrate and warm the predictor on the prefill tail (DSABackend.finish_prefill); the
        log says what calibration chose. phase(name): called after "calibrate" and after "warm"
        (experiments/request_cost.py times them)."""
        phase = phase or (lambda name: None)
        info = self.backend.calibrate_predictor(history, calibrate_on)
        phase("calibrate")
        self.backend.warm_predictor()
        phase("warm")
        if info:
            log.info("predictor calibration: %s", calibration_line(info))
        elif getattr(self.backend.predictor, "calibrate_on_prefill", True) is False:
            log.info("predictor calibration: off (opt-in: predictor.calibrate=true grid-searches alpha, stickiness, "
                     "recency on the prefill tail, +1.5 points of hit rate at |P| = K for about a decode step per "
                     "request; README)")
        return info

    def step(self, token: Tensor, position: int, step: int) -> tuple[Tensor, list[LayerStepRecord], float, float]:
        """One decode step reading token [B] at `position` -> (logits [B, V], the step's records,
        wall seconds, of which measurement work)."""
        t0 = time.perf_counter()
        logits = self.decoder(token.view(-1, 1).to(self.device), position, self.backend)[:, -1]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        records, measure_s = self.backend.end_step()
        check_finite(logits, step, self.backend)
        return logits, records, wall, measure_s
