"""The CPU-testable parts of experiments/bench_engine_runs.py: the case grid, which serial run a
case is compared with, and the stage map's prediction of a whole PRR run. (The runs need a GPU.)"""

import importlib.util
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_engine_runs", ROOT / "experiments" / "bench_engine_runs.py")
er = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = er  # (its dataclass looks its module up)
_spec.loader.exec_module(er)


def test_matrix_over_settings_names_each_case_and_its_serial_run():
    settings = [er.Setting(32000, 16, 32), er.Setting(128000, 64, 128)]
    cases = er.cases("matrix", settings, ("quest", "dense"), ("none", "ema"))
    assert len(cases) == 8
    quest = cases["quest-ema@128k_b64_k128"]
    assert quest[:2] == ["selector=quest", "predictor=ema"]
    assert {"task.prompt_tokens=128000", "runtime.block_size=64", "selector.topk_blocks=128"} <= set(quest)
    assert not any(o.startswith("selector.topk_blocks") for o in cases["dense-ema@32k_b16_k32"])  # no top-K
    assert er.serial_of("quest-ema@128k_b64_k128") == "quest-none@128k_b64_k128"
    assert er.serial_of("quest-ema") == "quest-none" and er.serial_of("main") == "serial"
    assert list(er.cases("matrix"))[:3] == ["dense-none", "dense-last_step", "dense-ema"]  # the old names stay


def stage_map() -> pd.DataFrame:
    rows = []
    for context in (32512, 130816):
        for hit, prr in ((0.0, 40.0), (0.9, 30.0), (1.0, 20.0)):
            rows.append({"batch": 1, "selector": "quest", "block": 16, "topk_tokens": 512, "context": context,
                         "target_hit_rate": hit, "serial": 27.0, "serial_fused_merge": 25.0 + (context > 100000),
                         "prr": prr})
    rows.append({"batch": 8, "selector": "quest", "block": 16, "topk_tokens": 512, "context": 32512,
                 "target_hit_rate": 1.0, "serial": 99.0, "serial_fused_merge": 99.0, "prr": 1.0})  # another batch
    return pd.DataFrame(rows)


def test_map_prediction_interpolates_the_hit_rate_at_the_nearest_context():
    m = stage_map()
    # (the serial stage is the engine's: splits merged in the split kernel, serial_fused_merge, not
    # the map's `serial` with its merge launch)
    # 32K, hit 0.95: PRR stage 25 µs (between 30 at 0.9 and 20 at 1.0) = serial's 25: no change
    assert er.map_prediction(m, "quest", 32000, 16, 512, 0.95, 5.0, 30) == pytest.approx(5.0)
    # 128K (nearest 130816, serial 26 µs), hit 1.0: 30 layers x 6 µs = 0.18 ms saved
    assert er.map_prediction(m, "quest", 128000, 16, 512, 1.0, 5.0, 30) == pytest.approx(5.0 - 0.18)
    # hit 0.2: PRR stage 40 - (0.2/0.9)*10 = 37.78 µs; 30 x (25 - 37.78) µs = 0.383 ms more
    assert er.map_prediction(m, "quest", 32000, 16, 512, 0.2, 5.0, 30) == pytest.approx(5.0 + 30 * (40 - 20 / 9 - 25) * 1e-3)
    for missing in (("infllm", 16, 512), ("quest", 64, 512), ("quest", 16, 2048)):
        assert math.isnan(er.map_prediction(m, missing[0], 32000, missing[1], missing[2], 0.5, 5.0, 30))
    assert math.isnan(er.map_prediction(m, "quest", 32000, 16, 512, float("nan"), 5.0, 30))


def test_map_prediction_reads_the_rates_the_maps_p_had():
    """bench_decode's P holds round(rate·K) of K blocks (0.9375 of 32 for 0.95): the prediction
    interpolates at those rates where the map records them (its hit_rate column)."""
    m = stage_map()
    m["hit_rate"] = m["target_hit_rate"].replace({0.9: 0.8})  # P of the 0.9 rows held 80% of A
    # hit 0.9 now lies between 0.8 (30 µs) and 1.0 (20 µs): 25 µs = serial's 25, no change
    assert er.map_prediction(m, "quest", 32000, 16, 512, 0.9, 5.0, 30) == pytest.approx(5.0)
    assert er.map_prediction(stage_map(), "quest", 32000, 16, 512, 0.9, 5.0, 30) == pytest.approx(5.0 + 30 * 5e-3)


def test_map_rates_that_round_to_one_are_averaged_and_clamping_is_judged_in_the_runs_cell():
    """Two requested rates whose P held the same share (0.98 and 1.0 of 6 blocks: 1.0) give one
    point, their mean; whether a run's rate lies outside the map is judged in the cell its
    prediction reads (same budget, nearest context), not across every cell of the selector."""
    m = stage_map().assign(hit_rate=lambda d: d["target_hit_rate"])
    m = pd.concat([m, m[m["target_hit_rate"] == 1.0].assign(target_hit_rate=0.98, prr=24.0)], ignore_index=True)
    # at 1.0 the PRR stage is (20 + 24) / 2 = 22 µs against serial's 25: 30 layers save 0.09 ms
    assert er.map_prediction(m, "quest", 32000, 16, 512, 1.0, 5.0, 30) == pytest.approx(5.0 - 0.09)
    m = m.assign(hit_rate=m["hit_rate"].clip(lower=0.4))  # K = 512 tokens: rates 0.4-1.0
    wide = pd.concat([m, m.assign(topk_tokens=2048, hit_rate=0.2)], ignore_index=True)  # another budget: 0.2
    row = pd.DataFrame([{"case": "quest-hit0.3@32k_b16_k32", "variant": "prr", "hit_rate": 0.3, "block_size": 16,
                         "prompt_tokens": 32000, "topk_blocks": 32}]).iloc[0]
    assert er.map_hit_outside(wide, row) and not er.map_hit_outside(wide, row.copy().replace({0.3: 0.5}))


def test_a_stage_map_of_another_dtype_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    """The map and the runs in one dtype (a map without the dtype column was timed in bf16)."""
    fp32, bf16 = tmp_path / "fp32.csv", tmp_path / "bf16.csv"
    stage_map().assign(dtype="float32").to_csv(fp32, index=False)
    stage_map().to_csv(bf16, index=False)
    monkeypatch.setattr(er, "run_case", lambda *a: pytest.fail("a run started"))
    for argv, said in (([str(fp32)], "timed in ['float32'], the runs in --dtype bfloat16"),
                       ([str(bf16), "--dtype", "float32"], "timed in ['bfloat16'], the runs in --dtype float32")):
        monkeypatch.setattr("sys.argv", ["bench_engine_runs.py", "--cases", "matrix", "--out", str(tmp_path / "x"),
                                         "--stage-map", *argv])
        with pytest.raises(SystemExit) as exit_:
            er.main()
        assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_predictions_go_to_prr_rows_only_beside_their_serial_run():
    table = pd.DataFrame([
        {"case": "quest-none@32k_b16_k32", "variant": "serial", "prompt_tokens": 32000, "block_size": 16,
         "topk_blocks": 32, "hit_rate": math.nan, "token_latency_median_ms": 5.0},
        {"case": "quest-ema@32k_b16_k32", "variant": "prr", "prompt_tokens": 32000, "block_size": 16,
         "topk_blocks": 32, "hit_rate": 1.0, "token_latency_median_ms": 4.9},
        {"case": "quest-ema@128k_b16_k32", "variant": "prr", "prompt_tokens": 128000, "block_size": 16,
         "topk_blocks": 32, "hit_rate": 1.0, "token_latency_median_ms": 4.9},  # its serial run failed
    ])
    out = er.with_predictions(table, stage_map())
    assert math.isnan(out.loc[0, "map_predicted_ms"]) and math.isnan(out.loc[2, "map_predicted_ms"])
    assert out.loc[1, "map_predicted_ms"] == pytest.approx(5.0 - 30 * 5e-3)  # 30 sparse layers of 32
    assert out.loc[1, "median_over_map"] == pytest.approx(4.9 / 4.85)
    assert out["map_hit_clamped"].tolist() == [None, False, False]  # hit 1.0 lies within the map's 0.0-1.0


@pytest.mark.parametrize("argv,message", [(["--contexts", "32k"], "not a comma-separated list of integers"),
                                          (["--blocks", "0"], "must be > 0"),
                                          (["--selectors", "quest,nsa"], "nsa not among"),
                                          (["--stage-map", "/nonexistent.csv"], "/nonexistent.csv: no such file")])
def test_bad_arguments_are_one_line_before_any_run(argv, message, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench_engine_runs.py", "--cases", "matrix", "--out", "/nonexistent/x", *argv])
    with pytest.raises(SystemExit) as exit_:
        er.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_controlled_hit_rate_cases_and_their_serial_runs():
    """--hit-rates / --profiled-hit-rates: predictor=bench_hit_rate per rate (and under
    budget=profiled with the same budget.hit_rate), each compared with its selector's serial run."""
    cases = er.cases("matrix", [er.Setting(32000, 16, 32)], ("quest",), ("none",), (0.5, 0.9), (0.9,))
    assert list(cases) == ["quest-none@32k_b16_k32", "quest-hit0.5@32k_b16_k32", "quest-hit0.9@32k_b16_k32",
                           "quest-hit0.9+profiled@32k_b16_k32"]
    assert {"predictor=bench_hit_rate", "predictor.hit_rate=0.5", "task.prompt_tokens=32000"} <= set(
        cases["quest-hit0.5@32k_b16_k32"])
    assert {"budget=profiled", "budget.hit_rate=0.9", "predictor.hit_rate=0.9"} <= set(
        cases["quest-hit0.9+profiled@32k_b16_k32"])
    for name in cases:
        assert er.serial_of(name) == "quest-none@32k_b16_k32"
    assert list(er.cases("matrix", None, ("quest",), ("none",), (0.7,))) == ["quest-none", "quest-hit0.7"]


def test_intervals_and_the_map_only_at_its_own_p():
    """Bootstrap interval of the median ratio over steps, Wilson over the script's selected blocks,
    token equality with serial DSA; a run at another |P| than |A| gets no map prediction."""
    base = {"variant": "prr", "prompt_tokens": 32000, "block_size": 16, "topk_blocks": 32,
            "generated_token_ids": [[1, 2, 3]]}
    table = pd.DataFrame([
        {**base, "case": "quest-none", "variant": "serial", "predicted_blocks": 0, "hit_rate": math.nan,
         "token_latency_median_ms": 5.0, "latencies_ms": [5.0, 5.1, 4.9, 5.0] * 8},
        {**base, "case": "quest-hit0.5", "predicted_blocks": 32, "hit_rate": 0.5, "token_latency_median_ms": 5.2,
         "latencies_ms": [5.2, 5.3, 5.1, 5.2] * 8,
         "budget_setup": {"calibration": {"selected": 1000, "hits": 500, "expected_hit_rate": 0.5}}},
        {**base, "case": "quest-hit0.9+profiled", "predicted_blocks": 64, "hit_rate": 0.9,
         "token_latency_median_ms": 4.9, "latencies_ms": [4.9] * 32, "generated_token_ids": [[1, 2, 4]]},
    ])
    out = er.with_predictions(er.with_intervals(table), stage_map())
    row = out.set_index("case").loc["quest-hit0.5"]
    assert row["median_over_serial_lo"] <= 5.2 / 5.0 <= row["median_over_serial_hi"] and row["median_over_serial_n"] == 32
    assert row["hit_rate_lo"] < 0.5 < row["hit_rate_hi"] and row["hit_rate_n"] == 1000 and row["script_hit_rate"] == 0.5
    assert bool(row["tokens_equal_serial"]) and math.isfinite(row["map_predicted_ms"])
    other = out.set_index("case").loc["quest-hit0.9+profiled"]
    assert not bool(other["tokens_equal_serial"]) and math.isnan(other["map_predicted_ms"])  # |P| = 64, map's 32
    assert other["first_token_difference"] == 2 and pd.isna(row["first_token_difference"])
    assert math.isnan(other["hit_rate_n"])  # no script counts in its record: no interval
    assert not row["map_hit_clamped"]  # 0.5 lies within the map's 0.0-1.0
    low = er.with_predictions(table.assign(hit_rate=[math.nan, 0.2, 0.9]).drop(columns=["map_predicted_ms",
                                                                                         "median_over_map"],
                                                                                errors="ignore"),
                              stage_map()[lambda m: m["target_hit_rate"] >= 0.9])
    assert low.set_index("case").loc["quest-hit0.5", "map_hit_clamped"]  # 0.2 below the map's lowest rate, 0.9


def test_the_indexer_takes_its_top_k_in_tokens():
    names = er.cases("matrix", [er.Setting(32000, 1, 2048)], ("indexer",), ("none",))
    assert names["indexer-none@32k_b1_k2048"][-1] == "selector.topk_tokens=2048"
    assert "runtime.block_size=1" in names["indexer-none@32k_b1_k2048"]


def test_reuse_cases_run_serial_dsa_with_anchors_and_are_priced_by_their_share_of_selections():
    names = er.cases("matrix", [er.Setting(32000, 16, 32)], ("quest",), ("none",), reuse_anchors=(4,))
    assert names["quest-none+anchors4@32k_b16_k32"][:4] == ["selector=quest", "predictor=none", "reuse=layers",
                                                          "reuse.anchors=4"]
    assert er.serial_of("quest-none+anchors4@32k_b16_k32") == "quest-none@32k_b16_k32"
    assert er.selecting_share({"policy": "layers", "selections_made": 8, "selections_skipped": 24}) == 0.25
    assert er.selecting_share(None) is None


def test_reuse_runs_are_priced_over_their_selectors_sparse_layers():
    """InfLLM-v2 selects in all 32 layers (its YAML's dense_layers: []), Quest in 30: a run of each
    with reuse.anchors=2 skips 16 and 15 selections a step, each saving the map's stage_select."""
    rows = []
    for selector, layers in (("quest", 30), ("infllm_v2", 32)):
        base = {"prompt_tokens": 32000, "block_size": 16, "topk_blocks": 32, "hit_rate": math.nan,
                "predicted_blocks": 0, "variant": "serial", "decode_steps": 4}
        made = -(-layers // 2)
        rows += [{**base, "case": f"{selector}-none", "token_latency_median_ms": 5.0, "reuse": None},
                 {**base, "case": f"{selector}-none+anchors2", "token_latency_median_ms": 4.9,
                  "reuse": {"policy": "layers", "selections_made": 4 * made, "selections_skipped": 4 * (layers - made)}}]
    stage_map = pd.concat([pd.DataFrame([{"batch": 1, "selector": s, "block": 16, "topk_tokens": 512, "context": 32512,
                                          "target_hit_rate": 1.0, "serial_fused_merge": 25.0, "stage_select": 10.0,
                                          "prr": 20.0}]) for s in ("quest", "infllm_v2")])
    out = er.with_predictions(pd.DataFrame(rows), stage_map).set_index("case")
    assert out.loc["quest-none+anchors2", "map_predicted_ms"] == pytest.approx(5.0 - 15 * 10e-3)
    assert out.loc["infllm_v2-none+anchors2", "map_predicted_ms"] == pytest.approx(5.0 - 16 * 10e-3)
    wrong = pd.DataFrame(rows[2:]).assign(reuse=[None, {"selections_made": 60, "selections_skipped": 60}])
    with pytest.raises(ValueError, match="selected in 30 layers a step, conf/selector/infllm_v2.yaml leaves 32"):
        er.with_predictions(wrong, stage_map)


def test_step_reuse_cases_run_serial_dsa_every_n_steps_and_are_priced_as_one_step_in_n():
    names = er.cases("matrix", [er.Setting(32000, 16, 32)], ("quest",), ("none",), reuse_every=(4,))
    assert names["quest-none+every4@32k_b16_k32"][:4] == ["selector=quest", "predictor=none", "reuse=steps",
                                                        "reuse.every=4"]
    assert er.serial_of("quest-none+every4@32k_b16_k32") == "quest-none@32k_b16_k32"
    base = {"prompt_tokens": 32000, "block_size": 16, "topk_blocks": 32, "hit_rate": math.nan, "predicted_blocks": 0,
            "variant": "serial", "decode_steps": 8}
    rows = [{**base, "case": "quest-none", "token_latency_median_ms": 5.0, "reuse": None},
            {**base, "case": "quest-none+every4", "token_latency_median_ms": 4.8,  # steps 0 and 4 select
             "reuse": {"policy": "steps", "selections_made": 2 * 30, "selections_skipped": 6 * 30}}]
    stage_map = pd.DataFrame([{"batch": 1, "selector": "quest", "block": 16, "topk_tokens": 512, "context": 32512,
                               "target_hit_rate": 1.0, "serial_fused_merge": 25.0, "stage_select": 10.0, "prr": 20.0}])
    out = er.with_predictions(pd.DataFrame(rows), stage_map).set_index("case")
    # 3 of 4 steps skip selection in each of Quest's 30 sparse layers: 30 x 10 us x 3/4 a token
    assert out.loc["quest-none+every4", "map_predicted_ms"] == pytest.approx(5.0 - 30 * 10e-3 * 3 / 4)
    assert er.reuse_variant({"policy": "layers", "selections_made": 8, "selections_skipped": 24}, 32) == \
        {"reuse": "layers", "anchors": 8}
