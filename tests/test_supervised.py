"""The supervised recipe's parts the ablation relies on: a fixed test split, augmentation on its own stream,
dropout in the CNN, learning-rate schedules (snapshot cycles), test-time augmentation; and that a run using
all of them is still verifiable and resumable."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from detrl.apps.audit import audit
from detrl.run import sessions
from detrl.run.config import ConfigError, apply_overrides, read_raw, validate
from detrl.supervised import data as datasets
from detrl.supervised import train

FULL = [
    "data.holdout=360",
    "data.augment=crop_flip",
    "model.channels=4",
    "model.dropout=0.3",
    "optimizer.schedule=cyclic",
    "optimizer.cycles=3",
    "train.steps=12",
    "verify.checkpoint_every=4",
]


def cfg_with(*overrides: str):
    return validate(apply_overrides(read_raw("configs/supervised/digits_cnn.yaml"), list(overrides)))


def test_the_test_split_is_fixed_and_disjoint() -> None:
    cfg = cfg_with("data.holdout=360")
    (x, y), (tx, ty) = train.load_split(cfg)
    assert len(x) == 1437 and len(tx) == 360
    (x2, _), (tx2, ty2) = train.load_split(cfg_with("data.holdout=360", "sources.seed=7"))
    assert torch.equal(tx, tx2) and torch.equal(ty, ty2)  # no seed moves the test set
    rows = {tuple(r.flatten().tolist()) for r in x}
    assert sum(tuple(r.flatten().tolist()) in rows for r in tx) < 20  # digits has a few duplicate images
    assert len(train.load_data(cfg_with())[0]) == 1797  # holdout 0: every example trains, as before
    with pytest.raises(ValueError, match="holdout"):
        train.load_test_data(cfg_with())


def test_augment_draws_a_fixed_count_and_is_exact() -> None:
    x = torch.rand(16, 1, 8, 8, dtype=torch.float64)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a, b = datasets.augment(x, "crop_flip", 1, g1), datasets.augment(x, "crop_flip", 1, g2)
    assert torch.equal(a, b) and a.shape == x.shape and a.dtype == x.dtype
    assert not torch.equal(a, x)
    # Every output value is an input value or padding: crops and flips move data, they compute nothing.
    assert set(a.flatten().tolist()) <= set(x.flatten().tolist()) | {0.0}
    # Same number of draws whatever the images: the generator ends in the same state.
    datasets.augment(torch.zeros_like(x), "crop_flip", 1, g1)
    datasets.augment(x, "crop_flip", 1, g2)
    assert torch.equal(g1.get_state(), g2.get_state())
    assert datasets.augment(x, "none", 1, g1) is x
    # A crop with zero offset on both axes is the shifted image: check one example by hand.
    g = torch.Generator().manual_seed(0)
    one = torch.arange(9.0).reshape(1, 1, 3, 3)
    out = datasets.augment(one, "crop", 1, g)
    g = torch.Generator().manual_seed(0)
    oy, ox = (int(torch.randint(0, 3, (1,), generator=g)) for _ in range(2))
    padded = torch.nn.functional.pad(one, (1, 1, 1, 1))
    assert torch.equal(out, padded[..., oy : oy + 3, ox : ox + 3])


def test_tta_views() -> None:
    x = torch.rand(2, 1, 8, 8)
    assert len(datasets.tta_views(x, "crop", 1)) == 5
    views = datasets.tta_views(x, "crop_flip", 1)
    assert len(views) == 10 and torch.equal(views[0], x) and torch.equal(views[5], x.flip(-1))
    assert all(v.shape == x.shape for v in views)


def test_learning_rate_schedules() -> None:
    cyc = cfg_with("optimizer.schedule=cyclic", "optimizer.cycles=3", "train.steps=12", "optimizer.lr=0.1")
    assert train.cycle_ends(12, 3) == [4, 8, 12]
    lrs = [train.learning_rate(cyc, t) for t in range(1, 13)]
    assert lrs[0] == lrs[4] == lrs[8] == 0.1  # each cycle restarts at lr
    assert lrs[1] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[3] < lrs[2] < lrs[1] and lrs[3] > 0
    cos = cfg_with("optimizer.schedule=cosine", "train.steps=10", "optimizer.lr=0.1")
    assert train.learning_rate(cos, 1) == 0.1 and train.learning_rate(cos, 6) == pytest.approx(0.05)
    assert train.learning_rate(cfg_with("optimizer.lr=0.1"), 7) == 0.1
    with pytest.raises(ValueError, match="cycles"):
        train.cycle_ends(3, 4)


def test_a_reference_batch_scales_the_learning_rate_linearly() -> None:
    """A recipe's lr given for batch 64 (``optimizer.reference_batch``) trains at an eighth of it at batch 8,
    its schedule included; without a reference batch the lr is as given."""
    scaled = cfg_with("optimizer.lr=0.05", "optimizer.reference_batch=64", "train.batch_size=8",
                      "optimizer.schedule=cosine", "train.steps=10")  # fmt: skip
    assert train.base_lr(scaled) == 0.05 / 8 and train.learning_rate(scaled, 1) == 0.05 / 8
    assert train.learning_rate(scaled, 6) == pytest.approx(0.05 / 16)
    model = torch.nn.Linear(2, 2)
    assert train.make_optimizer(scaled, model).param_groups[0]["lr"] == 0.05 / 8
    assert train.base_lr(cfg_with("optimizer.lr=0.05", "train.batch_size=8")) == 0.05
    with pytest.raises(ValueError, match="reference_batch"):
        cfg_with("optimizer.reference_batch=0")


def test_cnn_dropout_is_off_by_default_and_on_its_stream() -> None:
    assert isinstance(train.model_builder(cfg_with(), torch.zeros(1, 1, 8, 8))().dropout, torch.nn.Identity)
    m = train.model_builder(cfg_with("model.dropout=0.5"), torch.zeros(1, 1, 8, 8))()
    assert isinstance(m.dropout, torch.nn.Dropout) and m.dropout.p == 0.5


def _record(cfg, out: Path):
    session = sessions.session_for(cfg, out, "record")
    with session:
        train.run(cfg, session)
    return session


@pytest.mark.parametrize("varied", ["augment", "dropout"])
def test_augment_and_dropout_streams_move_the_run(tmp_path: Path, varied: str) -> None:
    base = cfg_with(*FULL, "precision=fp32", "optimizer.schedule=constant")
    other = cfg_with(*FULL, "precision=fp32", "optimizer.schedule=constant", f"sources.{varied}.seed=5")
    a, b = _record(base, tmp_path / "a"), _record(other, tmp_path / "b")
    assert a.leaves[0] != b.leaves[0]  # the switchboard is committed from step 0
    pa, pb = (dict(s.model.named_parameters()) for s in (a, b))
    assert any(not torch.equal(pa[n], pb[n]) for n in pa)


def test_a_run_with_every_part_replicates_and_resumes(tmp_path: Path) -> None:
    cfg = cfg_with(*FULL)
    _record(cfg, tmp_path / "whole")
    assert audit(tmp_path / "whole", hardware="emulated:reversed").verdict == "replicated"
    # Stop after step 5 (mid-cycle, mid-epoch, between checkpoints), then resume to the end.
    short = cfg.model_copy(deep=True)
    session = sessions.session_for(cfg, tmp_path / "resumed", "record")
    with session:
        orig = session.step

        def step(*a, **k):
            if session.step_index == 5:
                session.stop_requested = True
            return orig(*a, **k)

        session.step = step  # type: ignore[method-assign]
        train.run(short, session)
    session = sessions.session_for(cfg, tmp_path / "resumed", "record", resume=True)
    with session:
        train.run(cfg, session)
    whole = (tmp_path / "whole" / "commitments").read_bytes()
    assert (tmp_path / "resumed" / "commitments").read_bytes() == whole


def test_bad_values_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        cfg_with("data.augment=rotate")
    with pytest.raises(ConfigError):
        cfg_with("optimizer.schedule=linear")
