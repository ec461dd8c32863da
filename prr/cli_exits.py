"""How `python run.py` ends when a run does not finish, one convention for all of it:
- a refused input (bad override, invalid config, a run dir holding another config's run)
  exits with code 2 and one line per problem on stderr, `error: ...`;
- a run stopped by a write its storage refused (a full disk, a quota, a file system turned
  read-only) exits with code 2 too, one line naming the file and what summary.json says;
- an interrupted run (Ctrl-C, or SIGTERM, which the runner raises as Terminated) exits with
  code 130 and one line on stderr naming the run dir that keeps its records.
No traceback for either: neither is a bug of prr's, and the line says all there is.
This module imports nothing beyond the standard library: run.py loads it first."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C'd command


class ConfigError(ValueError):
    """Every problem of a refused config, one line each (prr.config_check finds them). Defined
    here, beside the exit it ends in, so that the tasks that raise it import no validator."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's kill, `kill PID`) turned into an exception so the run is marked
    (prr.runner raises it). Defined here, so that run.py can end any run without importing torch."""


def refuse(*problems: str) -> NoReturn:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    sys.exit(EXIT_REFUSED)


_ctrl_c_seen = False


def watch_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt, as Python's own handler does, and is remembered: OmegaConf
    turns a KeyboardInterrupt that lands mid-compose into another error (an AttributeError of its
    half-built node), which the checks before Hydra would report as a refused override."""

    def on_ctrl_c(signum: int, frame: object) -> None:
        global _ctrl_c_seen
        _ctrl_c_seen = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)


def refuse_without_teardown(*problems: str) -> NoReturn:
    """`refuse`, for a process that has started nothing (run.py's checks before Hydra): it exits
    at once (os._exit), skipping the interpreter's teardown, which takes about 0.45 s once torch
    is imported (2-core CPU): nothing is open, no atexit handler of prr's or Hydra's is set.
    After a Ctrl-C (watch_ctrl_c) the problems are the interrupt's wreckage: it ends as a Ctrl-C."""
    if _ctrl_c_seen:
        interrupted(KeyboardInterrupt(), None)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_REFUSED)


# A write the file system refused: the storage, not prr, is at fault, and the run dir tells what was kept
STORAGE_ERRORS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                  errno.EROFS: "the file system is read-only"}


def storage_refused(err: OSError, run_dir: Path) -> str | None:
    """One line for a run stopped by a write its storage refused (a full disk), naming the file
    (or run dir) and what summary.json says now; None for any other OSError."""
    if err.errno not in STORAGE_ERRORS:
        return None
    where = err.filename or run_dir
    return (f"{where}: {err.strerror} ({STORAGE_ERRORS[err.errno]}) while the run was writing; free space there "
            f"or choose another hydra.run.dir, and run again; {summary_state(run_dir)}")


def summary_state(run_dir: Path) -> str:
    """What run_dir/summary.json says of a run that stopped, in words."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError:
        return f"nothing of the run was written to {run_dir}"
    except (OSError, ValueError) as err:
        return f"{run_dir}/summary.json cannot be read ({err})"
    if summary.get("status") == "failed":
        return (f"{run_dir}/summary.json marked failed, records_kept "
                f"{json.dumps(summary.get('records_kept', {}))}")
    return f"{run_dir}/summary.json could not be marked failed and says {summary.get('status')!r}"


def interrupted(err: KeyboardInterrupt, run_dir: Path | None) -> NoReturn:
    """Exit after `err` stopped the run in run_dir (None: no run had begun)."""
    print(f"prr: {interrupt_cause(err)}; {records_left(run_dir)}", file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)


def interrupt_cause(err: KeyboardInterrupt) -> str:
    return str(err) if isinstance(err, Terminated) else "interrupted (Ctrl-C)"


def records_left(run_dir: Path | None) -> str:
    if run_dir is None:
        return "no run was in progress"
    if not (run_dir / "summary.json").is_file():
        return f"the run had not begun; nothing written to {run_dir}"
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("status") != "failed" or "records_kept" not in summary:
        return f"the run had not begun decoding; no records in {run_dir}"
    return (f"records kept in {run_dir} (summary.json: status failed, "
            f"records_kept {json.dumps(summary['records_kept'])})")
