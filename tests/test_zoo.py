"""The zoo (slow): every architecture of detrl.testing.zoo, built from its config, records in verifiable
precision and replays bit for bit on all four emulated profiles."""

from __future__ import annotations

import pytest
import torch

from detrl.core.hardware import profile_names
from detrl.testing import zoo

EMULATED = [p for p in profile_names() if p.startswith("emulated:")]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(zoo.SPECIMENS))
def test_every_zoo_model_replicates_on_every_emulated_profile(tmp_path, name):
    s = zoo.SPECIMENS[name]
    if not zoo.available(s):
        pytest.skip(f"transformers has no {s.needs}")
    rec = zoo.record(s, tmp_path / "run", steps=3)
    want = {k: v.detach().clone() for k, v in rec.model.named_parameters()}
    assert rec.step_index == 3
    for hw in EMULATED:
        rep = zoo.replay(s, tmp_path / "run", hw, steps=3)
        assert rep.step_index == 3, hw
        assert all(torch.equal(v, want[k]) for k, v in rep.model.named_parameters()), hw
