"""One run of the main command: validate, resume or refuse by the run dir, write the config and
provenance, then the run itself through the run driver (prr/driver.py), status kept in summary.json.

Run directory layout (Hydra's run dir):
  config.yaml              resolved config
  provenance.json          git commit and dirty flag, package versions, CPU/GPU model, argv, and the inputs:
                           the weights' sha256 (prr_source.json's record) and the prompt file's
  summary.json             run-level numbers; status running -> complete | failed
  records/steps.jsonl      one row per (decode step, layer, batch row, KV head), flushed per step
  records/tokens.jsonl     one row per decode step: token, latency
  layers.csv               per-layer aggregates
  generation.txt           the prompt's description and the generated text
  .hydra/                  Hydra's record of the job (config, hydra.yaml, overrides), when Hydra launched it
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from prr import driver
from prr.cli_exits import Terminated
from prr.config_check import validate
from prr.evaluation import is_evaluation_task
from prr.paths import write_json_atomic, write_text_atomic
from prr.provenance import provenance
from prr.sinks import NoLogger


class RunDirTaken(FileExistsError):
    """The run dir holds a finished run of another config: refused, never overwritten."""


class RunDirBusy(RunDirTaken):
    """Another process is running into the run dir now (it holds the dir's lock)."""


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on run_dir (created if missing) for a run, or raise RunDirBusy.
    The lock is flock(2) on the directory itself, so no lock file is added to a run dir that a
    refused or skipped run must leave as it was; the kernel drops it when the process ends,
    however it ends (kill -9 included), so a dead run never keeps its dir locked."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusy(f"{run_dir} is being written by another prr run right now (it holds the dir's lock); "
                             "wait for that run to end, or choose another hydra.run.dir (or hydra.sweep.dir)") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def finished_run(run_dir: Path, config_yaml: str) -> dict[str, Any] | None:
    """The summary of a complete run of this config in run_dir, if there is one.

    This is how sweeps resume: re-launched into the same directory, finished jobs are
    skipped and unfinished ones (running/failed) run again. A run of another config,
    finished or not, is never overwritten (RunDirTaken)."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return None
    summary = json.loads(summary_path.read_text())
    config_path = run_dir / "config.yaml"
    same = config_path.is_file() and config_path.read_text() == config_yaml
    if summary.get("status") != "complete":
        if config_path.is_file() and not same:  # its records are kept for a rerun of its own config only
            raise RunDirTaken(f"{run_dir} holds an unfinished run (status {summary.get('status')!r}) of a different "
                              "config, whose records prr never overwrites; choose another hydra.run.dir (or "
                              "hydra.sweep.dir), or run its own config again there to redo it")
        return None
    if not same:
        raise RunDirTaken(f"{run_dir} holds a finished run of a different config, which prr never overwrites; "
                          "choose another hydra.run.dir (or hydra.sweep.dir)")
    return summary


def write_hydra_record(run_dir: Path, cfg: DictConfig, hydra_cfg: DictConfig) -> None:
    """Hydra's record of a job in run_dir/.hydra, the three files Hydra itself writes when
    hydra.output_subdir is set. conf/config.yaml sets it to null so that they are written
    here, only once the run goes ahead: Hydra would write them before the job starts, over
    the record of a finished run that the job then refuses or skips (and results_store reads
    the run's group choices from .hydra/hydra.yaml)."""
    record = run_dir / ".hydra"
    write_text_atomic(record / "config.yaml", OmegaConf.to_yaml(cfg))
    write_text_atomic(record / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra_cfg}))
    write_text_atomic(record / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.overrides.task))


def run(cfg: DictConfig, run_dir: Path, hydra_cfg: DictConfig | None = None) -> dict[str, Any]:
    """hydra_cfg: the job's Hydra settings (HydraConfig.get()) when Hydra launched it,
    recorded in run_dir/.hydra once the run goes ahead."""
    validate(cfg)  # every problem at once, before anything loads
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    if worker_rank(cfg):  # a tensor-parallel rank other than 0: computes, writes nothing of the run
        done = finished_run(run_dir, config_yaml)  # skips or refuses as rank 0 does (rank 0 holds the lock)
        return done if done is not None else run_as_worker(cfg)
    with run_dir_lock(run_dir):  # a second run into this dir at the same time is refused (RunDirBusy)
        done = finished_run(run_dir, config_yaml)
        if done is not None:
            print(f"prr: {run_dir} already holds this run, complete; skipped")
            return done
        return run_locked(cfg, run_dir, config_yaml, hydra_cfg)


def run_locked(cfg: DictConfig, run_dir: Path, config_yaml: str, hydra_cfg: DictConfig | None) -> dict[str, Any]:
    """`run` once the run goes ahead in run_dir, whose lock this process holds."""
    if hydra_cfg is not None:
        write_hydra_record(run_dir, cfg, hydra_cfg)
    write_text_atomic(run_dir / "config.yaml", config_yaml)
    write_json_atomic(run_dir / "provenance.json", provenance(cfg))  # commit (dirty?), versions, machine, inputs
    write_json_atomic(run_dir / "summary.json", {"status": "running"})
    logger = instantiate(cfg.logger)
    ok = False
    try:
        logger.start(run_dir, OmegaConf.to_container(cfg, resolve=True), name=run_name(cfg))  # its failure: failed too
        with terminate_as_interrupt():
            # Scored tasks (many requests: accuracy, perplexity, lm-eval) are scored; the others
            # decode the task's prompt (runtime.engine: eager or graph).
            if is_evaluation_task(instantiate(cfg.task)):
                summary = driver.score(cfg, run_dir, logger)
            else:
                summary = driver.decode(cfg, run_dir, logger)
        ok = True
        return summary
    except BaseException as err:
        # Mark the run incomplete; the per-step records already flushed stay as they are.
        try:
            write_json_atomic(run_dir / "summary.json", {
                "status": "failed", "error": f"{type(err).__name__}: {err}",
                "records_kept": {p.name: count_lines(p) for p in sorted((run_dir / "records").glob("*.jsonl"))},
            })
        except OSError as unwritten:  # a full disk refuses this too: the run's own error is the one to report,
            # and summary.json still says "running" (never "complete"), which run.py's line states
            err.add_note(f"summary.json could not be marked failed: {unwritten}")
        raise
    finally:
        logger.finish(ok)


def worker_rank(cfg: DictConfig) -> int:
    """This process's rank under runtime.tensor_parallel > 1 (torchrun's RANK), else 0."""
    return int(os.environ.get("RANK", "0")) if cfg.runtime.get("tensor_parallel", 1) > 1 else 0


def run_as_worker(cfg: DictConfig) -> dict[str, Any]:
    """A tensor-parallel rank > 0: the same decode in a private temporary directory, no logger,
    no log file, so only rank 0 writes the run dir (and its W&B run)."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        root.removeHandler(handler)
    with tempfile.TemporaryDirectory(prefix=f"prr-rank{worker_rank(cfg)}-") as scratch:
        return driver.decode(cfg, Path(scratch), NoLogger())


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(f"terminated by signal {signum} ({signal.Signals(signum).name})")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.endswith(b"\n"))


def run_name(cfg: DictConfig) -> str:
    return "-".join(OmegaConf.select(cfg, f"{g}._target_").rsplit(".", 1)[-1] for g in ("selector", "predictor", "budget"))
