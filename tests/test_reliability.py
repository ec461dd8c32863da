"""Faults and bad inputs, tried: each gets a clear error, and nothing already written is lost.
(docs/reliability.md lists them with what the user sees.)"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

import prr.paths
from prr.model.loading import CorruptModelFile, load_model
from prr.results_store import hydra_choices, run_row
from prr.runner import run
from prr.sinks import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny-random", "logger=none", "selector.dense_layers=[]", "task.prompt_tokens=300",
        "task.max_new_tokens=10", "task.stop_at_eos=false", "selector.topk_blocks=6"]


def tiny_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[*TINY, *overrides])


# --- corrupt model files --------------------------------------------------------------------
@pytest.fixture
def converted_dir(tmp_path):
    """A tiny HF safetensors dir with the checksum record prr writes when it converts weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    (tmp_path / "m" / "prr_source.json").write_text(json.dumps({"sha256": {"model.safetensors": digest}}))
    return tmp_path / "m"


def test_intact_converted_weights_load(converted_dir):
    assert load_model(str(converted_dir)).config.num_layers == 2


def corrupt(weights, how):
    data = weights.read_bytes()
    if how == "flipped byte":
        weights.write_bytes(data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:])
    elif how == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.write_bytes(b"\xff" * 64)


CORRUPTIONS = {"flipped byte": "checksum mismatch", "truncated": "model.safetensors", "garbage": "not a safetensors file"}


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_corrupt_file_in_the_users_own_model_dir_is_named_and_never_to_be_deleted(converted_dir, how):
    corrupt(converted_dir / "model.safetensors", how)
    with pytest.raises(CorruptModelFile, match=CORRUPTIONS[how]) as err:
        load_model(str(converted_dir))
    assert str(err.value).startswith(str(converted_dir / "model.safetensors"))
    assert "delete" not in str(err.value)


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_corrupt_file_in_prrs_conversion_cache_is_named_with_its_dir_to_delete(converted_dir, tmp_path, monkeypatch,
                                                                              how):
    from prr.model.loading import gguf_cache_path

    monkeypatch.setenv("PRR_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # never read: its conversion is already in the cache
    cached = gguf_cache_path(gguf, prr.paths.cache_dir())
    shutil.copytree(converted_dir, cached)  # what a finished conversion leaves there
    corrupt(cached / "model.safetensors", how)
    with pytest.raises(CorruptModelFile, match=CORRUPTIONS[how]) as err:
        load_model(str(gguf))
    assert str(err.value).startswith(str(cached / "model.safetensors"))
    assert f"delete {cached} (prr's conversion cache) to reconvert it" in str(err.value)


# --- crashes and kills ------------------------------------------------------------------------
def start_long_run(tmp_path, name):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / name
    proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), *TINY, "task.max_new_tokens=3000",
                             f"hydra.run.dir={out}"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steps = out / "records" / "steps.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if steps.exists() and steps.read_bytes().count(b"\n") >= 20:
            return proc, out
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the run wrote no records within 120 s")


def test_kill_9_leaves_whole_records_and_an_incomplete_mark(tmp_path):
    proc, out = start_long_run(tmp_path, "killed")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert json.loads((out / "summary.json").read_text())["status"] == "running"  # never "complete"
    rows = read_jsonl(out / "records" / "steps.jsonl")
    assert len(rows) >= 20 and {"step", "layer", "hit_rate"} <= set(rows.columns)
    for path in (out / "records").glob("*.jsonl"):
        lines = path.read_text().split("\n")
        for line in lines[:-1]:
            json.loads(line)  # every complete line parses


def test_sigterm_marks_the_run_failed_and_keeps_records(tmp_path):
    proc, out = start_long_run(tmp_path, "terminated")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "terminated by signal" in summary["error"]
    assert summary["records_kept"]["steps.jsonl"] >= 20
    assert len(read_jsonl(out / "records" / "steps.jsonl")) >= summary["records_kept"]["steps.jsonl"]


def test_write_error_while_saving_results_loses_nothing(tmp_path, monkeypatch):
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(dst).endswith("summary.json") and json.loads(Path(src).read_text()).get("status") == "complete":
            raise OSError(28, "No space left on device (injected)")
        return real_replace(src, dst)

    monkeypatch.setattr(prr.paths.os, "replace", failing_replace)
    with pytest.raises(OSError, match="injected"):
        run(tiny_cfg(), tmp_path / "run")
    out = tmp_path / "run"
    # The final summary never landed half-written: the failure record replaced "running".
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"
    assert not list(out.glob(".*.tmp"))
    assert len(read_jsonl(out / "records" / "steps.jsonl")) == 10 * 2 * 2  # steps x layers x KV heads


def test_nan_in_attention_is_reported_with_step_and_layer(tmp_path, monkeypatch):
    from prr.model.spec import ModelSpec

    real_load = ModelSpec.load

    def poisoned_load(self, dtype, device):
        model = real_load(self, dtype, device)
        with torch.no_grad():
            model.decoder.model.layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
        return model

    monkeypatch.setattr(ModelSpec, "load", poisoned_load)
    with pytest.raises(FloatingPointError, match="decode step 0, first in the attention output of layer 1"):
        run(tiny_cfg(), tmp_path / "nan")
    assert json.loads((tmp_path / "nan" / "summary.json").read_text())["status"] == "failed"


def test_kv_cache_out_of_memory_names_the_sizes(tmp_path, monkeypatch):
    import prr.runtime.eager_run

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(prr.runtime.eager_run, "PagedKVCache", no_memory)
    with pytest.raises(MemoryError, match=r"GiB for 2 layers x batch 1 x 2 KV heads x 310 tokens"):
        run(tiny_cfg(), tmp_path / "oom")


# --- determinism ----------------------------------------------------------------------------
def test_same_config_and_seed_give_identical_selections_and_tokens(tmp_path):
    a = run(tiny_cfg("predictor=ema"), tmp_path / "a")
    b = run(tiny_cfg("predictor=ema"), tmp_path / "b")
    assert a["generated_token_ids"] == b["generated_token_ids"]
    untimed = lambda frame: frame[[c for c in frame.columns if not c.startswith("t_")]]  # noqa: E731
    sa, sb = (untimed(read_jsonl(tmp_path / x / "records" / "steps.jsonl")) for x in ("a", "b"))
    pd.testing.assert_frame_equal(sa, sb)


def test_result_files_are_not_world_writable(tmp_path):
    run(tiny_cfg(), tmp_path / "perm")
    for path in (tmp_path / "perm").rglob("*"):
        if path.is_file():
            assert not path.stat().st_mode & 0o002, path


# --- resuming -------------------------------------------------------------------------------
def test_a_finished_run_is_skipped_and_never_overwritten(tmp_path):
    first = run(tiny_cfg(), tmp_path / "r")
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "r").rglob("*") if p.is_file()}
    again = run(tiny_cfg(), tmp_path / "r")
    assert again == first
    assert stamps == {p: p.stat().st_mtime_ns for p in (tmp_path / "r").rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match="never overwrites"):
        run(tiny_cfg("predictor=last_step"), tmp_path / "r")


def launch(run_dir, *overrides):
    """run.py as a user starts it, into run_dir."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *TINY, *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=600)


def snapshot(folder):
    """Every file and folder under folder; files with their mtime (ns) and sha256."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            if p.is_file() else "dir" for p in sorted(folder.rglob("*"))}


def test_a_refused_relaunch_leaves_the_finished_run_and_its_hydra_record_as_they_were(tmp_path):
    out = tmp_path / "r"
    first = launch(out, "predictor=ema")
    assert first.returncode == 0, first.stderr[-3000:]
    assert hydra_choices(out)["predictor"] == "ema"
    before = snapshot(out)
    refused = launch(out, "predictor=last_step")
    assert refused.returncode != 0 and "holds a finished run of a different config" in refused.stderr
    assert snapshot(out) == before  # .hydra/ too: Hydra's record is written only for a run that goes ahead
    assert run_row(out)["predictor"] == "ema"
    skipped = launch(out, "predictor=ema")
    assert skipped.returncode == 0 and "skipped" in skipped.stdout
    assert snapshot(out) == before


def test_a_refused_relaunch_adds_no_file_to_a_run_written_without_hydra(tmp_path):
    out = tmp_path / "r"
    run(tiny_cfg(), out)  # no .hydra/, no log file
    before = snapshot(out)
    refused = launch(out, "predictor=last_step")
    assert refused.returncode != 0 and "holds a finished run of a different config" in refused.stderr
    assert snapshot(out) == before


def test_an_interrupted_run_runs_again(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"status": "running"}))
    assert run(tiny_cfg(), out)["status"] == "complete"


def test_relaunched_sweep_skips_finished_jobs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sweep = [sys.executable, str(ROOT / "run.py"), "-m", *TINY, "predictor=none,last_step", f"hydra.sweep.dir={tmp_path / 's'}"]
    assert subprocess.run(sweep, cwd=tmp_path, env=env, capture_output=True, timeout=600).returncode == 0
    summaries = sorted((tmp_path / "s").glob("*/summary.json"))
    assert len(summaries) == 2
    stamps = [p.stat().st_mtime_ns for p in summaries]
    done = subprocess.run(sweep, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.count("skipped") == 2
    assert stamps == [p.stat().st_mtime_ns for p in summaries]
