"""Tampering is caught, at the right step: a dishonest trainer, a forged rounding log, a changed checkpoint.

The trainer is the digits_cnn recipe (configs/supervised/digits_cnn.yaml, 8 steps, checkpoints at 4 and 8)
written out as a custom loop over :class:`detrl.Session`, so a test can play the dishonest trainer. The
honest bundle it records (once per module) carries the recipe's config and data fingerprint, so
``detrl audit`` can replay it as well. Every test copies it into ``tmp_path`` before changing anything.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml

from detrl import Divergence, Session, Sources
from detrl.cli import main
from detrl.core.hardware import Profile
from detrl.formats import bundle as bundle_mod
from detrl.formats.roundlog import OpEntries, RoundLogReader
from detrl.run import config as config_mod
from detrl.supervised import data
from detrl.supervised.models import DigitsCNN
from detrl.testing.logrewrite import rewrite

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "supervised" / "digits_cnn.yaml"
STEPS = 8
CHECKPOINT_EVERY = 4
TAMPER_STEP = 5
FLIP_STEP = 3  # the step whose rounding log is forged (>= 2: the calibration step is not special)
MAX_TRIES = 6  # log entries tried before giving up on finding one whose flip changes the state
EMULATED = ["emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic"]
ATEN_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")

_raw = yaml.safe_load(CONFIG.read_text())
_raw["train"]["steps"] = STEPS
_raw["verify"]["checkpoint_every"] = CHECKPOINT_EVERY
CFG = config_mod.validate(_raw)
X, Y = data.digits()
FINGERPRINT = data.fingerprint(X, Y)


# --- the (possibly dishonest) trainer ------------------------------------------------------------


class NudgedHardware(Profile):
    """A synthetic machine whose convolutions' FP64 results lie one ulp further from zero than native
    ones (real devices differ by that much): the exact ties in the log then round the other way here."""

    def __init__(self) -> None:
        super().__init__("test:nudged", "convolutions one FP64 ulp off native")

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        if func is torch.ops.aten.convolution.default and out.dtype == torch.float64:
            away = torch.nextafter(out, torch.copysign(torch.full_like(out, math.inf), out))
            out = torch.where(out == 0, out, away)  # exact zeros stay zero (cancellation is not modelled)
        return out


def train(
    run_dir: Path,
    mode: str,
    hardware: str | Profile = "native",
    *,
    x: torch.Tensor = X,
    y: torch.Tensor = Y,
    poison_step: int | None = None,
    skip_step: int | None = None,
    anomalies: list[tuple[int, Any]] | None = None,
    op_names: dict[int, list[str]] | None = None,
) -> Session:
    """The digits_cnn recipe, recorded or replayed. Tamper hooks:

    ``poison_step``: change one example's pixels after the loader hashed the batch (hash stays honest).
    ``skip_step``: compute the gradient but skip ``opt.step()``.
    ``anomalies`` / ``op_names``: collect each step's rounding anomalies / op names (replay).
    """
    torch.set_num_threads(CFG.threads)
    with Session(
        run_dir, mode=mode, hardware=hardware, sources=Sources.from_config(CFG.sources),
        checkpoint_every=CHECKPOINT_EVERY, task="supervised", config=CFG.model_dump(mode="json"),
        planned_steps=STEPS, data_fingerprint=FINGERPRINT, force=mode == "record",
    ) as s:  # fmt: skip
        model = s.init(lambda: DigitsCNN(channels=CFG.model.channels))
        o = CFG.optimizer
        opt = s.track(
            torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
        )
        model.train()
        for batch in s.loader((x, y), batch_size=CFG.train.batch_size, steps=STEPS):
            step = s.step_index + 1
            if step == poison_step:
                batch.x[0] = (
                    1.0 - batch.x[0]
                )  # after the loader hashed it: the committed batch hash is honest
            with s.step() as rounding:
                loss = F.cross_entropy(model(batch.x), batch.y)
                loss.backward()
                if step != skip_step:
                    opt.step()
                opt.zero_grad(set_to_none=True)
            if rounding is not None and anomalies is not None:
                anomalies.extend((step, a) for a in rounding.anomalies)
            if rounding is not None and op_names is not None:
                op_names[step] = list(rounding.op_names)
    return s


def replay(run_dir: Path, hardware: str | Profile = "native", **kw: Any) -> Divergence | None:
    """Replay with the honest data; the Divergence raised, or None when every commitment matched."""
    try:
        train(run_dir, "replay", hardware, **kw)
    except Divergence as d:
        return d
    return None


# --- fixtures and helpers ------------------------------------------------------------------------


# Recorded under rounding-rule revision 2, whose digits CNN log has entries that matter (conftest.py).
pytestmark = pytest.mark.usefixtures("rules_revision_2")


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("honest") / "run"
    train(run, "record")
    return run


def rehash(run: Path) -> None:
    """Make the manifest consistent with the changed files again, as the adversary can."""
    bundle_mod.reseal(run)


def commitments(run: Path) -> list[dict[str, str]]:
    leaves, _ = bundle_mod.parse_commitments((run / "commitments").read_bytes())
    return [{"state": s.hex(), "batch": b.hex()} for s, b in leaves]


def forge_log(
    run: Path, transform: Callable[[int, dict[int, OpEntries]], dict[int, OpEntries] | None]
) -> None:
    """Rewrite the bundle's roundlog through ``transform`` (valid checksums) and fix the manifest hashes."""
    forged = run / "roundlog.forged"
    rewrite(run / "roundlog", forged, transform)
    forged.replace(run / "roundlog")
    rehash(run)


def flip_one(step: int, op: int, pos: int) -> Callable[[int, dict[int, OpEntries]], dict[int, OpEntries]]:
    def transform(s: int, ops: dict[int, OpEntries]) -> dict[int, OpEntries]:
        if s == step:
            e = ops[op]
            up = e.up.copy()
            up[pos] = not up[pos]
            ops[op] = OpEntries(op, e.indices, up)
        return ops

    return transform


def remove_one(step: int, op: int, index: int) -> Callable[[int, dict[int, OpEntries]], dict[int, OpEntries]]:
    def transform(s: int, ops: dict[int, OpEntries]) -> dict[int, OpEntries]:
        if s == step:
            e = ops[op]
            keep = e.indices != index
            assert not keep.all(), f"index {index} not logged for op {op} at step {step}"
            if keep.any():
                ops[op] = OpEntries(op, e.indices[keep], e.up[keep])
            else:
                del ops[op]
        return ops

    return transform


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def rows_of_step(step: int) -> torch.Tensor:
    """Dataset rows the loader feeds at ``step`` (same switchboard as the recipe)."""
    s = Session(None, mode="off", sources=Sources.from_config(CFG.sources))
    for i, batch in enumerate(s.loader((X, Y), batch_size=CFG.train.batch_size, steps=step), start=1):
        if i == step:
            return batch.index.clone()
    raise AssertionError("unreachable")


# --- honest runs replicate -------------------------------------------------------------------------


@pytest.mark.parametrize("hardware", ["native", *EMULATED])
def test_honest_replays(bundle: Path, hardware: str) -> None:
    seen: list[tuple[int, Any]] = []
    try:
        s = train(bundle, "replay", hardware, anomalies=seen)
    except Divergence as d:  # pragma: no cover - the failure message is the point
        pytest.fail(f"honest bundle diverged on {hardware}: {d}")
    assert s.step_index == STEPS
    assert s.totals.unlogged_near == 0
    assert all(a.kind == "logged-direction-differs" for _, a in seen)  # log corrections only
    if hardware == "native":
        assert s.totals.corrected == 0 and not seen


def test_honest_bundle_audits_from_cli(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The Session-recorded bundle is a faithful digits_cnn recipe run: ``detrl audit`` rebuilds it."""
    rc, out, err = cli(capsys, "audit", str(bundle), "--hardware", "emulated:splitk", "--quiet")
    assert rc == 0, out + err
    assert out.startswith("REPLICATED")


# --- dishonest trainers ----------------------------------------------------------------------------


def test_poisoned_example_after_hashing(honest: Path, tmp_path: Path) -> None:
    run = tmp_path / "poisoned"
    train(run, "record", poison_step=TAMPER_STEP)
    got, want = commitments(run), commitments(honest)
    assert got[:TAMPER_STEP] == want[:TAMPER_STEP]
    assert (
        got[TAMPER_STEP]["batch"] == want[TAMPER_STEP]["batch"]
    )  # the batch hash was taken before poisoning
    assert got[TAMPER_STEP]["state"] != want[TAMPER_STEP]["state"]
    d = replay(run)
    assert d is not None, "the poisoned run replicated"
    assert d.step == TAMPER_STEP
    assert d.batch_matches


def test_poisoned_example_in_the_data(honest: Path, tmp_path: Path) -> None:
    rows = rows_of_step(TAMPER_STEP)
    row = int(rows[0])
    for step in range(1, STEPS + 1):  # the row is used by no other step (8 x 32 < one epoch)
        if step != TAMPER_STEP:
            assert row not in set(rows_of_step(step).tolist())
    x2 = X.clone()
    x2[row] = 1.0 - x2[row]
    run = tmp_path / "poisoned_data"
    train(run, "record", x=x2)
    got, want = commitments(run), commitments(honest)
    assert got[:TAMPER_STEP] == want[:TAMPER_STEP]
    assert got[TAMPER_STEP]["batch"] != want[TAMPER_STEP]["batch"]
    d = replay(run)  # the auditor's data is the honest X
    assert d is not None, "the run on poisoned data replicated"
    assert d.step == TAMPER_STEP
    assert not d.batch_matches
    assert "batch" in d.describe()


def test_skipped_step(tmp_path: Path) -> None:
    run = tmp_path / "skipped"
    train(run, "record", skip_step=TAMPER_STEP)
    d = replay(run)
    assert d is not None, "the run with a skipped optimizer step replicated"
    assert d.step == TAMPER_STEP
    assert d.batch_matches


# --- forged rounding logs --------------------------------------------------------------------------


def _candidates(run: Path, step: int) -> list[tuple[int, int]]:
    """(op, position) pairs to try: the first and the middle entry of each logged op, in op order."""
    with RoundLogReader(run / "roundlog") as r:
        ops = r.read_step(step)
    out = []
    for op in sorted(ops):
        n = len(ops[op].indices)
        out += [(op, 0)] + ([(op, n // 2)] if n > 2 else [])
    return out


@pytest.fixture(scope="module")
def flips(honest: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Flip one logged direction at FLIP_STEP, entry by entry, until one changes the state (or MAX_TRIES)."""
    names: dict[int, list[str]] = {}
    assert replay(honest, op_names=names) is None
    results = []
    for op, pos in _candidates(honest, FLIP_STEP)[:MAX_TRIES]:
        run = tmp_path_factory.mktemp("flip") / "run"
        shutil.copytree(honest, run)
        forge_log(run, flip_one(FLIP_STEP, op, pos))
        d = replay(run)
        results.append({"op": op, "pos": pos, "name": names[FLIP_STEP][op], "divergence": d})
        if d is not None:
            break
    return results


def test_flipped_direction_is_caught_at_its_step(flips: list[dict[str, Any]]) -> None:
    hit = [f for f in flips if f["divergence"] is not None]
    assert hit, f"none of {len(flips)} single-direction flips at step {FLIP_STEP} changed the state"
    for f in hit:
        d: Divergence = f["divergence"]
        assert d.step == FLIP_STEP
        assert d.batch_matches
        assert d.anomalies, "the divergence names no rounding anomaly"
        first = d.anomalies[0]
        assert first.op == f["op"]
        assert first.kind == "logged-direction-differs"
        assert first.name == f["name"]
        assert ATEN_NAME.match(first.name)
        assert f"op #{f['op']} aten.{first.name}" in d.describe()


def test_cli_audit_of_forged_log(
    flips: list[dict[str, Any]], bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = next((f for f in flips if f["divergence"] is not None), None)
    assert f is not None, "no effective flip found (see test_flipped_direction_is_caught_at_its_step)"
    forge_log(bundle, flip_one(FLIP_STEP, f["op"], f["pos"]))
    report = tmp_path / "report.json"
    rc, out, err = cli(capsys, "audit", str(bundle), "--hardware", "native", "--json", str(report), "--quiet")
    assert rc == 1, out + err
    assert "Traceback" not in out + err
    assert out.startswith("DIVERGED")
    assert f"step {FLIP_STEP}" in out.splitlines()[0]
    rep = json.loads(report.read_text())
    assert rep["verdict"] == "diverged"
    assert rep["diverged_step"] == FLIP_STEP
    assert rep["anomalies"][0]["op"] == f["op"]
    assert rep["anomalies"][0]["name"] == f["name"]


@pytest.fixture(scope="module")
def corrections(honest: Path) -> tuple[list[tuple[str, int, Any]], dict[str, int]]:
    """Log entries that matter: (profile, step, anomaly) where a profile's own nearest differs from the log."""
    found: list[tuple[Any, int, Any]] = []
    counts: dict[str, int] = {}
    for hw in [*EMULATED, NudgedHardware()]:
        seen: list[tuple[int, Any]] = []
        s = train(honest, "replay", hw, anomalies=seen)
        counts[str(getattr(hw, "name", hw))] = s.totals.corrected
        found += [(hw, step, a) for step, a in seen if a.kind == "logged-direction-differs"]
        if found:
            break
    return found, counts


def test_removed_entry_that_matters(
    corrections: tuple[list[tuple[str, int, Any]], dict[str, int]], bundle: Path
) -> None:
    found, counts = corrections
    # The emulated profiles rarely cross a midpoint on this small model; the nudged machine always does.
    assert found, f"no logged entry matters on any profile in {STEPS} steps (corrected: {counts})"
    hw, step, a = found[0]
    forge_log(bundle, remove_one(step, a.op, a.index))
    d = replay(bundle, hw)
    assert d is not None, f"removing the entry {step}/{a.op}/{a.index} that {hw} needs went unnoticed"
    assert d.step == step
    assert any(
        b.kind == "unlogged-near" and b.op == a.op and b.index == a.index and b.name == a.name
        for b in d.anomalies
    ), d.anomalies
    # The machine needs honest corrections too (it corrected the honest log), and the message names the
    # removed element, not one of those.
    assert counts[str(getattr(hw, "name", hw))] > 0, counts
    assert d.decisive is not None and (d.decisive.op, d.decisive.index) == (a.op, a.index)
    assert f"unlogged-near: op #{a.op} aten.{a.name}" in d.describe() and f"element {a.index}" in d.describe()
    # Where the entry does not matter, removing it is harmless: native computes the logged direction itself.
    assert replay(bundle, "native") is None


def test_removed_entry_natively_harmless_but_reported(bundle: Path) -> None:
    """Removing an entry on native hardware: the replayer reproduces the value but sees the unlogged element."""
    with RoundLogReader(bundle / "roundlog") as r:
        ops = r.read_step(FLIP_STEP)
    op = min(ops)
    index = int(ops[op].indices[0])
    forge_log(bundle, remove_one(FLIP_STEP, op, index))
    seen: list[tuple[int, Any]] = []
    s = train(bundle, "replay", "native", anomalies=seen)
    assert s.step_stats[FLIP_STEP - 1].unlogged_near >= 1
    assert any(
        st == FLIP_STEP and a.kind == "unlogged-near" and a.op == op and a.index == index for st, a in seen
    )


def test_emptied_log_is_not_replicated(
    bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log emptied of every entry (rewritten consistently, manifest rehashed) replays to the same states on
    the recorder's own hardware, but breaks its own thresholds: the verdict says so (exit 4)."""
    forge_log(bundle, lambda s, ops: {})
    report = tmp_path / "report.json"
    rc, out, err = cli(capsys, "audit", str(bundle), "--json", str(report), "--quiet")
    assert rc == 4, out + err
    assert out.startswith("LOG INCOMPLETE") and "unlogged" in out.splitlines()[0]
    rep = json.loads(report.read_text())
    assert rep["verdict"] == "log incomplete" and rep["unlogged_near"] > 0
    assert rep["anomalies"][0]["kind"] == "unlogged-near"


# --- checkpoints -----------------------------------------------------------------------------------


def _flip_checkpoint_byte(run: Path, step: int) -> str:
    rel = f"checkpoints/step_{step:08d}.safetensors"
    path = run / rel
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    pos = 8 + header_len + (len(raw) - 8 - header_len) // 2  # in the tensor data
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))
    return rel


def test_checkpoint_byte_changed_stale_manifest(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rel = _flip_checkpoint_byte(bundle, CHECKPOINT_EVERY)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("detrl: error:"), lines
    assert rel in lines[0]
    assert "Traceback" not in out + err


@pytest.mark.parametrize("step", [CHECKPOINT_EVERY, STEPS])
def test_checkpoint_byte_changed_rehashed(
    bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], step: int
) -> None:
    rel = _flip_checkpoint_byte(bundle, step)
    rehash(bundle)
    report = tmp_path / "report.json"
    rc, out, err = cli(capsys, "audit", str(bundle), "--json", str(report), "--quiet")
    assert "Traceback" not in out + err
    assert rc in (1, 2), out + err
    if rc == 1:
        assert f"step {step}" in out.splitlines()[0] or rel in out
        assert json.loads(report.read_text())["diverged_step"] == step
    else:
        assert rel in err


def test_checkpoint_swapped_for_other_step(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint that is valid, but of another step, does not match its step's commitment."""
    ck4, ck8 = (
        bundle / "checkpoints/step_00000004.safetensors",
        bundle / "checkpoints/step_00000008.safetensors",
    )
    ck4.write_bytes(ck8.read_bytes())
    rehash(bundle)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 1, out + err
    assert "step 4" in out.splitlines()[0]


def test_forged_log_with_stale_manifest_is_bad_input(
    bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Forging the log without fixing the manifest: its length no longer matches, before any replay."""
    forged = bundle / "forged"
    rewrite(bundle / "roundlog", forged, lambda s, ops: ops if s != FLIP_STEP else {})
    forged.replace(bundle / "roundlog")
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 2
    assert err.startswith("detrl: error: roundlog") and "manifest.json" in err


def test_dropped_log_segment_is_bad_input(bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every durable step has a segment (an empty one when nothing was logged): one missing is bad input."""
    forge_log(bundle, lambda s, ops: None if s == FLIP_STEP else ops)
    rc, out, err = cli(capsys, "audit", str(bundle), "--quiet")
    assert rc == 2 and "roundlog" in err and "segment" in err


def test_emptied_log_segment(bundle: Path) -> None:
    """Emptying a whole step's log segment (rehashed): native reproduces every value itself, so the state
    is still honest and replicates, but the replayer reports the unlogged near-midpoint elements."""
    forge_log(bundle, lambda s, ops: {} if s == FLIP_STEP else ops)
    seen: list[tuple[int, Any]] = []
    s = train(bundle, "replay", "native", anomalies=seen)
    assert s.step_stats[FLIP_STEP - 1].unlogged_near > 0
    assert s.step_stats[FLIP_STEP - 1].logged == 0
    assert any(st == FLIP_STEP and a.kind == "unlogged-near" for st, a in seen)
    assert all(st == FLIP_STEP for st, _ in seen)
