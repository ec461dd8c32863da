"""Experiment presets and sweeps: every preset composes into a resumable sweep; a tiny
submitit_local sweep runs, and re-running it launches nothing and changes no file; an
interrupted sweep re-runs only its unfinished job; SLURM settings reach the launcher."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
TINY = ["model=tiny-random", "logger=none", "selector.dense_layers=[]", "task.prompt_tokens=300",
        "task.max_new_tokens=6", "selector.topk_blocks=6", "runtime=cpu", "backend=torch"]


def compose_preset(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_a_resumable_sweep_of_its_own(name):
    cfg = compose_preset(f"+experiment={name}")
    assert cfg.hydra.sweeper._target_ == "hydra_plugins.prr_resume.resume_sweeper.ResumeSweeper"
    assert cfg.hydra.sweep.dir == f"multirun/{name}"  # a fixed dir: re-launching resumes it
    params = cfg.hydra.sweeper.params
    assert params and all("," in str(v) for v in params.values()), f"{name}: nothing swept: {params}"
    header = (ROOT / "conf" / "experiment" / f"{name}.yaml").read_text().splitlines()[0]
    assert header == "# @package _global_"


def test_the_issue_lists_a_preset_per_figure():
    assert {"locality", "hit_rate_ema", "hit_rate_predictors", "latency_breakdown", "speedup",
            "selector_fidelity", "accuracy"} <= set(PRESETS)


def test_slurm_settings_reach_the_launcher():
    cfg = compose_preset("+experiment=locality", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
                         "hydra.launcher.gpus_per_node=1", "hydra.launcher.timeout_min=90")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.timeout_min) == ("gpu", 1, 90)
    assert launcher.submitit_folder == "multirun/locality/.submitit/%j"  # logs beside the sweep's runs


def test_contiguous_runs():
    from hydra_plugins.prr_resume.resume_sweeper import contiguous_runs

    assert contiguous_runs([0, 1, 3, 4, 5, 7]) == [(0, 2), (3, 6), (7, 8)]
    assert contiguous_runs([]) == []


def snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under folder: mtime (ns) and sha256."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def sweep(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "run.py"), "-m", "+experiment=hit_rate_predictors", *TINY,
               "predictor=last_step,oracle", "budget.ratio=1.0", f"hydra.sweep.dir={tmp_path / 's'}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_tiny_submitit_local_sweep_then_a_rerun_does_no_work_and_changes_no_file(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    first = sweep(tmp_path, "hydra/launcher=submitit_local")
    assert "0 of 2 jobs already complete" in first.stdout
    summaries = [json.loads((tmp_path / "s" / str(i) / "summary.json").read_text()) for i in range(2)]
    assert [s["status"] for s in summaries] == ["complete", "complete"]
    assert summaries[1]["hit_rate"] == 1.0 and summaries[0]["hit_rate"] < 1.0  # oracle, then last_step
    assert list((tmp_path / "s" / ".submitit").iterdir())  # the jobs really went through submitit
    before = snapshot(tmp_path / "s")

    again = sweep(tmp_path, "hydra/launcher=submitit_local")
    assert "2 of 2 jobs already complete" in again.stdout and "launching 0" in again.stdout
    assert snapshot(tmp_path / "s") == before  # no file written, touched, added or removed


def test_an_interrupted_sweep_reruns_only_its_unfinished_job_and_a_changed_config_stops_untouched(tmp_path):
    sweep(tmp_path)  # basic launcher: in-process, quicker
    before = snapshot(tmp_path / "s")
    command = [sys.executable, str(ROOT / "run.py"), "-m", "+experiment=hit_rate_predictors", *TINY,
               "predictor=last_step,ema", "budget.ratio=1.0", f"hydra.sweep.dir={tmp_path / 's'}"]
    changed = subprocess.run(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                             text=True, timeout=600)
    assert changed.returncode == 2 and "Traceback" not in changed.stderr, changed.stderr[-3000:]
    assert changed.stderr.startswith(f"error: {tmp_path / 's' / '1'} holds a finished run of a different config")
    assert snapshot(tmp_path / "s") == before  # refused before launching or writing anything

    job0 = snapshot(tmp_path / "s" / "0")
    # What kill -9 leaves behind: the runner marks a run "running" until it completes.
    (tmp_path / "s" / "1" / "summary.json").write_text(json.dumps({"status": "running"}))
    resumed = sweep(tmp_path)
    assert "1 of 2 jobs already complete" in resumed.stdout and "launching 1" in resumed.stdout
    assert snapshot(tmp_path / "s" / "0") == job0  # the finished run is untouched
    assert json.loads((tmp_path / "s" / "1" / "summary.json").read_text())["status"] == "complete"
