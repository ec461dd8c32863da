import numpy as np
import pytest

from prr.intervals import bootstrap_mean, wilson


def test_wilson_matches_the_textbook_values():
    # 8 of 10: Wilson's 95% interval is [0.490, 0.943] (Newcombe 1998's table, to 3 places)
    iv = wilson(8, 10)
    assert iv.estimate == 0.8 and iv.n == 10
    assert iv.low == pytest.approx(0.4902, abs=5e-4) and iv.high == pytest.approx(0.9433, abs=5e-4)


def test_wilson_stays_inside_the_unit_interval_at_the_edges():
    zero, all_ = wilson(0, 5), wilson(5, 5)
    assert zero.low == 0.0 and 0.4 < zero.high < 0.5  # 0/5: [0, 0.434]
    assert all_.high == 1.0 and 0.5 < all_.low < 0.6
    assert wilson(50, 100).high - wilson(50, 100).low < wilson(5, 10).high - wilson(5, 10).low  # n narrows it


@pytest.mark.parametrize("successes,n", [(-1, 3), (4, 3), (0, 0)])
def test_wilson_refuses_impossible_counts(successes, n):
    with pytest.raises(ValueError, match=f"successes={successes}, n={n}"):
        wilson(successes, n)


def test_bootstrap_resamples_prompts_and_covers_the_mean():
    rng = np.random.default_rng(1)
    values = rng.normal(0.7, 0.1, size=40)
    iv = bootstrap_mean(values)
    assert iv.n == 40 and iv.low < values.mean() < iv.high
    # the bootstrap's width is close to the normal one for a mean of 40 iid draws (1.96 * sd / sqrt(n))
    normal = 1.96 * values.std(ddof=1) / np.sqrt(40)
    assert (iv.high - iv.low) / 2 == pytest.approx(normal, rel=0.15)
    assert bootstrap_mean(values, seed=3) != bootstrap_mean(values, seed=4)  # really resampled


def test_bootstrap_of_one_prompt_is_a_point_and_bad_input_is_refused():
    iv = bootstrap_mean([0.5])
    assert (iv.estimate, iv.low, iv.high, iv.n) == (0.5, 0.5, 0.5, 1)
    for bad in ([], [float("nan")], [[1.0, 2.0]]):
        with pytest.raises(ValueError, match="per-prompt values"):
            bootstrap_mean(bad)
    assert str(wilson(1, 2)).endswith("(n=2)")


def test_means_over_prompts_gives_each_groups_mean_interval_and_n():
    import pandas as pd

    from prr.intervals import means_over_prompts

    per_prompt = pd.DataFrame({"variant": ["a", "a", "a", "b"], "rate": [0.2, 0.4, 0.9, 0.5]})
    table = means_over_prompts(per_prompt, ["variant"], ["rate"]).set_index("variant")
    assert table.loc["a", "rate"] == pytest.approx(0.5) and table.loc["a", "prompts"] == 3
    assert 0.2 <= table.loc["a", "rate_lo"] < 0.5 < table.loc["a", "rate_hi"] <= 0.9
    assert table.loc["b", ["rate", "rate_lo", "rate_hi", "prompts"]].tolist() == [0.5, 0.5, 0.5, 1]


def test_score_interval_is_wilson_for_0_1_scores_and_a_bootstrap_for_partial_credit():
    from prr.intervals import score_interval

    assert score_interval([1, 0, 1, 1]) == wilson(3, 4)
    partial = score_interval([0.5, 1.0, 0.25])
    assert partial == bootstrap_mean([0.5, 1.0, 0.25]) and partial.n == 3


def test_mean_of_groups_weighs_groups_equally_and_resamples_within_each():
    """Tasks pooled with unequal prompts: the estimate is the mean of the group means (not of all
    values), a group of one constant value adds no spread, and equal groups give bootstrap_mean's
    estimate; bad groups are refused."""
    from prr.intervals import bootstrap_mean, bootstrap_mean_of_groups

    rng = np.random.default_rng(7)
    big, small = rng.random(41).tolist(), [1.0, 1.0, 1.0]
    pooled = bootstrap_mean_of_groups([big, small])
    assert pooled.estimate == pytest.approx((np.mean(big) + 1.0) / 2) and pooled.n == 44
    assert pooled.estimate != pytest.approx(np.mean(big + small))
    alone = bootstrap_mean(big)  # the constant group halves the spread of the big one's mean
    assert (pooled.high - pooled.low) == pytest.approx((alone.high - alone.low) / 2, rel=0.1)
    assert pooled.low <= pooled.estimate <= pooled.high
    even = [rng.random(9).tolist() for _ in range(3)]
    assert bootstrap_mean_of_groups(even).estimate == pytest.approx(bootstrap_mean(sum(even, [])).estimate)
    for bad in ([], [[]], [[0.5, float("nan")]]):
        with pytest.raises(ValueError, match="bootstrap_mean_of_groups"):
            bootstrap_mean_of_groups(bad)
