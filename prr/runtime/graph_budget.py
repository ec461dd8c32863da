"""The graph engine's timings for `budget=profiled` (prr/budget/profiled.py holds the rule):
`GraphProbe` times selection, speculation and the whole attention stage on the engine itself,
as CUDA-graph replays on a GPU (device time) and by the host clock on the CPU (eager launches;
under TRITON_INTERPRET=1 that times the interpreter, so a CPU choice tests the machinery and
is no speed claim; the probe's shape key names its timer, and so does the cache file's key).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Sequence

import torch

from prr.blocks import controlled_predictions
from prr.budget.base import StageTiming
from prr.runtime.graph_decode import GraphDecoder
from prr.runtime.probe import device_name, host_timing


def graph_samples_us(calls: Sequence[Callable[[], object]], repeats: int = 15,
                     stream: torch.cuda.Stream | None = None) -> list[float]:
    """µs per call of `calls` captured in one CUDA graph (after one eager warm-up of each on a
    side stream), one sample per replay over `repeats` replays: launch overhead excluded.
    stream: the capture stream (its priority goes into the graph's kernel nodes); default a new one."""
    stream = stream if stream is not None else torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(calls))
    return samples


def graph_median_us(calls: Sequence[Callable[[], object]], repeats: int = 15,
                    stream: torch.cuda.Stream | None = None) -> float:
    """Median µs per call of `calls` over `repeats` CUDA-graph replays (graph_samples_us)."""
    return statistics.median(graph_samples_us(calls, repeats, stream))


def stage_timer(device: torch.device) -> str:
    """The timer GraphProbe uses on `device`."""
    return "cuda_graph_replay" if device.type == "cuda" else "cpu_wall_clock"


def stage_timing(fn: Callable[[], object], device: torch.device, per_call: int = 1, repeats: int = 15) -> StageTiming:
    """fn's time in seconds per `per_call` (e.g. per layer) by `stage_timer(device)`: CUDA-graph
    replays on a GPU, the host clock over eager runs on the CPU (3 repeats there: under
    TRITON_INTERPRET=1 it times the interpreter, the machinery and not a speed)."""
    if stage_timer(device) == "cuda_graph_replay":
        return StageTiming.of([us * 1e-6 / per_call for us in graph_samples_us([fn], repeats)])
    timing = host_timing(fn, min(repeats, 3), device)
    return StageTiming(*(x / per_call for x in (timing.min_s, timing.q1_s, timing.median_s, timing.q3_s, timing.max_s)))


class GraphProbe:
    """budget=profiled's TimingProbe over the graph engine's own step (what the engine runs is
    what is timed): selection, speculation (attention per block of P) and the whole attention
    stage of every sparse layer, per layer, over a random context. `build(n)` makes an engine
    (variant "prr", predictor "fixed") with |P| = n; the probe keeps one, rebuilt when a stage
    timing needs another |P|."""

    def __init__(self, build: Callable[[int], GraphDecoder], first_size: int, repeats: int = 15, seed: int = 0) -> None:
        self._build, self._size, self.repeats, self.seed = build, first_size, repeats, seed
        self._engine: GraphDecoder | None = None
        self._context: int | None = None
        engine = self.engine(first_size)
        c, plan = engine.model.config, engine.plan
        choices = {k: v for k, v in dataclasses.asdict(plan).items()
                   if k not in ("variant", "predicted_blocks", "count_hits", "count_at_step_end", "measure_dense",
                                "study_counters", "study_ratios")}  # (measurement flags: a stored profile's key stays as it was)
        self.device_name = device_name(engine.device)
        self.shape_key = json.dumps({"engine": "graph", "timer": stage_timer(engine.device), "layers": c.num_layers,
                                     "heads": [c.num_heads, c.num_kv_heads, c.head_dim], "dtype": str(engine.dtype),
                                     "batch": engine.batch, "max_tokens": engine.max_tokens,
                                     "selector": type(engine.selector).__name__, "plan": choices}, sort_keys=True)

    def engine(self, size: int) -> GraphDecoder:
        """The probe's engine, built with |P| = size if it has another."""
        if self._engine is None or self._engine.plan.predicted_blocks != size:
            self._engine = self._context = None  # the old one's memory first
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._engine = self._build(size)
            e = self._engine
            gen = torch.Generator(device=e.device).manual_seed(self.seed)
            self._q = [torch.randn(e.batch, e.hq, e.d, generator=gen, device=e.device).to(e.dtype)
                       for _ in range(e.num_layers)]
            self._kv = [torch.randn(2, e.batch, e.hkv, e.d, generator=gen, device=e.device).to(e.dtype)
                        for _ in range(e.num_layers)]
        return self._engine

    def _at(self, context_blocks: int, size: int | None = None) -> GraphDecoder:
        """The engine (of |P| = size, or the one it has) holding a random context whose decode
        step sees context_blocks blocks."""
        engine = self.engine(size if size is not None else self._engine.plan.predicted_blocks)
        if self._context != context_blocks:
            bs = engine.plan.block_size
            engine.fill_random_context(max(1, (context_blocks - 1) * bs), seed=self.seed)
            self._context = context_blocks
        return engine

    def release(self) -> None:
        """Free the probe's engine (its cache) before the run builds its own."""
        self._engine = self._context = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _sparse_layers(self, engine: GraphDecoder) -> list[int]:
        return [i for i in range(engine.num_layers) if engine.sparse[i]]

    def time_select(self, context_blocks: int) -> StageTiming:
        engine = self._at(context_blocks)
        layers = self._sparse_layers(engine)
        lengths, num_blocks = engine.step_positions()

        def select() -> None:
            for i in layers:
                engine.select(i, self._q[i], lengths, num_blocks)
        return stage_timing(select, engine.device, len(layers), self.repeats)

    def time_speculate(self, predicted_blocks: int, context_blocks: int) -> StageTiming:
        engine = self._at(context_blocks)
        layers = self._sparse_layers(engine)
        lengths, _ = engine.step_positions()
        gen = torch.Generator().manual_seed(self.seed)
        b, h = engine.batch, engine.hkv
        idx = torch.stack([torch.randperm(context_blocks, generator=gen)[:predicted_blocks].sort().values
                           for _ in range(b * h)]).view(b, h, -1).to(torch.int32).to(engine.device)
        cnt = torch.full((b, h), idx.shape[-1], dtype=torch.int32, device=engine.device)
        per_block = engine.plan.repair_mode == "exact"

        def speculate() -> None:
            for i in layers:
                engine.attend(i, self._q[i], idx, cnt, lengths, per_block=per_block)
        return stage_timing(speculate, engine.device, len(layers), self.repeats)

    def time_stage(self, context_blocks: int, predicted_blocks: int, hit_rate: float) -> StageTiming:
        engine = self._at(context_blocks, predicted_blocks if predicted_blocks > 0 else None)
        if predicted_blocks > 0:  # P of every sparse layer: hit_rate of its true A
            serial = engine.with_plan(variant="serial")
            positions = serial.step_positions()
            for i in range(engine.num_layers):
                serial.attention(i, self._q[i], self._kv[i][0], self._kv[i][1], positions)
            gen = torch.Generator().manual_seed(self.seed)
            for i, selection in enumerate(engine.last_selection):
                if selection is not None and engine.sparse[i]:
                    idx, cnt = controlled_predictions(selection, hit_rate, context_blocks, gen, size=predicted_blocks)
                    engine.set_predictions(i, idx[..., :predicted_blocks], cnt)
        view = engine.with_plan(variant="prr" if predicted_blocks > 0 else "serial")

        def stage() -> None:
            positions = view.step_positions()
            for i in range(view.num_layers):
                view.attention(i, self._q[i], self._kv[i][0], self._kv[i][1], positions)
            view.join()
        return stage_timing(stage, engine.device, engine.num_layers, self.repeats)
