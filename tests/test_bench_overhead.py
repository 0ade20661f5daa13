"""``detrl bench overhead --breakdown``: where a step goes, phase by phase, measured inside the loop."""

import re
import statistics

import pytest
import torch

from detrl.bench import performance
from detrl.core.calibrate import Calibrator
from detrl.core.engine import Session
from detrl.core.hardware.profiles import EmulatedProfile
from detrl.formats import commit
from detrl.formats.bundle import BundleWriter

VARIANTS = ("fp64", "verifiable off", "verifiable record")


@pytest.fixture(scope="module")
def runs():
    """Three steps of the digits CNN in each variant the breakdown shows, in this process (after one
    warm-up step), with the commitment's parts timed; and what the timers wrapped, before and after."""
    wrapped = lambda: (  # noqa: E731
        commit.StateTensorCache.__call__, Session._state_hash, BundleWriter.append_step, Calibrator.__call__,
        EmulatedProfile.__call__,
    )  # fmt: skip
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


def test_the_calibration_step_is_broken_down_where_the_recording_calibrates(runs):
    """Only the recording calibrates: its first step holds the calibrator's time, the reruns under the
    profiles inside it, and the rest of the step; the table's cells add up."""
    res, _, _ = runs
    calibrator, reruns = performance.CALIBRATOR, performance.RERUNS
    for v in VARIANTS:
        (out,) = res[v]
        spent, _ = out["calibration"][calibrator]
        rerun, calls = out["calibration"][reruns]
        if v != "verifiable record":
            assert (spent, rerun, calls) == (0.0, 0.0, 0), v
            continue
        assert 0 < rerun < spent < out["first"][0]
        assert calls > 0
    text = performance._calibration_table("digits_cnn", res)
    rows = {c[0]: c[1:] for c in (re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[4:])}
    assert set(rows) == set(VARIANTS)
    ms = lambda cell: float(cell.split(" ")[0])  # noqa: E731  "12.3 (1.2 steps, 49 calls)" -> 12.3
    later, first, spent, rerun, rest, outside = rows["verifiable record"]
    assert ms(spent) == pytest.approx(ms(rerun) + ms(rest), abs=0.15)
    assert ms(first) == pytest.approx(ms(spent) + ms(outside), abs=0.15)
    assert rows["fp64"][2:5] == ["-", "-", "-"]


def test_on_an_emulated_profile_the_reruns_are_not_told_apart_from_the_steps_ops():
    """A run on an emulated profile calls the profile for every op of the step: the reruns' column is "-"
    there, not a count of every op."""
    out = performance._overhead_worker({"model": "digits_cnn", "variant": "verifiable record", "steps": 1,
                                        "warmup": 1, "threads": 1, "tau": None, "breakdown": True,
                                        "hardware": "emulated:pairwise"})  # fmt: skip
    assert out["calibration"][performance.CALIBRATOR][0] > 0
    assert performance.RERUNS not in out["calibration"]
    res = {
        v: [{**out, "calibration": {} if v != "verifiable record" else out["calibration"]}] for v in VARIANTS
    }
    row = next(
        ln
        for ln in performance._calibration_table("digits_cnn", res).splitlines()
        if ln.startswith("verifiable record")
    )
    assert re.split(r"\s{2,}", row.strip())[4:6] == ["-", "-"]


def test_every_repeat_runs_each_variant_once_with_fp64_beside_the_recording():
    firsts = set()
    for r in range(2 * len(performance.VARIANTS)):
        order = performance.run_order(r)
        assert sorted(order) == sorted(performance.VARIANTS)
        at, fp64 = order.index(performance.PAIRED), order.index("fp64")
        assert fp64 == (at - 1 if r % 2 else at + 1)  # back to back, fp64 first in odd repeats
        firsts.add(order[0])
    assert len(firsts) >= len(performance.VARIANTS) - 1  # the rotation spreads who runs first


def test_the_per_repeat_ratio_pairs_each_recording_with_its_own_fp64():
    rec = [{"times": [2.0, 2.2, 2.4]}, {"times": [3.0, 3.3, 3.6]}, {"times": [1.5]}]
    fp64 = [{"times": [1.0, 1.1, 1.2]}, {"times": [2.0, 2.2, 2.4]}, {"times": [1.25]}]
    assert performance._paired_column(rec, fp64) == "1.50x (1.20..2.00)"
    assert performance._paired_column([], []) == "-"


def test_a_profile_runs_every_variant_on_it_and_an_absent_gpu_is_one_line(capsys):
    """``--hardware``: each worker's Session runs on the profile (``cuda``: on the GPU); where torch sees no
    GPU, asking for one fails before any work, in one line."""
    out = performance._overhead_worker({"model": "digits_cnn", "variant": "fp64", "steps": 1, "warmup": 1,
                                        "threads": 1, "tau": None, "hardware": "emulated:splitk"})  # fmt: skip
    assert len(out["times"]) == 1
    if not torch.cuda.is_available():
        from detrl.cli import main

        assert main(["bench", "overhead", "--hardware", "cuda", "--models", "digits_cnn"]) == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert lines == [
            "detrl: error: hardware profile 'cuda' needs a CUDA device, but no CUDA device is available"
        ]


def test_step_by_step_runs_fp64_and_the_recording_in_turn_in_one_process():
    """The verdict's process: after each variant's warm-up, a timed step of each in turn, the first of the pair
    alternating, so that a drifting machine slows both alike."""
    out = performance._interleaved_worker({"model": "digits_cnn", "steps": 3, "warmup": 1, "threads": 1,
                                           "tau": None})  # fmt: skip
    first, second = performance.INTERLEAVED
    assert (first, second) == ("fp64", performance.PAIRED)
    assert out["order"] == [first, second, second, first, first, second]
    for v in performance.INTERLEAVED:
        assert len(out["times"][v]) == 3 and all(t > 0 for t in out["times"][v])


def test_the_step_by_step_ratio_pairs_each_step_with_the_one_beside_it():
    runs = [{"times": {"fp64": [1.0, 2.0], "verifiable record": [1.5, 2.0]}},
            {"times": {"fp64": [1.0, 1.0], "verifiable record": [1.2, 1.4]}}]  # fmt: skip
    assert performance._step_ratios(runs) == pytest.approx([1.5, 1.0, 1.2, 1.4])
    column = performance._step_by_step_column(runs, 1.3)  # the median: between 1.2 and 1.4
    assert column.startswith("1.30x (") and column.endswith("(goal <= 1.3x: MET)")
    slower = [{"times": {"fp64": [1.0], "verifiable record": [1.5]}}]
    assert performance._step_by_step_column(slower, 1.3) == "1.50x (1.50..1.50) (goal <= 1.3x: MISSED)"
    assert performance._step_by_step_column([], 1.3) == "-"
