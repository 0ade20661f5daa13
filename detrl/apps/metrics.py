"""Run-to-run variability metrics: supervised diversity and RL aggregate statistics.

Supervised metrics follow Summers & Dinneen, "Nondeterminism and Instability in Neural Network
Optimization" (ICML 2021). Every input holds several training runs of one model that differ only in
a source of nondeterminism. ``logits`` has shape ``(runs, examples, classes)``, with raw pre-softmax
scores; ``labels`` has shape ``(examples,)``, with integer classes. Accuracies are fractions in
[0, 1] and cross-entropies are mean nats per example. The paper's unit of resampling is the run:
:func:`bootstrap_interval` resamples runs, never examples.

RL metrics follow Agarwal et al., "Deep Reinforcement Learning at the Edge of the Statistical
Precipice" (NeurIPS 2021, the ``rliable`` library). ``scores`` are final returns with shape
``(runs,)`` or ``(runs, tasks)``. ``curves`` are returns over training with shape
``(runs, points)``, recorded at ``steps`` of shape ``(points,)``.

Only numpy and scipy are needed. :func:`iqm_with_interval` calls ``rliable`` itself when it is
installed (the ``stats`` extra) and otherwise a reimplementation of its stratified-bootstrap IQM that
reproduces it bit for bit (a test checks this wherever rliable imports): rliable 1.2 pins arch < 8, which
does not import under pandas 3.

Determinism: every function is a pure function of its inputs and ``seed``. The bootstraps here use
a private generator and never touch numpy's global RNG, apart from ``backend="rliable"`` (see
:func:`iqm_with_interval`). Identical runs give exact answers, not merely close ones: an SD of
0.0, a disagreement of 0.0, a correlation of 1.0 and ensemble gains of 0.0. That makes a
deterministic control row read exactly.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "accuracy",
    "area_under_curve",
    "bootstrap_interval",
    "cross_entropy",
    "diversity_summary",
    "ensemble_gain",
    "first_divergence",
    "first_divergence_step",
    "iqm_with_interval",
    "l2_distance",
    "mean_sd",
    "pairwise_correlation",
    "pairwise_disagreement",
    "pairwise_statistic",
]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

# ---------------------------------------------------------------------------------------------------------
# input checks and small exact helpers


def _logits(logits: ArrayLike) -> FloatArray:
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim != 3 or 0 in x.shape:
        raise ValueError(
            f"logits must have shape (runs, examples, classes), none of them empty; got {x.shape}"
        )
    return x


def _labels(labels: ArrayLike, logits: FloatArray) -> IntArray:
    y = np.asarray(labels)
    if y.shape != (logits.shape[1],):
        raise ValueError(f"labels must have shape (examples,) = ({logits.shape[1]},); got {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise TypeError(f"labels must be integers; got dtype {y.dtype}")
    if y.min() < 0 or y.max() >= logits.shape[2]:
        raise ValueError(f"labels must lie in [0, {logits.shape[2]}); got range [{y.min()}, {y.max()}]")
    return y.astype(np.int64)


def _need_pairs(runs: int) -> None:
    if runs < 2:
        raise ValueError(f"a pairwise metric needs at least 2 runs; got {runs}")


def _log_softmax(logits: FloatArray) -> FloatArray:
    """Stable log-softmax over the last axis. Shape in = shape out."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _label_log_prob(logits: FloatArray, labels: IntArray) -> FloatArray:
    """log p(label) for each run and example: (runs, examples, classes) -> (runs, examples)."""
    return np.take_along_axis(_log_softmax(logits), labels[None, :, None], axis=-1)[..., 0]


def _sd(x: FloatArray, axis: int = -1) -> FloatArray:
    """SD with ddof=1 along ``axis``. It is exactly 0.0 where all values are equal, so the mean's
    rounding cannot leak in. The reduced axis must have length >= 2."""
    sd = np.std(x, axis=axis, ddof=1)
    return np.where(np.ptp(x, axis=axis) == 0, 0.0, sd)


# ---------------------------------------------------------------------------------------------------------
# supervised: per-run metrics


def accuracy(logits: ArrayLike, labels: ArrayLike) -> FloatArray:
    """Top-1 accuracy of each run.

    Args:
        logits: (runs, examples, classes) float scores.
        labels: (examples,) integer classes.

    Returns:
        (runs,) fraction of examples in [0, 1] whose argmax equals the label. A tie goes to the
        lowest class index, as in ``np.argmax``.
    """
    x = _logits(logits)
    y = _labels(labels, x)
    return (x.argmax(axis=-1) == y[None, :]).mean(axis=1)


def cross_entropy(logits: ArrayLike, labels: ArrayLike) -> FloatArray:
    """Mean cross-entropy of each run, in nats per example, from a stable log-softmax.

    Args:
        logits: (runs, examples, classes) float scores.
        labels: (examples,) integer classes.

    Returns:
        (runs,) ``-mean_e log softmax(logits[r, e])[labels[e]]``.
    """
    x = _logits(logits)
    return -_label_log_prob(x, _labels(labels, x)).mean(axis=1)


# ---------------------------------------------------------------------------------------------------------
# supervised: pairwise metrics. Each metric first builds a symmetric (runs, runs) matrix of pair values,
# then averages it over the pairs of distinct runs. The bootstrap reuses the same matrix.


def pairwise_statistic(pair_values: ArrayLike) -> Callable[[ArrayLike], FloatArray]:
    """Turn a (runs, runs) matrix of pair values into a statistic of a multiset of run ids.

    The returned function takes run ids of shape ``(..., k)``, such as one bootstrap resample
    ``(k,)`` or a batch ``(resamples, k)``. It returns shape ``(...)``: the mean of
    ``pair_values[i, j]`` over all position pairs ``p < q`` in the resample whose runs differ. A
    run drawn c_a times and a run drawn c_b times thus contribute weight c_a * c_b. A run paired
    with its own copy is never counted, because it is not a pair of two trainings. Counting it
    would pull disagreement towards 0 and correlation towards 1 by about 1/runs of the pairs.
    With no two distinct runs the result is NaN; :func:`bootstrap_interval` skips such resamples.
    With ids ``arange(runs)`` the result is the plain mean over the runs*(runs-1)/2 pairs.
    """
    m = np.array(pair_values, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"pair_values must be a square (runs, runs) matrix; got {m.shape}")
    n = m.shape[0]
    np.fill_diagonal(m, 0.0)
    upper = np.triu_indices(n, k=1)

    def statistic(run_ids: ArrayLike) -> FloatArray:
        ids = np.asarray(run_ids, dtype=np.int64)
        flat = ids.reshape(-1, ids.shape[-1])
        rows = flat.shape[0]
        counts = np.bincount((flat + n * np.arange(rows)[:, None]).ravel(), minlength=rows * n)
        c = counts.reshape(rows, n).astype(np.float64)
        weights = c[:, upper[0]] * c[:, upper[1]]  # (rows, pairs)
        with np.errstate(invalid="ignore", divide="ignore"):
            out = (weights @ m[upper]) / weights.sum(axis=1)
        # Where every weighted pair has the same value (zero spread), return it exactly, not via rounding.
        vals = np.broadcast_to(m[upper], weights.shape)
        lo = np.where(weights > 0, vals, np.inf).min(axis=1)
        hi = np.where(weights > 0, vals, -np.inf).max(axis=1)
        out = np.where((lo == hi) & np.isfinite(lo), lo, out)
        return out.reshape(ids.shape[:-1])

    return statistic


def _pair_mean(pair_values: FloatArray) -> float:
    n = pair_values.shape[0]
    return float(pairwise_statistic(pair_values)(np.arange(n)))


def _disagreement_matrix(logits: FloatArray) -> FloatArray:
    pred = logits.argmax(axis=-1)  # (runs, examples)
    return np.stack([(pred[i] != pred).mean(axis=-1) for i in range(len(pred))])


def _correlation_matrix(logits: FloatArray, method: Literal["pearson", "spearman"]) -> FloatArray:
    flat = logits.reshape(logits.shape[0], -1)
    if method == "spearman":
        import scipy.stats  # here, not at the top: a sweep worker imports this module and never ranks

        flat = scipy.stats.rankdata(flat, method="average", axis=1)
    elif method != "pearson":
        raise ValueError(f"method must be 'pearson' or 'spearman'; got {method!r}")
    z = flat - flat.mean(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        z = z / np.sqrt((z * z).sum(axis=1, keepdims=True))  # a constant run gives NaN: correlation undefined
    r = np.clip(z @ z.T, -1.0, 1.0)
    # Identical runs correlate exactly 1, so rounding in z @ z.T cannot blur the control row. Only pairs
    # already within 1e-9 of 1 are compared element by element.
    for i, j in zip(*np.nonzero(np.triu(r > 1.0 - 1e-9, k=1))):
        if np.array_equal(flat[i], flat[j]):
            r[i, j] = r[j, i] = 1.0
    return r


def _ensemble_matrices(logits: FloatArray, labels: IntArray) -> tuple[FloatArray, FloatArray]:
    """Two-model ensemble gain of every pair: (in accuracy, in cross-entropy), each a (runs, runs) matrix."""
    runs = logits.shape[0]
    logp = _log_softmax(logits)  # (runs, examples, classes)
    prob = np.exp(logp)
    logp_y = np.take_along_axis(logp, labels[None, :, None], axis=-1)[..., 0]  # (runs, examples)
    acc = (logits.argmax(axis=-1) == labels).mean(axis=1)
    ce = -logp_y.mean(axis=1)
    gain_acc = np.zeros((runs, runs))
    gain_ce = np.zeros((runs, runs))
    for i, j in itertools.combinations(range(runs), 2):
        ens_acc = ((prob[i] + prob[j]).argmax(axis=-1) == labels).mean()
        # log((p_i + p_j) / 2) = max + log1p(expm1(-|a - b|) / 2). This is exact (= a) when a == b.
        a, b = logp_y[i], logp_y[j]
        ens_logp_y = np.maximum(a, b) + np.log1p(0.5 * np.expm1(-np.abs(a - b)))
        ens_ce = -ens_logp_y.mean()
        gain_acc[i, j] = gain_acc[j, i] = ens_acc - (acc[i] + acc[j]) / 2
        gain_ce[i, j] = gain_ce[j, i] = (ce[i] + ce[j]) / 2 - ens_ce
    return gain_acc, gain_ce


def pairwise_disagreement(logits: ArrayLike) -> float:
    """Mean over unordered run pairs of the share of examples whose argmax classes differ.

    Args:
        logits: (runs, examples, classes), with runs >= 2.

    Returns:
        A fraction in [0, 1]; 0.0 for identical runs.
    """
    x = _logits(logits)
    _need_pairs(x.shape[0])
    return _pair_mean(_disagreement_matrix(x))


def pairwise_correlation(logits: ArrayLike, method: Literal["pearson", "spearman"] = "pearson") -> float:
    """Mean over unordered run pairs of the correlation of the two runs' flattened logits.

    Summers & Dinneen correlate the logits themselves, not probabilities. Each run is flattened to
    a vector of length examples*classes. "spearman" is the Pearson correlation of ranks from
    ``scipy.stats.rankdata`` (ties get their average rank). Bitwise-identical runs give exactly
    1.0. A constant run has an undefined correlation, so the result is NaN.

    Args:
        logits: (runs, examples, classes), with runs >= 2.
        method: "pearson" or "spearman".

    Returns:
        A correlation in [-1, 1].
    """
    x = _logits(logits)
    _need_pairs(x.shape[0])
    return _pair_mean(_correlation_matrix(x, method))


def ensemble_gain(logits: ArrayLike, labels: ArrayLike) -> dict[str, float]:
    """Average benefit of ensembling two runs, over all unordered run pairs.

    The two-model ensemble averages the two runs' softmax probabilities, then scores accuracy
    (argmax) and cross-entropy (nats). Signs are chosen so that positive = the ensemble is better:

    * ``"accuracy"`` = ensemble accuracy - mean of the two single accuracies (a fraction).
    * ``"cross_entropy"`` = mean of the two single cross-entropies - ensemble cross-entropy (nats).

    Identical runs give exactly 0.0 for both.

    Args:
        logits: (runs, examples, classes), with runs >= 2.
        labels: (examples,) integer classes.

    Returns:
        ``{"accuracy": float, "cross_entropy": float}``, each averaged over the runs*(runs-1)/2 pairs.
    """
    x = _logits(logits)
    y = _labels(labels, x)
    _need_pairs(x.shape[0])
    gain_acc, gain_ce = _ensemble_matrices(x, y)
    return {"accuracy": _pair_mean(gain_acc), "cross_entropy": _pair_mean(gain_ce)}


# ---------------------------------------------------------------------------------------------------------
# bootstrap over runs


def bootstrap_interval(
    values_per_run: ArrayLike,
    statistic: Callable[[np.ndarray], ArrayLike],
    resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
    *,
    batched: bool = False,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic``, resampling runs with replacement.

    Each resample draws ``runs`` run indices with replacement from
    ``np.random.Generator(np.random.PCG64(seed))``. All indices are drawn up front as one
    (resamples, runs) array, so a given (seed, runs, resamples) always yields the same resamples,
    whatever the statistic. Resamples with fewer than 2 distinct runs are skipped: a pairwise
    metric has no pair in them, and an SD is degenerate. The interval is then the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of the kept statistics
    (``np.percentile``, linear interpolation).

    Args:
        values_per_run: an array whose first axis is the run, with runs >= 2. Examples: per-run
            accuracies (runs,), or run ids ``np.arange(runs)`` for a statistic from
            :func:`pairwise_statistic`.
        statistic: maps one resample ``values_per_run[idx]`` (idx of shape (runs,)) to a scalar.
            With ``batched=True`` it instead receives all kept resamples at once, with shape
            (kept, runs, ...), and must return shape (kept,).
        resamples: number of resamples drawn, counting skipped ones.
        confidence: coverage of the two-sided interval, in (0, 1).
        seed: seed of the PCG64 generator.
        batched: call ``statistic`` once on the whole batch (fast) instead of once per resample.

    Returns:
        (lo, hi), in the statistic's unit.
    """
    values = np.asarray(values_per_run)
    if values.ndim == 0:
        raise ValueError("values_per_run must have a leading run axis")
    runs = values.shape[0]
    if runs < 2:
        raise ValueError(f"the bootstrap over runs needs at least 2 runs; got {runs}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1); got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1; got {resamples}")
    rng = np.random.Generator(np.random.PCG64(seed))
    idx = rng.integers(0, runs, size=(resamples, runs))
    kept = idx[(idx != idx[:, :1]).any(axis=1)]  # at least 2 distinct runs
    if len(kept) == 0:
        raise ValueError("every resample drew a single run; increase resamples")
    if batched:
        stats = np.asarray(statistic(values[kept]), dtype=np.float64)
        if stats.shape != (len(kept),):
            raise ValueError(f"a batched statistic must return shape ({len(kept)},); got {stats.shape}")
    else:
        stats = np.array([float(statistic(values[row])) for row in kept])
    alpha = (1.0 - confidence) / 2
    lo, hi = np.percentile(stats, [100 * alpha, 100 * (1 - alpha)])
    return float(lo), float(hi)


def _batched_sd(batch: np.ndarray) -> FloatArray:
    return _sd(batch, axis=1)


def diversity_summary(
    logits: ArrayLike, labels: ArrayLike, resamples: int = 10_000, seed: int = 0
) -> dict[str, dict[str, float]]:
    """All Summers & Dinneen variability metrics of a set of runs, each with a 95% bootstrap interval.

    Every metric uses the same resamples of runs (same ``seed``), as drawn by
    :func:`bootstrap_interval`. Pairwise metrics are recomputed over the pairs of distinct runs in
    each resample (see :func:`pairwise_statistic`).

    Args:
        logits: (runs, examples, classes), with runs >= 2.
        labels: (examples,) integer classes.
        resamples: bootstrap resamples.
        seed: bootstrap seed.

    Returns:
        ``{metric: {"value": v, "lo": lo, "hi": hi}}`` for these metrics:

        * ``accuracy_sd``: SD (ddof=1) over runs of accuracy, a fraction.
        * ``cross_entropy_sd``: SD (ddof=1) over runs of cross-entropy, in nats.
        * ``disagreement``: :func:`pairwise_disagreement`, a fraction.
        * ``pearson`` and ``spearman``: :func:`pairwise_correlation`.
        * ``ensemble_gain_accuracy`` (a fraction) and ``ensemble_gain_cross_entropy`` (nats):
          :func:`ensemble_gain`, where positive = the ensemble is better.
    """
    x = _logits(logits)
    y = _labels(labels, x)
    runs = x.shape[0]
    _need_pairs(runs)
    out: dict[str, dict[str, float]] = {}

    def add(name: str, value: float, values: np.ndarray, stat: Callable[[np.ndarray], ArrayLike]) -> None:
        lo, hi = bootstrap_interval(values, stat, resamples=resamples, seed=seed, batched=True)
        out[name] = {"value": float(value), "lo": lo, "hi": hi}

    acc = (x.argmax(axis=-1) == y).mean(axis=1)
    ce = -_label_log_prob(x, y).mean(axis=1)
    add("accuracy_sd", _sd(acc), acc, _batched_sd)
    add("cross_entropy_sd", _sd(ce), ce, _batched_sd)
    gain_acc, gain_ce = _ensemble_matrices(x, y)
    ids = np.arange(runs)
    for name, matrix in (
        ("disagreement", _disagreement_matrix(x)),
        ("pearson", _correlation_matrix(x, "pearson")),
        ("spearman", _correlation_matrix(x, "spearman")),
        ("ensemble_gain_accuracy", gain_acc),
        ("ensemble_gain_cross_entropy", gain_ce),
    ):
        stat = pairwise_statistic(matrix)
        add(name, float(stat(ids)), ids, stat)
    return out


def l2_distance(a: Mapping[str, ArrayLike], b: Mapping[str, ArrayLike]) -> float:
    """Euclidean distance between two runs' parameters: sqrt(sum over common keys of ||a[k] - b[k]||^2).

    Only keys present in both dicts count, so extra entries such as optimiser state in one
    checkpoint are ignored. Values are compared in float64.

    Args:
        a, b: parameter name -> array. Each common key must have the same shape in both.

    Returns:
        The distance, in parameter units.

    Raises:
        ValueError: the dicts share no key, or a common key has different shapes.
    """
    keys = sorted(set(a) & set(b))
    if not keys:
        raise ValueError("the two parameter dicts share no key")
    total = 0.0
    for k in keys:
        xa = np.asarray(a[k], dtype=np.float64)
        xb = np.asarray(b[k], dtype=np.float64)
        if xa.shape != xb.shape:
            raise ValueError(f"parameter {k!r} has shape {xa.shape} in one run and {xb.shape} in the other")
        d = (xa - xb).ravel()
        total += float(d @ d)
    return float(np.sqrt(total))


# ---------------------------------------------------------------------------------------------------------
# RL statistics


@contextlib.contextmanager
def _global_numpy_seed(seed: int) -> Iterator[None]:
    """Seed numpy's legacy global RNG for the duration of the block, then restore its previous state.

    Not thread-safe: another thread drawing from ``np.random`` inside the block would both perturb
    the result and see seeded draws.
    """
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


@functools.cache
def rliable_available() -> bool:
    """Whether ``rliable`` imports (arch 7.x, which rliable pins, fails to import under pandas 3 with a
    TypeError rather than an ImportError, so any exception means no)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import rliable.library  # noqa: F401
            import rliable.metrics  # noqa: F401
    except Exception:
        return False
    return True


def _iqm(x: np.ndarray, axis: int | None) -> FloatArray:
    import scipy.stats

    return scipy.stats.trim_mean(x, proportiontocut=0.25, axis=axis)


def iqm_with_interval(
    scores: ArrayLike,
    resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
    backend: Literal["auto", "numpy", "rliable"] = "auto",
) -> tuple[float, float, float]:
    """Interquartile mean (IQM) of scores, with a stratified-bootstrap percentile interval (rliable).

    IQM is the 25%-trimmed mean over all runs x tasks scores, as in ``rliable.metrics.aggregate_iqm``
    (``scipy.stats.trim_mean(scores, 0.25, axis=None)``). The interval is the one returned by
    ``rliable.library.get_interval_estimates(..., method="percentile")``. Each task's runs are
    resampled with replacement, independently per task (stratified bootstrap), and nothing is
    skipped.

    Randomness in rliable 1.2.0 (read from ``rliable/library.py``): ``StratifiedBootstrap``
    overrides arch's ``update_indices`` and draws with ``np.random.choice(runs, (runs, tasks))``
    from numpy's *global* legacy RNG. The ``random_state`` argument of ``get_interval_estimates``
    is only passed on to ``arch.bootstrap.IIDBootstrap``. There it never reaches those draws, and
    arch >= 7 warns that it is deprecated. Passing it therefore does not make the result
    reproducible. Here:

    * ``backend="numpy"`` (the default) reimplements the same algorithm with a private
      ``np.random.RandomState(seed)``. One ``randint(0, runs, (resamples, runs, tasks))`` call
      draws exactly the stream that ``resamples`` successive ``np.random.choice`` calls draw after
      ``np.random.seed(seed)``. It needs no rliable, leaves the global RNG untouched, and is
      vectorised.
    * ``backend="rliable"`` calls rliable inside a context that seeds the global RNG with ``seed``
      and restores its previous state afterwards. It is not thread-safe.
    * ``backend="auto"`` (the default) calls rliable when it imports (``pip install 'detrl[stats]'``)
      and the reimplementation otherwise; the numbers are the same either way.

    For the same seed, both backends return identical floats. That was checked against rliable
    1.2.0 with arch 7.2.0 and pandas 2.3.3; arch 7.2.0 fails to import with pandas 3.

    Args:
        scores: (runs,) or (runs, tasks) final returns, in any unit (raw or normalised).
        resamples: bootstrap replications (rliable's ``reps``; rliable's own default is 50,000).
        confidence: coverage of the two-sided interval, in (0, 1).
        seed: seed of the legacy MT19937 stream, as for ``np.random.seed``.
        backend: "auto", "numpy" or "rliable".

    Returns:
        (iqm, lo, hi), in the unit of ``scores``.
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim == 1:
        s = s[:, None]
    if s.ndim != 2 or s.size == 0:
        raise ValueError(
            f"scores must have shape (runs,) or (runs, tasks), non-empty; got {np.shape(scores)}"
        )
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1); got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1; got {resamples}")
    if backend == "auto":
        backend = "rliable" if rliable_available() else "numpy"
    if backend == "rliable":
        from rliable import library as rly
        from rliable import metrics as rlm

        def func(x: np.ndarray) -> np.ndarray:
            return np.array([rlm.aggregate_iqm(x)])

        with _global_numpy_seed(seed):
            point, interval = rly.get_interval_estimates(
                {"scores": s}, func, method="percentile", reps=resamples, confidence_interval_size=confidence
            )
        return float(point["scores"][0]), float(interval["scores"][0, 0]), float(interval["scores"][1, 0])
    if backend != "numpy":
        raise ValueError(f"backend must be 'numpy' or 'rliable'; got {backend!r}")
    runs, tasks = s.shape
    rs = np.random.RandomState(seed)
    cols = np.arange(tasks)
    chunk = max(1, 4_000_000 // (runs * tasks))  # successive randint calls continue one stream
    stats = np.empty(resamples)
    for start in range(0, resamples, chunk):
        stop = min(start + chunk, resamples)
        idx = rs.randint(0, runs, size=(stop - start, runs, tasks))
        stats[start:stop] = _iqm(s[idx, cols].reshape(stop - start, -1), axis=1)
    alpha = (1.0 - confidence) / 2  # the same arithmetic as arch's conf_int, so the quantiles match bitwise
    lo, hi = np.percentile(stats, [100 * alpha, 100 * (1.0 - alpha)])
    return float(_iqm(s, axis=None)), float(lo), float(hi)


def area_under_curve(curves: ArrayLike, steps: ArrayLike) -> FloatArray:
    """Trapezoidal area under each learning curve, divided by the step range.

    The unit is therefore "mean return over training": a constant curve at c gives c, and a
    linear curve gives its value at the midpoint of the step range.

    Args:
        curves: (runs, points) returns, or a single curve (points,) treated as one run.
        steps: (points,) strictly increasing environment steps (or any x-axis), with points >= 2.

    Returns:
        (runs,) the normalised areas.
    """
    y = np.atleast_2d(np.asarray(curves, dtype=np.float64))
    t = np.asarray(steps, dtype=np.float64)
    if y.ndim != 2 or t.ndim != 1 or y.shape[1] != t.shape[0]:
        raise ValueError(f"curves must be (runs, points) and steps (points,); got {y.shape} and {t.shape}")
    if t.shape[0] < 2 or not np.all(np.diff(t) > 0):
        raise ValueError("steps must be strictly increasing, with at least 2 points")
    area = ((y[:, 1:] + y[:, :-1]) * 0.5 * np.diff(t)).sum(axis=1)
    return area / (t[-1] - t[0])


def mean_sd(x: ArrayLike) -> tuple[float, float]:
    """Mean and sample SD (ddof=1) over runs.

    The SD is 0.0 when there are fewer than 2 runs (instead of ddof=1's NaN), and exactly 0.0
    when all runs are equal. In that case the mean is exactly the common value.

    Args:
        x: (runs,) values, with runs >= 1.

    Returns:
        (mean, sd), in the unit of ``x``.
    """
    v = np.asarray(x, dtype=np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"x must have shape (runs,) with runs >= 1; got {v.shape}")
    if v.size < 2 or np.ptp(v) == 0:
        return float(v[0]), 0.0
    return float(v.mean()), float(_sd(v))


def first_divergence_step(control: ArrayLike, run: ArrayLike, steps: ArrayLike) -> int | None:
    """First step at which two recorded series stop being bitwise equal.

    Floats are compared by bit pattern (float64 as uint64, float32 as uint32, ...). So 0.0 vs -0.0
    counts as a divergence, a NaN equals a NaN with the same payload, and NaNs with different
    payloads differ. Other dtypes are compared with ``!=``.

    Args:
        control: (points,) or (points, ...) reference series.
        run: the same shape and dtype as ``control``. A dtype mismatch is an error, not a divergence.
        steps: (points,) integer step of each point.

    Returns:
        ``steps[k]`` for the first point k that differs anywhere in its trailing axes, or None if
        the two series are bitwise equal throughout.
    """
    c = np.asarray(control)
    r = np.asarray(run)
    t = np.asarray(steps)
    if c.dtype != r.dtype:
        raise TypeError(f"bitwise comparison needs one dtype; got {c.dtype} and {r.dtype}")
    if c.shape != r.shape or c.ndim == 0 or t.shape != c.shape[:1]:
        raise ValueError(
            f"control and run must share a shape (points, ...) and steps be (points,); "
            f"got {c.shape}, {r.shape} and {t.shape}"
        )
    if np.issubdtype(c.dtype, np.inexact):
        width = c.dtype.itemsize // (2 if np.issubdtype(c.dtype, np.complexfloating) else 1)
        if width not in (2, 4, 8):
            raise TypeError(f"no bitwise comparison for {c.dtype} (its padding bytes are undefined)")
        bits = np.dtype(f"u{width}")  # a complex number views as two words on the last axis
        c, r = np.ascontiguousarray(c).view(bits), np.ascontiguousarray(r).view(bits)
    differs = (c != r).reshape(c.shape[0], -1).any(axis=1)
    hits = np.flatnonzero(differs)
    if hits.size == 0:
        return None
    step = t[hits[0]]
    if step != int(step):
        raise ValueError(f"steps must be integer-valued; got {step}")
    return int(step)


def first_divergence(control: Sequence[int] | np.ndarray, run: Sequence[int] | np.ndarray) -> int | None:
    """The first step whose parameter digest differs from the control's (None: bitwise equal throughout).
    A run that stopped early counts as diverging at its first missing step."""
    control, run = np.asarray(control), np.asarray(run)
    n = min(len(control), len(run))
    differs = np.flatnonzero(control[:n] != run[:n])
    if differs.size:
        return int(differs[0])
    return None if len(control) == len(run) else n
