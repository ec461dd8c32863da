"""Seconds per sample of scored tasks on the research runtime (`runtime.engine=eager`) and on
the CUDA-graph engine (`runtime.engine=graph`, prr/runtime/graph_pipeline.py), same config.

    python experiments/bench_scoring.py --device cuda --dtype bfloat16 --backend triton \\
        --context 32512 --samples 3 --out experiments/results/h200/bench_scoring
    python experiments/bench_scoring.py --shape tiny-random --context 400 --samples 2   # a CPU smoke run

The model is a zoo model's shape (default Qwen2.5-Coder-0.5B: 24 layers, GQA 14/2, head 64,
vocab 151,936) with seeded random weights: weights do not travel to the GPU machine, and time
per sample does not depend on them. Without a tokenizer, text is bytes (one token per byte).
Tasks: `ruler_niah` (prr's needle generator: the prompt prefilled, greedy generation of
--new-tokens tokens, no EOS cut) and `perplexity` (a --context window prefilled, --score-tokens
continuation tokens scored by teacher forcing). Each engine runs --warmup samples first (the
graph engine builds, compiles and captures its step on its first request), then --samples timed
ones; a sample's time is the wall time of its `generate` / `score` call (prefill included,
synchronised), and its decode time the sum of its steps' times in records/tokens.jsonl (eager:
wall time per step; graph: CUDA-event device time per replay).

Writes <out>.csv (one row per task, engine and timed sample) and <out>.json (command, date, GPU,
versions, config, per task and engine: n, mean seconds per sample with a 95% t interval, the
ratio eager / graph with a 95% bootstrap interval, and whether both engines produced the same
tokens / log-likelihoods).
"""

from __future__ import annotations

import argparse
import math
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from hydra.utils import instantiate

from prr.paths import strict_json_dumps

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-coder-0.5b", help="zoo model whose config is used, random weights")
    p.add_argument("--layers", type=int, default=None, help="override its number of layers (smoke runs)")
    p.add_argument("--context", type=int, default=32512, help="prompt tokens (bytes) per sample")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per ruler_niah sample")
    p.add_argument("--score-tokens", type=int, default=64, help="continuation tokens scored per perplexity sample")
    p.add_argument("--tasks", default="ruler_niah,perplexity")
    p.add_argument("--engines", default="eager,graph")
    p.add_argument("--samples", type=int, default=3, help="timed samples per task and engine")
    p.add_argument("--warmup", type=int, default=1, help="untimed samples first (the graph engine's capture)")
    p.add_argument("--selector", default="quest")
    p.add_argument("--predictor", default="ema")
    p.add_argument("--topk-tokens", type=int, default=2048, help="selector.topk_blocks x block_size")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "cpu" / "bench_scoring"))
    p.add_argument("--profile", action="store_true",
                   help="cProfile the timed samples: <out>_<task>_<engine>_profile.txt, the prr functions by "
                        "cumulative time (with CUDA_LAUNCH_BLOCKING=1 each kernel's time lands on its caller)")
    args = p.parse_args(argv)
    if args.topk_tokens % args.block_size:
        p.error(f"--topk-tokens {args.topk_tokens} is not a multiple of --block-size {args.block_size}")
    return args


def random_model(args: argparse.Namespace) -> Any:
    """The zoo shape with seeded random weights, as prr.model.loading builds its random-init models."""
    import dataclasses

    from prr.model.decoder import Decoder
    from prr.model.loading import LoadedModel, parse_dtype
    from prr.model.zoo import ZOO

    if args.shape not in ZOO:
        raise SystemExit(f"--shape {args.shape!r} is not a zoo model: {sorted(ZOO)}")
    config = ZOO[args.shape].config
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    decoder = Decoder(config, dtype=parse_dtype(args.dtype), device=args.device)
    decoder.init_random_(seed=0).eval()
    return LoadedModel(f"{args.shape}-shape (random weights, seed 0)", config, decoder, tokenizer=None)


def overrides(args: argparse.Namespace, task: str, engine: str, samples: int) -> list[str]:
    common = ["logger=none", f"model={args.shape}", f"runtime.device={args.device}", f"runtime.dtype={args.dtype}",
              f"backend={args.backend}", f"runtime.block_size={args.block_size}", f"runtime.engine={engine}",
              f"selector={args.selector}", f"selector.topk_blocks={args.topk_tokens // args.block_size}",
              f"predictor={args.predictor}", "runtime.dense_metrics_every=1000000", "runtime.check_serial=false",
              f"task={task}", f"task.context_tokens={args.context}", f"task.num_samples={samples}"]
    if task == "ruler_niah":
        return [*common, f"task.max_new_tokens={args.new_tokens}", "task.chat_template=false"]
    if task == "perplexity":
        return [*common, f"task.score_tokens={args.score_tokens}"]
    raise SystemExit(f"--tasks: {task!r} is not one of ruler_niah, perplexity")


class Timed:
    """The Engine as a task sees it, with each generate / score call (a batch call: one per
    batch of the engine's rows, one request at batch size 1) timed, synchronised."""

    def __init__(self, engine: Any, profile_after: int | None = None) -> None:
        """profile_after: calls after which each call is cProfiled (self.profile), None: none."""
        self.engine, self.seconds, self.outputs = engine, [], []
        self.profile_after = profile_after
        self.profile = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _timed(self, fn, batch: bool, *a, **k):
        sync = torch.cuda.synchronize if self.engine.device.type == "cuda" else (lambda: None)
        sync()
        profiling = self.profile_after is not None and len(self.seconds) >= self.profile_after
        if profiling:
            import cProfile

            self.profile = self.profile or cProfile.Profile()
            self.profile.enable()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        sync()
        self.seconds.append(time.perf_counter() - t0)
        if profiling:
            self.profile.disable()
        self.outputs += out if batch else [out]
        return out

    def generate(self, *a, **k):
        return self._timed(self.engine.generate, False, *a, **k)

    def score(self, *a, **k):
        return self._timed(self.engine.score, False, *a, **k)

    def generate_batch(self, *a, **k):
        return self._timed(self.engine.generate_batch, True, *a, **k)

    def score_batch(self, *a, **k):
        return self._timed(self.engine.score_batch, True, *a, **k)


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% Student-t interval (n >= 2)."""
    from scipy.stats import t

    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def run_task(args, model, task_name: str, engine_name: str, run_dir: Path) -> tuple[list[dict[str, Any]], list]:
    from prr.config_check import compose_config
    from prr.evaluation import Engine
    from prr.sinks import read_jsonl

    total = args.warmup + args.samples
    # check=False: the model config names the zoo shape, whose real weights need not be here
    cfg = compose_config(overrides(args, task_name, engine_name, total), check=False)
    task = instantiate(cfg.task)
    engine = Engine(cfg, model, task.prompt_tokens_upper_bound() + getattr(task, "max_new_tokens", 0)
                    + getattr(task, "score_tokens", 0), run_dir)
    engine.eos_ids = set()  # every sample generates --new-tokens tokens: equal work per sample
    timed = Timed(engine, args.warmup if args.profile else None)
    try:
        task.evaluate(timed)
    finally:
        engine.close()
    if timed.profile is not None:
        write_profile(timed.profile, Path(f"{args.out}_{task_name}_{engine_name}_profile.txt"))
    tokens = read_jsonl(run_dir / "records" / "tokens.jsonl")
    rows = []
    for i, seconds in enumerate(timed.seconds):
        steps = tokens[tokens["sample"] == i] if len(tokens) else tokens
        rows.append({"task": task_name, "engine": engine_name, "sample": i, "warmup": i < args.warmup,
                     "seconds": seconds, "decode_s": float(steps["wall_s"].sum()) if len(steps) else 0.0,
                     "decode_steps": len(steps)})
    return rows, timed.outputs


def write_profile(profile: Any, path: Path) -> None:
    """The profiled calls' prr functions by cumulative time, then every function by own time."""
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats("prr/", 60)
    stats.sort_stats("tottime").print_stats(30)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())


def same_outputs(a: list, b: list) -> dict[str, Any]:
    """Generations: identical token ids; scores: the largest log-likelihood difference."""
    if a and hasattr(a[0], "token_ids"):
        return {"identical_generations": sum(x.token_ids == y.token_ids for x, y in zip(a, b, strict=True)),
                "of": len(a)}
    return {"max_abs_logprob_diff": max(max(abs(p - q) for p, q in zip(x[2], y[2], strict=True))
                                        for x, y in zip(a, b, strict=True)), "of": len(a)}


def main(argv: list[str] | None = None) -> None:
    from prr.intervals import median_ratio_interval

    args = parse_args(argv)
    command = " ".join(["python experiments/bench_scoring.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    model = random_model(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, outputs, summary = [], {}, {}
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout  # noqa: E731
    try:  # the commit, and the files the tree ran with that differ from it (a shared working tree)
        commit, changed = git("rev-parse", "HEAD").strip() or None, git("status", "--porcelain", "-uno").splitlines()
    except OSError:
        commit, changed = None, []
    meta = {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit,
            "uncommitted_files": [line[3:] for line in changed],
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else
            f"cpu {platform.machine()}, {torch.get_num_threads()} threads",
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "cuda": torch.version.cuda, "triton": _version("triton")},
            "model": model.name, "dtype": args.dtype, "backend": args.backend, "context_tokens": args.context,
            "new_tokens": args.new_tokens, "score_tokens": args.score_tokens, "selector": args.selector,
            "predictor": args.predictor, "topk_tokens": args.topk_tokens, "block_size": args.block_size,
            "warmup_samples": args.warmup, "timed_samples": args.samples,
            "timing": "wall seconds of each generate / score call (prefill + decode, synchronised); "
                      "decode_s: sum of the steps' times (eager: wall; graph: CUDA-event device time)"}
    for task_name in args.tasks.split(","):
        for engine_name in args.engines.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                got, outputs[task_name, engine_name] = run_task(args, model, task_name, engine_name, Path(tmp))
            rows += got
            timed = [r for r in got if not r["warmup"]]
            seconds = [r["seconds"] for r in timed]
            mean, lo, hi = t_interval(seconds) if len(seconds) > 1 else (seconds[0], math.nan, math.nan)
            summary[f"{task_name} {engine_name}"] = {
                "n": len(seconds), "seconds_per_sample": mean, "ci95": [lo, hi],
                "decode_s_per_sample": sum(r["decode_s"] for r in timed) / len(timed),
                "decode_steps_per_sample": sum(r["decode_steps"] for r in timed) / len(timed),
                "warmup_seconds": [r["seconds"] for r in got if r["warmup"]], "wall_s": time.perf_counter() - t0}
            print(f"{task_name} {engine_name}: {mean:.3f} s/sample [{lo:.3f}, {hi:.3f}] (n={len(seconds)}), "
                  f"warm-up {summary[f'{task_name} {engine_name}']['warmup_seconds']}", flush=True)
            pd.DataFrame(rows).assign(command=command).to_csv(f"{out}.csv", index=False)  # kept if cut short
        if {"eager", "graph"} <= set(args.engines.split(",")):
            e = [r["seconds"] for r in rows if r["task"] == task_name and r["engine"] == "eager" and not r["warmup"]]
            g = [r["seconds"] for r in rows if r["task"] == task_name and r["engine"] == "graph" and not r["warmup"]]
            ratio, lo, hi = median_ratio_interval(e, g)
            summary[f"{task_name} eager/graph"] = {
                "ratio_of_medians": ratio, "ci95_bootstrap": [lo, hi],
                **same_outputs(outputs[task_name, "eager"], outputs[task_name, "graph"])}
            print(f"{task_name}: eager / graph = {ratio:.1f}x [{lo:.1f}, {hi:.1f}]", flush=True)
        Path(f"{out}.json").write_text(strict_json_dumps({**meta, "results": summary}, indent=2) + "\n")
    print(f"wrote {out}.csv, {out}.json")


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
