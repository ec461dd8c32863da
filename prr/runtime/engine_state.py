"""The graph engine's device state and the hand-offs into it: the position and input token of
every row, the PRR step's buffers (`PRRStep`: P, the predictor state, the counters), the context
(random, copied, or a prefill's cache: prr/runtime/graph_context.py), the one hand-off from a
prefill (`take_over`), and checkpoints that rewind capture warm-up steps. `GraphDecoder`
(prr/runtime/graph_decode.py) adds the model's forward over it and the capture."""

from __future__ import annotations

import torch
from torch import Tensor

from prr.cache import PagedKVCache
from prr.model.decoder import Decoder
from prr.predictors import Predictor
from prr.reuse import SelectionReuse
from prr.runtime import graph_context
from prr.runtime.prr_step import PRRStep
from prr.runtime.static_plan import StaticPlan
from prr.runtime.step_observers import StepObservers
from prr.selectors import Selector


def _engine_part(path: str, doc: str) -> property:
    """A read-only view of the step's `path` (dotted: GraphDecoder.attn.<path>)."""
    def read(self):
        out = self.attn
        for name in path.split("."):
            out = getattr(out, name)
        return out
    return property(read, doc=doc)


class EngineState:
    """The device state of one graph engine for `batch` rows over `cache`, shared by its views."""

    def __init__(self, model: Decoder, plan: StaticPlan, batch: int, cache: PagedKVCache, *, selector: Selector,
                 predictor: Predictor | None, backend: str, reuse: SelectionReuse | None = None) -> None:
        """The step's buffers over `cache` (validated by the subclass: `GraphDecoder`); reuse: the
        step's selection reuse (prr.reuse; default none)."""
        # The attention of every layer (selection, speculation, repair, merge, the predictor, P and the
        # counters) is the step's; this object adds the position, the input token and the hand-offs.
        self.attn = PRRStep(plan, cache, model.config.num_heads, selector=selector, predictor=predictor,
                            backend=backend, reuse=reuse)
        self.model, self.cache, self.batch, self.device, self.dtype = model, cache, batch, model.device, model.dtype
        # Tokens in the cache before this step, per row (rows may differ: ragged batches).
        self.pos = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.replay: dict | None = None  # a replaying predictor's record of its serial pass (prime_predictions)
        # [B, max_tokens] int64 or None: the input token that follows each position, -1 where the
        # step's own greedy token follows. Set only by a replaying predictor's recorded pass
        # (prr/runtime/replay.py: teacher forcing, so a bf16 run cannot leave the recorded trajectory).
        self.forced_tokens: Tensor | None = None
        self.captures = [0]  # graphs captured over these buffers (one count every view shares)

    # The cache's and the model's shapes
    keys = property(lambda self: self.cache.keys, doc="[B, Hkv, T_max, D] per layer")
    values = property(lambda self: self.cache.values, doc="[B, Hkv, T_max, D] per layer")
    num_layers = property(lambda self: self.cache.num_layers)
    max_tokens = property(lambda self: self.cache.max_tokens)
    max_blocks = property(lambda self: self.cache.max_blocks)
    hq = property(lambda self: self.attn.hq, doc="query heads")
    hkv = property(lambda self: self.cache.num_kv_heads, doc="KV heads (a tensor-parallel rank's)")
    group = property(lambda self: self.attn.group, doc="query heads per KV head")
    d = property(lambda self: self.cache.head_dim, doc="head dim")

    # Plan fields that size the engine's buffers: equal in every view.
    BUFFER_FIELDS = ("predicted_blocks", "mode", "block_size", "study_ratios")

    # The engine's parts and state that the step's callers (the run driver, budgets, benchmarks)
    # read through the decoder: read-only views of `self.attn`'s, which owns them.
    COUNTERS = StepObservers.COUNTERS
    plan = _engine_part("plan", "the StaticPlan this view's step runs")
    backend = _engine_part("backend", "the op backend: triton or torch")
    selector = _engine_part("selector", "the run's selector")
    predictor = _engine_part("schedule.predictor", "the run's predictor (None: P set from outside)")
    predictor_state = _engine_part("schedule.state", "the predictor's device state")
    sparse = _engine_part("sparse", "per layer: sparse (selected) or dense")
    pred_idx = _engine_part("schedule.pred_idx", "P per layer: [B, Hkv, |P|] int32 (None: dense layers)")
    pred_cnt = _engine_part("schedule.pred_cnt", "|P| per layer: [B, Hkv] int32")
    last_selection = _engine_part("last_selection", "A of each layer's last step: (indices, counts)")
    topk_capacity = _engine_part("topk_capacity", "|A| at most, per (row, KV head)")
    kernel_metadata = _engine_part("kernel_metadata", "the append kernels update the selector's metadata")
    scratch = _engine_part("scratch", "the repair plan's workspace")
    scale = _engine_part("attention.scale", "the attention's softmax scale")

    def counters(self) -> dict[str, list[float]]:
        return self.attn.observers.counters()

    def study_counters(self, per_row: bool = False) -> dict[str, Tensor]:
        return self.attn.observers.study_counters(self.batch, per_row)

    def set_predictions(self, layer: int, idx: Tensor, cnt: Tensor) -> None:
        self.attn.schedule.set_predictions(layer, idx, cnt)

    def select(self, layer: int, q: Tensor, lengths: Tensor, num_blocks: Tensor | None = None):
        return self.attn.select(layer, q, lengths, num_blocks)

    def attend(self, *args, **kwargs):
        return self.attn.attend(*args, **kwargs)

    def speculate_beside_selection(self, *args, **kwargs):
        return self.attn.speculate_beside_selection(*args, **kwargs)

    def join(self) -> None:
        self.attn.streams.join()

    def use_side_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Side work on `stream` in this view and the views made from it after (None: the engine's own)."""
        self.attn.use_side_stream(stream)

    # --- context (prr/runtime/graph_context.py) -----------------------------------------
    def fill_random_context(self, length: int | list[int] | Tensor, seed: int = 0) -> None:
        """Random K/V for positions [0, length) of every layer (an int, or one per row: a ragged
        batch), then `start_at(length)` with a random token."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        graph_context.fill_random(self.cache, self.row_lengths(length), gen)
        token = torch.randint(0, self.model.config.vocab_size, (self.batch,), generator=gen, device=self.device)
        self.start_at(length, token, gen)

    def row_lengths(self, lengths: int | list[int] | Tensor) -> list[int]:
        """An int, a list or a [B] tensor -> [B] host ints, each in [1, max_tokens)."""
        return graph_context.row_lengths(lengths, self.batch, self.max_tokens)

    def fill_from_cache(self, keys: list[Tensor], values: list[Tensor], length: int | list[int] | Tensor,
                        token: Tensor) -> None:
        """Decode from keys / values [B, Hkv, >= length, D] per layer (`start_at`), token [B] the
        first input. (A run with the eager prefill passes its PagedKVCache to the constructor
        instead, metadata included, and calls `take_over`.)"""
        graph_context.copy_context(self.cache, keys, values, self.row_lengths(length))
        self.start_at(length, token.view(self.batch).to(self.device))

    @torch.no_grad()
    def start_at(self, length: int | list[int] | Tensor, token: Tensor, gen: torch.Generator | None = None,
                 query: Tensor | None = None) -> None:
        """Decode from position `length` of the cache as it is: the selector's metadata rebuilt
        (`graph_context.rebuild_metadata`, with a random query from `gen` or `query`), the
        predictor state back to `init_state`'s, then `begin(length, token)`. In place: graphs
        captured before stay valid."""
        gen = gen if gen is not None else torch.Generator(device=self.device).manual_seed(0)
        graph_context.rebuild_metadata(self.attn.selector, self.cache, self.attn.sparse, self.row_lengths(length),
                                       self.group, gen, query)
        self.attn.schedule.reset_state()
        self.begin(length, token)

    def begin(self, length: int | list[int] | Tensor, token: Tensor) -> None:
        """pos = length (an int, or one per row), token [B] the next input; hit counters
        cleared. The selector's metadata and the predictor state stay as they are (e.g. after
        the eager prefill; see `checkpoint` / `restore` to rewind capture warm-up steps)."""
        self.pos.copy_(torch.tensor(self.row_lengths(length), dtype=torch.int32))
        self.token.copy_(token.view(self.batch, 1))
        self.attn.schedule.clear_predictions()
        self.attn.observers.clear()

    def take_over(self, lengths: int | list[int] | Tensor, first: Tensor, warmed_state: object | None,
                  previous: list[Tensor | None]) -> None:
        """The one hand-off from a prefill to this engine: pos = lengths, first [B] the next input
        (`begin`); the predictor state warmed on the prompt tail (None: serial, dense, or no
        predictor) taken over (adopted by an engine whose step is not captured yet, copied in place
        into a captured one's) and the first step's P primed; A_{t-1} of each layer (previous:
        [B, Hkv, NB] bool or None, the prefill's last prompt-tail selections) for the overlap."""
        self.begin(lengths, first)
        schedule = self.attn.schedule
        if schedule.predictor is not None and schedule.state is not None:  # (built for PRR with a predictor)
            if warmed_state is None:
                raise ValueError(f"predictor={type(schedule.predictor).__name__}: the engine speculates, so it needs "
                                 "the predictor state the prefill warmed (got none)")
            if self.captures[0]:
                schedule.copy_state(warmed_state)
            else:  # (every view of this engine shares the adopted state)
                schedule.adopt_state(warmed_state)
            self.prime_predictions(lengths)
        self.set_previous_selections(previous)

    def prime_predictions(self, length: int | list[int] | Tensor) -> None:
        """P of the first decode step (a context of length + 1 tokens per row) from the
        predictor state, for the layers whose P a step's learning writes for the next step
        (`Predictor.proposals_after_update`: history-only predictors, cross_layer's first
        selected layer); the others are proposed inside the step.
        A predictor that replays selections (`replays_selections`: the benchmark tool
        bench_hit_rate) gets its serial pass recorded first (prr/runtime/replay.py): the engine
        decodes the steps its cache has room for as serial DSA, rewinds, and the predictor builds
        P of every step from the recorded A (its record: `self.replay`)."""
        if not self.attn.schedule.has_state():
            return
        if self.attn.schedule.predictor.replays_selections:
            from prr.runtime.replay import record_serial_pass

            self.replay = record_serial_pass(self, self.row_lengths(length))
        bs = self.plan.block_size
        num_blocks = torch.tensor([(n + bs) // bs for n in self.row_lengths(length)], dtype=torch.int32,
                                  device=self.device)
        self.attn.schedule.prime(num_blocks)

    def set_previous_selections(self, masks: list[Tensor | None]) -> None:
        """A_{t-1} per layer ([B, Hkv, NB] bool, None for dense layers; e.g. the eager prefill's
        last prompt-tail selections), for the last-step overlap counter."""
        self.attn.observers.counting.set_previous(masks, self.attn.reuse.width)  # (|A| as counted)

    def checkpoint(self) -> list[Tensor]:
        """Copies of every tensor a step mutates besides K/V (a step writes K/V only at pos and
        beyond): position, token, metadata, predictor state, P, counters."""
        return [t.clone() for t in self._mutable()]

    def restore(self, saved: list[Tensor]) -> None:
        """Back to a `checkpoint`, in place (captured graphs keep their pointers)."""
        for t, old in zip(self._mutable(), saved, strict=True):
            t.copy_(old)

    def _mutable(self) -> list[Tensor]:
        out = [self.pos, self.token]
        for layer in range(self.num_layers):
            out += [t for t in self.cache.metadata[layer].values() if isinstance(t, Tensor)]
        return out + self.attn.mutable_tensors()
