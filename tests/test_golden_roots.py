"""Real, different CPUs replicate: the Merkle roots of verifiable recordings are the same on every machine.

The roots below (``manifest.json`` ``durable.merkle_root``) were recorded from a fresh clone on an AMD
EPYC (2 cores, torch 2.13.0+cpu) and again on another AMD EPYC of that shape. Verifiable precision
computes in FP64 and rounds every result with the log, so a root is a property of the config, not of the
CPU: any machine that records a different one has found a real replication failure (or an engine change
that moved the roots, which its commit must explain, with new roots agreed between two kinds of machine).
The DQN root moved when its verifiable Adam became the list (foreach) form, and again at its op-sequence
revision 3 (Adam and the target update per tensor: a lerp's FP32 midpoints are decided by FP64 steps, not
by torch's lerp kernel; a revision 2 recording still gives ``b861085e...``). It was recorded on one AMD
EPYC only, so the next machine of another kind to run this test confirms it.

Plain FP32 roots are machine-dependent and held nowhere: the FP32 digits CNN gave
``77960b96...`` on one AMD EPYC and ``a5e0be2a...`` on another (a different vector unit, other kernels).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detrl.cli import main

REPO = Path(__file__).resolve().parents[1]
ROOTS = {
    "configs/supervised/digits_cnn.yaml": "0c9dd781e1c22e047598aaa990f4aa2d553531507949f64605e2d7cfeb53469c",
    "configs/dqn/tiny.yaml": "802464b2d2273762d32afb196d08315d6c75ece1414b323a60c676db472b2fa8",
    "configs/supervised/resnet50_tiny.yaml": "0a388816ae4490ed63826fab116aa212e3b264c3ad337b0017f98d4e31a141a2",
    "configs/supervised/gpt2_tiny.yaml": "b8abc209af7fd1d2de9d25b036c54f1feab0ef84e62964b3f848981fb94e2533",
}


@pytest.mark.parametrize("config", list(ROOTS))  # about 30 s together on 2 cores
def test_a_verifiable_recording_has_the_same_root_on_every_machine(config: str, tmp_path: Path) -> None:
    if "gpt2" in config:
        pytest.importorskip("transformers")
    run = tmp_path / "run"
    assert main(["train", str(REPO / config), "--out", str(run), "--quiet"]) == 0
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["durable"]["merkle_root"] == ROOTS[config], (
        f"{config}: this machine's verifiable recording has another Merkle root than the one recorded on "
        "other CPUs: a replication failure, or an engine change that moved the roots"
    )
