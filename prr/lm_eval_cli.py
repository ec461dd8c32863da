"""`prr-lm-eval`'s entry point: lm-eval is an extra (`make install`; `make run` installs no
lm-eval), so it is looked for first and, when missing, named in one line (exit status 2)
instead of an import traceback. A --tasks name that no task YAML mentions (lm-eval's, prr's
local tasks, --include_path's) is refused next, in about a second: lm-eval's import and task
index take 30-40 s on a loaded 2-core machine before lm-eval says so itself. Then
prr.lm_eval_model.main runs lm-eval's CLI."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

LOCAL_TASKS = Path(__file__).resolve().parent / "tasks" / "lm_eval_tasks"  # prr.lm_eval_model's, without its imports


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        print("prr-lm-eval: error: lm-eval is not installed: `make install` adds it (or pip install -e '.[eval]')",
              file=sys.stderr)
        sys.exit(2)
    missing = unmentioned_tasks(args, [Path(spec.origin).parent / "tasks", LOCAL_TASKS, *flag_values(args, "--include_path")])
    if missing:
        hint = "" if flag_values(args, "--model") else " (and no --model prr: lm-eval's default model would run)"
        print(f"prr-lm-eval: error: Tasks not found: {', '.join(missing)}: no task YAML of lm-eval's, prr's or "
              f"--include_path's names them (`prr-lm-eval ls tasks` lists the tasks){hint}", file=sys.stderr)
        sys.exit(2)
    from prr.lm_eval_model import main as lm_eval_main

    lm_eval_main(argv)


def flag_values(args: list[str], flag: str) -> list[str]:
    """The values given to `flag` (`--flag v` or `--flag=v`) in args."""
    values = []
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            values.append(args[i + 1])
        elif arg.startswith(flag + "="):
            values.append(arg.partition("=")[2])
    return values


def unmentioned_tasks(args: list[str], roots: list[Path | str]) -> list[str]:
    """The --tasks names that appear in no YAML file under roots: certainly not tasks, groups or
    tags (lm-eval defines each in a YAML file). Only a conservative test: a name that appears
    somewhere is left to lm-eval, as are patterns (niah*) and paths to a task file."""
    names = [n for value in flag_values(args, "--tasks") for n in value.split(",") if n.strip()]
    todo = {n.strip() for n in names if not any(c in n for c in "*?[") and not os.path.exists(n.strip())}
    for root in roots:
        for folder, _, files in os.walk(root):
            for file in files:
                if not todo:
                    return []
                if file.endswith((".yaml", ".yml")):
                    with open(os.path.join(folder, file), "rb") as handle:
                        text = handle.read()
                    todo = {n for n in todo if n.encode() not in text}
    return sorted(todo)
