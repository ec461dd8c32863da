"""What `python run.py` checks before Hydra starts a job, cheapest first, so that bad input is
refused in one line per problem before any work (prr/cli_exits.py: exit code 2):

1. the command line: flags, group options, keys (prr.override_check: Hydra and OmegaConf only);
2. paths: the run or sweep dir can be written, PRR_CACHE_DIR is a directory, and can be written
   where a model's first conversion goes (no torch yet);
3. values that need no torch: every job's model, selector, predictor, budget, task and logger
   against their torch-free classes and each other (prr.config_check.problems_before_torch);
4. `runtime=auto` (the default) becomes runtime=cuda when torch sees a GPU, else runtime=cpu;
5. values: every job's config validated against its classes and the model (prr.config_check),
   the runtime and backend groups included; steps 4 and 5 import torch.

Nothing here writes a file. `preflight` returns the command line to hand Hydra and the line
that says what runtime=auto chose (None when the command chose a runtime itself)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from prr.config_check import ConfigError, problems_before_torch
from prr.model.describe import pending_conversion
from prr.override_check import BadOverride, check_command_line
from prr.paths import cache_dir, cache_dir_problem


def preflight(argv: list[str], conf_dir: Path, config_name: str = "config") -> tuple[list[str], str | None]:
    """argv: run.py's arguments. Raises BadOverride or ConfigError (every problem found)."""
    jobs = check_command_line(argv, conf_dir, config_name)
    if jobs is None or {"--cfg", "-c"} & set(argv):  # Hydra's help, information, or the config printed
        return argv, None
    multirun = "-m" in argv or "--multirun" in argv
    problems = path_problems(jobs[0], multirun)
    for job in jobs[1:]:  # a swept model (its first conversion) too
        problem = conversion_problem(job)
        if problem and problem not in problems:
            problems.append(problem)
    if problems:
        raise ConfigError(problems)
    for job in jobs:  # checks 1-3 take well under a second; importing torch alone takes 1-1.5 s on 2 cores
        problems = problems_before_torch(job)
        if problems:
            raise ConfigError(problems)  # the first bad job's, as `validate` below reports them
    # numpy before torch: torch's C code imports numpy and swallows a Ctrl-C that lands there, leaving
    # numpy half-imported (a traceback later instead of exit code 130); a Python import lets it through
    import numpy  # noqa: F401

    chosen = None
    if any(OmegaConf.select(job, "hydra.runtime.choices.runtime") == "auto" for job in jobs):
        choice, why = auto_runtime()
        argv = with_runtime(argv, choice)
        chosen = f"prr: runtime=auto chose runtime={choice} ({why})"
        if choice != "cpu":  # conf/runtime/auto.yaml is runtime=cpu: only another choice composes again
            jobs = check_command_line(argv, conf_dir, config_name) or []
    from prr.config_check import validate  # imports torch and the configured classes

    for job in jobs:
        validate(job)
    return argv, chosen


def with_runtime(argv: list[str], choice: str) -> list[str]:
    """argv choosing runtime=<choice>: `auto` replaced where the command names it (`runtime=auto`, or
    one value of a sweep's `runtime=auto,cpu`), else the override put before the first override
    (argparse takes overrides in one run: `a=1 -m` must not become `a=1 -m b=2`)."""
    line = f"runtime={choice}"
    if any(a.startswith("runtime=") for a in argv):
        return ["runtime=" + ",".join(choice if v == "auto" else v for v in a.removeprefix("runtime=").split(","))
                if a.startswith("runtime=") else a for a in argv]
    first = next((i for i, a in enumerate(argv) if not a.startswith("-") and ("=" in a or a.startswith("~"))), None)
    return [*argv, line] if first is None else [*argv[:first], line, *argv[first:]]


def auto_runtime() -> tuple[str, str]:
    """('cuda' | 'cpu', why): cuda when this torch sees a GPU."""
    import torch

    if torch.cuda.is_available():
        return "cuda", f"torch {torch.__version__} sees {torch.cuda.get_device_name(0)}"
    return "cpu", f"torch {torch.__version__} sees no GPU"


def path_problems(job: DictConfig, multirun: bool) -> list[str]:
    """The run dir (sweep dir for -m) must be, or be creatable as, a writable directory, and
    PRR_CACHE_DIR (when set) a directory: checked here rather than met as an OSError mid-run."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        value = str(OmegaConf.select(job, key))
    except Exception:  # noqa: BLE001 - an interpolation only Hydra's job context resolves: Hydra checks it
        return []
    if not value.strip():  # Path("") is the current dir: the run's files would land among the user's
        return [f"{key}={value!r} is empty, which would write the run's files into the current directory "
                f"({Path.cwd()}); give a directory, or leave {key} out for its default"]
    where = Path(value).expanduser()
    problems = [p for p in [unwritable_dir(where, key), cache_dir_problem() or conversion_problem(job)] if p]
    return problems


def conversion_problem(job: DictConfig) -> str | None:
    """Why the model's first conversion cannot be written into prr's cache (an existing cache dir
    that is read-only or immutable: a cache already holding the conversion may be), or None."""
    name, cache = OmegaConf.select(job, "model.name_or_path"), OmegaConf.select(job, "model.cache_dir")
    if not isinstance(name, str):
        return None
    pending = pending_conversion(name, cache)
    if pending is None:
        return None
    refused = why_unwritable(pending)
    if refused is None:
        return None
    folder, reason = refused
    source = (f"model.cache_dir={cache!r}" if cache else f"PRR_CACHE_DIR={os.environ['PRR_CACHE_DIR']!r}"
              if os.environ.get("PRR_CACHE_DIR") else f"the cache dir {cache_dir()}")
    return (f"{source}: {folder} cannot be written ({reason}), and model {name!r} is not converted there yet "
            f"(its first run writes {pending}); point PRR_CACHE_DIR at a writable directory")


def unwritable_dir(path: Path, key: str) -> str | None:
    """Why `path` (a dir prr will create or write into) cannot be written, or None. Tried by
    creating and removing an empty dir in it (permissions, a read-only file system and the
    immutable attribute all show; access() does not see the last two for root); the folder's
    times are put back, so a folder left empty keeps looking as old as it is."""
    refused = why_unwritable(path, inside=(".hydra", "records", "wandb"))
    if refused is None:
        return None
    folder, reason = refused
    if reason == "a file":
        return f"{key}={str(path)!r}: {folder} is a file, not a directory; choose another {key}"
    return f"{key}={str(path)!r}: {folder} cannot be written ({reason}); choose another {key}"


def why_unwritable(path: Path, inside: tuple[str, ...] = ()) -> tuple[Path, str] | None:
    """(the folder, the reason) where `path` (a dir to create or write into; `inside`: its subdirs
    written too, where they exist) cannot be written, the reason "a file" where a file stands on
    the way; None when it can be."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return existing, "a file"
    folders = [existing] + ([existing / d for d in inside if (existing / d).is_dir()] if existing == path else [])
    for folder in folders:
        error = write_probe(folder)
        if error:
            return folder, error
    return None


def write_probe(folder: Path) -> str | None:
    """None when a dir can be made (and is removed) in folder, else the OS's reason."""
    times = folder.stat()
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".prr-write-probe-", dir=folder))
    except OSError as err:
        return err.strerror or type(err).__name__
    with contextlib.suppress(OSError):
        os.utime(folder, ns=(times.st_atime_ns, times.st_mtime_ns))
    return None


__all__ = ["BadOverride", "ConfigError", "preflight"]
