"""`make figures`: every registered figure from the committed results into analysis/figures/
(PDF + PNG, and the figure's data as <name>.data.csv: tests/test_figures_current.py checks
that it matches the committed results; tables as .md + .csv), and drawn_with.json: the versions
of matplotlib, fontTools and FreeType the PDFs' bytes depend on (no dates: the same results and
versions give the same files, so `make figures` leaves a checkout clean). A figure whose results file does not exist yet is skipped
with one line naming the file and the command that produces it; that is not an error.

    python -m prr.analysis.make_figures [--root REPO] [--out DIR] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from .figure_data import figure_table
from .figures import Figure, registry, table_markdown
from .style import save

ROOT = Path(__file__).resolve().parents[1]


def missing_inputs(figure: Figure, root: Path) -> list[Path]:
    return [root / p for p in figure.inputs if not (root / p).is_file()]


def make_figure(figure: Figure, root: Path = ROOT, out: Path = ROOT / "analysis" / "figures") -> list[Path]:
    """Draw one figure from its results files under root and write it to out; returns the files."""
    frame = figure.load(*[root / p for p in figure.inputs])
    result = figure.draw(frame)
    if isinstance(result, pd.DataFrame):
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"{figure.name}.md", out / f"{figure.name}.csv"]
        paths[0].write_text(f"{figure.caption}\n\n{table_markdown(result)}")
        result.to_csv(paths[1], float_format="%.4f")
        return paths
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{figure.name}.data.csv"  # what the figure shows, as a table: CI checks it is current
    data.write_text(figure_table(result))
    return [*save(result, out, figure.name), data]


def drawn_now(figure: Figure, root: Path = ROOT) -> dict[str, str]:
    """{file name: text} of what make_figure would write for this figure's data (its .data.csv,
    or a table's .md and .csv), drawn from the results under root, nothing written."""
    frame = figure.load(*[root / p for p in figure.inputs])
    result = figure.draw(frame)
    if isinstance(result, pd.DataFrame):
        return {f"{figure.name}.md": f"{figure.caption}\n\n{table_markdown(result)}",
                f"{figure.name}.csv": result.to_csv(float_format="%.4f")}
    import matplotlib.pyplot as plt

    text = figure_table(result)
    plt.close(result)
    return {f"{figure.name}.data.csv": text}


def make_all(root: Path = ROOT, out: Path = ROOT / "analysis" / "figures", only: list[str] | None = None) -> dict:
    """{name: written files} for the figures whose results exist; prints one line per figure."""
    figures = registry()
    unknown = sorted(set(only or []) - set(figures))
    if unknown:
        raise SystemExit(f"unknown figure(s) {unknown}; registered: {sorted(figures)}")
    written = {}
    for name, figure in figures.items():
        if only and name not in only:
            continue
        missing = missing_inputs(figure, root)
        if missing:
            print(f"skip {name}: {missing[0].relative_to(root)} not found; produce it with: {figure.command}")
            continue
        written[name] = make_figure(figure, root, out)
        print(f"wrote {', '.join(str(p.relative_to(out.parent) if out.parent in p.parents else p) for p in written[name])}")
    if written:
        (out / DRAWN_WITH).write_text(json.dumps(drawing_versions(), indent=1) + "\n")
    return written


# The PDFs' bytes depend on the data and on these packages (fontTools subsets the embedded font:
# another version embeds another subset, a few KB apart), never on the date (style.save): the same
# results drawn with the same versions give the same files (tests/test_figures.py checks the committed ones).
DRAWN_WITH = "drawn_with.json"


def drawing_versions() -> dict[str, str]:
    """The versions of what draws and embeds the figures."""
    import importlib.metadata

    import matplotlib.ft2font

    return {"matplotlib": importlib.metadata.version("matplotlib"), "fonttools": importlib.metadata.version("fonttools"),
            "freetype": matplotlib.ft2font.__freetype_version__}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="where the results files are (the repo root)")
    parser.add_argument("--out", type=Path, default=ROOT / "analysis" / "figures")
    parser.add_argument("--only", nargs="*", help="figure names (default: all)")
    args = parser.parse_args(argv)
    written = make_all(args.root.resolve(), args.out.resolve(), args.only)
    print(f"{len(written)} figure(s) written to {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
