"""Whole runs through the Hydra config and the runner: the acceptance properties of the
pipeline (oracle hits everything, none predicts nothing, exact repair is serial DSA and
token-identical, the dense selector decodes like plain dense attention), the CLI's
outputs and its errors."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from prr.model.dense import DenseAttention
from prr.model.loading import load_model
from prr.runner import run

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny-random", "logger=none", "selector.dense_layers=[]", "task.prompt_tokens=300",
        "task.max_new_tokens=12", "task.stop_at_eos=false", "selector.topk_blocks=6", "runtime.block_size=16"]


def run_tiny(tmp_path, *overrides, name="run"):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        base = [o for o in TINY if not ("selector=dense" in overrides and o.startswith("selector."))]
        cfg = compose(config_name="config", overrides=[*base, *overrides])
    return run(cfg, tmp_path / name)


def test_oracle_hit_rate_is_exactly_one(tmp_path):
    assert run_tiny(tmp_path, "predictor=oracle")["hit_rate"] == 1.0


def test_none_predicts_nothing(tmp_path):
    summary = run_tiny(tmp_path, "predictor=none")
    assert summary["mean_predicted_blocks"] == 0 and summary["hit_rate"] == 0.0


@pytest.mark.parametrize("predictor", ["last_step", "ema", "oracle"])
def test_exact_repair_is_serial_dsa_and_token_identical(tmp_path, predictor):
    serial = run_tiny(tmp_path, "predictor=none", name="serial")
    prr = run_tiny(tmp_path, f"predictor={predictor}", "runtime.check_serial=true", name=predictor)
    assert prr["max_serial_relerr"] <= 1e-5
    assert prr["generated_token_ids"] == serial["generated_token_ids"]
    assert 0 < prr["hit_rate"] <= 1


def test_dense_selector_generates_plain_dense_tokens(tmp_path):
    summary = run_tiny(tmp_path, "selector=dense", "predictor=none")
    model = load_model("tiny-random")
    from prr.tasks.long_text import LongTextTask

    ids = LongTextTask(prompt_tokens=300).build(None, model.config.vocab_size, 1).input_ids
    backend = DenseAttention(model.config.num_layers)
    tokens = []
    with torch.inference_mode():
        logits = model.decoder(ids, 0, backend)[:, -1]
        for step in range(12):
            token = logits.argmax(-1)
            tokens.append(int(token))
            logits = model.decoder(token[:, None], ids.shape[1] + step, backend)[:, -1]
    assert summary["generated_token_ids"][0] == tokens
    assert summary["mean_output_relerr"] < 1e-5


def test_shadow_mode_keeps_dense_trajectory(tmp_path):
    dense = run_tiny(tmp_path, "selector=dense", "predictor=none", name="dense")
    shadow = run_tiny(tmp_path, "runtime.mode=shadow", "selector.topk_blocks=2", name="shadow")
    assert shadow["generated_token_ids"] == dense["generated_token_ids"]
    assert shadow["mean_mass_recall"] < 1.0  # the selector was measured, not obeyed


def test_run_directory_outputs(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="prr")
    # stage_check=false: the eager runtime's stage check would choose |P| = 0 untimed (test_front_door)
    summary = run_tiny(tmp_path, "predictor=ema", "budget=profiled", "budget.use_cache=false", "budget.stage_check=false")
    out = tmp_path / "run"
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["status"] == "complete" and on_disk["hit_rate"] == summary["hit_rate"]
    steps = pd.read_json(out / "records" / "steps.jsonl", lines=True)
    # one row per (step, sparse layer, batch row, KV head)
    assert len(steps) == 12 * 2 * 1 * 2
    assert {"hit_rate", "precision", "misses", "waste", "overlap", "mass_recall", "t_select_s"} <= set(steps.columns)
    assert (out / "config.yaml").exists() and (out / "layers.csv").exists()
    setup = summary["budget_setup"]
    assert setup["profile_table"] and setup["profile_source"] == "measured" and setup["profile_spread"] >= 1
    assert setup["profile_choice"] == {str(c): n for c, n in setup["profile_table"]}
    assert [r for r in caplog.records if "budget=profiled: |P| per context" in r.getMessage()]  # said on the console


def cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_runs_and_writes_summary(tmp_path):
    done = cli(*TINY, f"hydra.run.dir={tmp_path / 'cli'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hit rate" in done.stdout
    assert json.loads((tmp_path / "cli" / "summary.json").read_text())["status"] == "complete"


def test_cli_bad_input_fails_before_loading(tmp_path):
    # Every problem at once, found before torch is imported (the runtime group's values too; only its
    # cross-checks with the device and the engine come after torch, in a second round).
    bad = ["selector.topk_blocks=0", "predictor.alpha=1.5", "runtime.block_size=3", "runtime.mode=dense"]
    done = cli(*TINY, *bad, f"hydra.run.dir={tmp_path / 'bad'}", cwd=tmp_path)
    assert done.returncode == 2
    for value in ("topk_blocks=0", "alpha=1.5", "block_size=3", "mode='dense'"):
        assert value in done.stderr, value
    assert [line[:7] for line in done.stderr.splitlines()] == ["error: "] * 4  # one line per problem
    assert not (tmp_path / "bad").exists()  # Hydra made it; refused before writing anything, it is removed
    done = cli("selector=nope", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("error: selector=nope: selector has no option 'nope'")


def test_cli_refuses_a_binary_or_empty_prompt_file_in_one_line_before_loading(tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    for task, prompt in ((["task.prompt_file=" + str(binary)], binary),
                         (["task=perplexity", "task.context_tokens=256", "task.score_tokens=8", "task.num_samples=1",
                           "task.prompt_file=" + str(empty)], empty)):
        base = [o for o in TINY if not (task[0] == "task=perplexity" and o.startswith("task."))]
        done = cli(*base, *task, f"hydra.run.dir={tmp_path / 'bad'}", cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        problems = done.stderr.splitlines()
        assert len(problems) == 1 and problems[0].startswith(f"error: task: task.prompt_file='{prompt}' "), done.stderr
        assert not (tmp_path / "bad" / "summary.json").exists()


def test_default_model_short_run(tmp_path):
    """The real SmolLM2 model, a short prompt: the default path works end to end."""
    done = cli("logger=none", "task.prompt_tokens=1024", "task.max_new_tokens=8", f"hydra.run.dir={tmp_path / 'smol'}",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "smol" / "summary.json").read_text())
    assert summary["model"] == "smollm2-135m" and summary["decode_steps"] >= 1
    assert 0 < summary["hit_rate"] <= 1 and 0 < summary["mean_mass_recall"] <= 1 + 1e-6
    assert (tmp_path / "smol" / "generation.txt").read_text().strip()


@pytest.mark.slow
def test_main_command_on_default_model(tmp_path):
    """The README's main command with default settings (about a minute on 2 cores)."""
    done = cli("selector=quest", "predictor=ema", "budget=profiled", "logger=none", f"hydra.run.dir={tmp_path / 'main'}",
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "main" / "summary.json").read_text())
    for key in ("hit_rate", "last_step_overlap", "mean_mass_recall", "t_select_us", "t_speculate_us", "t_repair_us"):
        assert key in summary
    assert "hit rate" in done.stdout and "stage time" in done.stdout
