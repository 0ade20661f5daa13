"""Merkle inclusion proofs: one step's commitment checked against a run's Merkle root without the bundle.

A bundle's ``commitments`` file holds, per step, the state hash and the batch hash; the step's Merkle leaf
is ``commit.leaf(step, state_hash, batch_hash)`` and ``manifest.json`` ``durable.merkle_root`` is
``commit.merkle_root`` over the leaves of steps 0..n-1 (an odd node is carried up unchanged). A proof of
step ``i`` is the leaf's inputs, the sibling hashes on the way from the leaf to the root, and the same for
the last leaf (step ``n-1``), which is what binds the number of leaves: the root alone does not.

This module is the proof format's one home: :func:`prove` makes a proof from a bundle's leaves,
:func:`encode` writes it, :func:`read` / :func:`parse` read it back as untrusted input, and :func:`verify`
recomputes the root. The format and what a proof does and does not establish: docs/verifiable.md,
"Merkle inclusion proofs".

**Untrusted input.** A proof comes from another party. A file over :data:`MAX_PROOF_BYTES` is refused
before it is read, the JSON is read by :func:`safeio.loads_json` (depth and number limits), the schema is
strict (no extra or missing keys, no bools for integers, lowercase 64-digit hex), the file must be the
canonical encoding :func:`encode` writes (so a proof has exactly one byte form, and any changed byte is
either refused or changes what is verified), and the path's shape is recomputed from the number of leaves
and the step rather than taken from the proof. Every defect is :class:`ProofError`, one line.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from detrl.formats import commit, safeio

__all__ = [
    "FORMAT",
    "MAX_PROOF_BYTES",
    "VERSION",
    "LastLeaf",
    "MerkleProof",
    "ProofError",
    "ProofMismatch",
    "Sibling",
    "encode",
    "parse",
    "path_sides",
    "prove",
    "read",
    "verify",
]

FORMAT = "detrl-merkle-proof"
#: 1: leaves and nodes as in bundle versions 4 and 5 (``detrl/leaf/v2``, ``detrl/node/v2``, BLAKE3).
VERSION = 1
#: Largest proof file read (bytes). The largest valid proof, two paths of 40 siblings, is under 8 KiB.
MAX_PROOF_BYTES = 64 << 10
#: Most leaves a proof may name: a bundle's steps are below 2**40 (``manifest.json`` bounds them so).
MAX_LEAVES = 1 << 40
#: Most siblings on a path: the tree over MAX_LEAVES leaves has 40 levels above the leaves.
MAX_DEPTH = 40

Side = Literal["left", "right"]
_HEX64 = r"^[0-9a-f]{64}$"


class ProofError(ValueError):
    """A proof is malformed (bad input): not a proof file, too large, off-schema, not canonical, or its
    path has the wrong shape for its number of leaves and step. The message is one line naming the file."""


class ProofMismatch(Exception):
    """A well-formed proof does not verify: its leaf does not hash up to its root, its last leaf does not
    (so the tree does not have the leaves it claims), or its root is not the root the verifier trusts."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Sibling(_Strict):
    """One sibling on a path: its hash and the side it sits on (``left``: node = H(sibling, ours))."""

    side: Side
    hash: str = Field(pattern=_HEX64, description="the sibling's 32-byte hash, lowercase hex")


class LastLeaf(_Strict):
    """The leaf of step ``leaves - 1`` and its path: every sibling is on the left (the last leaf has none
    to its right), one per 1-bit of ``leaves - 1``."""

    state_hash: str = Field(pattern=_HEX64)
    batch_hash: str = Field(pattern=_HEX64)
    path: list[Sibling] = Field(max_length=MAX_DEPTH)


class MerkleProof(_Strict):
    """The proof that step ``step``'s leaf is leaf number ``step`` of the ``leaves``-leaf tree with root
    ``root``. Hashes are lowercase hex of 32 bytes; paths run from the leaf level up."""

    format: Literal["detrl-merkle-proof"]
    version: int
    hash: Literal["blake3"]
    leaves: int = Field(ge=1, le=MAX_LEAVES, description="leaves of the tree: durable steps 0..leaves-1")
    step: int = Field(ge=0, lt=MAX_LEAVES)
    state_hash: str = Field(pattern=_HEX64, description="the step's state hash, from `commitments`")
    batch_hash: str = Field(pattern=_HEX64, description="the step's batch hash, from `commitments`")
    path: list[Sibling] = Field(max_length=MAX_DEPTH)
    last: LastLeaf | None = Field(description="step leaves-1's leaf and path; null when step is leaves-1")
    root: str = Field(pattern=_HEX64, description="the Merkle root the path leads to")


# ------------------------------------------------------------------------------------------------ the tree


def path_sides(leaves: int, index: int) -> list[Side]:
    """The side of each sibling on the path of leaf ``index`` in the tree over ``leaves`` leaves, from the
    leaf level up: ``left`` where the node has an odd index, ``right`` where it has a right neighbour, and no
    entry where it is the odd last node of its level, which ``commit.merkle_root`` carries up unchanged."""
    if not 0 <= index < leaves:
        raise ValueError(f"leaf {index} is not in a tree of {leaves} leaves")
    sides: list[Side] = []
    while leaves > 1:
        if index % 2:
            sides.append("left")
        elif index + 1 < leaves:
            sides.append("right")
        index //= 2
        leaves = (leaves + 1) // 2
    return sides


def _path(levels: list[list[bytes]], index: int) -> list[Sibling]:
    path = []
    for level in levels[:-1]:
        sibling = index ^ 1
        if sibling < len(level):  # else: the odd last node, carried up
            side: Side = "left" if index % 2 else "right"
            path.append(Sibling(side=side, hash=level[sibling].hex()))
        index //= 2
    return path


def _fold(leaf: bytes, path: Sequence[Sibling]) -> bytes:
    """The root that ``leaf`` (its 32-byte hash) and ``path`` lead to."""
    h = leaf
    for s in path:
        sibling = bytes.fromhex(s.hash)
        h = commit.node(sibling, h) if s.side == "left" else commit.node(h, sibling)
    return h


# ----------------------------------------------------------------------------------------- prove, verify


def prove(leaves: Sequence[tuple[bytes, bytes]], step: int) -> MerkleProof:
    """The inclusion proof of ``step`` among ``leaves``: the ``(state_hash, batch_hash)`` pairs (32 bytes
    each) of steps 0..n-1, as the commitments file holds them (``Bundle.leaves``). Its root is
    ``commit.merkle_root`` of their leaves. Raises ``ValueError`` if ``step`` is not in 0..n-1."""
    n = len(leaves)
    if not 0 <= step < n:
        raise ValueError(f"step {step} is not one of the {n} leaves (steps 0..{n - 1})")
    if n > MAX_LEAVES:
        raise ValueError(f"{n} leaves, more than a proof may name ({MAX_LEAVES})")
    for i, (s, b) in enumerate(leaves):
        if len(s) != commit.DIGEST_BYTES or len(b) != commit.DIGEST_BYTES:
            raise ValueError(f"leaf {i}: state and batch hashes must be {commit.DIGEST_BYTES} bytes")
    levels = commit.merkle_levels([commit.leaf(i, s, b) for i, (s, b) in enumerate(leaves)])
    last = None
    if step != n - 1:
        s, b = leaves[n - 1]
        last = LastLeaf(state_hash=s.hex(), batch_hash=b.hex(), path=_path(levels, n - 1))
    s, b = leaves[step]
    return MerkleProof(
        format=FORMAT,
        version=VERSION,
        hash=commit.HASH_NAME,
        leaves=n,
        step=step,
        state_hash=s.hex(),
        batch_hash=b.hex(),
        path=_path(levels, step),
        last=last,
        root=levels[-1][0].hex(),
    )


def _check_shape(p: MerkleProof, what: str) -> None:
    """The proof's step, last leaf and paths have the shape its number of leaves implies (ProofError)."""
    if p.version != VERSION:
        raise ProofError(f"{what}: unsupported proof version {p.version} (this detrl reads {VERSION})")
    if p.step >= p.leaves:
        raise ProofError(f"{what}: step {p.step} is not below leaves {p.leaves}")
    if (p.last is None) != (p.step == p.leaves - 1):
        want = "null, since step is the last leaf" if p.step == p.leaves - 1 else "the leaf of the last step"
        raise ProofError(f"{what}: last: must be {want}")
    paths = [("path", p.path, p.step)]
    if p.last is not None:
        paths.append(("last.path", p.last.path, p.leaves - 1))
    for name, path, index in paths:
        want_sides = path_sides(p.leaves, index)
        got = [s.side for s in path]
        if got != want_sides:
            raise ProofError(
                f"{what}: {name}: sides {','.join(got) or 'none'}; leaf {index} of a tree of {p.leaves} "
                f"leaves has {','.join(want_sides) or 'none'}"
            )


def verify(p: MerkleProof, root: bytes | None = None, what: str = "proof") -> bytes:
    """Check ``p``: recompute its leaf with ``commit.leaf(step, state_hash, batch_hash)``, hash it up its
    path, do the same for the last leaf, and compare both with ``p.root``; then, when given, compare
    ``p.root`` with ``root`` (32 bytes, the root the caller trusts). Returns the verified root.

    Raises :class:`ProofError` if the paths' shape does not fit ``leaves`` and ``step`` (malformed), and
    :class:`ProofMismatch` (one line: which hash differs) if the proof does not verify.
    """
    _check_shape(p, what)
    claimed = bytes.fromhex(p.root)
    got = _fold(commit.leaf(p.step, bytes.fromhex(p.state_hash), bytes.fromhex(p.batch_hash)), p.path)
    if got != claimed:
        raise ProofMismatch(
            f"step {p.step}: its leaf and path hash up to {got.hex()}, not to the proof's root {p.root}"
        )
    if p.last is not None:
        last = commit.leaf(p.leaves - 1, bytes.fromhex(p.last.state_hash), bytes.fromhex(p.last.batch_hash))
        got = _fold(last, p.last.path)
        if got != claimed:
            raise ProofMismatch(
                f"last leaf (step {p.leaves - 1}): it hashes up to {got.hex()}, not to the proof's root "
                f"{p.root}, so the tree does not have {p.leaves} leaves"
            )
    if root is not None and root != claimed:
        raise ProofMismatch(f"the proof is for root {p.root}, not for the given root {root.hex()}")
    return claimed


# -------------------------------------------------------------------------------------------- bytes, files


def encode(p: MerkleProof) -> bytes:
    """The proof's canonical JSON bytes (sorted keys, one-space indent, ASCII, final newline): the only
    encoding :func:`parse` accepts."""
    return safeio.dumps_json(p.model_dump(mode="json"))


def parse(data: bytes, what: str = "proof") -> MerkleProof:
    """Read untrusted proof bytes (``what`` names them in messages): bounded, strict and canonical JSON, a
    strict schema, and the paths' shape recomputed from ``leaves`` and ``step``. Raises :class:`ProofError`."""
    if len(data) > MAX_PROOF_BYTES:
        raise ProofError(f"{what}: {len(data)} bytes, larger than the cap of {MAX_PROOF_BYTES} bytes")
    try:
        obj = safeio.loads_json(data, what, max_depth=4)
    except safeio.UnsafeInput as e:
        raise ProofError(str(e)) from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ProofError(f"{what}: not a detrl Merkle proof (format is not {FORMAT!r})")
    version = obj.get("version")
    if type(version) is not int or version != VERSION:
        raise ProofError(
            f"{what}: unsupported proof version {str(version)[:20]!r} (this detrl reads {VERSION})"
        )
    try:
        p = MerkleProof.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        where = safeio.error_location(err["loc"], "proof")
        raise ProofError(f"{what}: {where}: {' '.join(str(err['msg']).split())[:200]}") from None
    if safeio.dumps_json(obj) != bytes(data):
        raise ProofError(
            f"{what}: not in canonical form (as `detrl prove` writes it: sorted keys, one-space indent, "
            "a final newline)"
        )
    _check_shape(p, what)
    return p


def read(path: str | os.PathLike[str]) -> MerkleProof:
    """Read and :func:`parse` the proof file the user named (``-``: standard input). Only a regular file of
    at most :data:`MAX_PROOF_BYTES` is opened and read (a FIFO or device is refused before it is opened,
    and the size is checked on the open descriptor). Raises :class:`ProofError`."""
    what = str(path)
    if what == "-":
        data = sys.stdin.buffer.read(MAX_PROOF_BYTES + 1)
        return parse(data, "<stdin>")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # not opened at all: opening some devices has effects
            raise ProofError(f"{what}: not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ProofError(f"{what}: cannot open ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):  # swapped since the look above
            raise ProofError(f"{what}: not a regular file")
        if st.st_size > MAX_PROOF_BYTES:
            raise ProofError(f"{what}: {st.st_size} bytes, larger than the cap of {MAX_PROOF_BYTES} bytes")
        try:
            data = safeio.read_bounded(f, st.st_size, what)
        except safeio.UnsafeInput as e:
            raise ProofError(str(e)) from None
    return parse(data, what)
