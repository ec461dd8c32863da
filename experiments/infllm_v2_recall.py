"""InfLLM-v2's selection training-free against Quest at equal token budgets, on the default model:
attention-mass recall, output error against dense and last-step overlap, in shadow mode (attention
stays dense, so every variant scores the same trajectory of a prompt), every layer sparse.

    python experiments/infllm_v2_recall.py [--out experiments/results/cpu/infllm_v2_recall]
        [--prompts 6] [--prompt-tokens 2048] [--steps 16] [--budgets 512,1024] [--runs-dir DIR]

Prompts: the first --prompts files of PROMPT_FILES (the standard library's own source, read as
text: one prompt each, no tokenizer-free shortcut). Variants (VARIANTS): infllm_v2 (blocks of 64),
Quest over the same 64-token blocks with the same forced blocks (1 initial + 1 local + the newest),
the exact top-K over those blocks (the ceiling of any selector of those units), and Quest over its
paper's 16-token pages (its defaults: 1 sink page + the newest); and infllm_v2 with the paper's
proportions (a third of K local). Budgets are tokens: K = budget / block size. Writes OUT.csv (variant x budget: each rate's mean over prompts with its 95% bootstrap
interval over prompts), OUT_per_prompt.csv and OUT.json (command, device, versions). Each run is an
ordinary run dir under --runs-dir (finished ones are skipped on a re-run: prr's resume rule).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import sysconfig
from pathlib import Path

import pandas as pd
import torch
from hydra import compose, initialize_config_dir

from prr.intervals import means_over_prompts
from prr.paths import strict_json_dumps
from prr.runner import run

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
PROMPT_FILES = ("argparse.py", "typing.py", "inspect.py", "subprocess.py", "tarfile.py", "pydoc.py",
                "datetime.py", "decimal.py" if (STDLIB / "decimal.py").exists() else "string.py")
FORCED_64 = ["selector.sink_blocks=1", "selector.local_blocks=1", "selector.force_newest=true"]
# variant -> (block size, selector overrides)
VARIANTS: dict[str, tuple[int, list[str]]] = {
    "infllm_v2": (64, ["selector=infllm_v2", *FORCED_64]),
    "quest_b64": (64, ["selector=quest", *FORCED_64]),
    "exact_b64": (64, ["selector=exact", *FORCED_64]),
    "quest_b16": (16, ["selector=quest"]),
    # the paper's proportions (sec. 4.1: 1 initial + 32 local of 96 blocks): a third of K local, the
    # newest block included; at K = 8 that is the default's 1 + 1
    "infllm_v2_local_third": (64, ["selector=infllm_v2", "selector.sink_blocks=1", "selector.local_blocks={third}"]),
}
RATES = ("mean_mass_recall", "mean_output_relerr", "last_step_overlap")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/cpu/infllm_v2_recall")
    parser.add_argument("--runs-dir", type=Path, default=Path("multirun/infllm_v2_recall"))
    parser.add_argument("--prompts", type=int, default=6, help=f"how many of {list(PROMPT_FILES)}")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per run")
    parser.add_argument("--budgets", default="512,1024", help="top-K budgets in tokens (multiples of 64)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {list(VARIANTS)}")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not 1 <= args.prompts <= len(PROMPT_FILES):
        parser.error(f"--variants {unknown} not among {list(VARIANTS)}, or --prompts not in 1..{len(PROMPT_FILES)}")
    budgets = [int(x) for x in args.budgets.split(",") if x]
    if any(b % 64 for b in budgets):
        parser.error(f"--budgets {budgets}: each must be a multiple of 64 tokens (one InfLLM-v2 block)")
    rows = []
    for prompt in PROMPT_FILES[: args.prompts]:
        for variant in variants:
            block, selector = VARIANTS[variant]
            for budget in budgets:
                k = budget // block
                overrides = [*(o.format(third=max(k // 3 - 1, 0)) for o in selector), f"selector.topk_blocks={k}", f"runtime.block_size={block}",
                             "selector.dense_layers=[]", "runtime=cpu", "runtime.mode=shadow", "predictor=ema",
                             "budget=fixed", "logger=none", f"task.prompt_file={STDLIB / prompt}",
                             f"task.prompt_tokens={args.prompt_tokens}", f"task.max_new_tokens={args.steps}",
                             "task.stop_at_eos=false"]
                with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                    cfg = compose(config_name="config", overrides=overrides)
                summary = run(cfg, args.runs_dir / f"{Path(prompt).stem}-{variant}-{budget}")
                rows.append({"prompt": prompt, "variant": variant, "budget_tokens": budget, "block_size": block,
                             **{r: summary.get(r) for r in RATES}, "prompt_tokens": summary["prompt_tokens"],
                             "decode_steps": summary["decode_steps"]})
                print(rows[-1], flush=True)
    command = "python " + " ".join(sys.argv)
    per_prompt = pd.DataFrame(rows)
    table = means_over_prompts(per_prompt, ["variant", "budget_tokens", "block_size"], RATES)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.insert(0, "command", command)
    table.to_csv(args.out.with_suffix(".csv"), index=False)
    per_prompt.insert(0, "command", command)
    per_prompt.to_csv(args.out.parent / f"{args.out.name}_per_prompt.csv", index=False)
    record = {"command": command, "device": f"cpu {platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "model": "smollm2-135m", "mode": "shadow", "prompts": list(PROMPT_FILES[: args.prompts]),
              "rows": table.drop(columns=["command"]).to_dict("records")}
    args.out.with_suffix(".json").write_text(strict_json_dumps(record, indent=1) + "\n")
    print(table.drop(columns=["command"]).to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
    main()
