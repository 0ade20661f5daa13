"""A ``torch.amp.GradScaler`` tracked by a Session: its loss scale is run state, committed with every step and
restored on resume, so a resumed run skips the steps the uninterrupted one skips."""

from __future__ import annotations

import pytest
import torch

from detrl.core.engine import Session, _GradScalerPart
from detrl.core.sources import Sources
from detrl.formats import bundle
from detrl.formats.bundle import BundleError

STEPS = 6


def _train(session: Session, track: bool, stop_after: int | None = None) -> torch.amp.GradScaler:
    """A linear model under a scaler whose scale doubles at every step and overflows at every other one
    (2**125 times these gradients is past float32's range): it skips every second step and backs off."""
    model = session.init(lambda: torch.nn.Linear(4, 1))
    opt = session.track(torch.optim.SGD(model.parameters(), lr=0.01))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**124, growth_interval=1)
    if track:
        assert session.track(scaler) is scaler
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g) * 10
    loader = session.loader((x, y), batch_size=16, steps=STEPS)
    session.restore()
    for batch in loader:
        with session.step():
            scaler.scale(torch.nn.functional.mse_loss(model(batch.x), batch.y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        if session.step_index == stop_after:
            session.stop_requested = True
            break
    return scaler


def _record(run, track: bool, stop_after: int | None = None, resume: bool = False) -> torch.amp.GradScaler:
    options = {"resume": True} if resume else {"sources": Sources(seed=0), "precision": "fp32"}
    with Session(run, planned_steps=STEPS, checkpoint_every=1, **options) as s:
        return _train(s, track, stop_after)


@pytest.mark.parametrize("track", [True, False])
def test_a_resumed_run_continues_the_scale_only_where_the_scaler_is_tracked(tmp_path, track: bool) -> None:
    whole = _record(tmp_path / "whole", track)
    _record(tmp_path / "resumed", track, stop_after=3)
    resumed = _record(tmp_path / "resumed", track, resume=True)
    if track:
        assert resumed.get_scale() == whole.get_scale()
        for name in (bundle.COMMITMENTS,):  # an fp32 run writes no rounding log
            assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), (
                name
            )
        with Session(tmp_path / "whole", mode="replay") as r:  # the replay checks the scale at every step
            _train(r, track=True)
        assert r.step_index == STEPS
    else:  # the resumed run restarted at the initial scale: the run it continues is lost
        assert resumed.get_scale() != whole.get_scale()


def test_a_verifiable_run_with_a_tracked_scaler_replays_on_a_reordering_profile(tmp_path) -> None:
    with Session(tmp_path, planned_steps=STEPS, checkpoint_every=2, sources=Sources(seed=0)) as s:
        recorded = _train(s, track=True)
    with Session(tmp_path, mode="replay", hardware="emulated:atomic") as r:
        replayed = _train(r, track=True)
    assert r.step_index == STEPS and replayed.get_scale() == recorded.get_scale()


def test_a_tracked_scaler_is_committed(tmp_path) -> None:
    """Two runs that differ only in the scaler's initial scale commit differently from the first step."""
    leaves = []
    for scale in (2.0**124, 2.0**10):
        with Session(
            tmp_path / str(scale), sources=Sources(seed=0), precision="fp32", checkpoint_every=0
        ) as s:
            model = s.init(lambda: torch.nn.Linear(2, 1))
            s.track(torch.amp.GradScaler("cpu", init_scale=scale))
            s.track(torch.optim.SGD(model.parameters(), lr=0.0))
            with s.step():
                pass
        leaves.append(s.leaves[1])
    assert leaves[0] != leaves[1] and set(s.parts) == {"grad_scaler"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scale": -1.0}, "scale = -1.0 out of range"),
        ({"scale": float("inf")}, "scale = inf out of range"),
        ({"scale": "65536"}, "scale is '65536', not a number"),
        ({"growth_interval": 0.5}, "growth_interval is 0.5, not a number"),
        ({"_growth_tracker": True}, "_growth_tracker is True, not a number"),
        ({"backoff_factor": 2.0}, "backoff_factor = 2.0 out of range"),
        ({"extra": 1}, "state keys"),
    ],
)
def test_a_checkpoints_scaler_state_is_checked_before_it_is_loaded(change: dict, message: str) -> None:
    scaler = torch.amp.GradScaler("cpu")
    part = _GradScalerPart(scaler)
    meta = {**part.state()[1], **change}
    with pytest.raises(ValueError, match=message):
        part.load_state({}, meta)
    assert scaler.get_scale() == 65536.0  # nothing loaded


def test_a_scaler_state_that_differs_from_the_commitment_refuses_the_resume(tmp_path) -> None:
    """A checkpoint whose scaler state was altered (a valid-looking scale) is not the committed state."""
    _record(tmp_path / "run", True, stop_after=3)
    path = tmp_path / "run" / bundle.checkpoint_name(3)
    tensors, meta = bundle.decode_checkpoint(path.read_bytes(), path.name, bundle.Caps())
    meta["parts"]["grad_scaler"]["meta"]["scale"] = 2.0**20
    path.write_bytes(bundle.encode_checkpoint(tensors, meta))
    bundle.reseal(tmp_path / "run")  # the manifest's hashes made to match, as the other party can
    before = {f: f.read_bytes() for f in (tmp_path / "run").rglob("*") if f.is_file()}
    with pytest.raises(BundleError, match="restored state differs from the step commitment"):
        _record(tmp_path / "run", True, resume=True)
    assert {
        f: f.read_bytes() for f in (tmp_path / "run").rglob("*") if f.is_file()
    } == before  # refused: unchanged
