"""Whole runs of run.py on the GPU through the engine, against serial DSA in the same session.

Each case is `python run.py runtime=cuda ...` in its own process (its own run directory under
--runs), on the Llama-3.1-8B shape with random bf16 weights and a random prompt; the per-token
latency is the device time of each step's CUDA-graph replay (the run's own summary.json).

  --cases acceptance: serial DSA (predictor=none) and the README's main command
      (selector=quest predictor=ema budget=profiled), each with dense-reference metrics off
      (only the first step measured) and on every 16th step: the main command's median and
      mean per-token latency as a ratio to serial DSA's.
  --cases matrix: every selector x {none, last_step, ema} at budget=fixed (|P| = top-K), at each
      setting of --contexts x --blocks x --topk (prompt tokens, runtime.block_size,
      selector.topk_blocks; one setting by default: --prompt-tokens, block 16, top-K 32).
      --selectors / --predictors narrow it. --hit-rates 0.5,0.7,0.9 adds, per selector and setting,
      PRR with predictor=bench_hit_rate at each rate (a benchmark tool: the step's true A with the
      rest of P swapped out, replayed from a recorded serial pass; cases selector-hit0.7@setting);
      --profiled-hit-rates 0.9 adds the same predictor under budget=profiled (its stage check at
      that rate: budget.hit_rate; cases selector-hit0.9+profiled@setting), whose |P| the run chooses.

With --stage-map (bench_decode.py's stage CSV), each PRR row is printed beside what the map
predicts for it: its serial run's per-token time minus, over the sparse layers, (serial stage -
PRR stage at the run's measured hit rate; linear between the map's hit rates), from the map's
cell at the same selector, block, budget (top-K x block tokens) and the nearest context. Rows
the map has no cell for get no prediction (NaN), never a neighbour's.

The map is timed at |P| = |A|: a run whose |P| differs (the profiled budget's choice) gets no
prediction. Every row carries 95% intervals: the median per-token latency over serial DSA's
(percentile bootstrap over each run's steps, resampled independently; n = steps) and, for the
replayed predictor, the hit rate (Wilson over the selected blocks the script counts), and says
whether its tokens equal its serial run's (exact-mode PRR decodes serial DSA's tokens).

Writes <out>.json (every summary's numbers, the commands, GPU, versions, date) and <out>.csv,
and prints a table last.
  usage (on the GPU): PYTHONPATH=$PWD python3 experiments/bench_engine_runs.py --cases acceptance --out $OUT/engine_acceptance
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from prr.bench_args import int_list
from prr.cost_model import Variant, map_cell, map_rate_column, predict_token_ms, sparse_layer_count
from prr.intervals import median_ratio_interval
from prr.paths import strict_json_dumps

SELECTORS = ("dense", "exact", "quest", "infllm", "infllm_prr", "less")  # the default matrix's
NAMED_ONLY = ("infllm_v2", "indexer")  # run when named (infllm_v2's blocks are 64 tokens: --blocks 64; the
# indexer selects tokens: --blocks 1, its --topk in tokens)
PREDICTORS = ("none", "last_step", "ema")
OFF = "runtime.dense_metrics_every=1000000"  # the first step only
EVERY_16 = "runtime.dense_metrics_every=16"
NUM_LAYERS = 32  # conf/model/llama-3.1-8b-shape.yaml (the sparse ones: each selector's, prr.cost_model.sparse_layer_count)


@dataclass(frozen=True)
class Setting:
    prompt_tokens: int
    block: int
    topk: int  # selector.topk_blocks

    @property
    def tag(self) -> str:
        return f"{self.prompt_tokens // 1000}k_b{self.block}_k{self.topk}"

    def overrides(self) -> list[str]:
        return [f"task.prompt_tokens={self.prompt_tokens}", f"runtime.block_size={self.block}",
                f"selector.topk_blocks={self.topk}"]


def cases(kind: str, settings: list[Setting] | None = None, selectors: tuple[str, ...] = SELECTORS,
          predictors: tuple[str, ...] = PREDICTORS, hit_rates: tuple[float, ...] = (),
          profiled_hit_rates: tuple[float, ...] = (), reuse_anchors: tuple[int, ...] = (),
          reuse_every: tuple[int, ...] = ()) -> dict[str, list[str]]:
    """name -> overrides. Matrix names are selector-predictor@setting; a single default setting
    (None) keeps the overrides out and the names short (selector-predictor). hit_rates: also
    predictor=bench_hit_rate at each (selector-hit0.7); profiled_hit_rates: that predictor under
    budget=profiled (selector-hit0.9+profiled); reuse_anchors / reuse_every: also serial DSA under
    reuse=layers with reuse.anchors=N (selector-none+anchorsN) / reuse=steps with reuse.every=N
    (selector-none+everyN)."""
    if kind == "acceptance":
        main = ["selector=quest", "predictor=ema", "budget=profiled"]
        return {"serial": ["selector=quest", "predictor=none", OFF], "main": [*main, OFF],
                "serial_dense16": ["selector=quest", "predictor=none", EVERY_16], "main_dense16": [*main, EVERY_16]}
    if kind == "matrix":
        out = {}
        for setting in settings or [None]:
            for selector in selectors:
                for predictor in predictors:
                    name = f"{selector}-{predictor}" + (f"@{setting.tag}" if setting else "")
                    extra = setting.overrides() if setting else []
                    if selector == "dense" and setting:  # dense has no top-K: the block size alone
                        extra = [o for o in extra if not o.startswith("selector.topk_blocks")]
                    if selector == "indexer":  # its top-K is in tokens (one block = one token)
                        extra = [o.replace("selector.topk_blocks=", "selector.topk_tokens=") for o in extra]
                    out[name] = [f"selector={selector}", f"predictor={predictor}", OFF, *extra]
                at = f"@{setting.tag}" if setting else ""
                for rate in hit_rates:
                    out[f"{selector}-hit{rate:g}{at}"] = [f"selector={selector}", *replay(rate), OFF, *extra]
                for anchors in reuse_anchors:
                    out[f"{selector}-none+anchors{anchors}{at}"] = [
                        f"selector={selector}", "predictor=none", "reuse=layers", f"reuse.anchors={anchors}", OFF, *extra]
                for every in reuse_every:
                    out[f"{selector}-none+every{every}{at}"] = [
                        f"selector={selector}", "predictor=none", "reuse=steps", f"reuse.every={every}", OFF, *extra]
                for rate in profiled_hit_rates:
                    out[f"{selector}-hit{rate:g}+profiled{at}"] = [
                        f"selector={selector}", *replay(rate), "budget=profiled", f"budget.hit_rate={rate}",
                        "budget.use_cache=false", OFF, *extra]
        return out
    raise SystemExit(f"--cases {kind!r} is not one of ['acceptance', 'matrix']")


def replay(rate: float) -> list[str]:
    """The overrides of predictor=bench_hit_rate at `rate`."""
    return ["predictor=bench_hit_rate", f"predictor.hit_rate={rate}"]


def serial_of(case: str) -> str:
    """The serial-DSA case a case is compared with (main -> serial, quest-ema -> quest-none,
    quest-ema@32k_b16_k32 -> quest-none@32k_b16_k32)."""
    name, at, setting = case.partition("@")
    serial = name.rsplit("-", 1)[0] + "-none" if "-" in name else name.replace("main", "serial")
    return serial + at + setting


def map_prediction(stage_map: pd.DataFrame, selector: str, context: int, block: int, topk_tokens: int,
                   hit_rate: float, serial_token_ms: float, sparse_layers: int) -> float:
    """What the stage map predicts for a whole PRR run's per-token ms (prr.cost_model: serial_token_ms
    minus sparse_layers x (serial stage - PRR stage at hit_rate) µs), from the batch-1 cell of the
    same selector, block and budget at the context nearest `context`. NaN where the map has no
    such cell or the run no hit rate."""
    cell = map_cell(stage_map, selector, context, block, topk_tokens)
    if cell.empty or not math.isfinite(hit_rate):
        return math.nan
    return predict_token_ms(cell, serial_token_ms, sparse_layers, Variant(speculates=True, hit_rate=hit_rate))


def run_case(name: str, overrides: list[str], args: argparse.Namespace) -> dict:
    run_dir = Path(args.runs) / name.replace("@", "_")
    command = [sys.executable, "run.py", "runtime=cuda", "model=llama-3.1-8b-shape", "logger=none",
               f"task.prompt_tokens={args.prompt_tokens}", f"task.max_new_tokens={args.steps}", "task.stop_at_eos=false",
               f"runtime.dtype={args.dtype}", *overrides, f"hydra.run.dir={run_dir}"]  # (a setting's task.prompt_tokens, later, wins)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    row = {"case": name, "command": " ".join(command[1:]), "rc": proc.returncode, "wall_s": round(wall, 1)}
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        row["error"] = (proc.stderr or proc.stdout)[-2000:]
        print(f"{name}: FAILED rc={proc.returncode}\n{row['error']}", file=sys.stderr)
        return row
    summary = json.loads(summary_path.read_text())
    tokens = run_dir / "records" / "tokens.jsonl"
    if tokens.exists():  # each step's device time (GPU) for the intervals
        row["latencies_ms"] = [1e3 * json.loads(line)["latency_s"] for line in tokens.read_text().splitlines()]
    row["generated_token_ids"] = summary.get("generated_token_ids")
    keep = ("engine", "variant", "device", "torch", "prompt_tokens", "block_size", "topk_blocks", "predicted_blocks",
            "decode_steps",
            "token_latency_median_ms", "token_latency_mean_ms", "token_latency_p90_ms", "hit_rate", "precision",
            "last_step_overlap", "mean_mass_recall", "mean_output_relerr", "budget_setup", "reuse")
    row.update({k: summary.get(k) for k in keep})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="acceptance")
    p.add_argument("--prompt-tokens", type=int, default=32000)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--timeout", type=int, default=240, help="seconds per run")
    p.add_argument("--runs", default="/tmp/prr_engine_runs", help="parent of the runs' directories")
    p.add_argument("--out", required=True, help="results path without suffix (.json, .csv)")
    p.add_argument("--contexts", type=int_list, help="matrix: prompt tokens, e.g. 32000,128000")
    p.add_argument("--blocks", type=int_list, help="matrix: runtime.block_size values, e.g. 16,64")
    p.add_argument("--topk", type=int_list, help="matrix: selector.topk_blocks values, e.g. 32,128")
    p.add_argument("--selectors", type=name_list(SELECTORS + NAMED_ONLY), default=SELECTORS)
    p.add_argument("--predictors", type=name_list(("none", "last_step", "ema", "spin", "ema_membership",
                                                   "ema_calibrated", "query_similarity", "cross_layer")),
                   default=PREDICTORS)
    p.add_argument("--stage-map", help="bench_decode.py's stage CSV: print each PRR row beside its prediction")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="runtime.dtype of every run (a --stage-map must be timed in the same: bench_decode.py --dtype)")
    p.add_argument("--hit-rates", type=rate_list, default=(),
                   help="matrix: also predictor=bench_hit_rate (a benchmark tool) at each rate, e.g. 0.5,0.7,0.9")
    p.add_argument("--reuse-anchors", type=int_list, default=[],
                   help="matrix: also serial DSA under reuse=layers with reuse.anchors=N for each N, e.g. 2,4")
    p.add_argument("--reuse-every", type=int_list, default=[],
                   help="matrix: also serial DSA under reuse=steps with reuse.every=N for each N, e.g. 2,4")
    p.add_argument("--profiled-hit-rates", type=rate_list, default=(),
                   help="matrix: also predictor=bench_hit_rate at each rate under budget=profiled (budget.hit_rate "
                        "the same)")
    args = p.parse_args()
    if args.stage_map and not Path(args.stage_map).is_file():
        p.error(f"--stage-map {args.stage_map}: no such file (bench_decode.py --parts stage writes it)")
    stage_map = pd.read_csv(args.stage_map) if args.stage_map else None  # (read first: a bad path costs no run)
    if stage_map is not None:  # (maps timed before the dtype column: bf16)
        map_dtypes = set(stage_map["dtype"]) if "dtype" in stage_map else {"bfloat16"}
        if map_dtypes != {args.dtype}:
            p.error(f"--stage-map {args.stage_map} was timed in {sorted(map_dtypes)}, the runs in --dtype "
                    f"{args.dtype}: time the map with bench_decode.py --dtype {args.dtype}")
    settings = None
    if args.contexts or args.blocks or args.topk:
        settings = [Setting(c, b, k) for c in args.contexts or [args.prompt_tokens] for b in args.blocks or [16]
                    for k in args.topk or [32]]
    rows = []
    for name, overrides in cases(args.cases, settings, args.selectors, args.predictors, args.hit_rates,
                                 args.profiled_hit_rates, tuple(args.reuse_anchors),
                                 tuple(args.reuse_every)).items():
        rows.append(run_case(name, overrides, args))
        write(rows, args, stage_map)  # after every case: a cut session keeps what ran
    table = write(rows, args, stage_map)
    shown = [c for c in ("case", "variant", "predicted_blocks", "token_latency_median_ms", "median_over_serial",
                         "median_over_serial_lo", "median_over_serial_hi", "hit_rate", "hit_rate_lo", "hit_rate_hi",
                         "tokens_equal_serial", "first_token_difference", "map_predicted_ms", "median_over_map",
                         "map_hit_clamped")
             if c in table]
    print(table[shown].to_string(index=False, float_format=lambda x: f"{x:.3f}"))



def rate_list(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of hit rates") from None
    if any(not 0.0 <= r <= 1.0 for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: every hit rate must lie in [0, 1]")
    return rates


def name_list(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(text.split(","))
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{','.join(bad)} not among {list(allowed)}")
        return names
    return parse


def with_predictions(table: pd.DataFrame, stage_map: pd.DataFrame) -> pd.DataFrame:
    """Adds map_predicted_ms and median_over_map to PRR rows and to rows that reuse selections
    (see the module docstring; prr.cost_model)."""
    by_case = table.set_index("case")
    predicted, outside = [], []
    for row in table.itertuples(index=False):
        serial = serial_of(row.case)
        outside.append(map_hit_outside(stage_map, row))
        at_map_size = int(getattr(row, "predicted_blocks", row.topk_blocks)) == int(row.topk_blocks)  # the map's |P|
        speculates = getattr(row, "variant", None) == "prr"
        selecting = selecting_share(getattr(row, "reuse", None))
        ok = ((speculates and at_map_size) or selecting is not None) and serial in by_case.index \
            and pd.notna(by_case.loc[serial].get("token_latency_median_ms"))
        if not ok:
            predicted.append(math.nan)
            continue
        selector = row.case.split("-", 1)[0]
        layers = run_sparse_layers(selector, row)
        cell = map_cell(stage_map, selector, int(row.prompt_tokens), int(row.block_size),
                        int(row.topk_blocks) * int(row.block_size))
        hit = float(row.hit_rate) if speculates and pd.notna(row.hit_rate) else math.nan
        if cell.empty or (speculates and not math.isfinite(hit)):
            predicted.append(math.nan)
            continue
        variant = Variant(speculates=speculates, hit_rate=hit, **reuse_variant(getattr(row, "reuse", None), layers))
        predicted.append(predict_token_ms(cell, float(by_case.loc[serial, "token_latency_median_ms"]), layers, variant))
    table["map_predicted_ms"] = predicted
    table["median_over_map"] = table["token_latency_median_ms"] / table["map_predicted_ms"]
    table["map_hit_clamped"] = outside  # the run's hit rate lies outside the map's: its nearest rate stood in
    return table


def run_sparse_layers(selector: str, row) -> int:
    """The sparse layers a run's selector has (its YAML's; InfLLM-v2 32, the others 30), checked
    against the run's own count where it has one (a reusing run's selections per step)."""
    layers = sparse_layer_count(selector, NUM_LAYERS)
    reuse, steps = getattr(row, "reuse", None), getattr(row, "decode_steps", None)
    if isinstance(reuse, dict) and reuse.get("selections_made") and steps:
        counted = (reuse["selections_made"] + reuse.get("selections_skipped", 0)) / int(steps)
        if counted != layers:
            raise ValueError(f"{row.case}: the run selected in {counted:g} layers a step, conf/selector/{selector}.yaml "
                             f"leaves {layers} of {NUM_LAYERS} sparse: price it with the run's model and selector config")
    return layers


def reuse_variant(reuse, layers: int) -> dict:
    """prr.cost_model.Variant's reuse fields for a run's summary `reuse` counts over `layers` sparse
    layers: reuse=layers as its anchor count, reuse=steps as one step in `every` (the run's share of
    selecting steps: 24 steps at every 5 select in 5 of them, priced as every 5); {} without reuse."""
    selecting = selecting_share(reuse)
    if selecting is None:
        return {}
    if reuse.get("policy") == "steps":
        return {"reuse": "steps", "every": max(1, round(1 / selecting))}
    return {"reuse": "layers", "anchors": max(1, round(selecting * layers))}


def selecting_share(reuse) -> float | None:
    """The share of sparse-layer steps that selected in a run that reuses selections (its summary's
    reuse counts), None for a run without reuse."""
    if not isinstance(reuse, dict) or not reuse.get("selections_made"):
        return None
    made, skipped = reuse["selections_made"], reuse.get("selections_skipped", 0)
    return made / (made + skipped)


def map_hit_outside(stage_map: pd.DataFrame, row) -> bool | None:
    """Whether the run's measured hit rate lies outside the hit rates the map timed for its selector
    and block (the prediction then takes the nearest one's PRR stage); None for runs without one."""
    hit = getattr(row, "hit_rate", None)
    if hit is None or pd.isna(hit) or getattr(row, "variant", None) != "prr":
        return None
    cell = map_cell(stage_map, row.case.split("-", 1)[0], int(row.prompt_tokens), int(row.block_size),
                    int(row.topk_blocks) * int(row.block_size))
    if cell.empty:
        return None
    rates = cell[map_rate_column(cell)]
    return not rates.min() <= float(hit) <= rates.max()


def write(rows: list[dict], args: argparse.Namespace, stage_map: pd.DataFrame | None = None) -> pd.DataFrame:
    """The table with ratios to serial DSA (and, given the stage map, to its prediction) ->
    <out>.json and <out>.csv."""
    import torch
    import triton

    table = pd.DataFrame(rows)
    by_case = table.set_index("case")
    for col in ("token_latency_median_ms", "token_latency_mean_ms"):
        if col in table:  # each case against serial DSA at the same setting, timed in this session
            base = table["case"].map(serial_of).map(by_case[col])
            table[col.replace("token_latency_", "").replace("_ms", "") + "_over_serial"] = table[col] / base
    if "latencies_ms" in table:
        table = with_intervals(table)
    if stage_map is not None and "variant" in table:
        table = with_predictions(table, stage_map)
    meta = {"command": "python " + " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "driver": torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None,
            "torch": torch.__version__, "triton": triton.__version__, "rows": table.to_dict("records")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(strict_json_dumps(meta, indent=1, default=str))
    table.drop(columns=["budget_setup", "error", "latencies_ms", "generated_token_ids"],
               errors="ignore").to_csv(args.out + ".csv", index=False)
    return table


def with_intervals(table: pd.DataFrame) -> pd.DataFrame:
    """Adds median_over_serial_lo/_hi/_n (bootstrap over steps), hit_rate_lo/_hi/_n (Wilson over
    the selected blocks bench_hit_rate's script counts) and tokens_equal_serial."""
    from prr.intervals import wilson

    by_case = table.set_index("case")
    extra = []
    for row in table.itertuples(index=False):
        out: dict = {}
        serial = serial_of(row.case)
        mine = getattr(row, "latencies_ms", None)
        mine = mine if isinstance(mine, list) else None
        if serial != row.case and serial in by_case.index:
            base = by_case.loc[serial, "latencies_ms"]
            if mine and isinstance(base, list) and base:
                _, lo, hi = median_ratio_interval(mine, base)
                out.update(median_over_serial_lo=lo, median_over_serial_hi=hi, median_over_serial_n=len(mine))
            theirs = by_case.loc[serial, "generated_token_ids"]
            tokens = getattr(row, "generated_token_ids", None)
            if isinstance(theirs, list) and isinstance(tokens, list):
                out["tokens_equal_serial"] = tokens == theirs
                # the first step whose token differs from serial DSA's (a replayed trajectory left there)
                out["first_token_difference"] = next((i for i, (x, y) in enumerate(zip(tokens[0], theirs[0], strict=False))
                                                      if x != y), None)
        setup = getattr(row, "budget_setup", None)
        record = (setup.get("calibration") or {}) if isinstance(setup, dict) else {}
        n, hit = record.get("selected"), getattr(row, "hit_rate", None)
        steps = getattr(row, "decode_steps", None)
        script_hit = record.get("expected_hit_rate")
        if record.get("selected_per_step") and steps is not None and pd.notna(steps):  # the steps the run decoded
            n = sum(record["selected_per_step"][: int(steps)])
            script_hit = sum(record["hits_per_step"][: int(steps)]) / n if n else None
        if n and hit is not None and pd.notna(hit):
            interval = wilson(round(float(hit) * n), int(n))
            out.update(hit_rate_lo=interval.low, hit_rate_hi=interval.high, hit_rate_n=interval.n,
                       script_hit_rate=script_hit)
        extra.append(out)
    return pd.concat([table, pd.DataFrame(extra, index=table.index)], axis=1)


if __name__ == "__main__":
    main()
