"""analysis/*.ipynb execute headless: figures.ipynb on the committed results (what `make
figures` draws), sweeps.ipynb on a small synthetic sweep shaped like the runner's output."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_results_store import write_sweep

ROOT = Path(__file__).resolve().parents[1]
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def execute(name: str, monkeypatch, **env: str):
    for key, value in env.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    notebook = nbformat.read(ROOT / "analysis" / f"{name}.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    return notebook


def outputs(notebook) -> str:
    return "\n".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)


@pytest.mark.slow  # 17 s: make test-full (make test keeps tests/test_figures_current.py, the figures' data)
def test_figures_notebook_regenerates_every_figure_whose_results_exist(tmp_path, monkeypatch):
    from prr.analysis.figures import FIGURES
    from prr.analysis.make_figures import missing_inputs

    notebook = execute("figures", monkeypatch, PRR_FIGURES_DIR=str(tmp_path))
    expected = sorted(f.name for f in FIGURES if not missing_inputs(f, ROOT))
    assert expected, "no committed results to draw"
    drawn = sorted({p.stem for p in tmp_path.glob("*.pdf")} & {p.stem for p in tmp_path.glob("*.png")}
                   | {p.stem for p in tmp_path.glob("*.md")} & {p.stem for p in tmp_path.glob("*.csv")})  # tables
    assert drawn == expected
    text = outputs(notebook)
    for entry in FIGURES:
        if entry.name not in expected:
            assert f"skip {entry.name}: " in text and entry.command in text


def test_sweeps_notebook_on_a_small_sweep(tmp_path, monkeypatch):
    jobs = [{"selector": s, "predictor": p} for s in ("quest", "exact") for p in ("last_step", "ema")]
    write_sweep(tmp_path / "sweep", jobs)
    execute("sweeps", monkeypatch, PRR_SWEEPS=str(tmp_path / "sweep"), PRR_FIGURES_DIR=str(tmp_path / "figs"))
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(
        f"sweep_{n}.{e}" for n in ("overlap_per_layer", "overlap_cdf", "latency_breakdown") for e in ("pdf", "png"))
