"""predictor_study.py's results store: a run cut short and resumed gives the tables of one run
over all its prompts; an existing store is refused without --resume, and one of another config
with it; rows of a prompt whose description was never written are dropped on resume."""

import gzip
import importlib.util
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


ps = load("predictor_study")
ARGS = ["--model", "tiny-random", "--tasks", "ruler_niah", "ruler_vt", "--steps", "3", "--predictors", "ema",
        "last_step", "--ratios", "1.0", "1.5", "--engine", "graph", "--no-figures",
        "--set", "selector.dense_layers=[]", "--set", "selector.topk_blocks=8"]
RATES = ["task", "predictor", "ratio", "hit_rate", "hit_rate_lo", "hit_rate_hi", "prompts"]


def table(out: Path) -> pd.DataFrame:
    return pd.read_csv(out.with_suffix(".csv"))[RATES]


def test_a_resumed_run_equals_one_run(tmp_path, capsys):
    ps.main([*ARGS, "--samples", "2", "--out", str(tmp_path / "whole")])
    ps.main([*ARGS, "--samples", "1", "--out", str(tmp_path / "cut")])
    assert set(table(tmp_path / "cut")["prompts"]) == {1}
    capsys.readouterr()
    ps.main([*ARGS, "--samples", "2", "--resume", "--out", str(tmp_path / "cut")])
    assert "2 prompts to measure (2 already in" in capsys.readouterr().out  # sample 1 of each task only
    whole, resumed = table(tmp_path / "whole"), table(tmp_path / "cut")
    assert set(whole["prompts"]) == {2}
    pd.testing.assert_frame_equal(resumed, whole)
    # the per-prompt table: one row per prompt, predictor and ratio, whose mean is the summary's
    prompts = pd.read_csv(tmp_path / "cut_per_prompt.csv")
    by_predictor = pd.read_csv(tmp_path / "cut_by_predictor.csv")
    assert len(prompts) == 4 * len(by_predictor)
    means = prompts.groupby(["predictor", "ratio"])["hit_rate"].mean()
    for row in by_predictor.itertuples():
        assert means[row.predictor, row.ratio] == pytest.approx(row.hit_rate, abs=1e-12)
    stored = pd.read_csv(tmp_path / "cut_store.csv.gz")
    assert sorted(set(zip(stored["task"], stored["sample"], strict=True))) == [
        ("ruler_niah", 0), ("ruler_niah", 1), ("ruler_vt", 0), ("ruler_vt", 1)]


def test_a_store_is_refused_without_resume_and_with_another_config(tmp_path, capsys):
    out = str(tmp_path / "run")
    ps.main([*ARGS, "--samples", "1", "--out", out])
    with pytest.raises(SystemExit) as exit_:
        ps.main([*ARGS, "--samples", "1", "--out", out])
    assert exit_.value.code == 2 and "pass --resume" in capsys.readouterr().err
    other = [*ARGS, "--samples", "1", "--resume", "--out", out]
    other[other.index("--steps") + 1] = "4"
    with pytest.raises(SystemExit) as exit_:
        ps.main(other)
    assert exit_.value.code == 2 and "steps: stored 3, now 4" in capsys.readouterr().err


def test_bad_set_is_one_line_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        ps.main([*ARGS, "--set", "selector.topk_blockz=3", "--out", str(tmp_path / "bad")])
    assert exit_.value.code == 2 and "selector.topk_blockz" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_rows_of_an_undescribed_prompt_are_dropped_on_resume(tmp_path):
    config = {"steps": 3}
    store = ps.PromptStore(tmp_path / "s", config)
    store.open(resume=False)
    frame = pd.DataFrame({"layer": [0, 1], "hits": [3, 4], "selected": [8, 8], "predicted": [8, 8], "heads": [2, 2]})
    store.add("t", 0, {("ema", 1.0): frame}, {("ema", 1.0): {"state_bytes": 1}}, {"decode_steps": 3}, "cmd")
    with gzip.open(store.frames_path, "at") as f:  # a run killed after the rows of sample 1, before its description
        frame.assign(task="t", sample=1, predictor="ema", ratio=1.0, command="cmd").to_csv(f, index=False, header=False)
    again = ps.PromptStore(tmp_path / "s", config)
    again.open(resume=True)
    assert again.done == {("t", 0)}
    assert again.frames()["sample"].tolist() == [0, 0]
    assert pd.read_csv(again.frames_path)["sample"].tolist() == [0, 0]  # rewritten without them


def test_parallel_runs_merged_equal_one_run(tmp_path):
    """Two runs over one task each, merged with --merge and --time-budget 0 (no prompt measured),
    give the tables of one run over both tasks; a merge of overlapping prompts is refused."""
    one_task = [a for a in ARGS if a not in ("ruler_niah", "ruler_vt")]
    at = one_task.index("--tasks") + 1
    for task in ("ruler_niah", "ruler_vt"):
        ps.main([*one_task[:at], task, *one_task[at:], "--samples", "2", "--out", str(tmp_path / task)])
    ps.main([*ARGS, "--samples", "2", "--out", str(tmp_path / "both")])
    sources = {p: p.read_bytes() for p in tmp_path.glob("ruler_*_store.*")}
    ps.main([*ARGS, "--samples", "2", "--time-budget", "0", "--out", str(tmp_path / "merged"),
             "--merge", str(tmp_path / "ruler_niah"), str(tmp_path / "ruler_vt")])
    pd.testing.assert_frame_equal(table(tmp_path / "merged"), table(tmp_path / "both"))
    assert len(sources) == 4 and all(p.read_bytes() == b for p, b in sources.items())  # the merged runs untouched
    with pytest.raises(SystemExit) as exit_:
        ps.main([*ARGS, "--samples", "2", "--time-budget", "0", "--out", str(tmp_path / "merged"),
                 "--merge", str(tmp_path / "ruler_vt")])
    assert exit_.value.code == 2
