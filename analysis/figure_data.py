"""The data a drawn figure shows, as a table: what `make figures` writes beside each PNG/PDF as
`<name>.data.csv`, and what tests/test_figures_current.py compares with a fresh drawing from
the committed results (the PNG's bytes depend on fonts and matplotlib's version; the table
does not). One row per thing a reader sees: each axes' title, axis labels and scales, legend
entries, categorical tick labels, and per artist (line, bar, marker set, image, text) its
label and its values (an error-bar set: x, y and each bar's low and high), rounded to 4
significant digits."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable
from typing import Any

from matplotlib.axes import Axes
from matplotlib.collections import Collection
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.ticker import FixedFormatter

COLUMNS = ("axes", "item", "label", "values")


def number(v: Any) -> str:
    """4 significant digits (nan, inf as such): drawing the same data twice gives the same text."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.4g}"


def numbers(values: Iterable[Any]) -> str:
    return " ".join(number(v) for v in values)


def flat(array: Any) -> list[Any]:
    """Every value of an array-like (masked entries as nan), row-major."""
    import numpy as np

    data = np.ma.filled(np.ma.asarray(array, dtype=float), np.nan)
    return data.ravel().tolist()


def axes_rows(i: int, ax: Axes) -> list[tuple[str, str, str, str]]:
    name = f"axes{i}"
    rows = [(name, "title", ax.get_title(), ""), (name, "xlabel", ax.get_xlabel(), ""),
            (name, "ylabel", ax.get_ylabel(), ""), (name, "scales", f"{ax.get_xscale()} {ax.get_yscale()}", "")]
    for axis, which in ((ax.xaxis, "xticks"), (ax.yaxis, "yticks")):
        formatter = axis.get_major_formatter()
        if isinstance(formatter, FixedFormatter):  # categorical ticks: their words are data
            rows.append((name, which, " | ".join(str(s) for s in formatter.seq), numbers(axis.get_majorticklocs())))
    legend = ax.get_legend()
    if legend is not None:
        rows.append((name, "legend", " | ".join(t.get_text() for t in legend.get_texts()),
                     legend.get_title().get_text()))
    errorbars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    parts = {id(a) for c in errorbars for a in (c.lines[0], *c.lines[1], *c.lines[2]) if a is not None}
    for line in ax.get_lines():
        if id(line) not in parts:  # an error bar's line and caps: its errorbars row below
            rows.append((name, "line", line.get_label(), f"x: {numbers(line.get_xdata())}; y: {numbers(line.get_ydata())}"))
    for container in ax.containers:
        if isinstance(container, BarContainer):
            bars = container.patches
            rows.append((name, "bars", str(container.get_label()),
                         "; ".join(f"{number(b.get_x())} {number(b.get_y())} {number(b.get_width())} {number(b.get_height())}"
                                   for b in bars)))
        elif isinstance(container, ErrorbarContainer):
            rows.append((name, "errorbars", str(container.get_label()), errorbar_values(container)))
    for collection in ax.collections:
        if id(collection) not in parts:
            rows += collection_rows(name, collection)
    for image in ax.get_images():
        rows.append((name, "image", image.get_label(), numbers(flat(image.get_array()))))
    for text in ax.texts:
        rows.append((name, "text", text.get_text(), numbers(text.get_position())))
    return rows


def errorbar_values(container: ErrorbarContainer) -> str:
    """An error-bar set's points: x, y and each point's vertical bar (low, high), where it has one."""
    line, _, bar_lines = container.lines
    text = f"x: {numbers(line.get_xdata())}; y: {numbers(line.get_ydata())}"
    if container.has_yerr:  # the vertical bars: the last LineCollection (x bars, where drawn, come first)
        segments = bar_lines[-1].get_segments()
        text += f"; low: {numbers(min(s[:, 1]) for s in segments)}; high: {numbers(max(s[:, 1]) for s in segments)}"
    return text


def collection_rows(name: str, collection: Collection) -> list[tuple[str, str, str, str]]:
    label = collection.get_label()
    array = collection.get_array()
    rows = []
    offsets = collection.get_offsets()
    if len(offsets) and not (len(offsets) == 1 and not any(offsets[0])):  # markers (scatter): their positions
        rows.append((name, "points", label, numbers(flat(offsets))))
    elif collection.get_paths():  # filled areas (fill_between, violins): their outlines
        rows.append((name, "areas", label, numbers(flat([v for p in collection.get_paths() for v in p.vertices]))))
    if array is not None:  # colour-mapped values (heat maps, coloured markers)
        rows.append((name, "colours", label, numbers(flat(array))))
    return rows


def figure_table(fig: Figure) -> str:
    """The figure's data as CSV text (COLUMNS), in drawing order."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    if fig._suptitle is not None:  # noqa: SLF001 - matplotlib has no public getter before 3.8's get_suptitle
        writer.writerow(("figure", "suptitle", fig._suptitle.get_text(), ""))  # noqa: SLF001
    for i, ax in enumerate(fig.get_axes()):
        writer.writerows(axes_rows(i, ax))
    return out.getvalue()


def first_difference(expected: str, actual: str) -> str:
    """The first differing row of two tables, for a one-line message."""
    old, new = expected.splitlines(), actual.splitlines()
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            return f"row {i}: committed {a[:160]!r}, drawn now {b[:160]!r}"
    return f"committed {len(old)} rows, drawn now {len(new)}"
