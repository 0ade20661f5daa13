"""State that torch objects carry from step to step, tracked by a Session (detrl/core/parts.py): an LR
scheduler with the hyperparameters it sets, and AMP's GradScaler. Committed with every step, restored on
resume, so a resumed recording is the uninterrupted one and replays from step 0; a checkpoint's values are
accepted only in the shape of the live object's own state."""

from __future__ import annotations

import pytest
import torch
from torch.optim import lr_scheduler

from detrl.core.engine import Divergence, Session
from detrl.core.parts import StateDictPart, grad_scaler_part, scheduler_part
from detrl.core.sources import Sources
from detrl.formats import bundle
from detrl.formats.bundle import BundleError

STEPS = 6

SCHEDULERS = {
    "step": lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "cosine": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
    "warm_restarts": lambda opt: lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2),
    "one_cycle": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=STEPS),  # momentum too
    "lambda": lambda opt: lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    "sequential": lambda opt: lr_scheduler.SequentialLR(
        opt, [lr_scheduler.LinearLR(opt, 0.1, total_iters=2), lr_scheduler.ExponentialLR(opt, 0.7)], [2]
    ),
    "plateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5),  # best starts at inf
    "multistep": lambda opt: lr_scheduler.MultiStepLR(opt, milestones=[2, 2, 4], gamma=0.5),  # a Counter
}


def _train(session: Session, scheduler: str | None, scaler: bool, track: bool, stop_after: int | None = None):
    """A linear model under SGD with momentum, a scheduler stepped after each update and, with ``scaler``, a
    GradScaler whose scale doubles at each step and overflows every other one (it skips those steps)."""
    model = session.init(lambda: torch.nn.Linear(4, 1))
    opt = session.track(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    sched = SCHEDULERS[scheduler](opt) if scheduler else None
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**124, growth_interval=1) if scaler else None
    for thing in (sched, amp) if track else ():
        if thing is not None:
            assert session.track(thing) is thing
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g) * 10
    loader = session.loader((x, y), batch_size=16, steps=STEPS)
    session.restore()
    for batch in loader:
        with session.step():
            loss = torch.nn.functional.mse_loss(model(batch.x), batch.y)
            if amp is None:
                loss.backward()
                opt.step()
            else:
                amp.scale(loss).backward()
                amp.step(opt)
                amp.update()
            opt.zero_grad(set_to_none=True)
            if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
                sched.step(float(loss.detach()))
            elif sched is not None:  # inside the step: its commitment and checkpoint hold the new rate
                sched.step()
        if session.step_index == stop_after:
            session.stop_requested = True
            break
    return opt, sched, amp


def _record(run, *args, stop_after: int | None = None, resume: bool = False, precision: str = "fp32"):
    options = {"resume": True} if resume else {"sources": Sources(seed=0), "precision": precision}
    with Session(run, planned_steps=STEPS, checkpoint_every=1, **options) as s:
        return _train(s, *args, stop_after=stop_after)


def _resumed_equals_whole(tmp_path, *args) -> tuple:
    whole = _record(tmp_path / "whole", *args)
    _record(tmp_path / "resumed", *args, stop_after=3)
    resumed = _record(tmp_path / "resumed", *args, resume=True)
    same = (tmp_path / "whole" / bundle.COMMITMENTS).read_bytes() == (
        tmp_path / "resumed" / bundle.COMMITMENTS
    ).read_bytes()
    return whole, resumed, same


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_a_resumed_run_with_a_tracked_scheduler_is_the_uninterrupted_run_and_replays(
    tmp_path, scheduler
) -> None:
    whole, resumed, same = _resumed_equals_whole(tmp_path, scheduler, False, True)
    assert same
    assert [g["lr"] for g in whole[0].param_groups] == [g["lr"] for g in resumed[0].param_groups]
    with Session(tmp_path / "resumed", mode="replay") as r:  # from step 0, the scheduler stepped afresh
        _train(r, scheduler, False, True)
    assert r.step_index == STEPS


def test_an_untracked_scheduler_restarts_on_resume_and_its_bundle_fails_a_replay(tmp_path) -> None:
    """The control: the learning rate a resumed run restarts at is not the one the run had reached."""
    _, _, same = _resumed_equals_whole(tmp_path, "step", False, False)
    assert not same
    with (
        pytest.raises(Divergence, match="diverged at step 4"),
        Session(tmp_path / "resumed", mode="replay") as r,
    ):
        _train(r, "step", False, False)


@pytest.mark.parametrize("track", [True, False])
def test_a_resumed_run_continues_the_loss_scale_only_where_the_scaler_is_tracked(
    tmp_path, track: bool
) -> None:
    whole, resumed, same = _resumed_equals_whole(tmp_path, None, True, track)
    if track:
        assert same and resumed[2].get_scale() == whole[2].get_scale()
    else:  # restarted at the initial scale: the run it continues is lost
        assert resumed[2].get_scale() != whole[2].get_scale()


def test_a_verifiable_run_with_a_scheduler_and_a_scaler_replays_on_a_reordering_profile(tmp_path) -> None:
    recorded = _record(tmp_path, "one_cycle", True, True, precision="verifiable")
    with Session(tmp_path, mode="replay", hardware="emulated:atomic") as r:
        replayed = _train(r, "one_cycle", True, True)
    assert r.step_index == STEPS and replayed[2].get_scale() == recorded[2].get_scale()
    assert set(r.parts) == {"loader", "lr_scheduler", "grad_scaler"}


def test_the_learning_rate_and_the_scale_are_in_the_commitment(tmp_path) -> None:
    """Runs that differ only in a scheduler's factor, or a scaler's initial scale, commit differently from
    their first step, before any update could tell them apart."""
    leaves = []
    for k, (gamma, scale) in enumerate([(0.5, 2.0**124), (0.25, 2.0**124), (0.5, 2.0**10)]):
        with Session(tmp_path / str(k), sources=Sources(seed=0), precision="fp32", checkpoint_every=0) as s:
            model = s.init(lambda: torch.nn.Linear(2, 1))
            opt = s.track(torch.optim.SGD(model.parameters(), lr=0.1))
            s.track(lr_scheduler.StepLR(opt, 1, gamma=gamma))
            s.track(torch.amp.GradScaler("cpu", init_scale=scale))
            with s.step():
                pass
        leaves.append(s.leaves[1])
    assert len(set(leaves)) == 3


def test_state_a_run_cannot_commit_is_refused_when_tracked() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))  # a tensor learning rate
    with (
        Session(None, mode="off", precision="fp32") as s,
        pytest.raises(ValueError, match=r"base_lrs\[0\] is a Tensor, which a run cannot commit"),
    ):
        s.track(lr_scheduler.StepLR(opt, 1))


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_a_scheduler_stepped_between_steps_is_refused_at_the_next_step(tmp_path) -> None:
    with Session(tmp_path, sources=Sources(seed=0), precision="fp32") as s:
        model = s.init(lambda: torch.nn.Linear(2, 1))
        opt = s.track(torch.optim.SGD(model.parameters(), lr=0.1))
        sched = s.track(lr_scheduler.StepLR(opt, 1))
        with s.step():
            pass
        sched.step()  # after step 1's commitment
        with pytest.raises(RuntimeError, match="lr_scheduler changed after step 1 was committed"), s.step():
            pass


@pytest.mark.parametrize("stop_after", [None, 3])
def test_a_scheduler_stepped_after_the_last_step_leaves_the_committed_state_in_the_final_checkpoint(
    tmp_path, stop_after
) -> None:
    """A scheduler stepped once more after the loop (a per-epoch step after the last batch) changes nothing
    the bundle holds: the final checkpoint, written at exit, holds the state the last step committed, so the
    bundle replays from step 0 and from its checkpoints, and a stopped run resumes."""

    def run(session: Session, stop: int | None = None) -> None:
        model = session.init(lambda: torch.nn.Linear(2, 1))
        opt = session.track(torch.optim.SGD(model.parameters(), lr=0.1))
        sched = session.track(lr_scheduler.StepLR(opt, 1, gamma=0.5))
        loader = session.loader((torch.ones(8, 2), torch.zeros(8, 1)), batch_size=4, steps=STEPS)
        session.restore()
        for batch in loader:
            with session.step():
                torch.nn.functional.mse_loss(model(batch.x), batch.y).backward()
                opt.step()
                opt.zero_grad()
                sched.step()
            if session.step_index == stop:
                session.stop_requested = True
                break
        sched.step()  # after the last step: not part of any step

    with Session(tmp_path, sources=Sources(seed=0), planned_steps=STEPS, checkpoint_every=4) as s:
        run(s, stop_after)
    if stop_after is not None:
        with Session(tmp_path, resume=True, planned_steps=STEPS, checkpoint_every=4) as s:
            run(s)
    for start in (0, 4):
        with Session(tmp_path, mode="replay", start=start) as r:
            run(r)
        assert r.step_index == STEPS


def test_a_checkpoints_state_with_many_keys_is_refused_in_a_short_line() -> None:
    part, _ = _plateau_part()
    meta = part.state()[1]
    meta["scheduler"].update({f"k{i}": 0 for i in range(10**5)})
    with pytest.raises(
        ValueError, match=r"unexpected keys \['k0', 'k1', 'k10', 'k100', \.\.\.\] \(100000\)"
    ) as e:
        part.load_state({}, meta)
    assert len(str(e.value)) < 300


def test_non_finite_numpy_floats_round_trip() -> None:
    import json

    import numpy as np

    class Capped:  # a LambdaLR factor as a callable object, whose attributes are its state
        def __init__(self) -> None:
            self.cap = np.float64("inf")

        def __call__(self, step: int) -> float:
            return min(1.0, self.cap)

    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    part = scheduler_part(lr_scheduler.LambdaLR(opt, Capped()))
    meta = json.loads(json.dumps(part.state()[1], allow_nan=False))
    assert meta["scheduler"]["lr_lambdas"][0] == {"cap": {"float": "inf"}}
    part.load_state({}, meta)


def _plateau_part() -> tuple[StateDictPart, lr_scheduler.ReduceLROnPlateau]:
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    sched = lr_scheduler.ReduceLROnPlateau(opt)
    return scheduler_part(sched), sched


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda m: m["scheduler"].update(__class__="x"),
            r"lr scheduler.scheduler: unexpected keys \['__class__'\]",
        ),
        (lambda m: m["scheduler"].pop("best"), r"missing keys \['best'\] \(1\)"),
        (
            lambda m: m["scheduler"].update(best="inf"),
            r"lr scheduler.scheduler.best: holds a string, expected a number",
        ),
        (lambda m: m["scheduler"].update(best={"float": "huge"}), "best: holds an object, expected a number"),
        (
            lambda m: m["scheduler"].update(_last_lr=[0.1, 0.1]),
            r"_last_lr: holds 2 values, expected 1 values",
        ),
        (lambda m: m["scheduler"].update(patience=True), "patience: holds a boolean, expected a number"),
        (
            lambda m: m["param_groups"][0].update(nesterov=[1] * 10**6),
            "nesterov: holds a list, expected a boolean",
        ),
        (lambda m: m.update(param_groups=[]), "param_groups: holds 0 values, expected 1 values"),
    ],
)
def test_a_checkpoints_state_is_taken_only_in_the_live_objects_shape(change, message: str) -> None:
    part, sched = _plateau_part()
    meta = part.state()[1]
    assert meta["scheduler"]["best"] == {"float": "inf"}  # JSON has no infinity
    change(meta)
    with pytest.raises(ValueError, match=message):
        part.load_state({}, meta)
    assert sched.best == float("inf") and not hasattr(sched, "x")  # nothing loaded


def test_a_checkpoints_state_round_trips_through_json() -> None:
    import json

    part, sched = _plateau_part()
    sched.step(1.5)
    assert part.state()[1]["scheduler"]["best"] == {"float": "inf"}  # the state of the last digest: committed
    digest = part.digest()  # a step's commitment
    meta = json.loads(json.dumps(part.state()[1], allow_nan=False))
    fresh, fresh_sched = _plateau_part()
    fresh.load_state({}, meta)
    assert fresh_sched.best == 1.5 and fresh.digest() == digest
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    copy = torch.amp.GradScaler("cpu")
    grad_scaler_part(copy).load_state({}, json.loads(json.dumps(grad_scaler_part(scaler).state()[1])))
    assert copy.get_scale() == 8.0


def test_a_scaler_state_that_differs_from_the_commitment_refuses_the_resume(tmp_path) -> None:
    """A checkpoint whose scaler state was altered (a valid-looking scale, the manifest resealed as the other
    party can) is not the committed state: the resume is refused and changes nothing."""
    _record(tmp_path / "run", None, True, True, stop_after=3)
    path = tmp_path / "run" / bundle.checkpoint_name(3)
    tensors, meta = bundle.decode_checkpoint(path.read_bytes(), path.name, bundle.Caps())
    meta["parts"]["grad_scaler"]["meta"]["scale"] = 2.0**20
    path.write_bytes(bundle.encode_checkpoint(tensors, meta))
    bundle.reseal(tmp_path / "run")
    before = {f: f.read_bytes() for f in (tmp_path / "run").rglob("*") if f.is_file()}
    with pytest.raises(BundleError, match="restored state differs from the step commitment"):
        _record(tmp_path / "run", None, True, True, resume=True)
    assert {f: f.read_bytes() for f in (tmp_path / "run").rglob("*") if f.is_file()} == before
