"""Dense accuracy of RULER's tasks from three sources, side by side (issue 20, section 2):

  prr       prr's own RULER-style generators (conf/task/ruler_*.yaml), where one exists
  ruler     task=ruler: RULER's 13 tasks on RULER's data (prr/tasks/ruler.py, `make ruler-data`)
  lm-eval   lm-eval's RULER tasks (niah_single_1, niah_multikey_2, niah_multikey_3, ruler_vt,
            ruler_cwe, ruler_fwe: the six it builds offline) through `prr-lm-eval --model prr`

    python experiments/ruler_agreement.py                      # 4K, SmolLM2-135M, selector=dense, CPU
    python experiments/ruler_agreement.py --samples 4 --tasks niah_single_1,vt

Every source runs selector=dense (predictor=none) on the same model, with the chat template and
RULER's answer prefix after it, greedy, at most --max-new-tokens new tokens (RULER asks for up
to 128; one cap for all three sources keeps a CPU run short: answers come first, and generation
stops at EOS). Writes <out>.json (every sample's prediction and score) and <out>.md (the table,
command, date, versions). lm-eval's tasks need `wonderwords` (lm-eval's `ruler` extra) and read
the model's tokenizer from its converted folder; what stops them is written into the results.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# RULER task -> (prr's own conf/task and overrides, lm-eval task name)
PRR_OWN: dict[str, tuple[str, list[str]] | None] = {
    "niah_single_1": ("ruler_niah", ["task.haystack=noise"]),
    "niah_single_2": ("ruler_niah", ["task.haystack=text"]),
    "niah_single_3": None,  # prr's needles are numbers only
    "niah_multikey_1": ("ruler_niah_multikey", ["task.haystack=text"]),
    "niah_multikey_2": None,  # a haystack of distractor needles: not in prr's generator
    "niah_multikey_3": None,
    "niah_multivalue": ("ruler_niah_multivalue", []),
    "niah_multiquery": ("ruler_niah_multiquery", []),
    "vt": ("ruler_vt", []),
    "cwe": ("ruler_cwe", []),
    "fwe": ("ruler_fwe", []),
    "qa_1": ("ruler_qa", []),  # prr's QA is a cloze over the Python reference, not SQuAD
    "qa_2": None,
}
MODEL: dict[str, Any] = {}  # the model, loaded once for both in-process passes
LM_EVAL = {"niah_single_1": "niah_single_1", "niah_multikey_2": "niah_multikey_2", "niah_multikey_3": "niah_multikey_3",
           "vt": "ruler_vt", "cwe": "ruler_cwe", "fwe": "ruler_fwe"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=",".join(PRR_OWN), help="RULER task names (default: all 13)")
    p.add_argument("--context", type=int, default=4096, help="RULER max_seq_length (prompt + generation)")
    p.add_argument("--samples", type=int, default=2, help="samples per task and source")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sources", default="prr,ruler,lm-eval")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "cpu" / "ruler_agreement"))
    p.add_argument("--report", metavar="JSON", help="only rewrite the markdown from this json (e.g. of a stopped run)")
    return p.parse_args(argv)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "lm_eval", "wonderwords", "nltk"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    from prr.tasks.ruler_data import WHEEL_PINS

    out["ruler_data"] = ", ".join(WHEEL_PINS)
    try:
        out["prr_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                           check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["prr_commit"] = "unknown"
    return out


def in_process(args: argparse.Namespace, tasks: list[str], sources: list[str], result: dict[str, Any],
               save: Any) -> None:
    """prr's own generators and task=ruler, one model load, through prr.evaluation.Engine."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from prr.config_check import validate
    from prr.evaluation import Engine

    common = [f"model={args.model}", "logger=none", "selector=dense", "predictor=none",
              "runtime.dense_metrics_every=1000000"]

    def config(overrides: list[str]) -> Any:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=common + overrides)
        validate(cfg)
        return cfg

    model = MODEL.get(args.model)
    for name in tasks:
        for source in ("prr", "ruler"):
            if source not in sources:
                continue
            if source == "prr":
                own = PRR_OWN[name]
                if own is None:
                    continue
                # prr's generators size the message alone; RULER's max_seq_length also holds the generation
                over = [f"task={own[0]}", *own[1], f"task.context_tokens={args.context - 128}"]
            else:
                over = ["task=ruler", f"task.name={name}", f"task.context_tokens={args.context}"]
            over += [f"task.num_samples={args.samples}", f"task.max_new_tokens={args.max_new_tokens}"]
            cfg = config(over)
            if model is None:
                settings = instantiate(cfg.runtime)
                model = MODEL[args.model] = instantiate(cfg.model).load(settings.dtype, settings.device)
            task = instantiate(cfg.task)
            engine = Engine(cfg, model, args.context + 256)
            rows: list[dict[str, Any]] = []
            engine.log_sample = rows.append  # type: ignore[method-assign]  # keep each sample's row here
            t0 = time.perf_counter()
            metrics = task.evaluate(engine)
            entry = {"accuracy": metrics["accuracy"], "n": metrics["num_samples"], "wall_s": time.perf_counter() - t0,
                     "overrides": over,
                     "samples": [{k: r[k] for k in ("prompt_tokens", "prediction", "answers", "score")} for r in rows]}
            result["results"].setdefault(name, {})[source] = entry
            print(f"{source:7s} {name:16s} accuracy {entry['accuracy']:.3f} (n={entry['n']}, {entry['wall_s']:.0f} s)",
                  flush=True)
            save()


def lm_eval_start(args: argparse.Namespace, tasks: list[str], result: dict[str, Any], save: Any) -> Any:
    """Start prr-lm-eval in its own process (it runs beside the in-process sources) -> (Popen, log, t0) or None."""
    names = [LM_EVAL[t] for t in tasks if t in LM_EVAL]
    if not names:
        return None
    try:
        import wonderwords  # noqa: F401 - lm-eval's niah and cwe generators import it
    except ImportError:
        result["lm_eval_error"] = ("lm-eval's RULER tasks import `wonderwords` (lm-eval's `ruler` extra), which is not "
                                   "installed: pip install wonderwords==3.0.1")
        save()
        return None
    from prr.model import zoo
    from prr.paths import cache_dir

    # lm-eval's RULER tasks size their data with an HF tokenizer: the zoo model's converted folder holds one
    spec = next((v for v in vars(zoo).values() if getattr(v, "name", None) == args.model and hasattr(v, "cache_key")),
                None)
    tokenizer_dir = str(cache_dir() / "models" / spec.cache_key) if spec is not None else args.model
    out_dir = lm_eval_dir(args)
    model_args = (f"model={args.model},selector=dense,predictor=none,runtime.dense_metrics_every=1000000,"
                  f"max_length={args.context}")
    cmd = ["prr-lm-eval", "--model", "prr", "--model_args", model_args, "--tasks", ",".join(names),
           "--limit", str(args.samples), "--apply_chat_template",
           "--gen_kwargs", f"max_gen_toks={args.max_new_tokens}",
           "--metadata", json.dumps({"tokenizer": tokenizer_dir, "max_seq_lengths": [args.context]}),
           "--output_path", str(out_dir), "--log_samples", "--seed", "0"]
    result["lm_eval_command"] = shlex.join(cmd)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    print("lm-eval:", result["lm_eval_command"], flush=True)
    log = open(args.out + "_lm_eval.log", "w")  # noqa: SIM115 - closed in lm_eval_finish
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log, time.perf_counter()


def lm_eval_dir(args: argparse.Namespace) -> Path:
    """lm-eval's own output (its results and per-sample files) goes to the git-ignored outputs/:
    the scores it holds are copied into this script's results file, which records the command."""
    return ROOT / "outputs" / (Path(args.out).name + "_lm_eval")


def lm_eval_finish(args: argparse.Namespace, tasks: list[str], started: Any, result: dict[str, Any], save: Any) -> None:
    proc, log, t0 = started
    returncode = proc.wait()
    log.close()
    result["lm_eval_wall_s"] = time.perf_counter() - t0
    log_path = Path(args.out + "_lm_eval.log")
    output = strip_progress(log_path.read_text())
    log_path.write_text(output)  # kept beside the results, without its progress bars
    out_dir = lm_eval_dir(args)
    if returncode != 0:
        tail = output.strip().splitlines()[-15:]
        result["lm_eval_error"] = f"prr-lm-eval exited {returncode}: " + " | ".join(tail)
        save()
        return
    files = sorted(out_dir.rglob("results_*.json"))
    if not files:
        result["lm_eval_error"] = "prr-lm-eval wrote no results file; output tail: " + " | ".join(
            output.strip().splitlines()[-10:])
        save()
        return
    lm = json.loads(files[-1].read_text())
    for name in tasks:
        if name not in LM_EVAL:
            continue
        values = lm["results"].get(LM_EVAL[name], {})
        acc = values.get(f"{args.context},none")
        samples = []
        for f in sorted(out_dir.rglob(f"samples_{LM_EVAL[name]}_*.jsonl")):
            for line in f.read_text().splitlines():
                s = json.loads(line)
                resp = s.get("filtered_resps") or s.get("resps")
                pred = resp[0] if isinstance(resp, list) and resp else resp
                pred = pred[0] if isinstance(pred, list) else pred
                samples.append({"prediction": pred, "answers": s.get("target"),
                                "score": s.get(str(args.context))})
        result["results"].setdefault(name, {})["lm-eval"] = {
            "accuracy": acc, "n": len(samples) or lm.get("n-samples", {}).get(LM_EVAL[name], {}).get("effective"),
            "task": LM_EVAL[name], "samples": samples}
    save()


def strip_progress(text: str) -> str:
    """lm-eval's log without tqdm's progress bars (carriage-return updates, "NN%|" lines)."""
    lines = (line.rsplit("\r", 1)[-1] for line in text.splitlines())
    return "".join(line + "\n" for line in lines if line.strip() and "%|" not in line)


def fmt(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "not run"
    if entry.get("accuracy") is None:
        return "–"
    return f"{entry['accuracy']:.2f} (n={entry['n']})"


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [f"# RULER agreement: dense accuracy at {a['context']} tokens, {a['model']}", "",
             f"- command: `{result['command']}`", f"- date: {result['date']}", f"- machine: {result['machine']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
             f"- every source: selector=dense, predictor=none, chat template + RULER's answer prefix, greedy, "
             f"at most {a['max_new_tokens']} new tokens, {a['samples']} samples per task",
             f"- wall time: {result.get('wall_s', 0):.0f} s", *([f"- {result['note']}"] if result.get("note") else []), "",
             "| RULER task | prr's own generator | RULER data (task=ruler) | lm-eval (prr-lm-eval --model prr) |",
             "| --- | --- | --- | --- |"]
    for name in a["tasks"]:
        r = result["results"].get(name, {})
        own = PRR_OWN.get(name)
        own_cell = fmt(r.get("prr")) + (f" `{own[0]}`" if own and r.get("prr") else "") if own else "no counterpart"
        lm_cell = fmt(r.get("lm-eval")) if name in LM_EVAL else "not built offline by lm-eval"
        lines.append(f"| {name} | {own_cell} | {fmt(r.get('ruler'))} | {lm_cell} |")
    lines.append("")
    if result.get("lm_eval_command"):
        lines += [f"lm-eval command: `{result['lm_eval_command']}`", ""]
    if result.get("lm_eval_error"):
        lines += [f"**lm-eval did not run**: {result['lm_eval_error']}", ""]
    lines += ["Accuracy is RULER's string match (all answers for niah/vt/cwe/fwe, any answer for qa), the mean over "
              "samples. Each sample's prompt, prediction and score are in the json beside this file.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:
        report = json.loads(Path(args.report).read_text())
        Path(args.report).with_suffix(".md").write_text(markdown(report))
        return
    tasks = args.tasks.split(",")
    bad = [t for t in tasks if t not in PRR_OWN]
    if bad:
        raise SystemExit(f"--tasks {bad}: not RULER tasks ({', '.join(PRR_OWN)})")
    sources = args.sources.split(",")
    import torch

    result: dict[str, Any] = {
        "command": shlex.join(["python", "experiments/ruler_agreement.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} cpu, torch threads {torch.get_num_threads()}",
        "versions": versions(), "args": {**vars(args), "tasks": tasks, "sources": sources}, "results": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def save() -> None:
        from prr.paths import strict_json_dumps  # prr is importable once ROOT is on sys.path

        result["wall_s"] = time.perf_counter() - t0
        out.with_suffix(".json").write_text(strict_json_dumps(result, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(markdown(result))

    # lm-eval in its own process, beside the in-process sources (the six tasks it builds run first here too)
    started = lm_eval_start(args, tasks, result, save) if "lm-eval" in sources else None
    first, rest = [t for t in tasks if t in LM_EVAL], [t for t in tasks if t not in LM_EVAL]
    # then RULER's other tasks on RULER's data, then prr's own counterparts of those
    for chunk, chunk_sources in ((first, sources), (rest, [s for s in sources if s == "ruler"]),
                                 (rest, [s for s in sources if s == "prr"])):
        if {"prr", "ruler"} & set(chunk_sources):
            in_process(args, chunk, chunk_sources, result, save)
    if started is not None:
        lm_eval_finish(args, tasks, started, result, save)
    save()
    print(markdown(result))


if __name__ == "__main__":
    main()
