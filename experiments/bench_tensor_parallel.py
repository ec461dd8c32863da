"""Per-token decode latency under tensor parallelism: dense, serial DSA and PRR per GPU count.

    torchrun --nproc_per_node N experiments/bench_tensor_parallel.py [--contexts 32768 131072]
        [--model llama-3.1-8b-shape] [--repeats 20] [--out experiments/results/h200/bench_tensor_parallel_tpN]

Each rank builds its shard of the model directly (`shard_config`, random bf16 weights: a shard
of a random model is random, so no rank ever holds the whole model) and a random KV context of
its KV heads, then times one decode step of the graph engine (batch 1, Quest top-K 2048 tokens
in blocks of 16, layers 0-1 dense, torch projections, the o_proj / down all-reduces inside the
captured CUDA graph): dense, serial DSA, and PRR with P set from outside at 100% and 90% of
serial DSA's A. Also timed: the step's 2 x layers all-reduces alone (a graph of just them).
Floor per GPU: the bytes a rank reads per step (its weight shard, the replicated embedding row,
norms and lm_head, its KV heads' KV / metadata / selected blocks) over the best bandwidth
measured on that GPU, plus the measured all-reduce time. Rank 0 writes OUT.json (command, GPUs,
versions, date, rows) and OUT.csv and prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from prr.paths import strict_json_dumps

ROOT = Path(__file__).resolve().parents[1]
BLOCK, TOPK_TOKENS, DENSE_LAYERS = 16, 2048, (0, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b-shape", help="a random-init zoo shape")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072], help="cache tokens per cell")
    parser.add_argument("--repeats", type=int, default=20, help="CUDA-graph replays timed per variant")
    parser.add_argument("--out", type=Path, default=None, help="default: experiments/results/h200/bench_tensor_parallel_tpN")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats}: at least 3 (the median of the replays is reported)")
    bad = [c for c in args.contexts if c % BLOCK or c <= 512]
    if bad:
        parser.error(f"--contexts {bad}: each must be a multiple of {BLOCK} above 512")
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_tensor_parallel.py times CUDA graphs on GPUs: launch it with torchrun on a CUDA machine")
    import torch.distributed as dist

    from prr.benchmarking import (
        HEADROOM,
        configured,
        copy_bandwidth,
        decode_step_bytes,
        environment,
        read_bandwidth,
        time_graph_us,
    )
    from prr.blocks import controlled_predictions
    from prr.model.decoder import Decoder
    from prr.model.tensor_parallel import TensorParallel, shard_config
    from prr.model.zoo import ZOO
    from prr.runtime.graph_decode import GraphDecoder, StaticPlan

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    tp = TensorParallel(dist.get_rank(), dist.get_world_size())
    config = ZOO[args.model].config
    problems = tp.problems(config)
    if problems:
        sys.exit(f"{args.model} at tensor_parallel={tp.world}: " + "; ".join(problems))
    shard = Decoder(shard_config(config, tp.world), torch.bfloat16, "cuda").init_random_(seed=tp.rank)
    shard.tensor_parallel = tp  # (shard_decoder's mark: every forward all-reduces)
    torch.backends.cuda.matmul.allow_tf32 = True
    bw = copy_bandwidth() | read_bandwidth()
    bandwidth = max(bw.values())
    h = config.hidden_size
    partial = torch.randn(1, 1, h, dtype=torch.bfloat16, device="cuda")
    allreduce_us = time_graph_us(lambda: [tp.all_reduce(partial) for _ in range(2 * config.num_layers)],
                                 repeats=args.repeats)
    rows = []
    k_blocks = TOPK_TOKENS // BLOCK
    for capacity in args.contexts:
        context = capacity - HEADROOM
        quest = configured("selector", "quest", topk_blocks=k_blocks, dense_layers=list(DENSE_LAYERS))
        plan = StaticPlan(variant="prr", predicted_blocks=k_blocks, block_size=BLOCK, projections="torch")
        eng = GraphDecoder(shard, plan, batch=1, max_tokens=capacity, selector=quest, predictor=None)  # P set below
        eng.fill_random_context(context, seed=1)
        eng.with_plan(variant="serial").step(advance=False)
        torch.cuda.synchronize()
        selections = list(eng.last_selection)
        for variant, hit in (("dense", None), ("serial", None), ("prr", 1.0), ("prr", 0.9)):
            if hit is not None:
                gen = torch.Generator().manual_seed(int(1000 * hit))
                for layer, s in enumerate(selections):
                    if s is not None:
                        eng.set_predictions(layer, *controlled_predictions(s, hit, context // BLOCK + 1, gen))
            view = eng.with_plan(variant=variant)
            us = time_graph_us(lambda v=view: v.step(advance=False), repeats=args.repeats)
            floor = decode_step_bytes(config, [context], variant != "dense", tp.world, BLOCK, TOPK_TOKENS,
                                      len(DENSE_LAYERS)) / bandwidth * 1e6
            rows.append(dict(model=args.model, tensor_parallel=tp.world, context=context, variant=variant,
                             hit_rate=hit, token_us=us, floor_us=floor, allreduce_us=allreduce_us,
                             over_floor=us / floor, over_floor_plus_allreduce=us / (floor + allreduce_us)))
        serial = next(r["token_us"] for r in rows if r["context"] == context and r["variant"] == "serial")
        for r in rows:
            if r["context"] == context:
                r["over_serial"] = r["token_us"] / serial
        del eng, view
        torch.cuda.empty_cache()
    if tp.rank == 0:
        out = args.out or ROOT / f"experiments/results/h200/bench_tensor_parallel_tp{tp.world}"
        out.parent.mkdir(parents=True, exist_ok=True)
        results = {"command": "torchrun --nproc_per_node " + str(tp.world) + " " + " ".join(sys.argv),
                   "environment": environment(), "gpus": tp.world, "bandwidth": bw, "rows": rows}
        out.with_suffix(".json").write_text(strict_json_dumps(results, indent=1))
        import pandas as pd

        df = pd.DataFrame(rows).assign(command=results["command"])
        df.to_csv(out.with_suffix(".csv"), index=False)
        print(df.drop(columns="command").round(3).to_string(index=False))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
