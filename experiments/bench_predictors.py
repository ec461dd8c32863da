"""The predictors' propose and update per sparse layer, kernels (backend triton) against the
torch path, at the 8B shape (8 KV heads, batch 1).

    python experiments/bench_predictors.py [--out DIR] [--contexts 32768,131072] [--blocks 16,64]
        [--budgets 32,128] [--predictors ema,last_step,spin,ema_membership,...] [--layers 32]
        [--qs-fill-width W]
    TRITON_INTERPRET=1 python experiments/bench_predictors.py --device cpu --quick   # the machinery, on a CPU

For each context × block size, every predictor (as conf/predictor/<name>.yaml builds it; ema
uncalibrated: calibration fits α, β, γ on the host and leaves the same kernels) gets a state of
`--layers` layers (one per layer, so replays walk different state), warmed by a few updates
over random selections (top-K = --topk blocks of random scores, -inf past the context), and
is timed on each backend it has:
- `update`: learning from A (one sparse layer);
- `propose`: P of |P| blocks for the next step;
- `side_chain`: what PredictorSchedule.learn runs per layer after the repair on the side stream:
  update, then the P it completes (`Predictor.proposals_after_update`: history-only predictors
  the layer's next P, with the next step's block counts; cross_layer the layer above's P of
  this step), copied into the P buffers. query_similarity's propose needs the step's query: it
  runs at the start of speculation, before the attention over P (`before_speculation`: on
  the speculation's critical path; 0 for the others).
Before timing, P of both backends is compared on one state (the same set: `p_equal`).
Times: CUDA-graph replays of all layers' calls, median over repeats, per layer (GPU); the
host clock over eager calls on the CPU (the interpreter's time: a check of the machinery only).

Writes OUT/bench_predictors.json (command, environment, rows) and .csv; prints a short table last.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path

from prr.paths import strict_json_dumps

ROOT = Path(__file__).resolve().parents[1]
HEADROOM = 256  # tokens free at the end of the cache (prr.benchmarking.HEADROOM)
KV_HEADS = 8  # the 8B shape's (32 query heads, GQA 4: the predictors see KV heads only)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "experiments" / "results" / "h200")),
                    help="directory for bench_predictors.json / .csv (default $OUT, else experiments/results/h200)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--contexts", default="32768,131072", help="cache capacities in tokens (context = capacity - 256)")
    ap.add_argument("--blocks", default="16,64", help="block sizes in tokens")
    ap.add_argument("--budgets", default="32,128", help="|P| in blocks")
    ap.add_argument("--topk", type=int, default=32, help="blocks in each selection A the predictors learn from")
    ap.add_argument("--predictors", default="ema,last_step,spin,ema_membership,cross_layer,query_similarity")
    ap.add_argument("--layers", type=int, default=32, help="sparse layers (distinct states) per replay")
    ap.add_argument("--qs-fill-width", type=int, default=None,
                    help="query_similarity's fill_width (default: conf/predictor's, 0): > 0 times its propose where "
                         "|P| exceeds the candidates with the rest of P from the fill list, not the whole row")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU check): 1024 tokens, block 16, |P| 4, 2 layers")
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.blocks, args.budgets, args.layers, args.topk, args.repeats = "1280", "16", "4", 2, 4, 1
    return args


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def predictor_conf(name: str):
    """conf/predictor/<name>.yaml with its `defaults` (another predictor file) merged under it."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "conf" / "predictor" / f"{name}.yaml")
    if "defaults" not in cfg:
        return cfg
    bases = [d for d in cfg.pop("defaults") if d != "_self_"]
    return OmegaConf.merge(*(predictor_conf(b) for b in bases), cfg)


def configured(name: str, **overrides):
    """The predictor conf/predictor/<name>.yaml describes (hydra instantiate), with overrides."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    return instantiate(OmegaConf.merge(predictor_conf(name), overrides))


OVERRIDES = {"ema": {"calibrate": False}, "ema_calibrated": {"calibrate": False}, "cross_layer": {"calibrate": False},
             "spin": {"seed": 0}}


def spread(samples: list[float]) -> tuple[float, float, float]:
    """-> (median, 10th percentile, 90th percentile) of the samples (nearest rank)."""
    ordered = sorted(samples)
    rank = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return statistics.median(ordered), rank(0.1), rank(0.9)


def timer(device):
    """-> f(calls, repeats) = (median, 10th, 90th percentile) µs per call over the repeats:
    CUDA-graph replays (GPU) or the host clock (CPU)."""
    import torch

    if device.type == "cuda":
        from prr.runtime.graph_budget import graph_samples_us

        return lambda calls, repeats: spread(graph_samples_us(calls, repeats))

    def host(calls, repeats):
        for fn in calls:
            fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for fn in calls:
                fn()
            samples.append((time.perf_counter() - start) * 1e6 / len(calls))
        return spread(samples)

    del torch
    return host


def selections(layers: int, num_blocks: int, max_blocks: int, topk: int, device, seed: int):
    """Random selections, one per layer: scores [1, Hkv, N] fp32 (-inf past num_blocks), A = the
    top-K of them with the newest block forced, ascending int32 (what selectors hand to update)."""
    import torch
    from prr.kernels.reference_selection import topk_select_reference

    from prr.blocks import BlockSet
    from prr.selectors.base import Selection

    g = torch.Generator().manual_seed(seed)
    out = []
    nb = torch.tensor([num_blocks], dtype=torch.int32)
    for _ in range(layers):
        scores = torch.randn(1, KV_HEADS, max_blocks, generator=g) * 3 + 10
        scores[..., num_blocks:] = float("-inf")
        idx, cnt = topk_select_reference(scores, topk, nb, sink_blocks=1, recent_blocks=1)
        out.append(Selection(BlockSet(idx.to(device), cnt.to(device)), scores.to(device)))
    return out


def bench_shape(names: list[str], capacity: int, block: int, budgets: list[int], args, device, time_us) -> list[dict]:
    import torch

    max_blocks = capacity // block
    num_blocks = math.ceil((capacity - HEADROOM) / block)
    layers = args.layers
    sels = selections(layers, num_blocks, max_blocks, args.topk, device, seed=capacity + block)
    warm = selections(layers, num_blocks, max_blocks, args.topk, device, seed=capacity + block + 1)
    lengths = torch.full((1,), num_blocks * block - block // 2, dtype=torch.int32, device=device)  # tokens this step
    nb_next = torch.full((1,), num_blocks, dtype=torch.int32, device=device)
    query = torch.randn(1, KV_HEADS, 4, 128, device=device)  # [B, Hkv, G, D]: query_similarity's
    rows = []
    for name in names:
        rows += bench_predictor(name, sels, warm, lengths, nb_next, query, capacity, block, budgets, args, device,
                                time_us)
    return rows


def bench_predictor(name: str, sels, warm, lengths, nb_next, query, capacity: int, block: int, budgets: list[int],
                    args, device, time_us) -> list[dict]:
    """Rows of one predictor at one shape: each backend it has × |P|."""
    import torch

    from prr.blocks import BlockSet

    layers, max_blocks = args.layers, capacity // block
    fill = {"fill_width": args.qs_fill_width} if name == "query_similarity" and args.qs_fill_width is not None else {}
    p = configured(name, **OVERRIDES.get(name, {}), **fill)
    backends = ["torch"] + (["triton"] if p.triton_problems() == [] else [])
    state = p.init_state(layers, 1, KV_HEADS, max_blocks, device)
    p.size_for_query(state, query.shape[-2] * query.shape[-1])
    extra = {"query": query} if p.needs_query else {}
    for _ in range(3):  # a warmed state (EMAs away from their zero start)
        for layer in range(layers):
            if p.needs_query:
                p.propose(state, layer, nb_next, budgets[0], **extra)
            p.update(state, layer, warm[layer])
    equal = {}  # P of both backends on one state: the same set
    for budget in budgets:
        sets = []
        for backend in backends:
            p.set_backend(backend)
            got = p.propose(state, 0, nb_next, budget, **extra)
            sets.append(BlockSet(got.indices, got.count).mask(max_blocks))
        equal[budget] = all(torch.equal(sets[0], s) for s in sets[1:])

    def update(layer):
        p.update(state, layer, sels[layer])

    def propose(layer, budget):
        return p.propose(state, layer, nb_next, budget, **extra)

    next_blocks = []  # the next step's block counts: computed by the first layer's chain, as the engine does

    def chain(layer, budget, pred_idx, pred_cnt):
        # PredictorSchedule.learn(propose_next=True) for one layer, on one stream: the update, then
        # the P it completes (history-only: this layer's next; cross_layer: the layer above's)
        p.update(state, layer, sels[layer])
        if layer == 0:
            next_blocks[:] = [(lengths + block).div(block, rounding_mode="floor")]
        for target, next_step in p.proposals_after_update(state, layer):
            nb = next_blocks[0] if next_step else nb_next
            got = p.propose(state, target, nb, budget, **extra)
            pred_idx[..., : got.capacity].copy_(got.indices)
            pred_cnt.copy_(got.count)

    rows = []
    for backend in backends:
        p.set_backend(backend)
        base = dict(predictor=name, backend=backend, context=capacity - HEADROOM, block=block,
                    num_blocks=int(nb_next[0]), layers=layers, history_only=p.history_only)
        update_us, update_p10, update_p90 = time_us([lambda layer=layer: update(layer) for layer in range(layers)],
                                                    args.repeats)
        for budget in budgets:
            pred_idx = [torch.zeros(1, KV_HEADS, budget, dtype=torch.int32, device=device) for _ in range(layers)]
            pred_cnt = [torch.zeros(1, KV_HEADS, dtype=torch.int32, device=device) for _ in range(layers)]
            propose_us, propose_p10, propose_p90 = time_us(
                [lambda layer=layer, b=budget: propose(layer, b) for layer in range(layers)], args.repeats)
            chain_us, *_ = time_us([lambda layer=layer, b=budget, i=pred_idx[layer], c=pred_cnt[layer]: chain(layer, b, i, c)
                                for layer in range(layers)], args.repeats)
            rows.append({**base, "budget": budget, "propose_us": propose_us, "update_us": update_us,
                         "propose_p10_us": propose_p10, "propose_p90_us": propose_p90, "update_p10_us": update_p10,
                         "update_p90_us": update_p90, "repeats": args.repeats,
                         "side_chain_us": chain_us, "p_equal": equal[budget],
                         # before this layer's speculation in the same step: none where P was
                         # written ahead by the side chain (history-only, cross_layer)
                         "before_speculation_us": 0.0 if p.proposed_ahead(state, layers - 1) else propose_us})
    p.set_backend("torch")
    return rows


COLUMNS = ["predictor", "backend", "context", "block", "num_blocks", "budget", "propose_us", "propose_p10_us",
           "propose_p90_us", "update_us", "update_p10_us", "update_p90_us", "side_chain_us", "before_speculation_us",
           "p_equal", "history_only", "layers", "repeats"]


def table(rows: list[dict]) -> str:
    """One line per predictor × shape × |P|: µs per layer on each backend (crit: before the
    layer's speculation, on its critical path) and the side chain's torch / triton."""
    by = {}
    for r in rows:
        by.setdefault((r["predictor"], r["context"], r["block"], r["budget"]), {})[r["backend"]] = r
    lines = ["predictor         context block  |P| | torch: propose update  chain   crit |"
             " triton: propose update  chain   crit | chain torch/triton  P equal"]

    def cells(r):
        return f"{r['propose_us']:8.1f} {r['update_us']:6.1f} {r['side_chain_us']:6.1f} {r['before_speculation_us']:6.1f}"

    for (name, context, block, budget), pair in by.items():
        t, k = pair.get("torch"), pair.get("triton")
        line = [f"{name:<17} {context:>7} {block:>5} {budget:>4}", "       " + cells(t)]
        if k is not None:
            line += ["        " + cells(k), f"{t['side_chain_us'] / k['side_chain_us']:17.2f}x  {k['p_equal']}"]
        else:
            line.append(f"{'(no kernels)':>38}")
        lines.append(" | ".join(line))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_predictors: --device cuda needs a GPU (use --device cpu --quick for a CPU check)")
    device = torch.device(args.device)
    names = [n for n in args.predictors.split(",") if n]
    unknown = [n for n in names if not (ROOT / "conf" / "predictor" / f"{n}.yaml").exists()]
    if unknown:
        sys.exit(f"bench_predictors: unknown --predictors {unknown} (conf/predictor has the names)")
    nothing = [n for n in names if n in ("none", "oracle")]
    if nothing:
        sys.exit(f"bench_predictors: --predictors {nothing} compute nothing to time (none: P = ∅; oracle: P = A, "
                 "handed in)")
    time_us = timer(device)
    started = time.time()
    rows = []
    with torch.inference_mode():
        for capacity in ints(args.contexts):
            for block in ints(args.blocks):
                rows += bench_shape(names, capacity, block, ints(args.budgets), args, device, time_us)
                print(f"[{time.time() - started:5.0f} s] context {capacity - HEADROOM}, block {block}: done", flush=True)
    if args.device == "cuda":
        from prr.benchmarking import environment

        env = environment()
    else:
        env = {"device": "cpu", "torch": torch.__version__, "note": "TRITON_INTERPRET=1: the interpreter's time"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(["python", *sys.argv]), "environment": env, "timer":
              "cuda_graph_replay median per layer" if args.device == "cuda" else "host clock", "rows": rows}
    (out / "bench_predictors.json").write_text(strict_json_dumps(record, indent=1))
    with open(out / "bench_predictors.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({c: r[c] for c in COLUMNS} for r in rows)
    print(f"wrote {out / 'bench_predictors.json'} and .csv ({len(rows)} rows, {time.time() - started:.0f} s)")
    print("µs per sparse layer (chain: the side stream's update + the P it completes + copies; query_similarity's"
          " propose runs before speculation instead)")
    print(table(rows))
    if not all(r["p_equal"] for r in rows):
        sys.exit("bench_predictors: P differs between backends (see p_equal)")


if __name__ == "__main__":
    main()
