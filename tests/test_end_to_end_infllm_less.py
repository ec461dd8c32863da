"""InfLLM and LESS through the Hydra config and the runner on the tiny model: exact-mode PRR
is serial DSA (LESS's compensation included) and token-identical to predictor=none."""

import pytest

from tests.test_end_to_end import run_tiny


@pytest.mark.parametrize("selector", ["infllm", "less"])
def test_selector_runs_end_to_end_and_prr_is_serial_dsa(tmp_path, selector):
    serial = run_tiny(tmp_path, f"selector={selector}", "predictor=none", name="serial")
    prr = run_tiny(tmp_path, f"selector={selector}", "predictor=ema", "runtime.check_serial=true", name="prr")
    assert prr["max_serial_relerr"] <= 1e-5
    assert prr["generated_token_ids"] == serial["generated_token_ids"]
    assert 0 < prr["hit_rate"] <= 1 and 0 < prr["mean_mass_recall"] <= 1
