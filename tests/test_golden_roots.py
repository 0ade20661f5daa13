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

Every root moved at bundle version 5, which hashes each tensor's bytes apart from its record header, and
nothing else: under version 4 the same recordings gave ``0c9dd781...``, ``802464b2...``, ``0a388816...`` and
``b8abc209...`` (in the order below), which two machines had agreed on. A root is a function of the
committed states' bytes, so machines that agreed on those states agree on these roots.

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
    "configs/supervised/digits_cnn.yaml": "4cb23aca883c8ccf8cc16a1d87d19ba6dd01e5c1fe8bc8cd1ff57427d03c3076",
    "configs/dqn/tiny.yaml": "4c510c928a429117acd69177c2ec3acaca1e6f2822d56fb7d79e0f454fe94ca5",
    "configs/supervised/resnet50_tiny.yaml": "b5cb79c560be0f768cc19ee4448c807fb96901d7500fcb4f3be515227d6fb38d",
    "configs/supervised/gpt2_tiny.yaml": "3650a30ba9e7d8d476dd1869ee36f3942f79c5e91d048b9f4ff2a12d3a448ea8",
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
