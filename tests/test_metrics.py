"""detrl.apps.metrics against hand-computed values on small fixed arrays (arithmetic in the comments)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import scipy.stats

from detrl.apps import metrics as M


def one_hot_logits(preds: list[list[int]], classes: int) -> np.ndarray:
    """(runs, examples) predicted classes -> (runs, examples, classes) logits whose argmax is that class."""
    return np.eye(classes)[np.asarray(preds)] * 5.0


# --------------------------------------------------------------------------------------------------------
# per-run metrics


def test_accuracy_and_stable_cross_entropy():
    # One run, 2 examples, 2 classes; labels [0, 1].
    # ex0 logits [1000, 0]: log-softmax = [-log1p(e^-1000), -1000 - log1p(e^-1000)] ~ [0, -1000]
    #                       label 0 -> 0 nats
    # ex1 logits [0, 0]:    log-softmax = [-ln 2, -ln 2]; label 1 -> ln 2 nats; argmax 0 (tie) is wrong
    # accuracy = 1/2; CE = (0 + ln 2) / 2. A naive softmax would overflow on exp(1000).
    logits = np.array([[[1000.0, 0.0], [0.0, 0.0]]])
    labels = np.array([0, 1])
    np.testing.assert_array_equal(M.accuracy(logits, labels), [0.5])
    ce = M.cross_entropy(logits, labels)
    assert ce.shape == (1,)
    assert ce[0] == pytest.approx(math.log(2) / 2, rel=1e-15)


def test_input_checks():
    with pytest.raises(ValueError, match="labels must have shape"):
        M.accuracy(np.zeros((2, 3, 4)), np.zeros(2, dtype=int))
    with pytest.raises(TypeError, match="integers"):
        M.accuracy(np.zeros((2, 3, 4)), np.zeros(3))
    with pytest.raises(ValueError, match="at least 2 runs"):
        M.pairwise_disagreement(np.zeros((1, 3, 4)))


# --------------------------------------------------------------------------------------------------------
# pairwise metrics


def test_disagreement_three_runs_four_examples():
    # predictions            ex0 ex1 ex2 ex3
    #   run0                   0   1   2   0
    #   run1                   0   1   1   0   vs run0: ex2            -> 1/4
    #   run2                   1   1   2   2   vs run0: ex0, ex3       -> 2/4 ; vs run1: ex0, ex2, ex3 -> 3/4
    # mean over the 3 pairs = (1/4 + 2/4 + 3/4) / 3 = 0.5
    logits = one_hot_logits([[0, 1, 2, 0], [0, 1, 1, 0], [1, 1, 2, 2]], classes=3)
    assert M.pairwise_disagreement(logits) == 0.5
    assert M.pairwise_disagreement(logits[:2]) == 0.25


# Three runs with 2 examples x 2 classes each; flattened: a = [1,2,3,4], b = [1,3,2,40], c = [1,2,2,3].
CORR_LOGITS = np.array([[[1, 2], [3, 4]], [[1, 3], [2, 40]], [[1, 2], [2, 3]]], dtype=np.float64)


def test_pearson_three_runs_by_hand():
    # deviations from the mean:  a (mean 2.5): [-1.5, -0.5, 0.5, 1.5]   sum sq = 5
    #                            b (mean 11.5): [-10.5, -8.5, -9.5, 28.5]
    #                                 sum sq = 110.25 + 72.25 + 90.25 + 812.25 = 1085
    #                            c (mean 2):   [-1, 0, 0, 1]            sum sq = 2
    # r_ab = (15.75 + 4.25 - 4.75 + 42.75) / sqrt(5 * 1085) = 58 / sqrt(5425)
    # r_ac = (1.5 + 0 + 0 + 1.5) / sqrt(5 * 2) = 3 / sqrt(10)
    # r_bc = (10.5 + 0 + 0 + 28.5) / sqrt(1085 * 2) = 39 / sqrt(2170)
    r_ab, r_ac, r_bc = 58 / math.sqrt(5425), 3 / math.sqrt(10), 39 / math.sqrt(2170)
    hand = (r_ab + r_ac + r_bc) / 3
    flat = CORR_LOGITS.reshape(3, -1)
    second_opinion = [scipy.stats.pearsonr(flat[i], flat[j])[0] for i, j in ((0, 1), (0, 2), (1, 2))]
    np.testing.assert_allclose(second_opinion, [r_ab, r_ac, r_bc], rtol=1e-12)
    assert M.pairwise_correlation(CORR_LOGITS, "pearson") == pytest.approx(hand, rel=1e-12)
    assert M.pairwise_correlation(CORR_LOGITS[:2]) == pytest.approx(r_ab, rel=1e-12)


def test_spearman_three_runs_by_hand_with_average_ties():
    # ranks: a -> [1, 2, 3, 4]; b -> [1, 3, 2, 4]; c = [1,2,2,3] -> [1, 2.5, 2.5, 4] (ties: average rank)
    # rank deviations (all means 2.5): a [-1.5,-.5,.5,1.5] (sum sq 5), b [-1.5,.5,-.5,1.5] (sum sq 5),
    #                                  c [-1.5,0,0,1.5] (sum sq 4.5)
    # rho_ab = (2.25 - .25 - .25 + 2.25) / sqrt(5 * 5) = 4 / 5 = 0.8
    # rho_ac = (2.25 + 0 + 0 + 2.25) / sqrt(5 * 4.5) = 4.5 / sqrt(22.5) = sqrt(0.9)
    # rho_bc = (2.25 + 0 + 0 + 2.25) / sqrt(5 * 4.5) = sqrt(0.9)
    hand = (0.8 + 2 * math.sqrt(0.9)) / 3
    flat = CORR_LOGITS.reshape(3, -1)
    second_opinion = [scipy.stats.spearmanr(flat[i], flat[j])[0] for i, j in ((0, 1), (0, 2), (1, 2))]
    np.testing.assert_allclose(second_opinion, [0.8, math.sqrt(0.9), math.sqrt(0.9)], rtol=1e-12)
    assert M.pairwise_correlation(CORR_LOGITS, "spearman") == pytest.approx(hand, rel=1e-12)
    with pytest.raises(ValueError, match="method"):
        M.pairwise_correlation(CORR_LOGITS, "kendall")  # type: ignore[arg-type]


def test_correlation_of_a_constant_run_is_nan():
    logits = np.stack([np.ones((2, 2)), CORR_LOGITS[0]])
    assert math.isnan(M.pairwise_correlation(logits))


def test_ensemble_gain_two_runs_three_examples():
    # labels [0, 0, 1]; logits = log(probabilities), so softmax gives the probabilities back.
    #            run0 p        run1 p        ensemble (mean)
    #   ex0  [0.9, 0.1] ok  [0.7, 0.3] ok  [0.80, 0.20] ok
    #   ex1  [0.4, 0.6] X   [0.8, 0.2] ok  [0.60, 0.40] ok   <- the ensemble fixes ex1
    #   ex2  [0.6, 0.4] X   [0.7, 0.3] X   [0.65, 0.35] X    (label 1: p = 0.4, 0.3, 0.35)
    # accuracy: run0 1/3, run1 2/3, ensemble 2/3 -> gain = 2/3 - (1/3 + 2/3)/2 = 1/6
    # CE: singles' mean = -(ln .9 + ln .4 + ln .4 + ln .7 + ln .8 + ln .3) / 6 = -ln(0.024192) / 6
    #     ensemble      = -(ln .8 + ln .6 + ln .35) / 3 = -ln(0.168) / 3
    #     gain = single - ensemble = (2 ln 0.168 - ln 0.024192) / 6 = ln(0.028224 / 0.024192) / 6
    #          = ln(7/6) / 6
    p = np.array(
        [
            [[0.9, 0.1], [0.4, 0.6], [0.6, 0.4]],
            [[0.7, 0.3], [0.8, 0.2], [0.7, 0.3]],
        ]
    )
    labels = np.array([0, 0, 1])
    logits = np.log(p)
    np.testing.assert_allclose(M.accuracy(logits, labels), [1 / 3, 2 / 3])
    gain = M.ensemble_gain(logits, labels)
    assert set(gain) == {"accuracy", "cross_entropy"}
    assert gain["accuracy"] == pytest.approx(1 / 6, rel=1e-12)
    assert gain["cross_entropy"] == pytest.approx(math.log(7 / 6) / 6, rel=1e-12)
    assert gain["cross_entropy"] > 0  # positive = the ensemble is better


def test_pairwise_statistic_weights_pairs_of_distinct_runs():
    # pair values: m01 = 1, m02 = 2, m12 = 4
    m = np.array([[9.0, 1.0, 2.0], [1.0, 9.0, 4.0], [2.0, 4.0, 9.0]])  # the diagonal is never used
    stat = M.pairwise_statistic(m)
    assert stat(np.arange(3)) == pytest.approx((1 + 2 + 4) / 3)
    # [0, 0, 1]: position pairs (0,0) self -> dropped, (0,1) twice -> mean = m01 = 1
    assert stat(np.array([0, 0, 1])) == 1.0
    # [0, 0, 2, 1]: counts c0=2, c1=1, c2=1 -> weights c0c1=2, c0c2=2, c1c2=1 -> (2*1 + 2*2 + 1*4) / 5 = 2
    assert stat(np.array([0, 0, 2, 1])) == pytest.approx(2.0)
    batch = stat(np.array([[0, 1, 2], [0, 0, 1], [2, 2, 2]]))
    assert batch.shape == (3,)
    assert batch[1] == 1.0 and math.isnan(batch[2])  # a single distinct run has no pair


# --------------------------------------------------------------------------------------------------------
# bootstrap


def test_bootstrap_interval_is_reproducible_and_contains_the_point():
    values = np.array([0.90, 0.91, 0.93, 0.88, 0.95, 0.92, 0.89, 0.94, 0.90, 0.91])  # mean = 0.913
    a = M.bootstrap_interval(values, np.mean, resamples=2000, seed=3)
    b = M.bootstrap_interval(values, np.mean, resamples=2000, seed=3)
    assert a == b
    assert a != M.bootstrap_interval(values, np.mean, resamples=2000, seed=4)
    lo, hi = a
    assert lo < values.mean() < hi
    assert M.bootstrap_interval(values, lambda x: x.mean(axis=1), resamples=2000, seed=3, batched=True) == a


def test_bootstrap_skips_resamples_with_one_distinct_run():
    # With 2 runs, half the resamples draw one run twice; the statistic must never see them.
    seen = []

    def distinct(x: np.ndarray) -> float:
        seen.append(len(set(x.tolist())))
        return float(x.mean())

    M.bootstrap_interval(np.array([0.0, 1.0]), distinct, resamples=200, seed=0)
    assert set(seen) == {2} and 60 < len(seen) < 140
    with pytest.raises(ValueError, match="at least 2 runs"):
        M.bootstrap_interval(np.array([1.0]), np.mean)


def test_identical_runs_are_the_exact_deterministic_control_row():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, size=50)
    logits = np.broadcast_to(rng.normal(size=(50, 4)), (5, 50, 4)).copy()
    assert M.pairwise_disagreement(logits) == 0.0
    assert M.pairwise_correlation(logits, "pearson") == 1.0
    assert M.pairwise_correlation(logits, "spearman") == 1.0
    assert M.ensemble_gain(logits, labels) == {"accuracy": 0.0, "cross_entropy": 0.0}
    acc = M.accuracy(logits, labels)
    assert M.mean_sd(acc) == (float(acc[0]), 0.0)
    summary = M.diversity_summary(logits, labels, resamples=500)
    exact = {"pearson": 1.0, "spearman": 1.0}
    for name, row in summary.items():
        want = exact.get(name, 0.0)
        assert row == {"value": want, "lo": want, "hi": want}, name


def test_diversity_summary_full_size_is_fast_and_consistent():
    # 10 runs x 1,797 examples (the digits set) x 10 classes, 10,000 resamples.
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 10, size=1797)
    base = rng.normal(size=(1797, 10))
    base[np.arange(1797), labels] += 2.0
    logits = base + 0.5 * rng.normal(size=(10, 1797, 10))
    t0 = time.perf_counter()
    summary = M.diversity_summary(logits, labels, resamples=10_000, seed=0)
    assert time.perf_counter() - t0 < 5.0
    assert list(summary) == [
        "accuracy_sd",
        "cross_entropy_sd",
        "disagreement",
        "pearson",
        "spearman",
        "ensemble_gain_accuracy",
        "ensemble_gain_cross_entropy",
    ]
    gain = M.ensemble_gain(logits, labels)
    assert summary["disagreement"]["value"] == pytest.approx(M.pairwise_disagreement(logits), rel=1e-12)
    assert summary["pearson"]["value"] == pytest.approx(M.pairwise_correlation(logits), rel=1e-12)
    assert summary["ensemble_gain_accuracy"]["value"] == pytest.approx(gain["accuracy"], rel=1e-12)
    assert summary["accuracy_sd"]["value"] == pytest.approx(np.std(M.accuracy(logits, labels), ddof=1))
    for name in (
        "disagreement",
        "pearson",
        "spearman",
        "ensemble_gain_accuracy",
        "ensemble_gain_cross_entropy",
    ):
        row = summary[name]
        assert row["lo"] <= row["value"] <= row["hi"], name
    assert M.diversity_summary(logits, labels, resamples=300, seed=5) == M.diversity_summary(
        logits, labels, resamples=300, seed=5
    )


def test_l2_distance_over_common_keys():
    # w differs by (3, 0), b by (4): sqrt(9 + 16) = 5; "extra" is only in one dict and is ignored.
    a = {"w": np.array([0.0, 0.0]), "b": np.array([1.0])}
    b = {"w": np.array([3.0, 0.0]), "b": np.array([5.0]), "extra": np.ones(7)}
    assert M.l2_distance(a, b) == 5.0
    assert M.l2_distance(a, a) == 0.0
    with pytest.raises(ValueError, match="shape"):
        M.l2_distance(a, {"w": np.zeros(3)})
    with pytest.raises(ValueError, match="no key"):
        M.l2_distance(a, {"z": np.zeros(1)})


# --------------------------------------------------------------------------------------------------------
# RL statistics


def test_iqm_of_one_to_eight():
    # 8 scores; trim 25% = 2 from each end -> mean(3, 4, 5, 6) = 4.5
    scores = np.arange(1, 9, dtype=np.float64)
    state = np.random.get_state()[1].copy()
    iqm, lo, hi = M.iqm_with_interval(scores, resamples=2000, seed=0)
    assert iqm == 4.5
    assert lo < 4.5 < hi
    assert M.iqm_with_interval(scores, resamples=2000, seed=0) == (iqm, lo, hi)
    assert np.array_equal(np.random.get_state()[1], state)  # the global RNG is left alone
    # (runs, tasks): the trim covers all 8 scores together, so a (4, 2) layout of them gives 4.5 too.
    assert M.iqm_with_interval(scores.reshape(4, 2), resamples=100)[0] == 4.5


@pytest.mark.skipif(not M.rliable_available(), reason="rliable is not installed (or does not import)")
@pytest.mark.filterwarnings("ignore")
def test_iqm_matches_rliable_bit_for_bit():
    scores = np.random.default_rng(2).normal(size=(6, 4))
    state = np.random.get_state()[1].copy()
    ours = M.iqm_with_interval(scores, resamples=500, confidence=0.9, seed=11, backend="numpy")
    assert M.iqm_with_interval(scores, resamples=500, confidence=0.9, seed=11) == ours  # auto: rliable
    theirs = M.iqm_with_interval(scores, resamples=500, confidence=0.9, seed=11, backend="rliable")
    assert ours == theirs
    assert np.array_equal(np.random.get_state()[1], state)


def test_area_under_linear_curves():
    # y = 2 t + 1 on t in [0, 30]: the mean over the range is the value at the midpoint, y(15) = 31.
    # Uneven steps [0, 10, 40] with y = [0, 10, 10]: areas (0+10)/2*10 = 50 and (10+10)/2*30 = 300
    #                                               -> 350 / 40 = 8.75
    steps = np.array([0.0, 10.0, 20.0, 30.0])
    np.testing.assert_allclose(
        M.area_under_curve(np.stack([2 * steps + 1, np.full(4, 7.0)]), steps), [31.0, 7.0]
    )
    np.testing.assert_allclose(M.area_under_curve([0.0, 10.0, 10.0], [0, 10, 40]), [8.75])
    with pytest.raises(ValueError, match="increasing"):
        M.area_under_curve([1.0, 2.0], [5, 5])


def test_mean_sd():
    # [1, 2, 3, 4]: mean 2.5; squared deviations 2.25 + .25 + .25 + 2.25 = 5; ddof=1 -> sqrt(5/3)
    assert M.mean_sd([1.0, 2.0, 3.0, 4.0]) == (2.5, pytest.approx(math.sqrt(5 / 3)))
    assert M.mean_sd([7.0]) == (7.0, 0.0)  # one run: SD 0.0 by convention
    assert M.mean_sd([0.1, 0.1, 0.1]) == (0.1, 0.0)  # exact, although (0.1 + 0.1 + 0.1) / 3 != 0.1


def test_first_divergence_step_is_bitwise():
    steps = np.array([100, 200, 300])
    control = np.array([1.0, 0.0, 2.0])
    assert (
        M.first_divergence_step(control, np.array([1.0, -0.0, 2.0]), steps) == 200
    )  # 0.0 == -0.0 numerically
    assert M.first_divergence_step(control, control.copy(), steps) is None
    assert M.first_divergence_step(control, np.array([1.0, 0.0, 2.5]), steps) == 300
    nan = np.array([np.nan, 1.0, 1.0])
    other_nan = nan.copy()
    other_nan.view(np.uint64)[0] ^= 1  # flip the lowest payload bit: still NaN, different bits
    assert np.isnan(other_nan[0])
    assert M.first_divergence_step(nan, nan.copy(), steps) is None  # same NaN bits: equal
    assert M.first_divergence_step(nan, other_nan, steps) == 100
    f32 = control.astype(np.float32)
    assert M.first_divergence_step(f32, np.array([1.0, -0.0, 2.0], dtype=np.float32), steps) == 200
    with pytest.raises(TypeError, match="dtype"):
        M.first_divergence_step(control, f32, steps)
