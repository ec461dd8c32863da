"""Where a whole PRR decode step's time goes, against serial DSA's: the engine's step replayed as a
CUDA graph, every kernel of it traced (issue 33: whole runs cost more than the stage map predicts).

    python experiments/step_breakdown.py [--cells quest:32000:16:32,...] [--replays 40] [--out DIR]

Each cell is selector:context:block:K (K in blocks), the Llama-3.1-8B shape with random bf16 weights
and a random context, batch 1, the run's objects (conf/ selector and predictor, `graph_plan`, the
fused projections run.py picks at batch 1 on a GPU). Views of one engine over one cache, each
captured on its own and replayed at a fixed position (the ema view decodes for real, rewound):
- serial: serial DSA as run.py runs it (merge in the split kernel where one wave: fuse_merge one_wave);
- serial_merge_launch: serial with the merge as its own launch (what the stage map's `serial` times);
- serial_counters: serial with the device counters run.py's views keep on (count_hits), every
  layer counted in one launch at the step's end on the side stream (StaticPlan.count_at_step_end);
  serial_counters_each_layer: one counters launch per layer on the main stream (count_at_step_end=False);
- prr_p=a: PRR with P = the step's own A (a 100% hit rate, no predictor work);
- prr_p=a_counters, prr_p=a_one_stream (speculation on the main stream);
- where the selector speculates inside its selection launch (exact on the kernels,
  StaticPlan.speculate_in_selection, the default): prr_p=a_speculation_beside and
  prr_ema_counters_speculation_beside, the speculation kernel on the side stream instead;
- prr_ema, prr_ema_counters: the ema predictor proposing and learning for real (hit rate near 0.2 on
  random data), counters off and on; prr_ema_counters_each_layer: counters per layer on the main
  stream; prr_ema_each_layer: ema learning after each sparse layer
  (StaticPlan.learn_layers_at_once=False) instead of once after the last;
- with --repair-tokens T1,T2,..: PRR's repair-and-merge tail with T tokens of A per program
  (StaticPlan.repair_tokens_per_split; default: prr_repair.default_splits), at P = A
  (prr_p=a_repair{T}) and at P with 90% of A (prr_p=0.9a, prr_p=0.9a_repair{T}): fewer, longer
  programs against the default's one program per SM.
Per view: the replay time (median over --replays replays, n and a 95% bootstrap interval of its
ratio to serial), then one traced replay set (torch.profiler, CUPTI): per step the span from the
first kernel's start to the last one's end, the time some kernel runs (the union of kernel
intervals), the idle rest, each stream's kernel time, and each kernel name's time and count.
Writes OUT/step_breakdown.json (command, GPU, versions, date, every row), OUT/step_breakdown.csv
(the views), OUT/step_breakdown_kernels.csv (per kernel name and view, µs per step) and prints
the table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch
from hydra.utils import instantiate

from prr.benchmarking import environment, model_of
from prr.blocks import controlled_predictions
from prr.config_check import compose_config
from prr.intervals import median_ratio_interval
from prr.paths import strict_json_dumps
from prr.runtime.graph_budget import graph_samples_us
from prr.runtime.graph_decode import GraphDecoder
from prr.runtime.graph_run import graph_plan
from prr.selectors.study_overrides import budget_overrides

SEPARATOR_CYCLES = 2_000_000  # torch.cuda._sleep between traced replays: about 1 ms, a gap no step holds


def parse_cells(text: str) -> list[tuple[str, int, int, int]]:
    cells = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 4:
            raise SystemExit(f"error: --cells {item!r}: give selector:context:block:K (e.g. quest:32000:16:32)")
        cells.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3])))
    return cells


def objects(selector_name: str, predictor_name: str, block: int, k: int):
    """The selector and predictor run.py builds for these options (conf/ through Hydra)."""
    # (the top-K's key and unit as the studies give them: the indexer's counts tokens at block 1)
    overrides = [*budget_overrides(selector_name, k * block, block), f"predictor={predictor_name}", "budget=fixed"]
    if predictor_name == "ema":
        overrides.append("predictor.calibrate=false")  # a random context has nothing to calibrate on
    if selector_name == "less":
        overrides.append("selector.feature_map_model=unused")
    cfg = compose_config(overrides, check=False)
    return instantiate(cfg.selector), instantiate(cfg.predictor), instantiate(cfg.budget)


def trace(fn, replays: int) -> list[dict]:
    """Kernels of `replays` replays of fn's CUDA graph, replays split by a sleep kernel ->
    per replay: a list of (name, stream, start µs, end µs)."""
    from torch.profiler import ProfilerActivity, profile

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            torch.cuda._sleep(SEPARATOR_CYCLES)
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    steps, current = [], None
    for e in kernels:
        if "spin_kernel" in e["name"]:  # torch.cuda._sleep's kernel (a namespaced name)
            current = []
            steps.append(current)
            continue
        if current is not None:
            current.append((e["name"], e.get("args", {}).get("stream"), float(e["ts"]), float(e["ts"] + e["dur"])))
    if not steps:  # what the trace held instead, for the warning
        print(f"  trace: {len(kernels)} kernels, none a separator; first: {[e['name'][:60] for e in kernels[:3]]}")
    return [s for s in steps if s]


def step_profile(steps: list[list[tuple]]) -> tuple[dict, dict]:
    """Per-step means: span, busy (union of kernel intervals), idle, kernel time per stream
    (main = the stream of the step's first kernel), launches; and µs per kernel name."""
    spans, busy, per_stream, launches, names = [], [], {"main": [], "side": []}, [], {}
    for kernels in steps:
        start, end = kernels[0][2], max(k[3] for k in kernels)
        union, reach = 0.0, start
        for _, _, s, e in sorted(kernels, key=lambda k: k[2]):
            if e > reach:
                union += e - max(s, reach)
                reach = e
        spans.append(end - start)
        busy.append(union)
        main = kernels[0][1]
        per_stream["main"].append(sum(k[3] - k[2] for k in kernels if k[1] == main))
        per_stream["side"].append(sum(k[3] - k[2] for k in kernels if k[1] != main))
        launches.append(len(kernels))
        for name, _, s, e in kernels:
            names.setdefault(name, [0.0, 0])
            names[name][0] += e - s
            names[name][1] += 1
    n = len(steps)
    summary = {"traced_steps": n, "span_us": statistics.fmean(spans), "busy_us": statistics.fmean(busy),
               "idle_us": statistics.fmean(spans) - statistics.fmean(busy),
               "main_kernel_us": statistics.fmean(per_stream["main"]),
               "side_kernel_us": statistics.fmean(per_stream["side"]), "launches": statistics.fmean(launches)}
    return summary, {name: (t / n, c / n) for name, (t, c) in names.items()}


def cell_rows(model, selector_name: str, context: int, block: int, k: int, replays: int, traced: int,
              repair_tokens: tuple[int, ...] = (), only: frozenset[str] | None = None):
    capacity = context + 256
    max_blocks = -(-capacity // block)
    settings = SimpleNamespace(repair_mode="exact", mode="sparse", block_size=block)
    selector, none, budget = objects(selector_name, "none", block, k)
    serial_plan = graph_plan(settings, selector, none, budget, max_blocks)
    serial_plan = dataclasses.replace(serial_plan, projections="fused")
    # P set from outside: the same engine as a "prr" plan with no predictor
    fixed_plan = dataclasses.replace(serial_plan, variant="prr", predicted_blocks=k)
    eng = GraphDecoder(model, fixed_plan, batch=1, max_tokens=capacity, selector=selector, predictor=None)
    eng.fill_random_context(context, seed=1)
    eng.with_plan(variant="serial").step(advance=False)
    torch.cuda.synchronize()
    for layer, selection in enumerate(eng.last_selection):
        if selection is not None:
            eng.set_predictions(layer, *selection)  # P = A: every block of A predicted
    views = {"serial": (eng.with_plan(variant="serial"), False),
             "serial_merge_launch": (eng.with_plan(variant="serial", fuse_merge=False), False),
             "serial_counters": (eng.with_plan(variant="serial", count_hits=True, count_at_step_end=True), False),
             "serial_counters_each_layer": (eng.with_plan(variant="serial", count_hits=True, count_at_step_end=False),
                                            False),
             "prr_p=a": (eng, False),
             "prr_p=a_counters": (eng.with_plan(count_hits=True, count_at_step_end=True), False),
             "prr_p=a_one_stream": (eng.with_plan(overlap=False), False)}
    if selector.speculates_in_selection():  # exact: P's states in its q·K launch (the default) or beside it
        views["prr_p=a_speculation_beside"] = (eng.with_plan(speculate_in_selection=False), False)
    rows, kernel_rows, base = [], [], None

    def measure(name: str, view: GraphDecoder, advance: bool, **extra) -> None:
        nonlocal base
        if only is not None and name not in only and name != "serial":  # (serial: every ratio's base)
            return
        start = view.checkpoint() if advance else None
        fn = (lambda: view.step(advance=advance))  # noqa: E731
        samples = graph_samples_us([fn], replays)
        if advance:
            view.restore(start)
        steps = trace(fn, traced)
        if not steps:  # said, not hidden: the timing row stands, the breakdown columns stay empty
            print(f"  warning: {name}: the profiler returned no kernels of the graph replays", flush=True)
            summary, names = {}, {}
        else:
            summary, names = step_profile(steps)
        if advance:
            view.restore(start)
        if base is None:
            base = samples
        ratio, lo, hi = median_ratio_interval(samples, base)
        rows.append(dict(selector=selector_name, context=context, block=block, topk_blocks=k, view=name,
                         step_us=statistics.median(samples), replays=len(samples), over_serial=ratio,
                         over_serial_lo=lo, over_serial_hi=hi, **summary, **extra))
        for kernel, (us, calls) in names.items():
            kernel_rows.append(dict(selector=selector_name, context=context, block=block, topk_blocks=k, view=name,
                                    kernel=kernel[:120], us_per_step=us, calls_per_step=calls))
        print(f"  {selector_name} {context} b{block} K{k} {name}: {rows[-1]['step_us']:.0f} µs "
              f"(x{ratio:.3f} [{lo:.3f}, {hi:.3f}]) {summary}", flush=True)

    for name, (view, advance) in views.items():
        measure(name, view, advance)
    for tokens in repair_tokens:
        measure(f"prr_p=a_repair{tokens}", eng.with_plan(repair_tokens_per_split=tokens), False)
    if repair_tokens:  # P holding 90% of A (the rest other blocks): the tail repairs 10% of A
        gen = torch.Generator().manual_seed(900)
        num_blocks = (context + block) // block
        for layer, selection in enumerate(eng.last_selection):
            if selection is not None:
                eng.set_predictions(layer, *controlled_predictions(selection, 0.9, num_blocks, gen))
        measure("prr_p=0.9a", eng, False)
        for tokens in repair_tokens:
            measure(f"prr_p=0.9a_repair{tokens}", eng.with_plan(repair_tokens_per_split=tokens), False)
    del eng, views
    torch.cuda.empty_cache()
    if only is not None and not any(name.startswith("prr_ema") for name in only):
        return rows, kernel_rows
    # ema decoding for real: its own engine (the predictor proposes and learns inside the step)
    selector, predictor, budget = objects(selector_name, "ema", block, k)
    plan = dataclasses.replace(graph_plan(settings, selector, predictor, budget, max_blocks), projections="fused")
    eng = GraphDecoder(model, plan, batch=1, max_tokens=capacity, selector=selector, predictor=predictor)
    eng.fill_random_context(context, seed=1)
    eng.prime_predictions(context)
    measure("prr_ema", eng, True)
    measure("prr_ema_counters", eng.with_plan(count_hits=True, count_at_step_end=True), True)
    measure("prr_ema_counters_each_layer", eng.with_plan(count_hits=True, count_at_step_end=False), True)
    measure("prr_ema_each_layer", eng.with_plan(learn_layers_at_once=False), True)
    if selector.speculates_in_selection():
        measure("prr_ema_counters_speculation_beside",
                eng.with_plan(count_hits=True, count_at_step_end=True, speculate_in_selection=False), True)
    del eng
    torch.cuda.empty_cache()
    return rows, kernel_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="quest:32000:16:32", help="selector:context:block:K, comma-separated")
    parser.add_argument("--replays", type=int, default=40, help="timed replays per view")
    parser.add_argument("--traced", type=int, default=5, help="traced replays per view")
    parser.add_argument("--repair-tokens", default="", help="tokens of A per repair program, comma-separated "
                        "(views of the repair tail's split plan; multiples of the block size)")
    parser.add_argument("--views", default="", help="only these views, comma-separated (serial is always timed: "
                        "the ratios' base); default every view")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/h200"))
    args = parser.parse_args()
    only = frozenset(v for v in args.views.split(",") if v) or None
    cells = parse_cells(args.cells)
    repair_tokens = tuple(int(t) for t in args.repair_tokens.split(",") if t)
    if not torch.cuda.is_available():
        raise SystemExit("error: step_breakdown.py times CUDA-graph replays: it needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(sys.argv)
    model = model_of(32)
    rows, kernel_rows = [], []
    for cell in cells:
        r, kr = cell_rows(model, *cell, replays=args.replays, traced=args.traced, repair_tokens=repair_tokens,
                           only=only)
        rows += r
        kernel_rows += kr
        table = pd.DataFrame(rows).assign(command=command)
        table.to_csv(args.out / "step_breakdown.csv", index=False)  # after every cell: a cut call keeps it
        pd.DataFrame(kernel_rows).assign(command=command).to_csv(args.out / "step_breakdown_kernels.csv", index=False)
        (args.out / "step_breakdown.json").write_text(strict_json_dumps(
            {"command": command, **environment(), "rows": rows}, indent=1))
    show = table[[c for c in ("selector", "context", "block", "view", "step_us", "over_serial", "over_serial_lo", "over_serial_hi",
                  "span_us", "busy_us", "idle_us", "main_kernel_us", "side_kernel_us", "launches") if c in table]]
    print(show.to_string(index=False, float_format=lambda x: f"{x:.3f}" if abs(x) < 10 else f"{x:.0f}"))


if __name__ == "__main__":
    main()
