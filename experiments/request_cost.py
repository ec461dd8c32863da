"""Where a scored request's PRR cost goes beside serial DSA's, phase by phase, on the research
runtime (`runtime.engine=eager`) or the graph engine's request path (`--engine graph`, on a CPU its
steps uncaptured): the work before the first decode step that PRR adds (issue 53, item 5), then
the decode.

    python experiments/request_cost.py --context-tokens 4096 --repeats 5 \\
        --out experiments/results/cpu/request_cost_smollm2_4096

One RULER prompt (--task, --sample) is prefilled densely once (`prr.evaluation.kept_prefill`, as
experiments/accuracy_study.py shares it between configs); each repeat then replays it into every
config, in turn, timing each phase of a request (wall clock, synchronised on CUDA):
- `replay`: `EagerRuntime.replay_prefill` — K/V into the cache, the selector's metadata and the
  prefill tail's selections (runtime.calibration_tokens positions per sparse layer);
- `calibrate`: `DSABackend.calibrate_predictor` (ema: the grid search of α, β, γ on the tail);
- `warm`: `DSABackend.warm_predictor` (the predictor's state, warmed by replaying the tail);
- `begin`: the pipeline's hand-off (graph engine: its state taken over from the prefill, the
  step captured on the first request);
- `decode`: --new-tokens greedy steps (the pipeline's `steps`: eager, wall time per step less
  its untimed measurement work, the records' predictor ranking, which no scoring needs; graph,
  the steps' timed replays).

Configs: `serial` (predictor=none) with the graph engine's one-token tail (GraphPipeline.prefill
gives serial that tail itself: it learns nothing from the tail but its last selection),
`serial_tail` with the full tail (what the eager path gives serial), `prr` (predictor=ema
calibrated, predictor.calibrate=true: the default before issue 53) and `prr_uncalibrated`
(predictor.calibrate=false: the default since). Repeats alternate the configs, so machine load
falls on each alike; each phase is reported as the median over repeats with its min–max.

Writes <out>.csv (one row per repeat, config and phase) and <out>.json (command, date, versions,
prompt, per config and phase: median, min, max seconds; the PRR / serial ratios of the medians of
the before-first-token work and of the whole request; the calibration's choice).
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from hydra.utils import instantiate

from prr.config_check import compose_config
from prr.evaluation import Engine, kept_prefill
from prr.paths import strict_json_dumps, write_text_atomic
from prr.tasks.ruler import task_overrides

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("replay", "calibrate", "warm", "begin", "decode")
CONFIGS = {  # name -> overrides beside the common ones
    "serial": ["predictor=none", "runtime.calibration_tokens=1"],
    "serial_tail": ["predictor=none"],
    "prr": ["predictor=ema", "predictor.calibrate=true", "runtime.repair_mode=exact"],
    "prr_uncalibrated": ["predictor=ema", "predictor.calibrate=false", "runtime.repair_mode=exact"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model option (default: the config's)")
    p.add_argument("--task", default="ruler:niah_multikey_2", help="ruler:NAME or a conf/task name")
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--sample", type=int, default=0, help="which prompt of the task")
    p.add_argument("--selector", default="quest")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps per request (RULER's answers: 16-128)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--engine", default="eager", choices=["eager", "graph"], help="runtime.engine")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a Hydra override of every config, repeatable")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "cpu" / "request_cost"))
    args = p.parse_args(argv)
    if args.repeats < 1 or args.new_tokens < 1:
        p.error(f"--repeats {args.repeats} and --new-tokens {args.new_tokens} must be >= 1")
    return args


def common_overrides(args: argparse.Namespace) -> list[str]:
    model = [f"model={args.model}"] if args.model else []
    return [*model, "logger=none", f"runtime.device={args.device}", f"runtime.dtype={args.dtype}",
            f"runtime.engine={args.engine}", f"selector={args.selector}", "runtime.dense_metrics_every=1000000",
            "runtime.check_serial=false", *task_overrides(args.task), f"task.context_tokens={args.context_tokens}",
            *args.extra]


def one_request(engine: Engine, prefill: Any, new_tokens: int) -> tuple[dict[str, float], dict[str, Any], list[int]]:
    """One request of `engine`'s config from a kept prefill, phase by phase as Engine's own
    request start runs them (its pipeline's prefill, with a mark after each phase, and steps) ->
    (seconds per phase, the calibration's choice, the greedy tokens)."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    pipeline = engine.pipeline  # EagerPipeline or GraphPipeline
    marks = [time.perf_counter()]

    def mark(name: str) -> None:
        sync()
        marks.append(time.perf_counter())

    pipeline.prefill([prefill.input_ids], [prefill], new_tokens, phase=mark)
    info = dict(pipeline.calibration)
    token = int(prefill.last_logits.argmax())
    steps = pipeline.steps([token], new_tokens, None)[0]  # greedy
    pipeline.end()
    seconds = dict(zip(PHASES[:-1], (b - a for a, b in zip(marks, marks[1:], strict=False)), strict=True))
    seconds["decode"] = sum(steps.wall_s) - sum(steps.measure_s)
    return seconds, info, [token, *steps.chosen]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common = common_overrides(args)
    cfgs = {name: compose_config([*common, *CONFIGS[name]]) for name in args.configs}
    first = next(iter(cfgs.values()))
    settings = instantiate(first.runtime)
    model = instantiate(first.model).load(settings.dtype, settings.device)
    task = instantiate(first.task)
    base = Engine(first, model, 1)  # (the tokenizer and prompt encoding)
    sample = task.make_sample(base.tokenizer, task.rng(args.sample), args.sample)
    ids = base.encode_prompt(sample.prompt, task.chat_template, sample.gen_prefix)  # [1, T]
    prefill = kept_prefill(model, ids, settings.device)
    engines = {name: Engine(cfg, model, ids.shape[1] + args.new_tokens) for name, cfg in cfgs.items()}
    one_request(engines[args.configs[0]], prefill, 2)  # warm the process up (allocations, first calls)
    rows, infos, tokens = [], {}, {}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            seconds, infos[name], tokens[name] = one_request(engine, prefill, args.new_tokens)
            rows += [{"repeat": repeat, "config": name, "phase": ph, "seconds": seconds[ph]} for ph in PHASES]
        print(f"repeat {repeat}: " + ", ".join(f"{r['config']} {r['phase']} {r['seconds']:.3f}s" for r in rows
                                                if r["repeat"] == repeat), flush=True)
    frame = pd.DataFrame(rows)
    per_request = frame.groupby(["config", "repeat"])["seconds"].sum()
    before = frame[frame.phase != "decode"].groupby(["config", "repeat"])["seconds"].sum()
    summary: dict[str, Any] = {}
    for name in engines:
        summary[name] = {ph: spread(frame[(frame.config == name) & (frame.phase == ph)]["seconds"].tolist())
                         for ph in PHASES}
        summary[name]["before_first_token"] = spread(before[name].tolist())
        summary[name]["request"] = spread(per_request[name].tolist())
        summary[name]["calibration"] = infos[name]
    ratios = {}
    if "serial" in engines:
        for name in engines:
            if name.startswith("prr"):
                ratios[f"{name} / serial"] = {
                    key: summary[name][key]["median"] / summary["serial"][key]["median"]
                    for key in ("before_first_token", "request")}
    same_tokens = {name: tokens[name] == tokens[args.configs[0]] for name in engines}
    command = " ".join(["python experiments/request_cost.py", *(shlex.quote(a) for a in (argv or sys.argv[1:]))])
    meta = {"command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "threads": torch.get_num_threads(), "model": model.name, "task": args.task, "sample": args.sample,
            "prompt_tokens": int(ids.shape[1]), "new_tokens": args.new_tokens, "repeats": args.repeats,
            "selector": args.selector, "topk_blocks": int(first.selector.get("topk_blocks", 0) or 0),
            "calibration_tokens": int(first.runtime.calibration_tokens), "engine": args.engine, "device": args.device,
            "dtype": args.dtype}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(f"{out}.csv"), frame.assign(command=command).to_csv(index=False))
    write_text_atomic(Path(f"{out}.json"), strict_json_dumps({**meta, "results": summary, "ratios": ratios,
                                                              "same_tokens_as_first_config": same_tokens},
                                                             indent=2) + "\n")
    for name in engines:
        s = summary[name]
        print(f"{name:17s} " + "  ".join(f"{k} {s[k]['median']:.3f} [{s[k]['min']:.3f}, {s[k]['max']:.3f}]"
                                         for k in (*PHASES, "request")))
    print(strict_json_dumps(ratios, indent=1))
    print(f"wrote {out}.csv, {out}.json")


if __name__ == "__main__":
    main()
