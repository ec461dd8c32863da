"""accuracy_study --report: tables rebuilt from stores, several stores (parallel workers) merged."""

import importlib.util
from pathlib import Path

import pandas as pd

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
