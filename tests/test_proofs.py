"""Merkle inclusion proofs (detrl/formats/proof.py, ``detrl prove``, ``detrl verify-proof``).

Pure hashing first: every step of every tree of 1..33 leaves proves against ``commit.merkle_root``, the
carry-up of an odd node gives the paths' shape, a changed byte anywhere in a proof never verifies, and
the number of leaves is bound by the last leaf. Then the CLI end to end on one small recorded bundle
(4 steps of digits_cnn, recorded once per module).
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detrl.cli import main
from detrl.formats import commit, proof
from detrl.formats.bundle import COMMIT_HEADER, COMMIT_RECORD, COMMITMENTS, parse_commitments
from detrl.testing.hostile import read_manifest, write_manifest

CONFIG = "configs/supervised/digits_cnn.yaml"
TRAIN_ARGS = ["--set", "train.steps=4", "--set", "verify.checkpoint_every=2", "--no-tensorboard", "--quiet"]


def random_leaves(n: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    """``n`` distinct (state hash, batch hash) pairs, deterministic in ``seed``."""
    return [
        (
            blake3.blake3(b"state %d/%d" % (seed, i)).digest(),
            blake3.blake3(b"batch %d/%d" % (seed, i)).digest(),
        )
        for i in range(n)
    ]


def root_of(leaves: list[tuple[bytes, bytes]]) -> bytes:
    return commit.merkle_root([commit.leaf(i, s, b) for i, (s, b) in enumerate(leaves)])


#: A proof of step 2 of 7 leaves (a path of three siblings and a last leaf of two)
_SEVEN = proof.encode(proof.prove(random_leaves(7, seed=7), 2))


def check(data: bytes, root: bytes | None) -> bytes:
    """Parse and verify proof bytes: the root, or ProofError / ProofMismatch (nothing else may escape)."""
    return proof.verify(proof.parse(data), root)


# --- the tree ----------------------------------------------------------------------------------------


def test_every_step_of_every_tree_of_1_to_33_leaves_verifies_against_merkle_root():
    for n in range(1, 34):
        leaves = random_leaves(n, seed=n)
        root = root_of(leaves)
        for step in range(n):
            p = proof.prove(leaves, step)
            assert bytes.fromhex(p.root) == root
            assert [s.side for s in p.path] == proof.path_sides(n, step)
            assert (p.last is None) == (step == n - 1)
            assert check(proof.encode(p), root) == root
            assert check(proof.encode(p), None) == root


def test_path_shape_follows_the_carry_up_of_the_odd_node():
    assert proof.path_sides(1, 0) == []
    assert proof.path_sides(2, 0) == ["right"] and proof.path_sides(2, 1) == ["left"]
    # 3 leaves: L2 is carried up past level 0, then paired with node(L0, L1) as the right child
    assert proof.path_sides(3, 2) == ["left"]
    assert proof.path_sides(3, 0) == ["right", "right"]
    # 5 leaves: L4 is carried twice; its only sibling is the subtree over L0..L3
    assert proof.path_sides(5, 4) == ["left"]
    assert proof.path_sides(5, 3) == ["left", "left", "right"]
    # the last leaf's siblings are all on the left, one per 1-bit of n - 1
    for n in range(1, 300):
        assert proof.path_sides(n, n - 1) == ["left"] * bin(n - 1).count("1")
    with pytest.raises(ValueError):
        proof.path_sides(5, 5)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32)),
        min_size=1,
        max_size=200,
    ),
    st.data(),
)
def test_proof_root_is_merkle_root_for_random_leaves(leaves, data):
    step = data.draw(st.integers(0, len(leaves) - 1))
    root = root_of(leaves)
    p = proof.prove(leaves, step)
    assert bytes.fromhex(p.root) == root
    assert check(proof.encode(p), root) == root


def test_the_frontier_folds_the_root_of_every_prefix_as_the_levels_do():
    """The root folded leaf by leaf (the recorder's, at each durable point) is the level-by-level tree's
    root for every count of leaves, powers of two and their neighbours included."""
    hashes = [commit.leaf(i, s, b) for i, (s, b) in enumerate(random_leaves(300, seed=3))]
    frontier = commit.MerkleFrontier()
    assert frontier.root() == commit.merkle_root([])
    for n, h in enumerate(hashes, start=1):
        frontier.append(h)
        assert frontier.count == n
        assert frontier.root() == commit.merkle_levels(hashes[:n])[-1][0], n


def test_a_recorder_hashes_each_leaf_once_whatever_its_durable_points(tmp_path, monkeypatch):
    """A bundle writer publishes the root at each durable point; it folds in only the steps since the last
    one (before, each durable point hashed every leaf again: 3-4 s at a million steps)."""
    from detrl.formats import bundle as bundle_mod

    calls = []
    real_leaf = commit.leaf
    monkeypatch.setattr(commit, "leaf", lambda *a: calls.append(a[0]) or real_leaf(*a))
    writer = bundle_mod.BundleWriter(tmp_path / "b", {"precision": "fp32"})
    pairs = random_leaves(60)
    roots = []
    for i, (s, b) in enumerate(pairs):
        writer.append_step(i, s, b, None)
        if i % 7 == 0 or i == 59:
            writer.make_durable("complete" if i == 59 else "recording")
            roots.append(read_manifest(tmp_path / "b")["durable"]["merkle_root"])
    writer.close()
    assert calls == list(range(60))  # each step's leaf once, in order
    assert roots[-1] == root_of(pairs).hex() and roots[1] == root_of(pairs[:8]).hex()


def test_prove_refuses_a_step_outside_the_leaves():
    leaves = random_leaves(3)
    for step in (-1, 3):
        with pytest.raises(ValueError, match="not one of the 3 leaves"):
            proof.prove(leaves, step)


# --- tampering -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,step", [(1, 0), (5, 0), (6, 5), (33, 5)])
def test_every_single_bit_flip_anywhere_in_the_proof_never_verifies(n, step):
    leaves = random_leaves(n, seed=100 + n)
    good = proof.encode(proof.prove(leaves, step))
    kinds = {"malformed": 0, "mismatch": 0}
    for pos in range(len(good)):
        for bit in range(8):
            bad = bytearray(good)
            bad[pos] ^= 1 << bit
            try:
                check(bytes(bad), None)
            except proof.ProofError:
                kinds["malformed"] += 1
            except proof.ProofMismatch:
                kinds["mismatch"] += 1
            else:
                pytest.fail(
                    f"a flip of bit {bit} at byte {pos} verifies: {bytes(bad[pos - 20 : pos + 20])!r}"
                )
    assert kinds["mismatch"] > 0 and kinds["malformed"] > 0  # both kinds of refusal are reached


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_replaced_byte_never_verifies(data):
    good = _SEVEN
    pos = data.draw(st.integers(0, len(good) - 1))
    byte = data.draw(st.integers(0, 255).filter(lambda b: b != good[pos]))
    bad = good[:pos] + bytes([byte]) + good[pos + 1 :]
    with pytest.raises((proof.ProofError, proof.ProofMismatch)):
        check(bad, None)


def test_the_number_of_leaves_is_bound_by_the_last_leaf():
    # The root does not commit to the number of leaves: step 0 of 6 leaves and step 0 of 7 have the same
    # path shape, and so do the last leaves (steps 5 and 6: 101 and 110, two left siblings each). The last
    # leaf's step is inside its hash, so a proof that claims 7 leaves fails on that hash.
    leaves = random_leaves(6, seed=6)
    p = proof.prove(leaves, 0)
    assert proof.path_sides(6, 0) == proof.path_sides(7, 0)
    assert proof.path_sides(6, 5) == proof.path_sides(7, 6)
    obj = json.loads(proof.encode(p))
    obj["leaves"] = 7
    with pytest.raises(proof.ProofMismatch, match="last leaf .step 6.*does not have 7 leaves"):
        check(_enc(obj), None)
    for other in range(1, 70):  # and no other count verifies either
        if other != 6:
            obj["leaves"] = other
            with pytest.raises((proof.ProofError, proof.ProofMismatch)):
                check(_enc(obj), None)


def test_a_wrong_root_does_not_verify():
    leaves = random_leaves(9)
    p = proof.prove(leaves, 4)
    assert proof.verify(p, root_of(leaves)) == root_of(leaves)
    with pytest.raises(proof.ProofMismatch, match="not for the given root"):
        proof.verify(p, root_of(random_leaves(9, seed=1)))
    # a proof re-pointed at another root (its own root field changed) fails on its own hashes
    other = p.model_copy(update={"root": root_of(random_leaves(9, seed=1)).hex()})
    with pytest.raises(proof.ProofMismatch, match="hash up to"):
        proof.verify(other, bytes.fromhex(other.root))


def test_a_leaf_from_another_step_does_not_verify():
    leaves = random_leaves(8)
    p = proof.prove(leaves, 3)
    swapped = p.model_copy(update={"state_hash": leaves[4][0].hex(), "batch_hash": leaves[4][1].hex()})
    with pytest.raises(proof.ProofMismatch):
        proof.verify(swapped, root_of(leaves))


# --- malformed proofs -------------------------------------------------------------------------------------


def _obj() -> dict:
    return json.loads(_SEVEN)


def _enc(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=1).encode() + b"\n"


@pytest.mark.parametrize(
    "edit,says",
    [
        (lambda o: o.update(version=True), "unsupported proof version"),
        (lambda o: o.update(version=2), "unsupported proof version"),
        (lambda o: o.update(format="detrl-bundle"), "not a detrl Merkle proof"),
        (lambda o: o.update(hash="sha256"), "hash:"),
        (lambda o: o.update(leaves=7.0), "leaves:"),
        (lambda o: o.update(leaves=0), "leaves:"),
        (lambda o: o.update(leaves=1 << 41), "leaves:"),
        (lambda o: o.update(step=7), "step 7 is not below leaves 7"),
        (lambda o: o.update(root=o["root"].upper()), "root:"),
        (lambda o: o.update(state_hash=o["state_hash"][:-2]), "state_hash:"),
        (lambda o: o.update(extra=1), "extra:"),
        (lambda o: o.pop("last"), "last:"),
        (lambda o: o.update(last=None), "last: must be the leaf of the last step"),
        (lambda o: o["path"].pop(), "path: sides"),
        (lambda o: o["path"].append(o["path"][0]), "path: sides"),
        (lambda o: o["path"][0].update(side="left"), "path: sides"),
        (lambda o: o["path"][0].update(side="up"), "path.0.side:"),
        (lambda o: o.update(path=[{"hash": "00" * 32, "side": "left"}] * 41), "path:"),
        (lambda o: o.update(path=[[[[[[]]]]]]), "nested"),
    ],
)
def test_malformed_proofs_are_one_line_proof_errors(edit, says):
    obj = _obj()
    edit(obj)
    with pytest.raises(proof.ProofError, match=re.escape(says)) as e:
        check(_enc(obj), None)
    assert "\n" not in str(e.value)


def test_only_the_canonical_encoding_is_read():
    obj = _obj()
    assert check(_enc(obj), None)  # json.dumps(sort_keys, indent=1) + newline is the canonical form
    for other in (
        json.dumps(dict(reversed(obj.items())), indent=1).encode() + b"\n",  # keys unsorted
        _enc(obj)[:-1],  # no final newline
        _enc(obj).replace(b"\n", b"\r\n"),
        json.dumps(obj, sort_keys=True).encode() + b"\n",
    ):
        with pytest.raises(proof.ProofError, match="canonical"):
            check(other, None)


def test_reads_are_bounded_and_never_block(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(proof.MAX_PROOF_BYTES + 1)  # sparse: nothing is read before the size is refused
    with pytest.raises(proof.ProofError, match="larger than the cap"):
        proof.read(big)
    with pytest.raises(proof.ProofError, match="larger than the cap"):
        proof.parse(b" " * (proof.MAX_PROOF_BYTES + 1))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(proof.ProofError, match="not a regular file"):
        proof.read(fifo)
    with pytest.raises(proof.ProofError, match="cannot open"):
        proof.read(tmp_path / "missing.json")
    (tmp_path / "p.json").write_bytes(_SEVEN)
    assert proof.read(tmp_path / "p.json") == proof.parse(_SEVEN)


# --- the CLI on a recorded bundle ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("recorded") / "run"
    assert main(["train", CONFIG, "--out", str(out), *TRAIN_ARGS]) == 0
    return out


def one_line(err: str) -> str:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_prove_and_verify_every_step_of_a_recorded_bundle(honest, tmp_path, capsys):
    capsys.readouterr()
    root = read_manifest(honest)["durable"]["merkle_root"]
    records, _ = parse_commitments((honest / COMMITMENTS).read_bytes())
    assert len(records) == 5  # steps 0..4
    for step, (state, batch) in enumerate(records):
        out = tmp_path / f"p{step}.json"
        assert main(["prove", str(honest), str(step), "--out", str(out)]) == 0
        err = one_line(capsys.readouterr().err)
        assert f"proof of step {step} of durable steps 0..4 under root {root}" in err
        p = json.loads(out.read_text())
        assert (p["step"], p["leaves"], p["root"]) == (step, 5, root)
        assert (p["state_hash"], p["batch_hash"]) == (state.hex(), batch.hex())  # the commitments record
        assert main(["verify-proof", str(out)]) == 0
        text = capsys.readouterr().out
        assert text.startswith(f"VERIFIED: step {step} is leaf {step} of the 5-leaf tree with root {root}")
        assert "root written in the proof itself" in text
        assert main(["verify-proof", str(out), "--root", root.upper()]) == 0
        assert "root written in the proof itself" not in capsys.readouterr().out
    # stdout gets the same bytes as --out
    assert main(["prove", str(honest), "2"]) == 0
    assert capsys.readouterr().out.encode() == (tmp_path / "p2.json").read_bytes()


def test_verify_proof_exit_codes(honest, tmp_path, capsys, monkeypatch):
    good = tmp_path / "p.json"
    assert main(["prove", str(honest), "1", "--out", str(good)]) == 0
    capsys.readouterr()
    # 1: another root, or a claim about another state (re-encoded canonically, so it parses)
    assert main(["verify-proof", str(good), "--root", "ab" * 32]) == 1
    assert capsys.readouterr().out.startswith("NOT VERIFIED: the proof is for root")
    obj = json.loads(good.read_text())
    obj["state_hash"] = "00" * 32
    forged = tmp_path / "forged.json"
    forged.write_bytes(_enc(obj))
    assert main(["verify-proof", str(forged)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("NOT VERIFIED: step 1:") and len(out.splitlines()) == 1
    # standard input
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(good.read_bytes())))
    assert main(["verify-proof", "-"]) == 0
    assert capsys.readouterr().out.startswith("VERIFIED: step 1 is leaf 1 of the 5-leaf tree")
    # 2: a malformed proof, a malformed --root, a missing file: one line, no traceback
    junk = tmp_path / "junk.json"
    junk.write_bytes(good.read_bytes()[:-40])
    for argv, says in [
        (["verify-proof", str(junk)], "not valid JSON"),
        (["verify-proof", str(good), "--root", "xyz"], "--root 'xyz': not a Merkle root"),
        (["verify-proof", str(tmp_path / "none.json")], "cannot open"),
        (["verify-proof", str(tmp_path)], "not a regular file"),
    ]:
        assert main(argv) == 2
        assert says in one_line(capsys.readouterr().err)


def test_prove_refuses_a_step_out_of_range_and_a_bad_bundle(bundle, capsys):
    for step in ("5", "-1"):
        assert main(["prove", str(bundle), step]) == 2
        _, err = capsys.readouterr()
        assert f"step {step} is out of range: the bundle's durable steps are 0..4" in one_line(err)
    # a commitments record changed after the root was written: the bundle reader's bad input
    data = bytearray((bundle / COMMITMENTS).read_bytes())
    data[COMMIT_HEADER.size + COMMIT_RECORD.size + 10] ^= 1
    (bundle / COMMITMENTS).write_bytes(bytes(data))
    assert main(["prove", str(bundle), "0"]) == 2
    assert "commitments: record 1: checksum mismatch" in one_line(capsys.readouterr().err)
    m = read_manifest(bundle)
    m["format"] = "nope"
    write_manifest(bundle, m)
    assert main(["prove", str(bundle), "0"]) == 2
    assert "manifest.json: not a detrl bundle manifest" in one_line(capsys.readouterr().err)
