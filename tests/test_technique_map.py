"""analysis/technique_map.py: which technique pays where, priced by prr.cost_model from a stage
map and set beside the whole runs (synthetic files here; the committed figure's data:
tests/test_figures_current.py)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from prr.analysis import technique_map as tm

GPU = "NVIDIA H100 80GB HBM3"
SERIAL, SELECT = 50.0, 40.0  # µs a layer: infllm_v2's serial stage, of which selection


def write_inputs(tmp_path, runs_gpu: str = GPU, hinted_candidates: int = 2048):
    """One infllm_v2 cell (32K, block 64, K = 8 blocks, PRR 55 µs at h 0.75, 49 at 1.0), its
    serial run and reuse run (16 of 32 layers select), a PRR run at hit 0.9 of another session,
    and a hinted top-k benchmark cell (8 rows, k = 32: 1.5 µs saved)."""
    stage = tmp_path / "stage.csv"
    pd.DataFrame([dict(batch=1, selector="infllm_v2", context=32512, block=64, topk_tokens=512, target_hit_rate=h,
                       hit_rate=h, prr=p, serial_fused_merge=SERIAL, stage_select=SELECT)
                  for h, p in ((0.75, 55.0), (1.0, 49.0))]).to_csv(stage, index=False)
    stage_json = tmp_path / "stage.json"
    stage_json.write_text(json.dumps({"environment": {"gpu": GPU}}))
    setting = dict(prompt_tokens=32000, block_size=64, topk_blocks=8, decode_steps=4)
    reuse = tmp_path / "reuse.json"
    reuse.write_text(json.dumps({"gpu": runs_gpu, "rows": [
        {**setting, "case": "infllm_v2-none@32k_b64_k8", "token_latency_median_ms": 8.0, "hit_rate": None},
        {**setting, "case": "infllm_v2-none+anchors2@32k_b64_k8", "token_latency_median_ms": 7.2, "hit_rate": None,
         "median_over_serial_lo": 0.89, "median_over_serial_hi": 0.91,
         "reuse": {"selections_made": 64, "selections_skipped": 64}}]}))
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps({"gpu": GPU, "rows": [
        {**setting, "case": "infllm_v2-none@32k_b64_k8", "token_latency_median_ms": 10.0, "hit_rate": None},
        {**setting, "case": "infllm_v2-hit1@32k_b64_k8", "token_latency_median_ms": 10.1, "hit_rate": 0.9,
         "median_over_serial_lo": 1.0, "median_over_serial_hi": 1.02},
        {**setting, "case": "infllm_v2-hit0.7+profiled@32k_b64_k8", "token_latency_median_ms": 9.0, "hit_rate": None}]}))
    hinted = tmp_path / "hinted.csv"
    pd.DataFrame([dict(rows=8, candidates=hinted_candidates, k=k, hit_rate=h, prr_us=6.5, hinted_us=5.0 + (h != 0.7))
                  for k in (32, 256) for h in (0.6, 0.7)]).to_csv(hinted, index=False)
    return stage, stage_json, reuse, matrix, hinted


def test_each_technique_is_priced_over_its_own_sessions_serial_run(tmp_path):
    rows = tm.read_technique_runs(*write_inputs(tmp_path, hinted_candidates=509)).set_index("technique")
    assert list(rows.index) == ["prr_replayed", "prr_hit1", "reuse_2", "hinted_topk"]  # TECHNIQUES' order
    assert set(rows["gpu"]) == {"H100"} and set(rows["sparse_layers"]) == {32}  # infllm_v2 selects in every layer
    # reuse: 16 reusing layers skip the selection, over its own serial run (8 ms)
    assert rows.loc["reuse_2", "predicted"] == pytest.approx((8.0 - 16 * SELECT * 1e-3) / 8.0)
    assert rows.loc["reuse_2", "measured"] == pytest.approx(0.9) and rows.loc["reuse_2", "measured_lo"] == 0.89
    # PRR at its run's hit 0.9: stage 55 - 0.6 x 6 = 51.4 µs, over the matrix session's serial run (10 ms)
    assert rows.loc["prr_replayed", "predicted"] == pytest.approx((10.0 + 32 * (51.4 - SERIAL) * 1e-3) / 10.0)
    assert rows.loc["prr_replayed", "measured"] == pytest.approx(1.01)
    # no run: the map's stage at hit 1.0 and the hinted top-k's saving (k = 32, the nearest timed; hit 0.7)
    assert rows.loc["prr_hit1", "predicted"] == pytest.approx((8.0 - 32 * 1.0 * 1e-3) / 8.0)
    assert rows.loc["hinted_topk", "predicted"] == pytest.approx((8.0 - 32 * 1.5e-3) / 8.0)
    assert "k = 32 (8 not timed)" in rows.loc["hinted_topk", "note"]
    assert math.isnan(rows.loc["hinted_topk", "measured"])


def test_hinted_top_k_needs_a_timed_cell_of_the_maps_candidates(tmp_path):
    rows = tm.read_technique_runs(*write_inputs(tmp_path, hinted_candidates=8192))
    assert "hinted_topk" not in set(rows["technique"])


def test_results_of_two_gpus_are_refused(tmp_path):
    with pytest.raises(ValueError, match="draw it from one GPU's"):
        tm.read_technique_runs(*write_inputs(tmp_path, runs_gpu="NVIDIA H200"))


def test_a_technique_pays_by_its_run_where_measured_else_by_the_model():
    rows = pd.DataFrame({"predicted": [0.99, 1.01, 0.98, 1.02], "measured": [1.01, 0.99, math.nan, math.nan]})
    assert tm.pays(rows).tolist() == [False, True, True, False]


def test_the_figure_and_table_mark_what_pays(tmp_path):
    import matplotlib.pyplot as plt

    rows = tm.read_technique_runs(*write_inputs(tmp_path))
    fig = tm.technique_map(rows)
    (ax,) = fig.get_axes()
    bars = {c.get_label(): [round(p.get_height(), 4) for p in c.patches] for c in ax.containers if hasattr(c, "patches")}
    plt.close(fig)
    assert bars["32K: pays"] == [round(rows.loc[i, "predicted"] - 1, 4) for i in rows.index
                                 if rows.loc[i, "technique"] in ("prr_hit1", "reuse_2", "hinted_topk")]
    assert bars["32K: does not pay"] == [round(rows.loc[0, "predicted"] - 1, 4)]  # replayed: run 1.01x
    assert "H100" in ax.get_title()
    table = tm.technique_table(rows)
    assert table.loc["InfLLM-v2, 32K, reuse=layers, 1 in 2 select", "pays"] == "yes"
    assert table.loc["InfLLM-v2, 32K, PRR, P = A replayed", "run × [95%]"] == "1.010 [1.000, 1.020]"
