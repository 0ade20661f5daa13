"""The run bundle: a directory another party hands to an auditor. This module owns its format.

::

    manifest.json   format, version, config, switchboard, thresholds, status, the durable point, checkpoints
    commitments     append-only: per step, BLAKE3 of the state after it and of the batch it consumed
    roundlog        append-only: the sparse rounding log, one segment per step (detrl/formats/roundlog.py)
    checkpoints/    step_NNNNNNNN.safetensors: parameters, buffers, optimizer state, resume state

:class:`BundleWriter` writes it while a run records; :class:`Bundle` reads and validates it for an audit
or a resume. Nothing else touches these files.

**Crash safety.** The bundle is valid at every moment. The manifest is written when recording starts and
replaced atomically (temp file, fsync, rename, fsync of the directory) at every checkpoint, at the end
of calibration and at the end. Commitments and log segments are appended, each with its own checksum.
The manifest names the *durable point*: the last step whose commitments and log were fsynced before the
manifest was replaced. A recording killed at any moment leaves a bundle that audits up to its durable
point (verdict ``incomplete``) and that ``detrl train --resume`` continues from its last checkpoint.
Steps written after the durable point are re-recorded on resume and must come out byte-identical;
nothing on disk changes until the resumed run goes past what the bundle already holds.

**Untrusted input.** Nothing is unpickled. Only regular files inside the bundle are opened (no symlinks,
FIFOs or devices), every read is bounded by :class:`Caps`, JSON has depth and number limits, and every
defect raises :class:`BundleError`, one line naming the file and the problem.

**Determinism.** Two recordings of one config give byte-identical bundles except the manifest's
``created`` field, the only timestamp (``tb/`` beside the bundle holds TensorBoard logs, not bundle data).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import re
import struct
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal, overload

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from detrl.formats import commit, safeio
from detrl.formats.roundlog import (
    HEADER_BYTES as ROUNDLOG_HEADER_BYTES,
)
from detrl.formats.roundlog import (
    OpEntries,
    RoundLogError,
    RoundLogReader,
    RoundLogWriter,
    encode_segment,
    segment_compressor,
)

FORMAT = "detrl-bundle"
#: 3: append-only binary commitments with per-record CRCs, a manifest written from the start with a
#: durable point and a status, checkpoints listed with their SHA-256, rounding log v2 (no trailer).
#: 4: commitments (state, batch, Merkle leaves and nodes) are BLAKE3 over length-prefixed records with
#: v2 domain tags (detrl/formats/commit.py); checkpoint files keep their SHA-256.
#: 5: a tensor record holds the BLAKE3 of the tensor's bytes instead of the bytes (tensor, state and batch
#: tags v3), and a state holds its records instead of their digests; leaves and nodes are unchanged.
VERSION = 5
MANIFEST = "manifest.json"
COMMITMENTS = "commitments"
ROUNDLOG = "roundlog"
CHECKPOINTS = "checkpoints"
#: Files and folders of a bundle (``--force`` removes exactly these, from a bundle only; ``tb/`` belongs to the
#: CLI).
BUNDLE_ENTRIES = (MANIFEST, COMMITMENTS, ROUNDLOG, CHECKPOINTS)
#: Checkpoint tensors under this prefix are resume state of attached parts, outside the state commitment.
RESUME_PREFIX = "resume/"
#: zstd level of the rounding log: 9 costs well under a millisecond per step and is a few % smaller than 3.
LOG_ZSTD_LEVEL = 9

# [0-9] and \Z, not \d and $: \d matches any Unicode digit and $ matches before a trailing newline
_CKPT_RE = re.compile(r"^checkpoints/step_([0-9]{8})\.safetensors\Z")
_TMP_RE = re.compile(r"^\.step_\d{8}\.safetensors\.tmp$")  # safeio.write_atomic's, left by a kill
_HEX64 = r"^[0-9a-f]{64}$"

# commitments: header magic[8] | version u16 | reserved u16 | reserved u32, then fixed-size records
COMMIT_MAGIC = b"DTRLCMIT"
COMMIT_HEADER = struct.Struct("<8sHHI")
#: step u64 | state hash 32 | batch hash 32 | crc32 u32 (over the 72 bytes before it)
COMMIT_RECORD = struct.Struct("<Q32s32sI")


class BundleError(ValueError):
    """The bundle is malformed, incomplete or inconsistent (a bad input, not a divergence)."""


@dataclasses.dataclass(frozen=True)
class Caps:
    """The auditor's bounds on what reading a bundle may cost (bytes). A bundle over a cap is bad input."""

    manifest_bytes: int = 16 << 20
    commitments_bytes: int = 1 << 30
    roundlog_bytes: int = 16 << 30
    checkpoint_bytes: int = 8 << 30
    #: safetensors header and detrl metadata inside a checkpoint
    checkpoint_header_bytes: int = 64 << 20
    #: tensors in one checkpoint (GPT-2 small with AdamW state writes about 600)
    checkpoint_tensors: int = 1 << 16


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINTS}/step_{step:08d}.safetensors"


def utc_now() -> str:
    """The manifest's ``created`` value: the only timestamp in a bundle."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------------- manifest
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Durable(_Strict):
    """The last step whose commitments and log were fsynced before this manifest was written."""

    step: int = Field(ge=0, lt=1 << 40)
    merkle_root: str = Field(pattern=_HEX64, description="Merkle root over the leaves of steps 0..step")
    roundlog_bytes: int = Field(0, ge=0, description="bytes of the rounding log through that step")


class Manifest(_Strict):
    """``manifest.json``: every field is the trainer's claim, checked where the auditor can."""

    format: Literal["detrl-bundle"]
    version: int
    created: str = Field(
        pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$",  # utc_now's: no control character gets through
        description="UTC time recording started: the only timestamp",
    )
    task: str | None = Field(None, max_length=64, description="the task that replays it; None: a script")
    config: dict[str, Any] | None = None
    precision: Literal["verifiable", "fp64", "fp32"]
    hardware: str = Field(max_length=200)
    sources: dict[str, Any]
    thresholds: dict[str, Any]
    calibration_steps: int = Field(ge=0, lt=1 << 40)
    margin: float = Field(ge=1.0, le=1e6)
    checkpoint_every: int = Field(ge=0, lt=1 << 40)
    planned_steps: int | None = Field(None, ge=0, lt=1 << 40)
    status: Literal["recording", "stopped", "complete"]
    stopped_at: int | None = Field(None, ge=0, lt=1 << 40)
    durable: Durable | None = None
    checkpoints: dict[str, str] = Field(default_factory=dict)
    data_fingerprint: str | None = Field(None, pattern=_HEX64)
    stats: dict[str, int] = Field(default_factory=dict)
    torch: str = Field(max_length=64)
    ops_revision: int = Field(
        1,
        ge=1,
        lt=1 << 16,
        description="the task's op-sequence revision the steps ran (1: written before revisions)",
    )
    rules_revision: int = Field(
        1,
        ge=1,
        lt=1 << 16,
        description="the rounding rules' revision the steps followed (1: written before revisions)",
    )


def _manifest_error(e: ValidationError) -> BundleError:
    err = e.errors()[0]
    where = safeio.error_location(err["loc"], "manifest")
    return BundleError(f"{MANIFEST}: {where}: {err['msg']}")


def parse_manifest(data: bytes) -> Manifest:
    """Validate ``manifest.json`` bytes (bounded JSON, then the schema)."""
    try:
        obj = safeio.loads_json(data, MANIFEST)
    except safeio.UnsafeInput as e:
        raise BundleError(str(e)) from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise BundleError(f"{MANIFEST}: not a detrl bundle manifest (format is not {FORMAT!r})")
    if obj.get("version") != VERSION:
        raise BundleError(
            f"{MANIFEST}: unsupported bundle version {obj.get('version')!r} (this detrl reads {VERSION})"
        )
    try:
        m = Manifest.model_validate(obj)
    except ValidationError as e:
        raise _manifest_error(e) from None
    for rel, digest in m.checkpoints.items():
        if not _CKPT_RE.match(rel):
            raise BundleError(f"{MANIFEST}: checkpoints: unexpected file name {rel[:80]!r}")
        if not re.fullmatch(_HEX64, digest):
            raise BundleError(f"{MANIFEST}: checkpoints: bad SHA-256 for {rel}")
    return m


# ---------------------------------------------------------------------------------------------- commitments
def commit_record(step: int, state: bytes, batch: bytes) -> bytes:
    """One commitments record: step, state hash, batch hash and the CRC-32 of those."""
    body = COMMIT_RECORD.pack(step, state, batch, 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


class Leaves(Sequence[tuple[bytes, bytes]]):
    """The steps' ``(state hash, batch hash)`` pairs (32 bytes each), step i at index i, in one buffer: 64
    bytes a step. A list of tuples of two ``bytes`` took about 200, so a commitments file near its 1 GiB cap
    (14 million records) cost an auditor about 4 GiB before any check could refuse it, and a long recording
    (a DQN's millions of steps) held as much. Compares equal to another sequence of the same pairs."""

    __slots__ = ("_buf",)
    PAIR = 64

    def __init__(self, packed: bytearray | None = None) -> None:
        self._buf = packed if packed is not None else bytearray()  # taken as it is, not copied

    def __len__(self) -> int:
        return len(self._buf) // self.PAIR

    @overload
    def __getitem__(self, i: int) -> tuple[bytes, bytes]: ...
    @overload
    def __getitem__(self, i: slice) -> Leaves: ...
    def __getitem__(self, i: int | slice) -> tuple[bytes, bytes] | Leaves:
        if isinstance(i, slice):
            start, stop, stride = i.indices(len(self))
            if stride != 1:
                raise ValueError("Leaves: slices step by 1")
            return Leaves(self._buf[start * self.PAIR : max(start, stop) * self.PAIR])
        o = self._offset(i)
        return bytes(self._buf[o : o + 32]), bytes(self._buf[o + 32 : o + self.PAIR])

    def __setitem__(self, i: int, pair: tuple[bytes, bytes]) -> None:
        o = self._offset(i)
        self._buf[o : o + self.PAIR] = self._packed(pair)

    def _offset(self, i: int) -> int:
        """Where step ``i`` (negative: from the end) starts in the buffer; IndexError outside."""
        n = len(self)
        k = i + n if i < 0 else i
        if not 0 <= k < n:
            raise IndexError(f"Leaves: step {i} of {n}")
        return k * self.PAIR

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        buf = self._buf
        for o in range(0, len(buf), self.PAIR):
            yield bytes(buf[o : o + 32]), bytes(buf[o + 32 : o + self.PAIR])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Leaves):
            return self._buf == other._buf
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == tuple(b) for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable (append)

    def __repr__(self) -> str:
        return f"Leaves({len(self)} steps)"

    def append(self, pair: tuple[bytes, bytes]) -> None:
        self._buf += self._packed(pair)

    @staticmethod
    def _packed(pair: tuple[bytes, bytes]) -> bytes:
        state, batch = pair
        if len(state) != 32 or len(batch) != 32:
            raise ValueError(f"Leaves: hashes of 32 bytes, not {len(state)} and {len(batch)}")
        return bytes(state) + bytes(batch)


def parse_commitments(data: bytes) -> tuple[Leaves, int]:
    """``(leaves, torn_bytes)``: the complete records of a commitments file, steps 0, 1, 2, ... in order,
    and the bytes of a torn last record (a writer killed mid-append), which are not part of the bundle."""
    if len(data) < COMMIT_HEADER.size:
        raise BundleError(f"{COMMITMENTS}: truncated header ({len(data)} bytes)")
    magic, version, r1, r2 = COMMIT_HEADER.unpack_from(data)
    if magic != COMMIT_MAGIC:
        raise BundleError(f"{COMMITMENTS}: bad magic (not a detrl commitments file)")
    if version != 1 or r1 or r2:
        raise BundleError(f"{COMMITMENTS}: unsupported version {version}")
    body = memoryview(data)[COMMIT_HEADER.size :]
    n, torn = divmod(len(body), COMMIT_RECORD.size)
    size = COMMIT_RECORD.size
    for i, (step, _, _, crc) in enumerate(COMMIT_RECORD.iter_unpack(body[: n * size])):
        if zlib.crc32(body[i * size : (i + 1) * size - 4]) != crc:
            raise BundleError(f"{COMMITMENTS}: record {i}: checksum mismatch")
        if step != i:
            raise BundleError(f"{COMMITMENTS}: record {i} is for step {step}")
    # the 64 hash bytes of each record (after its 8-byte step), side by side, copied once
    leaves = Leaves(bytearray(n * Leaves.PAIR))
    records = np.frombuffer(body, dtype=np.uint8, count=n * size).reshape(n, size)
    np.frombuffer(leaves._buf, dtype=np.uint8).reshape(n, Leaves.PAIR)[:] = records[:, 8 : 8 + Leaves.PAIR]
    return leaves, torn


def merkle_root(leaves: Sequence[tuple[bytes, bytes]], frontier: commit.MerkleFrontier | None = None) -> str:
    """The hex Merkle root over the steps' ``(state hash, batch hash)`` pairs, folded leaf by leaf (a root of
    millions of steps holds no list of their leaf hashes). ``frontier``: one that holds the first
    ``frontier.count`` of these steps already (a recorder's, kept from one durable point to the next): only
    the steps after them are hashed, and it then holds them all."""
    f = frontier if frontier is not None else commit.MerkleFrontier()
    new = leaves[f.count :] if f.count else leaves  # iterated, not indexed step by step (a third faster)
    f.extend(commit.leaf(i, s, b) for i, (s, b) in enumerate(new, start=f.count))
    return f.root().hex()


# ---------------------------------------------------------------------------------------------- checkpoints
#: The checkpoint metadata's list of the tensors stored as real pairs (complex tensors).
COMPLEX_KEY = "complex"


def encode_checkpoint(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> bytes:
    """The safetensors bytes of a checkpoint (deterministic: sorted keys, canonical metadata JSON)."""
    from safetensors.torch import save

    clean = {k: v.detach().cpu().contiguous() for k, v in sorted(tensors.items())}
    # safetensors has no complex128: a complex tensor is stored as its real view (a trailing axis of 2,
    # real and imaginary parts), and the metadata names it (``COMPLEX_KEY``; absent when there is none).
    complex_names = [k for k, v in clean.items() if v.is_complex()]
    if complex_names:
        clean.update({k: torch.view_as_real(clean[k]).contiguous() for k in complex_names})
        meta = {**meta, COMPLEX_KEY: complex_names}
    return save(clean, metadata={"detrl": json.dumps(meta, sort_keys=True, separators=(",", ":"))})


def decode_checkpoint(data: bytes, rel: str, caps: Caps) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and detrl metadata of checkpoint bytes (safetensors: no code is executed)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if len(data) < 8:
        raise BundleError(f"{rel}: not a valid safetensors checkpoint (truncated)")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, caps.checkpoint_header_bytes):
        raise BundleError(f"{rel}: safetensors header of {n} bytes does not fit")
    try:
        header = safeio.loads_json(bytes(data[8 : 8 + n]), rel)
        raw_meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
        text = raw_meta.get("detrl") if isinstance(raw_meta, dict) else None
        if not isinstance(text, str):
            raise BundleError(f"{rel}: no detrl metadata")
        # surrogatepass: a lone surrogate (a "\udcff" escape in the header) is refused as not UTF-8 below
        meta = safeio.loads_json(text.encode("utf-8", "surrogatepass"), rel)
    except safeio.UnsafeInput as e:
        raise BundleError(str(e)) from None
    if not isinstance(meta, dict):
        raise BundleError(f"{rel}: bad detrl metadata")
    try:
        tensors = load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError, TypeError, OverflowError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BundleError(f"{rel}: not a valid safetensors checkpoint ({msg[:200]})") from None
    complex_names = meta.pop(COMPLEX_KEY, [])
    if not isinstance(complex_names, list) or not all(isinstance(k, str) for k in complex_names):
        raise BundleError(f"{rel}: bad detrl metadata ({COMPLEX_KEY} is not a list of tensor names)")
    for k in complex_names:
        t = tensors.get(k)
        if t is None or t.dtype not in (torch.float32, torch.float64) or t.dim() == 0 or t.shape[-1] != 2:
            raise BundleError(f"{rel}: {k[:80]!r} is named complex but is not a float tensor of real pairs")
        tensors[k] = torch.view_as_complex(t.clone())  # its own storage: aligned for the pairs
    return tensors, meta


# ---------------------------------------------------------------------------------------------- reading
class Bundle:
    """A bundle read for an audit or a resume. Construction validates the manifest, the commitments
    through the durable point (Merkle root), the rounding log's structure, and the listed checkpoints'
    names; a checkpoint's SHA-256 is checked when it is loaded."""

    def __init__(self, run_dir: str | os.PathLike, caps: Caps | None = None) -> None:
        self.dir = Path(run_dir)
        self.caps = caps or Caps()
        if not self.dir.is_dir():
            raise BundleError(f"{self.dir}: not a run bundle directory")
        self.manifest = m = parse_manifest(self._read(MANIFEST, self.caps.manifest_bytes))
        self.status = m.status
        #: the steps an audit replays: through the durable point
        self.steps = m.durable.step if m.durable is not None else 0
        if m.durable is None and not _exists(self.dir / COMMITMENTS):
            # Killed between writing the first manifest and creating the files: nothing recorded yet.
            self.written, self.torn_bytes = Leaves(), 0
        else:
            self.written, self.torn_bytes = parse_commitments(self._read_commitments(m.planned_steps))
        if m.durable is None:
            self.leaves = Leaves()
        else:
            if len(self.written) < self.steps + 1:
                raise BundleError(
                    f"{COMMITMENTS}: {len(self.written)} records, the manifest's durable point is step "
                    f"{self.steps} (file truncated?)"
                )
            # (the records themselves where they are all durable: a bundle reads them, never appends)
            self.leaves = (
                self.written if len(self.written) == self.steps + 1 else self.written[: self.steps + 1]
            )
            if merkle_root(self.leaves) != m.durable.merkle_root:
                raise BundleError(f"{COMMITMENTS}: Merkle root does not match {MANIFEST}")
        if m.status != "recording" and len(self.written) != self.steps + 1:
            raise BundleError(f"{COMMITMENTS}: records beyond the end of a finished recording")
        if m.status == "stopped" and m.stopped_at != self.steps:
            raise BundleError(f"{MANIFEST}: stopped_at does not match the durable point")
        self.checkpoint_steps = sorted(_ckpt_step(rel) for rel in m.checkpoints)
        if self.checkpoint_steps and self.checkpoint_steps[-1] > self.steps:
            raise BundleError(f"{MANIFEST}: a checkpoint beyond the durable point")
        # Up front: a linked or missing checkpoint, or one whose header does not fit or names too many
        # tensors, is bad input before any replay
        for rel in m.checkpoints:
            try:
                f, size = safeio.open_regular(self.dir, rel, self.caps.checkpoint_bytes)
                with f:
                    self._check_checkpoint_header(f, size, rel)
            except safeio.UnsafeInput as e:
                raise BundleError(str(e)) from None
        self.roundlog: RoundLogReader | None = None
        if m.precision == "verifiable" and (m.durable is not None or _exists(self.dir / ROUNDLOG)):
            self.roundlog = self._open_log()

    def _read(self, rel: str, cap: int, append_only: bool = False) -> bytes:
        try:
            return safeio.read_file(self.dir, rel, cap, append_only)
        except safeio.UnsafeInput as e:
            raise BundleError(str(e)) from None

    def _read_commitments(self, planned_steps: int | None) -> bytes:
        """The commitments file, its header checked before anything else is read, and its size against the
        records the planned steps can write (steps 0..planned, and a torn record): a file of zeros or a giant
        one is refused from its first bytes, not after a whole-file read."""
        try:
            f, size = safeio.open_regular(self.dir, COMMITMENTS, self.caps.commitments_bytes)
            with f:
                head = safeio.read_bounded(f, min(size, COMMIT_HEADER.size), COMMITMENTS, append_only=True)
                parse_commitments(head)  # magic and version (a short file: truncated header)
                if planned_steps is not None:
                    most = COMMIT_HEADER.size + (planned_steps + 2) * COMMIT_RECORD.size
                    if size > most:
                        raise BundleError(
                            f"{COMMITMENTS}: {size} bytes, more than the {planned_steps} planned steps "
                            f"can write ({most})"
                        )
                return head + safeio.read_bounded(f, size - len(head), COMMITMENTS, append_only=True)
        except safeio.UnsafeInput as e:
            raise BundleError(str(e)) from None

    def _open_log(self) -> RoundLogReader:
        try:
            f, _ = safeio.open_regular(self.dir, ROUNDLOG, self.caps.roundlog_bytes)
        except safeio.UnsafeInput as e:
            raise BundleError(str(e)) from None
        try:
            reader = RoundLogReader(f, name=ROUNDLOG)
        except RoundLogError as e:
            f.close()
            raise BundleError(str(e)) from None
        durable = self.manifest.durable
        have = reader.steps[: self.steps]
        if have != list(range(1, self.steps + 1)):
            reader.close()
            raise BundleError(f"{ROUNDLOG}: does not hold one segment for each of steps 1..{self.steps}")
        if self.status != "recording" and (len(reader.steps) != self.steps or reader.torn_bytes):
            reader.close()
            raise BundleError(f"{ROUNDLOG}: segments beyond the end of a finished recording")
        if durable is not None and self.steps and reader.segment_end(self.steps) != durable.roundlog_bytes:
            reader.close()
            raise BundleError(f"{ROUNDLOG}: length through step {self.steps} differs from {MANIFEST}")
        return reader

    # -- what replay and resume read
    def log_cursor(self, step: int) -> Any:
        """A streaming reader of ``step``'s log entries (None without a rounding log)."""
        if self.roundlog is None:
            return None
        try:
            return self.roundlog.cursor(step)
        except RoundLogError as e:
            raise BundleError(str(e)) from None

    def load_checkpoint(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Tensors and metadata of the checkpoint at ``step``, after checking its SHA-256."""
        rel = checkpoint_name(step)
        digest = self.manifest.checkpoints.get(rel)
        if digest is None:
            raise BundleError(f"{rel}: not listed in {MANIFEST}")
        try:
            f, size = safeio.open_regular(self.dir, rel, self.caps.checkpoint_bytes)
            with f:
                # The header's length and tensor count were checked when the bundle was opened; the SHA-256
                # (while streaming) says the file is still that one, and only then is it read whole.
                h = hashlib.sha256()
                for chunk in iter(lambda: f.read(safeio.CHUNK_BYTES), b""):
                    h.update(chunk)
                if h.hexdigest() != digest:
                    raise BundleError(f"{rel}: SHA-256 does not match {MANIFEST} (file changed or corrupted)")
                f.seek(0)
                data = safeio.read_bounded(f, size, rel)
        except safeio.UnsafeInput as e:
            raise BundleError(str(e)) from None
        return decode_checkpoint(data, rel, self.caps)

    def _check_checkpoint_header(self, f: Any, size: int, rel: str) -> None:
        """A safetensors header that fits the file and the cap, naming at most ``caps.checkpoint_tensors``."""
        head = safeio.read_bounded(f, min(size, 8), rel, append_only=True)
        if len(head) < 8:
            raise BundleError(f"{rel}: not a valid safetensors checkpoint (truncated)")
        n = int.from_bytes(head, "little")
        if not 2 <= n <= min(size - 8, self.caps.checkpoint_header_bytes):  # "{}" at least
            raise BundleError(f"{rel}: safetensors header of {n} bytes does not fit")
        raw = safeio.read_bounded(f, n, rel, append_only=True)
        # Every tensor's entry names its data_offsets: counted in the bytes, before parsing builds them all
        # (the count is at least the number of tensors, and exact for every checkpoint detrl writes).
        count = raw.count(b'"data_offsets"')
        if count > self.caps.checkpoint_tensors:
            raise BundleError(
                f"{rel}: {count} tensors, more than the auditor's cap {self.caps.checkpoint_tensors}"
            )

    def resume_point(self) -> ResumePoint:
        """Where ``--resume`` continues: the last checkpoint, with what was written after it (without a
        checkpoint, e.g. killed after calibration but before the first one: step 0, rebuilt from the config
        and checked against its commitment)."""
        step = self.checkpoint_steps[-1] if self.checkpoint_steps else 0
        tensors, meta = self.load_checkpoint(step) if self.checkpoint_steps else ({}, {})
        if step and (
            not isinstance(meta.get("sources"), dict) or not isinstance(meta.get("parts", {}), dict)
        ):
            raise BundleError(f"{checkpoint_name(step)}: no resume state")
        # Records after the checkpoint (durable or not) are re-recorded and compared, never trusted.
        written = self.written
        if self.roundlog is not None:
            log_steps = self.roundlog.steps
            last = 0
            while last < len(log_steps) and log_steps[last] == last + 1:
                last += 1
            written = written[: last + 1]
        return ResumePoint(step, tensors, meta, written, self)  # shared: its readers take slices

    def close(self) -> None:
        """Close the files; the validated index (steps, segment sizes) stays readable."""
        if self.roundlog is not None:
            self.roundlog.close()


@dataclasses.dataclass
class ResumePoint:
    """A bundle's last checkpoint and the records on disk (``written``: leaves of steps 0..m, m >= step; the
    bundle's own, read only)."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    written: Leaves
    bundle: Bundle


# ---------------------------------------------------------------------------------------------- writing
class BundleWriter:
    """Writes a bundle while a run records; :class:`~detrl.core.engine.Session` drives it step by step.

    ``header``: the manifest fields fixed for the run (config, precision, hardware, sources, ...).
    ``force``: replace an existing bundle in ``run_dir`` (otherwise refused). ``resume``: continue the
    bundle whose :class:`ResumePoint` this is: steps up to the last record on disk are compared with
    what is there, and only steps beyond it are appended.

    One writer at a time: the directory is locked (``flock`` on the directory itself, so no lock file
    is left behind and a killed writer's lock is released by the kernel).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        header: dict[str, Any],
        *,
        force: bool = False,
        resume: ResumePoint | None = None,
    ) -> None:
        self.dir = Path(run_dir)
        self.header = dict(header)
        self.resume = resume
        self.verifiable = header["precision"] == "verifiable"
        self.leaves = Leaves()
        self._frontier = commit.MerkleFrontier()  # over self.leaves, which only grows (merkle_root)
        self.checkpoints: dict[str, str] = {}
        self.durable: Durable | None = None
        self.status = "recording"
        self.stopped_at: int | None = None
        self.stats: dict[str, int] = {}
        self._commits: BinaryIO | None = None
        self._log: RoundLogWriter | None = None
        self._log_bytes_through: dict[int, int] = {}
        self._log_end = 0
        self._lock: safeio.DirLock | None = None
        self._cctx: Any = None
        self._compare: list[tuple[bytes, bytes]] = []  # resume: records on disk not yet re-recorded
        self._compare_log: RoundLogReader | None = None
        self._open(force)

    # -- lifecycle
    def _open(self, force: bool) -> None:
        if self.dir.exists() and not self.dir.is_dir():
            raise BundleError(f"{self.dir}: exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = safeio.DirLock(self.dir)  # first: a bundle another process writes is refused as such
        try:
            self._lock.acquire()
        except safeio.LockedError as e:
            self._lock = None
            raise BundleError(str(e)) from None
        try:
            existing = any(_exists(self.dir / e) for e in BUNDLE_ENTRIES)
            if self.resume is None and existing and not force:
                raise BundleError(f"{self.dir}: a bundle is already there (use --force to replace it)")
            if self.resume is None and existing:
                _check_replaceable(self.dir)
            if self.resume is None:
                self._start_fresh()
            else:
                self._start_resume()
        except BaseException:
            self.close()
            raise

    def _start_fresh(self) -> None:
        # --force (checked by _check_replaceable): the old bundle goes, the manifest first, and in
        # checkpoints/ only the files a bundle writes
        for entry in (MANIFEST, COMMITMENTS, ROUNDLOG):
            (self.dir / entry).unlink(missing_ok=True)
        ckpts = self.dir / CHECKPOINTS
        if ckpts.is_dir() and not ckpts.is_symlink():
            for p in ckpts.iterdir():
                p.unlink()
            ckpts.rmdir()
        self.header.setdefault("created", utc_now())
        # The manifest first: from here on the directory is a bundle (incomplete at step 0) whatever happens.
        self._write_manifest()
        self._commits = open(self.dir / COMMITMENTS, "wb")  # noqa: SIM115 - closed in close()
        self._commits.write(COMMIT_HEADER.pack(COMMIT_MAGIC, 1, 0, 0))
        self._commits.flush()
        if self.verifiable:
            self._log = RoundLogWriter(self.dir / ROUNDLOG, level=LOG_ZSTD_LEVEL)
            self._log_end = self._log.bytes_written

    def _start_resume(self) -> None:
        r = self.resume
        assert r is not None
        b = r.bundle
        m = b.manifest
        self.header["created"] = m.created
        self.leaves = r.written[: r.step + 1]
        self._frontier = commit.MerkleFrontier()  # a new list of leaves
        self._compare = list(r.written[r.step + 1 :])  # at most a checkpoint's spacing of steps
        self.checkpoints = {k: v for k, v in m.checkpoints.items() if _ckpt_step(k) <= r.step}
        self.durable = m.durable
        self.stats = dict(m.stats)
        if self.verifiable and b.roundlog is not None:
            self._compare_log = b.roundlog
            self._log_end = b.roundlog.segment_end(r.step) if r.step else b.roundlog.segment_end(0)
        elif self.verifiable:  # killed before the log was created: it starts after its header
            self._log_end = ROUNDLOG_HEADER_BYTES
        # Files are opened for appending only when the first step beyond the records on disk arrives.

    def _begin_append(self) -> None:
        """Resume: the re-recorded steps matched the bundle; cut any torn tail and append from here."""
        n = len(self.leaves)
        if self.resume.bundle.status != "recording":  # type: ignore[union-attr]
            # A stopped (or complete, extended) bundle holds no records past its end: before one goes
            # there, its manifest must say it is recording again (same durable point), or a kill in
            # between would leave "records beyond the end of a finished recording".
            self.status, self.stopped_at = "recording", None
            self._write_manifest()
        if not (self.dir / COMMITMENTS).exists():  # killed before the files were created
            (self.dir / COMMITMENTS).write_bytes(COMMIT_HEADER.pack(COMMIT_MAGIC, 1, 0, 0))
        if self.verifiable and not (self.dir / ROUNDLOG).exists():
            RoundLogWriter(self.dir / ROUNDLOG, level=LOG_ZSTD_LEVEL).close()
        self._commits = open(self.dir / COMMITMENTS, "r+b")  # noqa: SIM115 - closed in close()
        self._commits.truncate(COMMIT_HEADER.size + n * COMMIT_RECORD.size)
        self._commits.seek(0, os.SEEK_END)
        if self.verifiable:
            last = n - 1 if n else None  # killed before step 0 was written: no segment is kept
            self._log = RoundLogWriter.append(self.dir / ROUNDLOG, self._log_end, last, level=LOG_ZSTD_LEVEL)
        self.resume.bundle.close()  # type: ignore[union-attr]
        self.resume = None
        self._compare_log = None

    @property
    def unchanged(self) -> bool:
        """Resume: whether the bundle on disk is still as it was (the steps re-recorded so far are compared
        with it, nothing is written until the run goes past them or stops there). False for a fresh bundle."""
        return self.resume is not None

    def close(self) -> None:
        for f in (self._commits, self._log):
            if f is not None:
                f.close()
        self._commits = self._log = None
        if self.resume is not None:
            self.resume.bundle.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- per step
    def append_step(self, step: int, state: bytes, batch: bytes, log_ops: list[OpEntries] | None) -> int:
        """Append ``step``'s log segment and commitment record (flushed, not fsynced). Returns the log
        segment's size in bytes (0 without a log). On resume, a step already on disk is compared instead."""
        if step != len(self.leaves):
            raise RuntimeError(f"bundle writer: step {step} after {len(self.leaves) - 1}")
        if self._compare:
            return self._compare_step(step, state, batch, log_ops)
        if self.resume is not None:
            self._begin_append()
        size = 0
        if self._log is not None and step > 0:
            with safeio.naming(self.dir / ROUNDLOG):
                size = self._log.write_step(step, log_ops or [])
            self._log_end = self._log.bytes_written
        assert self._commits is not None
        with safeio.naming(self.dir / COMMITMENTS):
            self._commits.write(commit_record(step, state, batch))
            self._commits.flush()
        self.leaves.append((state, batch))
        return size

    def _compare_step(self, step: int, state: bytes, batch: bytes, log_ops: list[OpEntries] | None) -> int:
        want = self._compare.pop(0)
        if want != (state, batch):
            raise BundleError(
                f"{self.dir}: resumed step {step} differs from the step the bundle holds (a run that is not "
                "deterministic here: other hardware or thread count?); the bundle is unchanged"
            )
        size = 0
        if self._compare_log is not None and step > 0:
            if self._cctx is None:
                self._cctx = segment_compressor(LOG_ZSTD_LEVEL)
            seg = encode_segment(step, log_ops or [], self._cctx)
            start, end = self._log_end, self._compare_log.segment_end(step)
            if self._compare_log.raw_bytes(start, end - start) != seg:
                raise BundleError(
                    f"{self.dir}: resumed step {step} logs differently from the bundle's {ROUNDLOG}; "
                    "the bundle is unchanged"
                )
            size = len(seg)
            self._log_end = end
        self.leaves.append((state, batch))
        return size

    # -- durable points
    def checkpoint(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        meta: dict[str, Any],
        status: str = "recording",
        stopped_at: int | None = None,
    ) -> None:
        """Write the checkpoint of ``step`` (atomically) and make ``step`` durable."""
        data = encode_checkpoint(tensors, meta)
        rel = checkpoint_name(step)
        digest = hashlib.sha256(data).hexdigest()
        path = self.dir / rel
        if self._compare and status != "recording" and self._inside_durable():
            return  # a stop inside the durable steps the bundle holds leaves it as it was (make_durable)
        if not (self.resume is not None and path.is_file() and _sha256_file(path) == digest):
            (self.dir / CHECKPOINTS).mkdir(exist_ok=True)
            safeio.write_atomic(self.dir / CHECKPOINTS, path.name, data)
        self.checkpoints[rel] = digest
        self.make_durable(status, stopped_at)

    def make_durable(self, status: str = "recording", stopped_at: int | None = None) -> None:
        """fsync what was appended and replace the manifest: everything through the last step is durable.

        While a resumed run is still re-recording steps the bundle holds, nothing is written (those steps
        are on disk already), unless the run ends there: then the records after it are cut."""
        if self._compare:
            if status == "recording" or self._inside_durable():
                return  # a stop inside the durable steps the bundle holds leaves it as it was
            self._compare = []
        if self.resume is not None:
            self._begin_append()
        if self._commits is not None:
            with safeio.naming(self.dir / COMMITMENTS):
                self._commits.flush()
                os.fsync(self._commits.fileno())
        if self._log is not None:
            with safeio.naming(self.dir / ROUNDLOG):
                self._log.sync()
        step = len(self.leaves) - 1
        if step >= 0:
            self.durable = Durable(
                step=step, merkle_root=merkle_root(self.leaves, self._frontier), roundlog_bytes=self._log_end
            )
        # A checkpoint off the checkpoint_every grid was a stop's; once the run is past it, it goes, so a
        # resumed bundle is the bundle an uninterrupted run writes (listing first, then the file).
        every = self.header.get("checkpoint_every", 0)
        stale = [
            r for r in self.checkpoints if _ckpt_step(r) < step and not (every and _ckpt_step(r) % every == 0)
        ]
        for rel in stale:
            del self.checkpoints[rel]
        self.status, self.stopped_at = status, stopped_at
        self._write_manifest()
        # What the listing does not name goes: the stale checkpoints, and what a killed writer left behind
        # (a checkpoint of a step up to here it never listed, a temporary file).
        ckpts = self.dir / CHECKPOINTS
        for p in sorted(ckpts.iterdir()) if ckpts.is_dir() and not ckpts.is_symlink() else ():
            rel = f"{CHECKPOINTS}/{p.name}"
            orphan = _CKPT_RE.match(rel) and rel not in self.checkpoints and _ckpt_step(rel) <= step
            if (orphan or _TMP_RE.match(p.name)) and p.is_file() and not p.is_symlink():
                p.unlink()

    def _inside_durable(self) -> bool:
        """Resume: the run is still before the bundle's durable point (re-recording steps it holds)."""
        return self.durable is not None and len(self.leaves) - 1 < self.durable.step

    def update_header(self, **fields: Any) -> None:
        """Change fixed manifest fields (thresholds after calibration); written at the next durable point."""
        self.header.update(fields)

    def _write_manifest(self) -> None:
        m = {
            "format": FORMAT,
            "version": VERSION,
            **self.header,
            "status": self.status,
            "stopped_at": self.stopped_at,
            "durable": self.durable.model_dump() if self.durable is not None else None,
            "checkpoints": dict(sorted(self.checkpoints.items())),
            "stats": dict(self.stats),
        }
        safeio.write_atomic(self.dir, MANIFEST, safeio.dumps_json(m))


def reseal(run_dir: str | os.PathLike) -> None:
    """Make a changed bundle's manifest consistent with its files again: checkpoint SHA-256s, the Merkle
    root of the durable commitments and the log's length through the durable step.

    Anyone can do this, the trainer included: these fields catch accidents, not fraud (replay does). The
    ``nolog`` benchmark and the tampering tests use it to forge bundles that pass every structural check.
    """
    run_dir = Path(run_dir)
    m = parse_manifest((run_dir / MANIFEST).read_bytes()).model_dump()
    m["checkpoints"] = {rel: _sha256_file(run_dir / rel) for rel in m["checkpoints"]}
    leaves, _ = parse_commitments((run_dir / COMMITMENTS).read_bytes())
    if m["durable"] is not None:
        step = m["durable"]["step"]
        m["durable"]["merkle_root"] = merkle_root(leaves[: step + 1])
        if (run_dir / ROUNDLOG).exists():
            with RoundLogReader(run_dir / ROUNDLOG) as r:
                m["durable"]["roundlog_bytes"] = r.segment_end(step)
    safeio.write_atomic(run_dir, MANIFEST, safeio.dumps_json(m))


def _check_replaceable(run_dir: Path) -> None:
    """Refuse ``--force`` unless ``run_dir`` holds a detrl bundle and nothing of anyone else's among the
    entries a bundle owns: a manifest that says it is one (its ``format`` marker), ``roundlog`` and
    ``commitments`` regular files, and in ``checkpoints/`` only checkpoint files. Nothing is changed."""
    refuse = f"{run_dir}: --force replaces only a detrl bundle, and nothing was changed:"
    try:
        m = safeio.loads_json(safeio.read_file(run_dir, MANIFEST, 1 << 26), MANIFEST)
    except (safeio.UnsafeInput, OSError):
        m = None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise BundleError(f"{refuse} it holds no {MANIFEST} with format {FORMAT!r}")
    for entry in (COMMITMENTS, ROUNDLOG):
        p = run_dir / entry
        if _exists(p) and (p.is_symlink() or not p.is_file()):
            raise BundleError(f"{refuse} {entry} is not a regular file")
    ckpts = run_dir / CHECKPOINTS
    if not _exists(ckpts):
        return
    if ckpts.is_symlink() or not ckpts.is_dir():
        raise BundleError(f"{refuse} {CHECKPOINTS} is not a directory")
    for p in ckpts.iterdir():
        rel = f"{CHECKPOINTS}/{p.name}"
        if p.is_symlink() or not p.is_file() or not (_CKPT_RE.match(rel) or _TMP_RE.match(p.name)):
            raise BundleError(f"{refuse} {rel!r} is not a checkpoint detrl wrote")


def _exists(path: Path) -> bool:
    """Whether anything (a file, a link, a FIFO) is at ``path``: only a true absence is tolerated."""
    return os.path.lexists(path)


def _ckpt_step(rel: str) -> int:
    return int(_CKPT_RE.match(rel).group(1))  # type: ignore[union-attr]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
