"""The results store: run/sweep dirs -> one DataFrame; per-layer and per-step tables; W&B
runs offline (read from the run folder written by the real logger) and online (API shape)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml

from prr.results_store import ResultsError, find_run_dirs, load_layers, load_runs, load_steps, load_wandb

STAGES = ("predict", "speculate", "select", "repair", "merge")


def write_run(run_dir: Path, selector: str = "quest", predictor: str = "ema", ratio: float = 1.0,
              status: str = "complete", layers: int = 3, steps: int = 4, seed: int = 0) -> dict:
    """A run directory shaped like the runner's (config.yaml, summary.json, layers.csv,
    records/steps.jsonl) with seeded random metrics; returns its summary."""
    rng = np.random.default_rng(seed)
    targets = {"quest": "prr.selectors.quest.QuestSelector", "exact": "prr.selectors.exact.ExactSelector",
               "infllm": "prr.selectors.infllm.InfLLMSelector"}
    predictors = {"ema": "prr.predictors.ema.EmaPredictor", "last_step": "prr.predictors.last_step.LastStepPredictor",
                  "none": "prr.predictors.none.NoPredictor"}
    config = {
        "model": {"_target_": "prr.model.spec.ModelSpec", "name_or_path": "tiny-random"},
        "task": {"_target_": "prr.tasks.long_text.LongTextTask", "prompt_tokens": 300, "max_new_tokens": steps},
        "selector": {"_target_": targets[selector], "topk_blocks": 6, "dense_layers": []},
        "predictor": {"_target_": predictors[predictor], **({"alpha": 0.8} if predictor == "ema" else {})},
        "budget": {"_target_": "prr.budget.fixed.FixedBudget", "ratio": ratio, "blocks": None},
        "runtime": {"_target_": "prr.runtime.settings.RuntimeSettings", "mode": "shadow", "block_size": 16},
        "backend": {"_target_": "prr.runtime.engine_ops.OpsBackend", "name": "torch"},
        "logger": {"_target_": "prr.sinks.NoLogger"},
        "seed": 0,
    }
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    rows = []
    for step in range(steps):
        for layer in range(layers):
            timings = {f"t_{s}_s": float(rng.uniform(1e-5, 1e-4)) for s in STAGES}
            for head in range(2):
                hits = int(rng.integers(0, 7))
                rows.append({"step": step, "layer": layer, "batch": 0, "kv_head": head, "selected_blocks": 6,
                             "predicted_blocks": 6, "hits": hits, "misses": 6 - hits, "waste": 6 - hits,
                             "overlap": None if step == 0 else hits / 6, "hit_rate": hits / 6, **timings})
    (run_dir / "records").mkdir()
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "records" / "steps.jsonl").write_text(text + '{"step": 99, "lay')  # a cut-off last line (killed writer)
    frame = pd.DataFrame(rows)
    g = frame.groupby("layer")
    pd.DataFrame({"layer": range(layers), "hit_rate": g["hits"].sum() / g["selected_blocks"].sum(),
                  "last_step_overlap": g["overlap"].mean(),
                  **{f"t_{s}_us": g[f"t_{s}_s"].median() * 1e6 for s in STAGES}}).to_csv(run_dir / "layers.csv", index=False)
    summary = {"status": status, "model": "tiny-random", "prompt_tokens": 300, "device": "cpu:test",
               "hit_rate": float(frame["hits"].sum() / frame["selected_blocks"].sum()),
               "last_step_overlap": float(frame["overlap"].mean()), "token_latency_median_ms": float(rng.uniform(5, 10)),
               "calibration": {"alpha": 0.5, "stickiness": 1.0}, "generated_token_ids": [list(range(steps))],
               **{f"t_{s}_us": float(frame[f"t_{s}_s"].median() * 1e6) for s in STAGES}}
    if status != "complete":
        summary = {"status": status}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return summary


def write_sweep(sweep: Path, jobs: list[dict]) -> list[dict]:
    return [write_run(sweep / str(i), seed=i, **job) for i, job in enumerate(jobs)]


def test_one_row_per_run_in_job_order_with_options_config_and_summary(tmp_path):
    jobs = [{"predictor": p, "ratio": r} for p in ("last_step", "ema") for r in (1.0, 2.0)] + [{"status": "running"}] * 7
    summaries = write_sweep(tmp_path / "s", jobs)
    runs = load_runs(tmp_path / "s")
    assert list(runs["run_dir"].map(lambda d: Path(d).name)) == [str(i) for i in range(11)]  # 10 after 9, not after 1
    assert list(runs["status"]) == ["complete"] * 4 + ["running"] * 7  # unfinished runs listed, not dropped
    assert list(runs["predictor"][:4]) == ["last_step", "last_step", "ema", "ema"]  # names of conf/predictor/*.yaml
    assert set(runs["selector"]) == {"quest"} and set(runs["model"]) == {"tiny-random"}
    assert list(runs["budget.ratio"][:4]) == [1.0, 2.0, 1.0, 2.0]
    assert runs["hit_rate"][:4].tolist() == pytest.approx([s["hit_rate"] for s in summaries[:4]])
    assert runs["calibration.alpha"][0] == 0.5
    assert "generated_token_ids" not in runs.columns  # long lists stay out of the table
    assert runs["sweep"].nunique() == 1 and runs["sweep"][0] == str((tmp_path / "s").resolve())


def test_several_sweeps_and_single_run_dirs(tmp_path):
    write_sweep(tmp_path / "a", [{"selector": "quest"}, {"selector": "exact"}])
    write_sweep(tmp_path / "b", [{"selector": "infllm"}])
    runs = load_runs(tmp_path / "a", tmp_path / "b", tmp_path / "a" / "1")
    assert list(runs["selector"]) == ["quest", "exact", "infllm", "exact"]
    assert runs["sweep"].map(lambda s: Path(s).name).tolist() == ["a", "a", "b", "a"]
    assert len(find_run_dirs(tmp_path)) == 3  # a parent of several sweeps


def test_layers_and_steps_keep_run_keys_and_skip_unfinished(tmp_path):
    write_sweep(tmp_path / "s", [{"selector": "quest"}, {"selector": "exact"}, {"status": "failed"}])
    layers = load_layers(tmp_path / "s")
    assert len(layers) == 2 * 3 and set(layers["selector"]) == {"quest", "exact"}
    assert {"layer", "hit_rate", "last_step_overlap", "t_select_us", "run_dir", "selector.topk_blocks"} <= set(layers.columns)
    steps = load_steps(tmp_path / "s", columns=["overlap", "misses"])
    assert len(steps) == 2 * 4 * 3 * 2  # runs x steps x layers x heads; the cut-off last line is left out
    assert {"step", "layer", "kv_head", "overlap", "misses", "selector"} <= set(steps.columns)
    assert "waste" not in steps.columns
    with pytest.raises(ResultsError, match=r"no column\(s\) \['nope'\]"):
        load_steps(tmp_path / "s", columns=["nope"])


def test_bad_paths_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no/such/sweep.*does not exist"):
        load_runs(tmp_path / "no/such/sweep")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ResultsError, match="holds no run: no summary.json"):
        load_runs(tmp_path / "empty")
    with pytest.raises(ResultsError, match="no results path"):
        load_runs()


def test_offline_wandb_run_written_by_the_logger_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from prr.sinks import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    summary = write_run(tmp_path / "r", predictor="last_step")
    run_dir = tmp_path / "r"
    layers = pd.read_csv(run_dir / "layers.csv")
    steps = pd.read_json(run_dir / "records" / "steps.jsonl", lines=True, nrows=24)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    logger = WandbLogger(mode="offline", group="multirun/test")
    logger.start(run_dir, config, name="quest-last_step")
    logger.log_run(summary, layers, steps)
    logger.finish(True)

    deadline = time.monotonic() + 120
    while (row := load_wandb(tmp_path).iloc[0].to_dict())["wandb_state"] == "running":
        # wandb writes the offline log in the background, after finish() returns (seen under load)
        assert time.monotonic() < deadline, "the offline W&B run never got its exit record"
        time.sleep(0.5)
    assert row["wandb_state"] == "finished"
    assert row["wandb_group"] == "multirun/test" and row["wandb_name"] == "quest-last_step"
    assert row["predictor"] == "last_step" and row["budget.ratio"] == 1.0
    assert row["hit_rate"] == pytest.approx(summary["hit_rate"])
    assert row["hist/misses/_type"] == "histogram" and row["hist/waste/_type"] == "histogram"
    images = sorted(p.name.split("_1_")[0] for p in run_dir.rglob("media/images/figures/*.png"))
    assert images == ["per_layer_rates", "per_layer_stages"]
    assert row["per_layer/_type"] == "table-file"


def test_online_wandb_runs_through_the_api(tmp_path):
    run = SimpleNamespace(id="abc", name="quest-ema", group="multirun/x",
                          config={"selector": {"_target_": "prr.selectors.quest.QuestSelector", "topk_blocks": 32},
                                  "_wandb": {"x": 1}},
                          summary={"hit_rate": 0.9, "_runtime": 3, "per_layer": {"_type": "table-file"}})

    class Api:
        def runs(self, path, filters):
            assert path == "me/prr" and filters == {"group": "multirun/x"}
            return [run]

    (row,) = load_wandb("me/prr", filters={"group": "multirun/x"}, api=Api()).to_dict(orient="records")
    assert row["selector"] == "quest" and row["selector.topk_blocks"] == 32 and row["hit_rate"] == 0.9
    assert "_runtime" not in row and "per_layer" not in row
    with pytest.raises(ResultsError, match="neither an existing folder nor 'entity/project'"):
        load_wandb(tmp_path / "missing")


def test_the_wandb_log_reader_joins_records_split_across_blocks(tmp_path):
    from prr.results_store import WANDB_BLOCK, wandb_log_records

    def header(kind: int, length: int) -> bytes:
        return b"\0\0\0\0" + length.to_bytes(2, "little") + bytes([kind])

    big = bytes(range(256)) * 200  # 51200 bytes: FIRST, MIDDLE?, LAST over 32 KiB blocks
    data = bytearray(b":W&B\xe1\xbe\x00" + header(1, 5) + b"small")
    pos_data, rest, first = big, big, True
    while rest:
        room = WANDB_BLOCK - len(data) % WANDB_BLOCK - 7
        chunk, rest = rest[:room], rest[room:]
        kind = (2 if first else 3) if rest else 4
        data += header(kind, len(chunk)) + chunk
        first = False
    data += header(1, 3) + b"end" + header(1, 10) + b"cut"  # the last record cut off
    (tmp_path / "run-x.wandb").write_bytes(bytes(data))
    assert list(wandb_log_records(tmp_path / "run-x.wandb")) == [b"small", pos_data, b"end"]


def test_sweep_jobs_are_grouped_by_their_sweep_dir():
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict, read_write

    from prr.sinks import sweep_group

    root = Path(__file__).resolve().parents[1]
    with initialize_config_dir(config_dir=str(root / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=locality"], return_hydra_config=True)
    saved = HydraConfig.instance().cfg
    try:
        for mode, group in ((RunMode.RUN, None), (RunMode.MULTIRUN, "multirun/locality")):
            job = cfg.copy()  # set_config makes what it is given read-only
            with read_write(job), open_dict(job):
                job.hydra.mode = mode
            HydraConfig.instance().set_config(job)
            assert sweep_group() == group
    finally:
        HydraConfig.instance().cfg = saved
