"""The report's vocabulary: file names, the metrics with their labels and units, the references, and the
number formatting every part of the report shares."""

from __future__ import annotations

from dataclasses import dataclass

REPORT_DIR = "report"
MARKDOWN = "report.md"
NUMBERS_CSV = "numbers.csv"
NUMBERS_JSON = "numbers.json"
#: PNG resolution (dots per inch): 120 keeps 9-point text crisp at a moderate file size.
DPI = 120
NUMBER_COLUMNS = ("table", "condition", "metric", "value", "lo", "hi", "unit")
_MISSING = "–"

REFERENCES = {
    "rl": (
        "Nagarajan, P., Warnell, G. & Stone, P. (2018). *Deterministic Implementations for Reproducibility "
        "in Deep Reinforcement Learning.* 2nd Reproducibility in Machine Learning Workshop at ICML 2018. "
        "arXiv:1809.05676."
    ),
    "supervised": (
        "Summers, C. & Dinneen, M. J. (2021). *Nondeterminism and Instability in Neural Network "
        "Optimization.* Proceedings of the 38th International Conference on Machine Learning (ICML), "
        "PMLR 139. arXiv:2103.04514."
    ),
}
IQM_REFERENCE = (
    "Agarwal, R., Schwarzer, M., Castro, P. S., Courville, A. & Bellemare, M. G. (2021). *Deep "
    "Reinforcement Learning at the Edge of the Statistical Precipice.* NeurIPS 2021. arXiv:2108.13264."
)


@dataclass(frozen=True)
class MetricInfo:
    """How a supervised diversity metric is shown: its label, display unit and the factor to that unit."""

    label: str
    unit: str  # display unit in the tables and plots
    scale: float  # summary value x scale = displayed value
    decimals: int
    raw_unit: str  # unit of the value in summary.json and numbers.csv


#: The diversity metrics of Summers & Dinneen (2021), in table order.
METRICS: dict[str, MetricInfo] = {
    "accuracy_sd": MetricInfo("SD of accuracy", "pp", 100.0, 2, "fraction"),
    "cross_entropy_sd": MetricInfo("SD of cross-entropy", "nats", 1.0, 4, "nats"),
    "disagreement": MetricInfo("disagreement", "%", 100.0, 2, "fraction"),
    "pearson": MetricInfo("Pearson r of logits", "", 1.0, 4, ""),
    "spearman": MetricInfo("Spearman ρ of logits", "", 1.0, 4, ""),
    "ensemble_gain_accuracy": MetricInfo("ensemble gain, accuracy", "pp", 100.0, 2, "fraction"),
    "ensemble_gain_cross_entropy": MetricInfo("ensemble gain, cross-entropy", "nats", 1.0, 4, "nats"),
}
#: Correlations measure similarity (near 1 when models agree): drawn as points with intervals, not bars.
_SIMILARITY = ("pearson", "spearman")
REMEDY_LABELS = {
    "single": "single models",
    "snapshot": "snapshot ensembles",
    "tta": "test-time augmentation",
}
