"""accuracy_study --report: tables rebuilt from stores, several stores (parallel workers) merged; --reuse's
runs beside serial DSA."""

import importlib.util
import json
import math
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "experiments" / "results" / "h200" / "accuracy_qwen_matrix_samples.csv.gz"
KEY = ["task", "context_tokens", "sample", "config"]


def load_study():
    spec = importlib.util.spec_from_file_location("accuracy_study", ROOT / "experiments" / "accuracy_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_merges_overlapping_stores_keeping_each_rows_command(tmp_path):
    rows = pd.read_csv(STORE, keep_default_na=False, na_values=[""])
    cell = rows[(rows.task == "ruler:vt") & (rows.context_tokens == 8192) & (rows["sample"] < 5)]
    assert len(cell) == 5 * 17
    first, second = cell[cell["sample"] < 3].copy(), cell[cell["sample"] >= 2].copy()  # sample 2 in both
    second.loc[:, "command"] = "worker two"
    first.to_csv(tmp_path / "a.csv", index=False)
    second.to_csv(tmp_path / "b.csv", index=False)
    load_study().main(["--report", str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--out", str(tmp_path / "m")])
    merged = pd.read_csv(tmp_path / "m_samples.csv", keep_default_na=False, na_values=[""])
    assert len(merged) == len(cell) and not merged.duplicated(KEY).any()
    assert set(merged.loc[merged["sample"] == 2, "command"]) == set(first.loc[first["sample"] == 2, "command"])
    assert set(merged.loc[merged["sample"] == 4, "command"]) == {"worker two"}
    table = pd.read_csv(tmp_path / "m.csv")
    assert (table["samples"] == 5).all() and len(table) == 17


def test_reuse_specs_become_the_reuse_groups_overrides():
    study = load_study()
    assert study.reuse_overrides("layers:4") == ["reuse=layers", "reuse.anchors=4"]
    assert study.reuse_overrides("steps") == ["reuse=steps"]
    for bad in ("tokens:2", "layers:x"):
        with pytest.raises(ValueError, match=f"--reuse '{bad}'"):
            study.reuse_overrides(bad)


def test_a_reuse_row_is_compared_with_serial_dsa_and_older_stores_read_as_none():
    """Serial DSA's reference is the row without reuse (a reuse row is predictor=none too);
    identical_to_serial of a reuse row counts the samples whose tokens are serial DSA's."""
    def row(config, selector, reuse, sample, tokens, budget=64.0):
        return {"task": "t", "context_tokens": 500, "sample": sample, "config": config, "selector": selector,
                "predictor": "none", "reuse": reuse, "budget_tokens": budget, "score": 1.0,
                "token_ids": json.dumps(tokens), "margins": "[]", "max_serial_relerr": None, "hit_rate": None,
                "decode_s": 0.1}
    rows = [row("dense", "dense", "none", s, [s, 1], math.nan) for s in (0, 1)]
    rows += [row("quest-none-64", "quest", "none", s, [s, 2]) for s in (0, 1)]
    rows += [row("quest-none-64-layers4", "quest", "layers:4", 0, [0, 2]), row("quest-none-64-layers4", "quest",
                                                                            "layers:4", 1, [1, 3])]
    table, _ = load_study().summarize(pd.DataFrame(rows))
    by_config = table.set_index("reuse")
    assert by_config.loc["layers:4", "identical_to_serial"] == 0.5
    old, _ = load_study().summarize(pd.DataFrame(rows[:4]).drop(columns="reuse"))
    assert list(old["reuse"]) == ["none", "none"]


def test_the_study_runs_reuse_beside_serial_dsa(tmp_path):
    load_study().main(["--model", "tiny-random", "--tasks", "ruler_niah", "--contexts", "500", "--samples", "1",
                       "--budgets", "64", "--ema-budgets", "", "--selectors", "quest", "--dense-layers", "0",
                       "--reuse", "steps:3", "--max-new-tokens", "4", "--out", str(tmp_path / "a")])
    table = pd.read_csv(tmp_path / "a.csv")
    assert list(table["reuse"]) == ["none", "none", "steps:3"] and table["samples"].eq(1).all()
