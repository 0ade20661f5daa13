"""The replication experiment (detrl.apps.replication, `detrl bench replication`): its measures and one small run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from detrl.apps import replication as rep


def test_first_divergence_is_the_first_differing_step() -> None:
    assert rep.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert rep.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert rep.first_divergence([5, 2], [6, 2]) == 0
    # a run that stopped early diverges at its first missing step
    assert rep.first_divergence([1, 2, 3], [1, 2]) == 2


def test_l2_distance_by_hand() -> None:
    a = {"w": np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32), "n": np.array([7], dtype=np.int64)}
    b = {"w": np.array([[1.0, 0.0], [3.0, 5.0]], dtype=np.float32), "n": np.array([9], dtype=np.int64)}
    assert rep.l2_distance(a, b) == pytest.approx(math.sqrt(4.0 + 1.0))  # integers are not weights
    assert rep.l2_distance(a, a) == 0.0
    assert rep.l2_distance(a, {}) is None  # nothing shared (a run that stopped): not a distance of 0


def test_auditors_default_to_every_profile_but_the_trainer() -> None:
    names = rep.auditor_profiles()
    assert rep.RECORDER not in names
    assert {"emulated:splitk", "emulated:pairwise", "emulated:atomic"} <= set(names)
    assert rep.auditor_profiles(["emulated:reversed"]) == ["emulated:reversed"]


def test_a_small_replication_table(tmp_path) -> None:  # noqa: ANN001
    """The paper's finding on the digits CNN: plain FP32 on another profile diverges at the first step;
    the verifiable replay of the trainer's bundle replicates with distance 0; the costs are measured."""
    cfg = rep.load_model_config("digits_cnn", 4)
    costs, rows = rep.replicate(cfg, ["emulated:pairwise", "emulated:splitk"], tmp_path)
    assert costs.steps == 4 and costs.parameters > 0
    assert costs.vs_fp64 > 0 and costs.vs_fp32 > 0
    assert costs.dense_bytes_per_step > costs.log_bytes_per_step > 0
    by = {(r.auditor, r.mode): r for r in rows}
    assert len(by) == 6
    for auditor in ("emulated:pairwise", "emulated:splitk"):
        fp32, verifiable = by[(auditor, "fp32")], by[(auditor, "verifiable")]
        assert fp32.first_divergence == 1 and fp32.l2 is not None and fp32.l2 > 0
        assert verifiable.verdict == "replicated" and verifiable.first_divergence is None
        assert verifiable.l2 == 0.0
        rounded = by[(auditor, "rounded")]
        # rounded without the log may or may not meet a midpoint in 4 steps, but its distance says which
        assert (rounded.first_divergence is None) == (rounded.l2 == 0.0)


def test_learning_quality_compares_fp32_and_verifiable() -> None:
    cfg = rep.load_model_config("digits_cnn", 30)
    fp32, verifiable, fp32_b, _ = rep.learning_quality(cfg, holdout=200, seeds=[0, 1])
    assert (fp32.precision, verifiable.precision, fp32.seed, fp32_b.seed) == ("fp32", "verifiable", 0, 1)
    assert fp32.test_loss != fp32_b.test_loss  # another seed, another model
    for q in (fp32, verifiable):
        assert q.steps == 30
        assert 0.0 <= q.test_accuracy <= 1.0 and q.test_loss > 0
        assert q.test_accuracy > 0.3  # learned something: chance is 0.1
    assert abs(fp32.test_accuracy - verifiable.test_accuracy) < 0.1


def test_a_finished_run_is_freed_without_the_cyclic_collector(tmp_path) -> None:  # noqa: ANN001
    """The experiment runs many sessions in one process, and each must free its model once dropped, not at
    the cyclic collector's next pass: with the session in reference cycles (its loader, its rounding mode's
    module-path callback), the FP64 GPT-2 small rows piled up runs until the machine ran out of memory."""
    import gc
    import weakref

    from detrl.apps.audit import audit
    from detrl.core.engine import Session

    cfg = rep.load_model_config("digits_cnn", 2)
    # A process's first optimizer imports torch._dynamo, and that import leaves its callers' frames in a
    # cycle once (torch.fx's wrap): make that import here, not inside the measured run.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    gc.collect()
    gc.disable()
    try:
        _, session = rep.trace_run(cfg, tmp_path / "run")
        weight = weakref.ref(next(session.model.parameters()))
        del session
        assert weight() is None
        assert audit(tmp_path / "run", "emulated:splitk").verdict == "replicated"
        assert not [o for o in gc.get_objects() if issubclass(type(o), Session)]  # type(): no lazy attribute
    finally:
        gc.enable()
