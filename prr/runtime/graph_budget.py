"""`budget=profiled` for the graph engine: whether to speculate, decided per context length
from timings of the attention stage on the running device.

For each profiled context the engine's cache is filled with random K/V, the true selections
of random queries are taken, P is set to them with a share (1 − hit_rate) of blocks swapped
for unselected ones, and the attention stage of every layer is timed
as serial DSA and as PRR: on a GPU as CUDA-graph replays (device time), on the CPU by the
host clock over eager runs (no graphs there; under TRITON_INTERPRET=1 that times the
interpreter, so a CPU choice is for tests of the machinery, not a speed claim; each row
names its timer). The choice at a context is PRR (|P| = |A|) only where it measured
faster by more than `margin`, else serial DSA (|P| = 0), so speculating never makes the step
slower than the noise of the measurement. The table is cached per device, model shape,
plan, batch, hit rate and contexts (cache_dir()/budget), like `budget=profiled`.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from prr.paths import cache_dir, write_json_atomic
from prr.runtime.graph_decode import GraphDecoder
from prr.runtime.probe import device_name, host_timing


def graph_median_us(calls: Sequence[Callable[[], object]], repeats: int = 15,
                    stream: torch.cuda.Stream | None = None) -> float:
    """Median µs per call of `calls` captured in one CUDA graph (after one eager warm-up of
    each on a side stream), over `repeats` replays: launch overhead excluded.
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
    return statistics.median(samples)


def stage_timer(device: torch.device) -> str:
    """The timer profile_speculation uses on `device`."""
    return "cuda_graph_replay" if device.type == "cuda" else "cpu_wall_clock"


def controlled_predictions(selection: tuple[Tensor, Tensor], hit_rate: float, num_blocks: int,
                           gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """P with |P| = |A| for A = selection (indices [B, Hkv, K] ascending, counts [B, Hkv]):
    round(hit_rate·|A|) blocks of A and the rest blocks of [0, num_blocks) outside A, ascending,
    on A's device."""
    idx, cnt = (t.cpu() for t in selection)
    pred, pcnt = torch.zeros_like(idx), torch.zeros_like(cnt)
    for b in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            a = idx[b, h, : int(cnt[b, h])]
            keep = round(hit_rate * len(a))
            kept = a[torch.randperm(len(a), generator=gen)[:keep]]
            outside = torch.ones(num_blocks, dtype=torch.bool)
            outside[a.long()] = False
            others = outside.nonzero()[:, 0]
            others = others[torch.randperm(len(others), generator=gen)[: len(a) - keep]].to(idx.dtype)
            row = torch.cat([kept, others]).sort().values
            pred[b, h, : len(row)] = row
            pcnt[b, h] = len(row)
    return pred.to(selection[0].device), pcnt.to(selection[0].device)


@dataclass(frozen=True)
class SpeculationProfile:
    rows: tuple[dict, ...]  # per context: context, serial_us, prr_us, choice ("prr" | "serial")
    key: str

    def choice(self, context: int) -> str:
        """The choice at the largest profiled context not above `context` (the first row below the grid)."""
        contexts = [r["context"] for r in self.rows]
        return self.rows[max(0, bisect.bisect_right(contexts, context) - 1)]["choice"]


def attention_stage_us(engine: GraphDecoder, variant: str, q: list[Tensor], k: list[Tensor], v: list[Tensor],
                       repeats: int = 15) -> float:
    """Median µs per layer of the attention stage of every layer as `variant` (`stage_timer`:
    graph replays on a GPU, the host clock on the CPU)."""
    view = engine.with_plan(variant=variant)

    def stage() -> None:
        positions = view.step_positions()
        for i in range(view.num_layers):
            view.attention(i, q[i], k[i], v[i], positions)
        view.join()
    if stage_timer(engine.device) == "cuda_graph_replay":
        return graph_median_us([stage], repeats) / engine.num_layers
    return host_timing(stage, min(repeats, 3), engine.device).median_s * 1e6 / engine.num_layers


# PRR is chosen only when faster than serial DSA by more than this: timing the same ~20 µs graph
# twice differs by up to ~3% on the H200 (bench_decode_stage.csv, serial vs serial_retimed).
DEFAULT_MARGIN = 0.02


def profile_speculation(engine: GraphDecoder, contexts: Sequence[int], hit_rate: float = 0.9,
                        margin: float = DEFAULT_MARGIN,
                        use_cache: bool = True, seed: int = 0) -> SpeculationProfile:
    """Time serial DSA and PRR (|P| = |A|, P hitting `hit_rate` of A) at each context on this
    engine (built with variant="prr", predictor="fixed"); leaves the engine's cache holding
    random data of the last context."""
    plan = engine.plan
    problems = []
    if plan.variant != "prr" or plan.predictor != "fixed" or plan.predicted_blocks != plan.topk_blocks:
        problems.append(f"profile_speculation needs an engine built with variant='prr', predictor='fixed' and "
                        f"predicted_blocks == topk_blocks; got {plan.variant!r}, {plan.predictor!r}, "
                        f"{plan.predicted_blocks} vs {plan.topk_blocks}")
    if not 0.0 <= hit_rate <= 1.0 or margin < 0:
        problems.append(f"hit_rate={hit_rate} must lie in [0, 1] and margin={margin} be >= 0")
    if not contexts or any(not 0 < c < engine.max_tokens for c in contexts):
        problems.append(f"contexts={list(contexts)} must be non-empty, each in [1, {engine.max_tokens})")
    if problems:
        raise ValueError("; ".join(problems))
    c = engine.model.config
    key = json.dumps({"device": device_name(engine.device), "layers": c.num_layers, "heads": [c.num_heads,
                      c.num_kv_heads, c.head_dim], "dtype": str(engine.dtype), "batch": engine.batch,
                      "plan": dataclasses.asdict(plan), "hit_rate": hit_rate, "margin": margin,
                      "contexts": sorted(contexts), "seed": seed}, sort_keys=True)
    path = cache_dir() / "budget" / ("graph-" + hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    if use_cache and path.exists():
        record = json.loads(path.read_text())
        if record.get("key") == key:
            return SpeculationProfile(tuple(record["rows"]), key)
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    shape = (engine.batch, engine.hq, engine.d), (engine.batch, engine.hkv, engine.d)
    q = [torch.randn(shape[0], generator=gen, device=engine.device).to(engine.dtype) for _ in range(engine.num_layers)]
    k = [torch.randn(shape[1], generator=gen, device=engine.device).to(engine.dtype) for _ in range(engine.num_layers)]
    v = [torch.randn(shape[1], generator=gen, device=engine.device).to(engine.dtype) for _ in range(engine.num_layers)]
    rows = []
    for context in sorted(contexts):
        engine.fill_random_context(context, seed=seed)
        serial = engine.with_plan(variant="serial")
        positions = serial.step_positions()
        for i in range(engine.num_layers):  # the true A of each layer at this context
            serial.attention(i, q[i], k[i], v[i], positions)
        host_gen = torch.Generator().manual_seed(seed)
        num_blocks = context // plan.block_size + 1
        for i, selection in enumerate(engine.last_selection):
            if selection is not None and engine.sparse[i]:
                engine.set_predictions(i, *controlled_predictions(selection, hit_rate, num_blocks, host_gen))
        serial_us = attention_stage_us(engine, "serial", q, k, v)
        prr_us = attention_stage_us(engine, "prr", q, k, v)
        rows.append({"context": context, "timer": stage_timer(engine.device), "serial_us": serial_us, "prr_us": prr_us,
                     "choice": "prr" if prr_us < serial_us * (1.0 - margin) else "serial"})
    if use_cache:
        write_json_atomic(path, {"key": key, "rows": rows})
    return SpeculationProfile(tuple(rows), key)
