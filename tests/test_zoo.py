"""The zoo (slow): every architecture of detrl.testing.zoo, built from its config, records in verifiable
precision and replays bit for bit on all four emulated profiles."""

from __future__ import annotations

import dataclasses

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


@pytest.mark.slow
@pytest.mark.parametrize("name", list(zoo.REGRESSIONS))
def test_hugging_face_models_that_broke_replicate_with_nothing_unlogged(tmp_path, name):
    """BigBird (an in-place view of a float32 mask), SegFormer's segmentation loss (channels-last logits),
    EfficientNet (a weight gradient that cancels before batch norm), DPT (thresholds looked up under a
    layout), wav2vec2 (SpecAugment's masks from NumPy's global RNG), FNet and Llama 4 (complex tensors),
    DeBERTa-v2 on padding and GPT-2 on left padding (rows masked whole with FP64's minimum turned NaN) failed
    under an earlier detrl: each replicates on every emulated profile, nothing unlogged."""
    s = zoo.REGRESSIONS[name]
    if not zoo.available(s):
        pytest.skip(f"transformers has no {s.needs}")
    rec = zoo.record(s, tmp_path / "run", steps=2)
    want = {k: v.detach().clone() for k, v in rec.model.named_parameters()}
    for hw in EMULATED:
        rep = zoo.replay(s, tmp_path / "run", hw, steps=2)
        assert rep.step_index == 2, hw
        assert rep.totals.unlogged_near == 0 and rep.totals.refused == 0, hw
        assert all(torch.equal(v, want[k]) for k, v in rep.model.named_parameters()), hw


def _penalised(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross-entropy plus a gradient penalty: ``autograd.grad`` of the loss w.r.t. a leaf copy of the input
    (``create_graph=True``), as WGAN-GP and input-gradient regularisers take it."""
    x = batch[0].clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(model(x), batch[1])
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    return loss + grad.pow(2).sum()


def test_a_gradient_penalty_on_a_leaf_input_replays(tmp_path) -> None:
    """The replayer names each op's module with torch's module tracker, which hooked every module input
    requiring a gradient; torch refuses such a hook on a leaf while ``autograd.grad`` runs, so the replay
    of a gradient-penalty step crashed (its recording did not). Leaf inputs get no hook now."""
    import functools

    specimen = zoo.Specimen(
        "penalty",
        functools.partial(zoo.BatchNormCNN, 16),
        functools.partial(zoo.images, zoo.Size()),
        _penalised,
    )
    rec = zoo.record(specimen, tmp_path / "run", steps=2)
    want = {k: v.detach().clone() for k, v in rec.model.named_parameters()}
    rep = zoo.replay(specimen, tmp_path / "run", "emulated:pairwise", steps=2)
    assert rep.totals.refused == 0 and rep.totals.unlogged_near == 0
    assert all(torch.equal(v, want[k]) for k, v in rep.model.named_parameters())


def test_a_compiled_model_runs_as_written_inside_steps(tmp_path) -> None:
    """``torch.compile``'s generated kernels would compute outside the rounding mode (and inductor failed to
    build the mode's FP64 graph, a C++ error at the first step): inside a step the model runs eagerly, so it
    records the bits of the same model uncompiled, and replays."""
    plain = zoo.SPECIMENS["upcast_mlp"]
    compiled = dataclasses.replace(plain, name="compiled", build=lambda: torch.compile(plain.build()))
    want = zoo.record(plain, tmp_path / "plain", steps=2).model.state_dict()
    rec = zoo.record(compiled, tmp_path / "run", steps=2)
    got = {k.removeprefix("_orig_mod."): v for k, v in rec.model.state_dict().items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    rep = zoo.replay(compiled, tmp_path / "run", "emulated:pairwise", steps=2)
    assert rep.totals.refused == 0 and rep.totals.unlogged_near == 0
