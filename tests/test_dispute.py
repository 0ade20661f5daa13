"""Disputes between two bundles of one config (detrl/apps/dispute.py): the referee finds the first step
whose commitments differ within ceil(log2 n) + 1 comparisons, replays it, and blames the right bundle and
op, in either order.

The trainer is a shrunk digits_cnn (4 channels, 8 steps, checkpoints at 4 and 8), recorded once per module
honestly, once by a cheat that scales the loss of step ``CHEAT_STEP`` by 1.001 and once by one that scales
that step's logits.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from detrl.apps.dispute import Blame, Channel, Party, Referee, _tensor_message, dispute, replay_step
from detrl.bench.common import record
from detrl.cli import main
from detrl.formats import bundle as bundle_mod
from detrl.formats.bundle import BundleError
from detrl.run import config as config_mod
from detrl.testing.cheats import cheating_reexecute, overwrite_commitment, scaled_loss

STEPS = 8
CHEAT_STEP = 6
OVERWRITTEN_STEP = 3
CFG = config_mod.load(
    "configs/supervised/digits_cnn.yaml",
    [f"train.steps={STEPS}", "verify.checkpoint_every=4", "model.channels=4"],
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dispute")
    torch.set_num_threads(1)
    record(CFG, root / "honest")
    with scaled_loss(CHEAT_STEP, 1.001):
        record(CFG, root / "cheat")
    with scaled_loss(CHEAT_STEP, 1.001, on="logits"):
        record(CFG, root / "logits")
    return {name: root / name for name in ("honest", "cheat", "logits")}


def _bound(leaves: int) -> int:
    return math.ceil(math.log2(leaves)) + 1


def _settle(a: Party, b: Party, run_a: Path, run_b: Path) -> object:
    return Referee(Channel("A", a), Channel("B", b), run_a, run_b).settle()


@pytest.mark.parametrize("cheat_is", ["A", "B"])
def test_loss_scaling_cheat_blames_the_scaling(runs: dict[str, Path], cheat_is: str) -> None:
    """The cheater re-executes its step with the same cheat when asked: the first op that departs is the
    scaling ``mul`` itself (where the referee has the loss's backward), not a product further down."""
    honest = Party(runs["honest"])
    cheat = Party(runs["cheat"], reexecute=cheating_reexecute(CHEAT_STEP, 1.001))
    if cheat_is == "A":
        v = _settle(cheat, honest, runs["cheat"], runs["honest"])
    else:
        v = _settle(honest, cheat, runs["honest"], runs["cheat"])
    other = "B" if cheat_is == "A" else "A"
    assert v.outcome == "settled" and v.exit_code == 1
    assert v.step == CHEAT_STEP and not v.batch_differs
    assert v.comparisons <= _bound(STEPS + 1) == v.comparison_bound
    assert v.replay_from == 4  # the last checkpoint both hold before the step
    assert v.reproduces == other
    assert [b.party for b in v.blamed] == [cheat_is]
    blame = v.blamed[0]
    mine = replay_step(runs["honest"], CHEAT_STEP)
    ops = [r.op for r in mine.trace.records]
    assert blame.op == "mul" and blame.referee_op == "nll_loss_backward"
    assert blame.position == ops.index("nll_loss_backward") < ops.index("mm")
    assert v.bytes_exchanged > 0 and v.messages >= 2 * v.comparisons
    assert json.loads(json.dumps(v.to_json()))["blamed"][0]["op"] == "mul"


def test_element_named_when_shapes_agree(runs: dict[str, Path]) -> None:
    """A cheat that scales the logits: its ``mul`` has the shape of the op the referee runs there (the
    log-softmax), so the revealed values are compared and the first differing element is named."""
    cheat = Party(runs["logits"], reexecute=cheating_reexecute(CHEAT_STEP, 1.001, on="logits"))
    v = _settle(Party(runs["honest"]), cheat, runs["honest"], runs["logits"])
    assert v.step == CHEAT_STEP and v.reproduces == "A"
    (blame,) = v.blamed
    assert (blame.op, blame.referee_op) == ("mul", "_log_softmax")
    assert blame.output == 0 and blame.element is not None
    assert blame.party_value != blame.referee_value


def test_honest_reexecution_of_a_cheated_bundle(runs: dict[str, Path]) -> None:
    """A party that re-executes honestly a bundle recorded with the cheat: every op matches the
    referee's, and the bundle is still blamed, for a commitment no execution of those ops gives."""
    v = dispute(runs["honest"], runs["cheat"])
    assert v.step == CHEAT_STEP and v.reproduces == "A"
    (blame,) = v.blamed
    assert blame.party == "B" and blame.position is None and "no execution gives" in blame.detail


@pytest.mark.parametrize("forged_is", ["A", "B"])
def test_overwritten_commitment_is_blamed(runs: dict[str, Path], tmp_path: Path, forged_is: str) -> None:
    """One commitment overwritten (the later ones left honest, so the leaves agree again after it): the
    search still finds that step, the first one that differs, and the forged bundle is blamed."""
    forged = tmp_path / "forged"
    shutil.copytree(runs["honest"], forged)
    overwrite_commitment(forged, OVERWRITTEN_STEP)
    pair = (forged, runs["honest"]) if forged_is == "A" else (runs["honest"], forged)
    v = dispute(*pair)
    assert v.step == OVERWRITTEN_STEP and v.comparisons <= _bound(STEPS + 1)
    assert v.logs_identical is True and v.replay_from == 0
    assert v.reproduces == ("B" if forged_is == "A" else "A")
    assert [b.party for b in v.blamed] == [forged_is]


def test_a_dispute_over_the_initial_state(runs: dict[str, Path], tmp_path: Path) -> None:
    forged = tmp_path / "forged"
    shutil.copytree(runs["honest"], forged)
    overwrite_commitment(forged, 0)
    v = dispute(runs["honest"], forged)
    assert v.step == 0 and "initial state" in v.message and v.comparisons <= _bound(STEPS + 1)
    assert v.reproduces == "A" and [b.party for b in v.blamed] == ["B"]


def test_equal_roots_are_no_dispute(runs: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(runs["honest"], copy)
    v = dispute(runs["honest"], copy)
    assert v.outcome == "no dispute" and v.exit_code == 0 and v.step is None and v.comparisons == 0


def test_different_configs_are_bad_input(runs: dict[str, Path], tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(runs["honest"], other)
    m = json.loads((other / bundle_mod.MANIFEST).read_text())
    m["config"]["optimizer"]["lr"] = 0.01
    (other / bundle_mod.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(BundleError, match=r"not of one config: config\.optimizer\.lr differs"):
        dispute(runs["honest"], other)


def test_a_party_cannot_steer_the_search(runs: dict[str, Path]) -> None:
    """Children that do not hash to the node they are asked about, and answers that are not messages,
    are bad input naming the party."""
    honest, cheat = Party(runs["honest"]), Party(runs["cheat"])

    def lying(request: bytes) -> bytes:
        answer = json.loads(cheat.handle(request))
        if "children" in answer:
            answer["children"] = answer["children"][::-1]
        return json.dumps(answer).encode()

    with pytest.raises(BundleError, match=r"party B: the children of node .* do not hash to it"):
        _settle(honest, lying, runs["honest"], runs["cheat"])  # type: ignore[arg-type]
    with pytest.raises(BundleError, match="party B: config answer: not valid JSON"):
        _settle(honest, lambda request: b"[", runs["honest"], runs["cheat"])  # type: ignore[arg-type]
    assert b"error" in honest.handle(b'{"ask": "leaf", "step": 99}')


def test_a_party_that_reveals_nothing_is_blamed_without_an_op(runs: dict[str, Path]) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise BundleError("this party does not re-execute")

    v = _settle(Party(runs["honest"]), Party(runs["cheat"], reexecute=refuse), runs["honest"], runs["cheat"])
    (blame,) = v.blamed
    assert blame.party == "B" and blame.position is None
    assert "revealed no per-op digests" in blame.detail and "does not re-execute" in blame.detail


def test_cli(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "verdict.json"
    code = main(["dispute", str(runs["honest"]), str(runs["cheat"]), "--json", str(report), "--quiet"])
    out = capsys.readouterr().out
    assert code == 1
    assert f"first differing step: {CHEAT_STEP} of {STEPS}" in out and "reproduces: A" in out
    assert json.loads(report.read_text())["step"] == CHEAT_STEP
    assert main(["dispute", str(runs["honest"]), str(tmp_path / "missing")]) == 2
    assert "detrl: error:" in capsys.readouterr().err


class _Revealing:
    """A party that reveals the given outputs when asked for an op's values."""

    name = "B"

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        self.outputs = outputs

    def ask(self, kind: str, **fields: object) -> dict[str, object]:
        assert kind == "values"
        return {"outputs": [_tensor_message(t) for t in self.outputs]}


def test_the_first_differing_element_is_a_value_not_a_nans_bits() -> None:
    """Two NaNs are one value (their sign and payload are the hardware's): the element named is the first
    whose value differs, past NaNs whose bits differ; where only NaNs' bits differ, the detail says so."""
    ours = torch.tensor([1.0, math.nan, 2.0, 3.0], dtype=torch.float64)
    theirs = ours.clone()
    theirs.view(torch.int64)[1] ^= -(2**63)  # the NaN with its sign flipped
    referee = Referee.__new__(Referee)  # the comparison reads nothing of the referee's runs
    blame = Blame("B", 1)
    referee._first_element(_Revealing([theirs]), blame, 1, 0, [ours])
    assert blame.element is None and "but for NaNs' signs and payloads" in blame.detail
    theirs[3] = 4.0
    blame = Blame("B", 1)
    referee._first_element(_Revealing([theirs]), blame, 1, 0, [ours])
    assert (blame.output, blame.element, blame.party_value, blame.referee_value) == (0, 3, 4.0, 3.0)
