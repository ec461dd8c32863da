"""analysis/: figure functions on documented columns, one colour per stage and per method
across figures, labelled axes, the registry, and `make figures` (skips what is missing,
writes PDF + PNG, byte-stable)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_hex
from prr.analysis import figures, style
from prr.analysis.make_figures import ROOT, make_all
from prr.analysis.run_figures import run_figures

STAGE_HEX = {k: to_hex(v) for k, v in style.STAGE_COLORS.items()}
STAGE_COLS = {f"t_{s}_us": 10.0 * (i + 1) for i, s in enumerate(style.STAGE_ORDER)}


def line_colors(fig) -> dict[str, str]:
    return {line.get_label(): to_hex(line.get_color()) for ax in fig.axes for line in ax.get_lines()
            if not line.get_label().startswith("_")}


def assert_labelled(fig) -> None:
    for ax in fig.axes:
        for label in (ax.get_xlabel(), ax.get_ylabel()):
            assert "(" in label and ")" in label, f"axis label {label!r} has no unit in parentheses"


def test_a_method_has_one_colour_in_every_figure():
    layers = pd.DataFrame({"selector": ["quest"] * 3 + ["infllm"] * 3, "layer": [0, 1, 2] * 2,
                           "last_step_overlap": np.linspace(0.5, 0.9, 6)})
    steps = pd.DataFrame({"selector": ["quest", "infllm"] * 5, "overlap": np.linspace(0, 1, 10)})
    fidelity = pd.DataFrame({"selector": ["quest", "quest", "infllm", "infllm"], "budget_tokens": [256, 512] * 2,
                             "mean_mass_recall": [0.8, 0.9, 0.7, 0.85], "mean_output_relerr": [0.2, 0.1, 0.3, 0.15]})
    drawn = [figures.overlap_per_layer(layers), figures.overlap_cdf(steps), figures.selector_fidelity(fidelity)]
    for fig in drawn:
        assert_labelled(fig)
        colors = line_colors(fig)
        assert colors[next(k for k in colors if k.startswith("Quest"))] == to_hex(style.METHOD_COLORS["quest"])
        assert colors[next(k for k in colors if k.startswith("InfLLM"))] == to_hex(style.METHOD_COLORS["infllm"])


def test_stage_colours_in_the_latency_breakdown_and_the_run_figures():
    runs = pd.DataFrame([{"prompt_tokens": c, "predictor": p, "status": "complete", **STAGE_COLS}
                         for c in (1024, 4096) for p in ("none", "ema")])
    fig = figures.latency_breakdown(runs)
    assert_labelled(fig)
    bars = {c.get_label(): to_hex(c[0].get_facecolor()) for c in fig.axes[0].containers if not c.get_label().startswith("_")}
    assert bars == STAGE_HEX
    per_run = run_figures(pd.DataFrame({"layer": [0, 1], "hit_rate": [0.5, 0.7], "last_step_overlap": [0.4, 0.6],
                                        **{k: [v, v] for k, v in STAGE_COLS.items()}}))
    assert set(per_run) == {"per_layer_rates", "per_layer_stages"}
    stages = {c.get_label(): to_hex(c[0].get_facecolor()) for c in per_run["per_layer_stages"].axes[0].containers}
    assert stages == STAGE_HEX


def test_stage_words_are_the_runtime_s():
    from prr.runtime.timing import STAGES

    assert sorted(style.STAGE_ORDER) == sorted(STAGES) == sorted(style.STAGE_COLORS)


def test_colours_are_distinct_and_unknown_methods_get_a_stable_one():
    colors = [to_hex(c) for c in (*style.STAGE_COLORS.values(), *style.METHOD_COLORS.values())]
    assert len(set(colors)) == len(colors)
    assert style.method_color("some_new_predictor") == style.method_color("some_new_predictor")
    assert style.method_color("some_new_predictor") in style.RESERVE
    with pytest.raises(ValueError, match="is a stage"):
        style.method_color("select")
    with pytest.raises(ValueError, match="not one of"):
        style.stage_color("attend")


def test_speedup_is_against_the_serial_baseline_of_the_same_context():
    frame = pd.DataFrame({"context_tokens": [8192, 8192, 32768, 32768], "method": ["none", "ema"] * 2,
                          "latency_ms": [10.0, 8.0, 20.0, 10.0], "hit_rate": [np.nan, 0.9, np.nan, 0.95]})
    fig = figures.speedup(frame)
    assert_labelled(fig)
    (ema_vs_context,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "EMA"]
    assert ema_vs_context.get_ydata().tolist() == pytest.approx([1.25, 2.0])
    with pytest.raises(ValueError, match="serial baseline method 'none'"):
        figures.speedup(frame[frame["method"] != "none"])


def test_missing_columns_are_named():
    with pytest.raises(KeyError, match=r"needs column\(s\) \['last_step_overlap'\]"):
        figures.overlap_per_layer(pd.DataFrame({"selector": ["quest"], "layer": [0]}))


def test_accuracy_table_and_old_sweep_csvs(tmp_path):
    table = figures.accuracy_table(pd.DataFrame({"task": ["a", "b", "a", "b"], "method": ["dense", "dense", "quest", "quest"],
                                                 "score": [1.0, 0.5, 0.5, 0.5]}))
    assert table.loc["dense", "mean"] == 0.75 and table.loc["quest", "mean"] == 0.5
    assert "| dense | 1.000 | 0.500 | 0.750 |" in figures.table_markdown(table)
    path = tmp_path / "old.csv"
    pd.DataFrame({"overrides": ["predictor=ema budget.ratio=1.5 logger=none"], "hit_rate": [0.9]}).to_csv(path, index=False)
    old = figures.read_sweep_csv(path)
    assert old.loc[0, "predictor"] == "ema" and old.loc[0, "budget.ratio"] == 1.5


def test_registry_entries_are_complete():
    entries = figures.registry()
    assert len(entries) == len(figures.FIGURES)
    for entry in entries.values():
        assert entry.inputs and entry.command and entry.caption
        assert all(not p.startswith("/") for p in entry.inputs)


def test_make_figures_skips_missing_results_and_is_byte_stable(tmp_path, capsys):
    assert make_all(tmp_path, tmp_path / "out") == {}
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(figures.FIGURES)
    first = figures.FIGURES[0]
    assert lines[0] == f"skip {first.name}: {first.inputs[0]} not found; produce it with: {first.command}"
    assert not (tmp_path / "out").exists()

    fidelity = tmp_path / "experiments/results/cpu/selector_fidelity.csv"
    fidelity.parent.mkdir(parents=True)
    pd.DataFrame({"selector": ["quest", "exact"] * 2, "budget_tokens": [256, 256, 512, 512],
                  "mean_mass_recall": [0.8, 0.9, 0.9, 0.95], "mean_output_relerr": [0.2, 0.1, 0.1, 0.05]}).to_csv(fidelity)
    written = make_all(tmp_path, tmp_path / "out")
    assert list(written) == ["selector_fidelity"]
    paths = written["selector_fidelity"]
    assert [p.name for p in paths] == ["selector_fidelity.pdf", "selector_fidelity.png", "selector_fidelity.data.csv"]
    first_bytes = [p.read_bytes() for p in paths]
    make_all(tmp_path, tmp_path / "out", only=["selector_fidelity"])
    assert [p.read_bytes() for p in paths] == first_bytes  # no timestamps: the same results give the same files


def test_committed_figures_are_registered_pdf_png_pairs():
    # Not "every result has its figure": results land from several studies; `make figures` draws them.
    names = set(figures.registry())
    folder = ROOT / "analysis" / "figures"
    pdfs = {p.stem for p in folder.glob("*.pdf")}
    assert pdfs == {p.stem for p in folder.glob("*.png")}
    assert pdfs <= names, f"figures with no registry entry: {sorted(pdfs - names)}"


def test_bench_decode_files_feed_the_speedup_and_breakdown_figures():
    token = pd.DataFrame([{"batch": b, "context": c, "block": 16, "topk_tokens": 2048, "selector": "quest", "variant": v,
                           "cuda_graphs": g, "hit_rate": h, "token_us": us}
                          for b in (1, 8) for c in (32768, 131072) for g in (True, False)
                          for v, h, us in (("dense", None, 900.0), ("serial_uncompiled", None, 990.0), ("serial", None, 500.0 * c / 32768),
                                           ("prr_ema", 0.97, 400.0 * c / 32768), ("prr_fixed_0.90", 0.9, 450.0),
                                           ("serial_fused", None, 300.0), ("prr_fixed_1.00_fused", 1.0, 280.0))])
    frame = figures.speedup_from_bench_decode(token)
    # serial is the baseline; dense and the fused-projection variants (another engine setting) left out
    assert set(frame["method"]) == {"none", "ema_membership", "fixed P, hit 0.90"}  # the engine's "prr_ema" was it
    assert len(frame) == 2 * 3  # batch 1, CUDA graphs on, two contexts
    fig = figures.speedup(frame)
    (ema,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "EMA of membership"]
    assert ema.get_ydata().tolist() == pytest.approx([1.25, 1.25])
    stage = pd.DataFrame([{"batch": 1, "context": c, "block": 16, "topk_tokens": 2048, "selector": "quest",
                           "target_hit_rate": h, "stage_select": 60.0, "stage_speculate": 50.0, "stage_repair": 10.0,
                           "stage_merge": 5.0} for c in (32768, 131072) for h in (1.0, 0.9)])
    breakdown = figures.stage_breakdown_from_bench_decode(stage)
    assert len(breakdown) == 4 and (breakdown["t_select_us"] == 60.0).all()
    assert sorted(set(breakdown["predictor"])) == ["fixed P, hit 0.90", "none"]
    figures.latency_breakdown(breakdown)


def test_token_profile_sorts_kernels_into_parts():
    assert figures.token_part("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT") == "dense GEMVs (weights)"
    assert figures.token_part("_topk_row_kernel") == "select: top-k"
    assert figures.token_part("_dense_gemv_kernel") == "dense GEMVs (weights)"
    assert figures.token_part("_qkv_rope_append_kernel") == "q|k|v GEMV + RoPE + KV append (one launch)"
    assert figures.token_part("sparse_decode_split_kernel") == "attention over A (and 2 dense layers)"
    assert figures.token_part("void at::native::fill") == "other (copies, index, fill)"
    frame = pd.DataFrame({"profile": ["a", "a", "b"], "kernel": ["nvjet_x", "_quest_score_kernel", "nvjet_x"],
                          "us_per_step": [4000.0, 300.0, 3900.0]})
    fig = figures.token_profile(frame)
    widths = sorted(round(p.get_width(), 3) for p in fig.axes[0].patches if p.get_width() > 0)
    assert widths == [0.3, 3.9, 4.0]


def test_prr_map_marks_the_ceiling_and_the_overlap_bound_at_full_hit():
    stage = pd.DataFrame([{"selector": "quest", "batch": 1, "context": 131072, "block": 64, "topk_tokens": 8192,
                           "target_hit_rate": h, "serial": 30.0, "prr": 40.0, "prr_ideal_overlap": 25.0,
                           "stage_overlap": 20.0} for h in (1.0, 0.9)])
    lines = figures.prr_map(stage).axes[0].get_lines()
    markers = {ln.get_marker(): ln.get_ydata().tolist() for ln in lines if ln.get_marker() in ("_", "x")}
    assert markers == {"_": pytest.approx([1.2]), "x": pytest.approx([1.5])}
    # older results without stage_overlap: no x
    lines = figures.prr_map(stage.drop(columns="stage_overlap")).axes[0].get_lines()
    assert "x" not in {ln.get_marker() for ln in lines}


def legend_texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def test_prr_map_legend_names_the_bar_and_x_markers():
    stage = pd.DataFrame([{"selector": s, "batch": 1, "context": 131072, "block": 64, "topk_tokens": 8192,
                           "target_hit_rate": h, "serial": 30.0, "prr": 40.0, "prr_ideal_overlap": 25.0,
                           "stage_overlap": 20.0} for s in ("quest", "infllm") for h in (1.0, 0.9)])
    texts = legend_texts(figures.prr_map(stage))
    assert figures.PRR_MAP_KEY["_"] in texts and figures.PRR_MAP_KEY["x"] in texts
    assert "B=1, K=8K, block 64" in texts  # the configurations keep their legend
    fig = figures.prr_map(stage[stage["selector"] == "quest"].drop(columns="stage_overlap"))  # one panel, no x drawn
    texts = legend_texts(fig)
    assert figures.PRR_MAP_KEY["_"] in texts and figures.PRR_MAP_KEY["x"] not in texts
    handles = {h.get_label(): h for h in fig.axes[0].get_legend().legend_handles}
    assert handles[figures.PRR_MAP_KEY["_"]].get_marker() == "_"


def test_selector_fidelity_keeps_a_line_visible_under_an_identical_one():
    """LESS selects as Quest does: the same recall curve. Quest's line must not hide under LESS's."""
    recall, budgets = [0.83, 0.91, 0.96], [256, 512, 1024]
    fidelity = pd.DataFrame({"selector": ["quest"] * 3 + ["less"] * 3, "budget_tokens": budgets * 2,
                             "mean_mass_recall": recall * 2, "mean_output_relerr": [0.2, 0.1, 0.05, 0.21, 0.11, 0.06]})
    fig = figures.selector_fidelity(fidelity)
    quest, less = fig.axes[0].get_lines()
    assert quest.get_label() == "Quest" and less.get_label() == "LESS: recall = Quest's"
    assert quest.get_linestyle() != less.get_linestyle() and quest.get_marker() != less.get_marker()
    # the earlier line is wider with bigger markers, so it shows around the one drawn over it
    assert quest.get_linewidth() > less.get_linewidth() and quest.get_markersize() > less.get_markersize()
    assert "LESS: recall = Quest's" in legend_texts(fig)


def test_locality_vs_context_draws_each_rates_interval_over_prompts_where_the_table_has_one():
    from matplotlib.collections import PolyCollection
    from prr.analysis.figures import LOCALITY_PANELS, locality_vs_context

    rows = [{"model": "m", "context_tokens": c, "variant": "quest_max", "topk_blocks": 64,
             **{k: v for col in LOCALITY_PANELS for k, v in ((col, 0.8), (f"{col}_lo", 0.7), (f"{col}_hi", 0.9))}}
            for c in (4096, 8192)]
    with_bands = locality_vs_context(pd.DataFrame(rows))
    without = locality_vs_context(pd.DataFrame(rows).drop(columns=[c for c in rows[0] if c.endswith(("_lo", "_hi"))]))
    bands = [[c for c in ax.collections if isinstance(c, PolyCollection)] for ax in with_bands.axes]
    assert all(len(b) == 1 for b in bands) and len(bands) == len(LOCALITY_PANELS)
    (path,) = bands[0][0].get_paths()
    assert path.vertices[:, 1].min() == pytest.approx(70) and path.vertices[:, 1].max() == pytest.approx(90)
    assert not any(isinstance(c, PolyCollection) for ax in without.axes for c in ax.collections)


def test_predictor_hit_rate_figure_draws_the_interval_over_prompts_where_the_table_has_one():
    from matplotlib.collections import PolyCollection
    from prr.analysis.predictor_figures import plot_hit_rate_vs_budget

    table = pd.DataFrame({"task": "t", "predictor": "ema", "ratio": [1.0, 1.5], "hit_rate": [0.8, 0.9],
                          "hit_rate_lo": [0.75, 0.85], "hit_rate_hi": [0.85, 0.95]})
    bands = [c for ax in plot_hit_rate_vs_budget(table).axes for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1 and bands[0].get_paths()[0].vertices[:, 1].max() == pytest.approx(95)
    plain = plot_hit_rate_vs_budget(table.drop(columns=["hit_rate_lo", "hit_rate_hi"]))
    assert not any(isinstance(c, PolyCollection) for ax in plain.axes for c in ax.collections)


def test_accuracy_cells_carry_n_and_the_interval_of_their_samples(tmp_path):
    """read_accuracy: a table written before accuracy_study kept intervals gets each cell's from its
    samples file (Wilson for 0/1 scores); accuracy_table prints "score [low, high] n=N"."""
    cell = {"task": "ruler_niah", "context_tokens": 1024, "selector": "quest", "predictor": "none", "budget_tokens": 256.0}
    pd.DataFrame([{**cell, "samples": 3, "accuracy": 2 / 3}]).to_csv(tmp_path / "acc.csv", index=False)
    pd.DataFrame([{**cell, "sample": i, "score": s} for i, s in enumerate([1.0, 0.0, 1.0])]).to_csv(
        tmp_path / "acc_samples.csv", index=False)
    frame = figures.read_accuracy(tmp_path / "acc.csv", tmp_path / "acc_samples.csv")
    from prr.intervals import wilson

    want = wilson(2, 3)
    assert frame.loc[0, "accuracy_lo"] == pytest.approx(want.low) and frame.loc[0, "accuracy_hi"] == pytest.approx(want.high)
    table = figures.accuracy_table(figures.accuracy_frame(frame))
    assert table.loc["quest serial @256", "ruler_niah 1K"] == f"0.667 [{want.low:.2f}, {want.high:.2f}] n=3"
    pd.DataFrame([{**cell, "sample": 0, "score": 1.0}]).to_csv(tmp_path / "acc_samples.csv", index=False)
    with pytest.raises(ValueError, match="do not match"):
        figures.read_accuracy(tmp_path / "acc.csv", tmp_path / "acc_samples.csv")


def test_accuracy_vs_context_averages_the_same_complete_prompts_on_every_line():
    """Two contexts, 8K thin (1-2 samples per task); prompt (b, 8K, 1) lacks one config's row: it
    counts on no line at 8K (its scores of 1 would lift every mean there), and n says so."""
    from matplotlib.container import ErrorbarContainer
    from prr.analysis.figure_data import figure_table

    configs = [("dense", "none", np.nan), *[(s, p, b) for s in ("quest", "infllm") for b in (1024.0, 2048.0)
                                            for p in ("none", "ema")]]
    prompts = [("a", 4096, i) for i in range(3)] + [("b", 4096, i) for i in range(3)] + \
        [("a", 8192, 0), ("b", 8192, 0), ("b", 8192, 1)]
    rows = [{"task": t, "context_tokens": c, "sample": i, "config": f"{s}-{p}-{b}", "selector": s, "predictor": p,
             "budget_tokens": b, "score": 1.0 if (t, c, i) == ("b", 8192, 1) else [0.0, 0.5, 1.0][(i + j + (t == "b")) % 3]}
            for t, c, i in prompts for j, (s, p, b) in enumerate(configs)]
    store = pd.DataFrame([r for r in rows if not (r["sample"] == 1 and r["context_tokens"] == 8192
                                                   and r["config"] == "infllm-ema-2048.0")])
    points = figures.accuracy_vs_context_points(store)
    assert len(points) == 2 * len(configs)
    assert ((points["low"] <= points["mean"]) & (points["mean"] <= points["high"])).all()
    assert points.groupby("context_tokens")["n"].unique().map(list).to_dict() == {4096: [6], 8192: [2]}
    kept = store[store["context_tokens"] == 8192]
    kept = kept[kept["sample"] == 0].groupby("config")["score"].mean()  # without the incomplete prompt
    at_8k = points[points["context_tokens"] == 8192].set_index("config")["mean"]
    assert at_8k.to_dict() == pytest.approx(kept.to_dict())

    fig = figures.accuracy_vs_context(store)
    assert fig.axes[0].get_ylabel() == "accuracy (mean score, %)" and fig.axes[1].get_xlabel().startswith("context (")
    assert [ax.get_title() for ax in fig.axes] == ["top-K budget 1,024 tokens", "top-K budget 2,048 tokens"]
    for ax in fig.axes:
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert [c.get_label() for c in bars] == ["dense", "Quest, serial", "Quest, PRR (EMA)", "InfLLM, serial",
                                                 "InfLLM, PRR (EMA)"]  # dense in both panels
        for c in bars:
            y = c.lines[0].get_ydata()
            low, high = (np.array([s[:, 1].min() for s in c.lines[2][-1].get_segments()]),
                         np.array([s[:, 1].max() for s in c.lines[2][-1].get_segments()]))
            assert c.lines[0].get_xdata().tolist() == [4096, 8192] and ((low <= y) & (y <= high)).all()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["4K\nn=6", "8K\nn=2"]
    assert '"4K\nn=6 | 8K\nn=2"' in figure_table(fig) and "errorbars,dense,x: 4096 8192; y:" in figure_table(fig)


def test_accuracy_pooled_counts_complete_prompts_tokens_and_same_batch_times():
    """Prompt (b, 1) lacks PRR's row: it counts nowhere (its tokens equal dense's and serial's). Of the
    other three, serial = dense on 2, PRR = dense on 2, PRR = serial on 1 (hand count); (b, 0)'s PRR
    decode ran 2 rows to serial's 1: it is left out of the time ratio, median(2, 3) / median(1, 1) = 2.5 on
    n = 2 (with it: median(2, 3, 100) / 1 = 3), and out of the hit rate (0.75, not 0.8). A row that
    built its engine (includes_capture) leaves the ratio too."""
    configs = {"dense": ("dense", "none", np.nan), "quest-none-1024": ("quest", "none", 1024.0),
               "quest-ema-1024": ("quest", "ema", 1024.0)}
    tokens = {"dense": {("a", 0): [1, 2], ("a", 1): [1, 2], ("b", 0): [1, 2], ("b", 1): [1, 2]},
              "quest-none-1024": {("a", 0): [1, 2], ("a", 1): [1, 3], ("b", 0): [1, 2], ("b", 1): [1, 2]},
              "quest-ema-1024": {("a", 0): [1, 2], ("a", 1): [1, 2], ("b", 0): [9]}}
    decode_s = {"quest-ema-1024": {("a", 0): 2.0, ("a", 1): 3.0, ("b", 0): 100.0}}
    rows = [{"task": t, "context_tokens": 4096, "sample": i, "config": c, "selector": s, "predictor": p,
             "budget_tokens": b, "score": float(tokens[c][(t, i)] == [1, 2]), "token_ids": str(tokens[c][(t, i)]),
             "decode_s": decode_s.get(c, {}).get((t, i), 1.0), "hit_rate": {"a": 0.75, "b": 0.9}[t] if p == "ema" else np.nan,
             "batch_rows": 2.0 if (c, t, i) == ("quest-ema-1024", "b", 0) else np.nan}
            for c, (s, p, b) in configs.items() for (t, i) in tokens[c]]
    table = figures.accuracy_pooled(pd.DataFrame(rows))
    assert table.index.tolist() == ["4K"] * 3 and table["config"].tolist() == ["dense", "quest 1,024", "all sparse"]
    dense, quest, pooled = (table.iloc[i] for i in range(3))
    assert dense["prompts n"] == quest["prompts n"] == "3" and dense["= dense, serial / PRR"] == "3 / 3"
    assert dense["accuracy, serial / PRR"].startswith("1.000 ")
    # tasks weighted equally: serial (a: 1, 0; b: 1) = (0.5 + 1) / 2, PRR (a: 1, 1; b: 0) = (1 + 0) / 2
    assert quest["accuracy, serial / PRR"].startswith("0.750 [") and " / 0.500 [" in quest["accuracy, serial / PRR"]
    assert quest["= dense, serial / PRR"] == "2 / 2"
    assert quest["PRR = serial tokens"].startswith("1 / 3 = 33.3% [") and pooled["PRR = serial tokens"] == quest["PRR = serial tokens"]
    assert quest["PRR / serial time"].startswith("2.50 [") and quest["PRR / serial time"].endswith(" (n=2)")
    assert quest["hit (PRR)"].startswith("0.750 [") and quest["hit (PRR)"].endswith(" (n=2)")
    assert pooled["PRR / serial time"] == ""
    captured = pd.DataFrame(rows).assign(includes_capture=[c == "quest-none-1024" and (t, i) == ("a", 1)
                                                           for c, (t, i) in ((r["config"], (r["task"], r["sample"])) for r in rows)])
    assert figures.accuracy_pooled(captured).iloc[1]["PRR / serial time"].startswith("2.00 [")  # only (a, 0) left: 2 / 1
    store_order = pd.DataFrame({"command": ["x", "x", "y", "x"], "config": ["q", "q", "q", "d"]})
    assert figures.captured_rows(store_order).tolist() == [True, False, True, True]  # (no column: first per command)
    ratio = figures.paired_median_ratio([2.0, 3.0], [1.0, 1.0])
    assert (ratio.estimate, ratio.n) == (2.5, 2) and ratio.low <= 2.5 <= ratio.high


def test_predictor_hit_rate_vs_context_draws_interval_and_n_and_only_predictors_measured_everywhere(tmp_path):
    rows = [{"predictor": p, "ratio": r, "hit_rate": 0.6 + 0.01 * i + (r - 1), "hit_rate_lo": 0.55 + (r - 1),
             "hit_rate_hi": 0.7 + (r - 1),
             "prompts": 20 - i, "command": f"python experiments/predictor_study.py --context-tokens {c} --steps 64"}
            for i, c in enumerate((4096, 32768)) for p in ("ema", "last_step") for r in (1.0, 1.5)]
    rows.append({**rows[0], "predictor": "spin"})  # measured at 4K only: no line
    paths = []
    for c in (4096, 32768):
        paths.append(tmp_path / f"{c}.csv")
        pd.DataFrame([r for r in rows if f" {c} " in r["command"]]).to_csv(paths[-1], index=False)
    frame = figures.read_predictor_study(*paths)
    assert sorted(frame["context_tokens"].unique()) == [4096, 32768]
    fig = figures.predictor_hit_rate_vs_context(frame)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [style.method_label("ema"), style.method_label("last_step")]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4K\nn=20", "32K\nn=19"]
    segments = [c for c in ax.collections if c.get_segments()]  # one error bar per point, |P| = K only: 55-70 %
    assert len(segments) == 2 and all(len(c.get_segments()) == 2 for c in segments)
    assert all(np.allclose(s[:, 1], [55, 70]) for c in segments for s in c.get_segments())
    assert_labelled(fig)
    with pytest.raises(KeyError, match="prompts"):
        figures.predictor_hit_rate_vs_context(frame.drop(columns=["prompts"]))


def test_the_committed_pdfs_are_what_make_figures_draws_with_the_recorded_versions(tmp_path):
    """Issue 54 item 5: `make figures` rewrote all 16 committed PDFs (a few KB apart: another fontTools
    embedded another font subset), turning the checkout dirty. With the versions drawn_with.json
    records, a committed figure is redrawn byte for byte."""
    from prr.analysis.make_figures import DRAWN_WITH, drawing_versions, make_figure

    folder = ROOT / "analysis" / "figures"
    recorded = json.loads((folder / DRAWN_WITH).read_text())
    if drawing_versions() != recorded:
        pytest.skip(f"drawn with {recorded}, this install has {drawing_versions()}: other bytes expected")
    figure = figures.registry()["latency_breakdown_cpu"]
    drawn = make_figure(figure, ROOT, tmp_path)
    for path in drawn:
        assert path.read_bytes() == (folder / path.name).read_bytes(), path.name
