"""The committed figures are what `make figures` draws from the committed results (issue 36):
each figure is drawn again, in memory, and its data table (analysis/figure_data.py: labels,
legend, every line's and bar's values) must equal the committed `<name>.data.csv`; each table
figure's .md and .csv must equal the committed ones. PNG bytes are not compared (they depend on
fonts and matplotlib's version). When this fails: `make figures`, look, commit analysis/figures/."""

from pathlib import Path

import pytest
from prr.analysis.figure_data import figure_table, first_difference
from prr.analysis.figures import registry
from prr.analysis.make_figures import drawn_now, missing_inputs

ROOT = Path(__file__).resolve().parents[1]
FIGURES_DIR = ROOT / "analysis" / "figures"
DRAWABLE = [name for name, figure in registry().items() if not missing_inputs(figure, ROOT)]


@pytest.mark.parametrize("name", DRAWABLE)
def test_the_committed_figure_shows_the_committed_results(name):
    for file_name, text in drawn_now(registry()[name], ROOT).items():
        committed = FIGURES_DIR / file_name
        assert committed.is_file(), f"{committed} is not committed: run `make figures` and commit analysis/figures/"
        old = committed.read_text()
        assert old == text, (f"{file_name} is stale ({first_difference(old, text)}): run `make figures` and commit "
                             "analysis/figures/")


def test_every_drawn_figure_file_has_its_data_table():
    """A PNG in analysis/figures without a current .data.csv could not be checked above."""
    pngs = {p.stem for p in FIGURES_DIR.glob("*.png")}
    assert pngs, FIGURES_DIR
    assert pngs <= {p.name.removesuffix(".data.csv") for p in FIGURES_DIR.glob("*.data.csv")}
    assert pngs <= set(DRAWABLE), f"PNGs of no drawable figure (results missing?): {sorted(pngs - set(DRAWABLE))}"


def test_the_table_changes_when_a_legend_or_a_value_does():
    """The check can fail: a legend's word (issue 36: 'EMA' vs 'EMA of membership') and a
    plotted value each change the table."""
    import matplotlib.pyplot as plt

    def table(label: str, y: float) -> str:
        fig, ax = plt.subplots()
        ax.plot([1, 2], [0.5, y], label=label)
        ax.bar(["a", "b"], [1.0, 2.0], label="bars")
        ax.legend()
        text = figure_table(fig)
        plt.close(fig)
        return text

    base = table("EMA", 0.7)
    assert base == table("EMA", 0.7)
    assert base != table("EMA of membership", 0.7) and "EMA of membership" in table("EMA of membership", 0.7)
    assert base != table("EMA", 0.71)
