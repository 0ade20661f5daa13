"""``detrl bench overhead --breakdown``: where a step goes, phase by phase, measured inside the loop."""

import re
import statistics

import pytest

from detrl.bench import performance
from detrl.core.engine import Session
from detrl.formats import commit
from detrl.formats.bundle import BundleWriter

VARIANTS = ("fp64", "verifiable off", "verifiable record")


@pytest.fixture(scope="module")
def runs():
    """Three steps of the digits CNN in each variant the breakdown shows, in this process (after one
    warm-up step), with the commitment's parts timed; and what the timers wrapped, before and after."""
    wrapped = lambda: (commit.state_tensors, Session._state_hash, BundleWriter.append_step)  # noqa: E731
    before = wrapped()
    res = {
        v: [performance._overhead_worker({"model": "digits_cnn", "variant": v, "steps": 3, "warmup": 1,
                                          "threads": 1, "tau": None, "breakdown": True})]
        for v in VARIANTS
    }  # fmt: skip
    return res, before, wrapped()


def test_the_phases_add_up_to_the_step_and_only_recording_commits(runs):
    res, before, after = runs
    assert before == after  # every timer is gone
    for v in VARIANTS:
        (out,) = res[v]
        phases = out["phases"]
        assert sum(phases[p] for p in performance.PHASES) == pytest.approx(statistics.mean(out["times"]))
        for p in ("forward and loss", "backward", "optimizer step", "step exit"):
            assert phases[p] > 0, (v, p)
        for _, _, label in performance.COMMIT_PARTS:  # inside the exit; zero where nothing is committed
            assert (phases[label] > 0) == (v == "verifiable record"), (v, label)
            assert phases[label] <= phases["step exit"]


def test_the_table_shows_each_part_and_recordings_excess_over_fp64(runs):
    res, _, _ = runs
    text = performance._breakdown_table("digits_cnn", res)
    cells = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[3:]]  # label, 4 numbers
    rows = {c[0]: c[1:] for c in cells}
    phases = [p for p in performance.PHASES if p != "step exit"]  # the exit is shown by its parts
    labels = [*phases, *(label for _, _, label in performance.COMMIT_PARTS)]
    for label in [*labels, "step exit: the rest (stats, Session)", "a step"]:
        fp64, off, recorded, excess = (float(x) for x in rows[label])
        assert excess == pytest.approx(recorded - fp64, abs=2e-3), label
    assert float(rows["a step"][2]) == pytest.approx(
        statistics.median(res["verifiable record"][0]["times"]) * 1e3, abs=1e-3
    )
