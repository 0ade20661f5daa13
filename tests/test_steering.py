"""The steering bound: a recorder that picks the other FP32 neighbour of logged elements writes a bundle
that replicates on other hardware (the log cannot stop it), and the audit on the recorder's own declared
profile, where an honest log corrects nothing, flags it without changing the verdict.

digits_cnn, 3 steps, 297 digits held out: 10 to 25 s in all on a busy 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from detrl.apps.audit import audit
from detrl.bench.common import record
from detrl.formats.bundle import Bundle
from detrl.run import config as config_mod
from detrl.testing.steering import POLICIES, record_steered

STEPS = 3


def _cfg():  # noqa: ANN202
    return config_mod.load(
        "configs/supervised/digits_cnn.yaml",
        [f"train.steps={STEPS}", "data.holdout=297", "verify.checkpoint_every=0"],
    )


# Recorded under rounding-rule revision 2, whose digits CNN log has entries that matter (conftest.py).
pytestmark = pytest.mark.usefixtures("rules_revision_2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An honest bundle (the plain recorder) and one per steering policy, of one config."""
    root = tmp_path_factory.mktemp("steering")
    out = {"honest": root / "honest"}
    record(_cfg(), out["honest"])
    for policy in ("other", "adversarial"):
        out[policy] = root / policy
        session = record_steered(_cfg(), out[policy], policy)
        out[policy + ".steered"] = sum(session.rounding.steered)  # type: ignore[assignment]
    return out


def _leaves(run: Path) -> list[tuple[bytes, bytes]]:
    b = Bundle(run)
    try:
        return list(b.leaves)
    finally:
        b.close()


@pytest.mark.parametrize("policy", ["other", "adversarial"])
def test_steered_bundle_replicates_on_other_hardware_and_differs_from_the_honest_one(runs, policy):
    assert runs[policy + ".steered"] > 0
    honest, steered = _leaves(runs["honest"]), _leaves(runs[policy])
    assert steered[0] == honest[0]  # the same initial model ...
    assert all(s[0] != h[0] for s, h in zip(steered[1:], honest[1:], strict=True))  # ... steered from step 1
    assert all(s[1] == h[1] for s, h in zip(steered, honest, strict=True))  # on the same batches
    report = audit(runs[policy], "emulated:splitk")
    assert report.verdict == "replicated", report.message
    assert report.corrected > 0
    assert not report.steering_suspected  # not the declared profile: corrections are the log's job there


@pytest.mark.parametrize("policy", ["other", "adversarial"])
def test_steered_bundle_on_its_declared_profile_is_flagged_without_changing_the_verdict(runs, policy):
    report = audit(runs[policy], "native")  # the manifest's hardware
    assert report.verdict == "replicated" and report.exit_code == 0
    assert report.corrected == runs[policy + ".steered"]  # every steered element, and nothing else
    assert sum(s.corrected for s in report.per_step) == report.corrected
    assert report.steering_suspected and report.steering_first_step == 1
    assert "steering suspected" in report.message
    data = report.to_json()
    assert data["steering_suspected"] is True and data["per_step"][0]["corrected"] > 0


def test_honest_bundle_on_its_declared_profile_shows_no_correction_and_no_flag(runs):
    report = audit(runs["honest"], "native")
    assert report.verdict == "replicated"
    assert report.corrected == 0 and all(s.corrected == 0 for s in report.per_step)
    assert len(report.per_step) == STEPS and all(s.logged > 0 for s in report.per_step)
    assert not report.steering_suspected and report.steering_first_step is None
    assert "steering" not in report.message


def test_the_honest_policy_records_the_plain_recorders_bundle(runs, tmp_path):
    session = record_steered(_cfg(), tmp_path / "nearest", "nearest")
    assert sum(session.rounding.steered) == 0
    assert _leaves(tmp_path / "nearest") == _leaves(runs["honest"])
    assert len(session.params) == len(session.heldout_loss) == STEPS + 1


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown steering policy"):
        record_steered(_cfg(), Path("/nonexistent/never-written"), "sideways")
    assert "nearest" in POLICIES
