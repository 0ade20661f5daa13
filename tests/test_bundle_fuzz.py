"""Property tests of the bundle readers on damaged input: each accepts or raises its one error type.

``parse_manifest``, ``parse_commitments``, ``decode_checkpoint`` and ``Bundle`` may raise only
:class:`~detrl.formats.bundle.BundleError`; the rounding-log reader and its cursors only
:class:`~detrl.formats.roundlog.RoundLogError`. Anything else escaping (``IndexError``, ``struct.error``,
``RecursionError``, ``UnicodeError``, ``MemoryError`` ...) fails the test, and hypothesis shrinks it.
The damage starts from a real bundle recorded once for the module; the mutation driver
(:mod:`detrl.testing.fuzzing`) is the one ``detrl bench fuzz`` runs by the hundred thousand.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from detrl.cli import main
from detrl.formats import bundle as bundle_mod
from detrl.formats import safeio
from detrl.formats.bundle import BundleError, Caps
from detrl.formats.roundlog import RoundLogError, RoundLogReader
from detrl.testing import fuzzing

TRAIN = ["configs/supervised/digits_cnn.yaml", "--set", "train.steps=8", "--set", "verify.checkpoint_every=4",
         "--no-tensorboard", "--quiet"]  # fmt: skip
FAST = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> fuzzing.BaseBundle:
    root = tmp_path_factory.mktemp("fuzz")
    assert main(["train", *TRAIN, "--out", str(root / "run")]) == 0
    return fuzzing.BaseBundle.load(root / "run", root / "work" / "run")


# Byte edits (detrl.testing.fuzzing.EDITS): positions wrap around the data, so hypothesis may draw any integer.
interesting = st.sampled_from(fuzzing.INTERESTING_INTS)
edits = st.lists(
    st.tuples(
        st.sampled_from(fuzzing.EDITS), st.integers(0, 1 << 20), interesting | st.integers(0, 2**64 - 1)
    ),
    min_size=1,
    max_size=4,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def replace_node(obj: Any, index: int, value: Any) -> Any:
    """``obj`` (copied) with its ``index``-th node (``json_paths`` order, wrapping) replaced by ``value``."""
    obj = json.loads(json.dumps(obj))
    paths = fuzzing.json_paths(obj)
    path = paths[index % len(paths)]
    if not path:
        return value
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return obj


def encode(obj: Any) -> bytes:
    try:
        return safeio.dumps_json(obj)
    except RecursionError:  # hypothesis values are shallow; this guards the test, not the reader
        assume(False)  # inside @given: pytest.skip would skip the whole test, assume drops this example


def only_bundle_error(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except BundleError as e:
        assert str(e) and "\n" not in str(e)  # one line


def only_roundlog_error(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except RoundLogError as e:
        assert str(e).startswith("roundlog") and "\n" not in str(e)


def test_base_bundle_is_valid(base: fuzzing.BaseBundle) -> None:
    """The scratch copy the cases damage is a valid bundle (so a case's damage is what it tests)."""
    b = bundle_mod.Bundle(base.workdir)
    try:
        assert b.steps == 8 and b.checkpoint_steps == [4, 8]
        for step in b.checkpoint_steps:
            b.load_checkpoint(step)
    finally:
        b.close()


# --- manifest.json ----------------------------------------------------------------------------------


@FAST
@given(data=st.binary(max_size=3000))
def test_parse_manifest_any_bytes(data: bytes) -> None:
    only_bundle_error(bundle_mod.parse_manifest, data)


@FAST
@given(e=edits)
def test_parse_manifest_byte_edits(base: fuzzing.BaseBundle, e: list) -> None:
    only_bundle_error(bundle_mod.parse_manifest, fuzzing.apply_edits(base.files["manifest.json"], e))


@FAST
@given(index=st.integers(0, 10_000), value=json_values | st.sampled_from(fuzzing.hostile_values()))
def test_parse_manifest_wrong_json_value(base: fuzzing.BaseBundle, index: int, value: Any) -> None:
    only_bundle_error(bundle_mod.parse_manifest, encode(replace_node(base.manifest, index, value)))


def test_a_schema_error_under_a_key_with_a_newline_is_one_line(base: fuzzing.BaseBundle) -> None:
    """pydantic names where an error is by the JSON's own keys: a key of another party's with a newline
    (hypothesis found ``{"checkpoints": {"\\n": 5}}``) is quoted in the message, which stays one line."""
    manifest = dict(base.manifest, checkpoints={"\n": 5})
    with pytest.raises(BundleError) as raised:
        bundle_mod.parse_manifest(encode(manifest))
    assert "\n" not in str(raised.value) and "checkpoints.'\\n'" in str(raised.value)


@FAST
@given(rng=st.randoms(use_true_random=False))
def test_parse_manifest_driver(base: fuzzing.BaseBundle, rng: random.Random) -> None:
    assert fuzzing.fuzz_case(rng, base, "manifest") in ("manifest:accepted", "manifest:BundleError")


# --- commitments --------------------------------------------------------------------------------------


@FAST
@given(data=st.binary(max_size=2000))
def test_parse_commitments_any_bytes(data: bytes) -> None:
    only_bundle_error(bundle_mod.parse_commitments, data)


@FAST
@given(e=edits)
def test_parse_commitments_byte_edits(base: fuzzing.BaseBundle, e: list) -> None:
    only_bundle_error(bundle_mod.parse_commitments, fuzzing.apply_edits(base.files["commitments"], e))


@FAST
@given(rng=st.randoms(use_true_random=False))
def test_parse_commitments_driver(base: fuzzing.BaseBundle, rng: random.Random) -> None:
    assert fuzzing.fuzz_case(rng, base, "commitments").startswith("commitments:")


# --- checkpoints --------------------------------------------------------------------------------------


@FAST
@given(e=edits, which=st.integers(0, 1))
def test_decode_checkpoint_byte_edits(base: fuzzing.BaseBundle, e: list, which: int) -> None:
    rel = base.checkpoint_rels()[which]
    only_bundle_error(bundle_mod.decode_checkpoint, fuzzing.apply_edits(base.files[rel], e), rel, Caps())


@FAST
@given(n=interesting | st.integers(0, 2**64 - 1))
def test_decode_checkpoint_header_length(base: fuzzing.BaseBundle, n: int) -> None:
    rel = base.checkpoint_rels()[0]
    data = n.to_bytes(8, "little") + base.files[rel][8:]
    only_bundle_error(bundle_mod.decode_checkpoint, data, rel, Caps(checkpoint_header_bytes=1 << 16))


@FAST
@given(
    index=st.integers(0, 10_000),
    value=json_values | st.sampled_from(fuzzing.hostile_values()),
    meta=st.booleans(),
)
def test_decode_checkpoint_wrong_json_value(
    base: fuzzing.BaseBundle, index: int, value: Any, meta: bool
) -> None:
    """A value of the safetensors header, or of the detrl metadata inside it, replaced."""
    rel = base.checkpoint_rels()[0]
    data = base.files[rel]
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    if meta:
        header["__metadata__"]["detrl"] = encode(
            replace_node(json.loads(header["__metadata__"]["detrl"]), index, value)
        ).decode()
    else:
        header = replace_node(header, index, value)
    raw = encode(header)
    raw += b" " * (-len(raw) % 8)
    only_bundle_error(
        bundle_mod.decode_checkpoint, len(raw).to_bytes(8, "little") + raw + data[8 + n :], rel, Caps()
    )


@FAST
@given(
    text=st.text(st.characters(categories=["Cs", "Cc", "Nd", "Po", "Ll"]), max_size=40)
    | st.sampled_from(fuzzing.HOSTILE_TEXTS)
)
def test_decode_checkpoint_metadata_string(base: fuzzing.BaseBundle, text: str) -> None:
    """The detrl metadata string itself: not JSON, a lone surrogate (once a crash: UnicodeEncodeError)."""
    rel = base.checkpoint_rels()[0]
    data = base.files[rel]
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["detrl"] = text
    raw = encode(header)
    raw += b" " * (-len(raw) % 8)
    only_bundle_error(
        bundle_mod.decode_checkpoint, len(raw).to_bytes(8, "little") + raw + data[8 + n :], rel, Caps()
    )


@FAST
@given(rng=st.randoms(use_true_random=False))
def test_decode_checkpoint_driver(base: fuzzing.BaseBundle, rng: random.Random) -> None:
    assert fuzzing.fuzz_case(rng, base, "checkpoint").startswith("checkpoint:")


# --- the rounding log -------------------------------------------------------------------------------------


@FAST
@given(e=edits, rng=st.randoms(use_true_random=False))
def test_roundlog_byte_edits(base: fuzzing.BaseBundle, e: list, rng: random.Random) -> None:
    def read() -> None:
        with RoundLogReader(io.BytesIO(fuzzing.apply_edits(base.files["roundlog"], e)), name="roundlog") as r:
            fuzzing.exercise_log(rng, r, base)

    only_roundlog_error(read)


@FAST
@given(rng=st.randoms(use_true_random=False))
def test_roundlog_driver(base: fuzzing.BaseBundle, rng: random.Random) -> None:
    """Segments rebuilt around damaged records, frames and header fields, with valid CRCs."""
    assert fuzzing.fuzz_case(rng, base, "roundlog") in ("roundlog:accepted", "roundlog:RoundLogError")


# --- the bundle directory ---------------------------------------------------------------------------------


@SLOW
@given(rng=st.randoms(use_true_random=False))
def test_bundle_directory_driver(base: fuzzing.BaseBundle, rng: random.Random) -> None:
    """One or two files of the bundle damaged (or swapped for a link, FIFO, folder), the manifest often
    re-signed so the damage reaches the reader behind the SHA-256 and Merkle checks."""
    assert fuzzing.fuzz_case(rng, base, "bundle").startswith("bundle:")


@SLOW
@given(e=edits, rel=st.sampled_from(["manifest.json", "commitments", "roundlog"]))
def test_bundle_directory_byte_edits(base: fuzzing.BaseBundle, e: list, rel: str) -> None:
    (base.workdir / rel).write_bytes(fuzzing.apply_edits(base.files[rel], e))
    try:
        b = bundle_mod.Bundle(base.workdir)
        b.close()
    except BundleError as err:
        assert "\n" not in str(err)
    finally:
        base.restore(rel)


@SLOW
@given(rng=st.randoms(use_true_random=False))
def test_any_target(base: fuzzing.BaseBundle, rng: random.Random) -> None:
    target, _, outcome = fuzzing.fuzz_case(rng, base).partition(":")
    assert target in fuzzing.TARGETS and outcome in ("accepted", "BundleError", "RoundLogError")


def test_cases_restore_the_scratch_copy(base: fuzzing.BaseBundle) -> None:
    """After many bundle cases the scratch copy holds exactly the base files again."""
    for i in range(200):
        fuzzing.fuzz_case(random.Random(i), base, "bundle")
    found = {str(p.relative_to(base.workdir)): p.read_bytes() for p in base.workdir.rglob("*") if p.is_file()}
    assert found == base.files
    assert all(p.is_dir() or p.is_file() for p in base.workdir.rglob("*"))
    assert not any(p.is_symlink() for p in base.workdir.rglob("*"))
    assert [p.name for p in base.workdir.parent.iterdir()] == ["run"]


def test_driver_is_deterministic(base: fuzzing.BaseBundle) -> None:
    """A case is a pure function of its seed, so a crash the benchmark reports can be replayed."""
    first = [fuzzing.fuzz_case(random.Random(f"s{i}"), base) for i in range(100)]
    assert first == [fuzzing.fuzz_case(random.Random(f"s{i}"), base) for i in range(100)]


def test_unknown_target(base: fuzzing.BaseBundle) -> None:
    with pytest.raises(ValueError, match="unknown fuzz target"):
        fuzzing.fuzz_case(random.Random(0), base, "nope")


def test_base_loads_from_a_copy(base: fuzzing.BaseBundle, tmp_path: Path) -> None:
    shutil.copytree(base.workdir, tmp_path / "copy")
    again = fuzzing.BaseBundle.load(tmp_path / "copy", tmp_path / "work2")
    assert again.files == base.files and again.ops == base.ops
