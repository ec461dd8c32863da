"""prr.cost_model: each variant's prediction is the serial run's time less, per sparse layer, what
the variant changes in the stage map's measured stage."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from prr.cost_model import Variant, map_cell, predict_token_ms

SERIAL, SELECT = 40.0, 15.0  # µs a layer: serial stage, of which selection


def stage_map() -> pd.DataFrame:
    """One quest cell at 32K (PRR 30 µs at h = 0.5, 20 µs at h = 1.0) and one at 128K."""
    rows = [dict(batch=1, selector="quest", context=c, block=16, topk_tokens=512, hit_rate=h, prr=p,
                 serial_fused_merge=SERIAL * k, stage_select=SELECT * k)
            for c, k in ((32000, 1.0), (128000, 3.0)) for h, p in ((0.5, 30.0 * k), (1.0, 20.0 * k))]
    return pd.DataFrame(rows)


@pytest.fixture
def cell() -> pd.DataFrame:
    return map_cell(stage_map(), "quest", 30000, 16, 512)


def test_serial_dsa_is_predicted_as_its_own_run(cell):
    assert predict_token_ms(cell, 5.0, 30, Variant()) == pytest.approx(5.0)


def test_speculation_takes_the_prr_stage_at_the_runs_hit_rate(cell):
    assert predict_token_ms(cell, 5.0, 30, Variant(speculates=True, hit_rate=0.75)) == \
        pytest.approx(5.0 - 30 * (SERIAL - 25.0) * 1e-3)
    # clamped to the map's rates
    assert predict_token_ms(cell, 5.0, 30, Variant(speculates=True, hit_rate=0.2)) == \
        pytest.approx(5.0 - 30 * (SERIAL - 30.0) * 1e-3)


def test_reused_layers_skip_their_selection_and_anchors_keep_the_base(cell):
    assert predict_token_ms(cell, 5.0, 30, Variant(reuse="layers", anchors=30)) == pytest.approx(5.0)
    assert predict_token_ms(cell, 5.0, 30, Variant(reuse="layers", anchors=8)) == pytest.approx(5.0 - 22 * SELECT * 1e-3)
    spec = Variant(speculates=True, hit_rate=1.0, reuse="layers", anchors=8)
    assert predict_token_ms(cell, 5.0, 30, spec) == pytest.approx(5.0 - (8 * (SERIAL - 20.0) + 22 * SELECT) * 1e-3)


def test_reuse_across_steps_selects_one_step_in_n(cell):
    assert predict_token_ms(cell, 5.0, 30, Variant(reuse="steps", every=1)) == pytest.approx(5.0)
    assert predict_token_ms(cell, 5.0, 30, Variant(reuse="steps", every=4)) == pytest.approx(5.0 - 30 * 0.75 * SELECT * 1e-3)


def test_a_hinted_top_k_saves_on_every_selecting_layer_only(cell):
    assert predict_token_ms(cell, 5.0, 30, Variant(selection_saving_us=2.0)) == pytest.approx(5.0 - 30 * 2.0 * 1e-3)
    both = Variant(reuse="layers", anchors=10, selection_saving_us=2.0)
    assert predict_token_ms(cell, 5.0, 30, both) == pytest.approx(5.0 - (10 * 2.0 + 20 * SELECT) * 1e-3)


def test_the_nearest_context_and_a_missing_cell():
    far = map_cell(stage_map(), "quest", 100000, 16, 512)
    assert set(far["context"]) == {128000}
    assert predict_token_ms(far, 9.0, 30, Variant(reuse="steps", every=2)) == pytest.approx(9.0 - 30 * 0.5 * 3 * SELECT * 1e-3)
    assert math.isnan(predict_token_ms(map_cell(stage_map(), "exact", 32000, 16, 512), 5.0, 30, Variant()))


@pytest.mark.parametrize("variant, words", [
    (Variant(reuse="sometimes"), "reuse='sometimes'"),
    (Variant(reuse="layers"), "anchors >= 1"),
    (Variant(reuse="steps", every=0), "every=0"),
    (Variant(speculates=True), "hit_rate"),
])
def test_a_variant_it_cannot_price_is_refused_by_name(cell, variant, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        predict_token_ms(cell, 5.0, 30, variant)


def test_sparse_layers_are_the_selectors_own(tmp_path):
    from prr.cost_model import sparse_layer_count

    assert sparse_layer_count("quest", 32) == 30  # dense_layers [0, 1]
    assert sparse_layer_count("infllm_v2", 32) == 32  # dense_layers []: it selects in every layer
    assert sparse_layer_count("dense", 32) == 32
    (tmp_path / "odd.yaml").write_text("dense_layers: [0, 5, 5]\n")
    assert sparse_layer_count("odd", 32, tmp_path) == 30
    with pytest.raises(ValueError, match=r"dense_layers \[40\] lie outside a 32-layer model"):
        (tmp_path / "far.yaml").write_text("dense_layers: [40]\n")
        sparse_layer_count("far", 32, tmp_path)
    with pytest.raises(ValueError, match="selector 'nsa' has no"):
        sparse_layer_count("nsa", 32, tmp_path)
