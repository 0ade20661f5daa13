"""Sparse rounding log: which FP32 neighbour was chosen for near-midpoint FP64 results.

Verifiable training computes every op in FP64 and rounds each result to FP32. Elements whose
FP64 value lies very close to an FP32 rounding midpoint could round either way on different
hardware, so the trainer records, per training step and per op position (sequence number of the
rounded op output within the step), the logical row-major flat indices of those elements and the
chosen direction (``up=True``: the larger-magnitude FP32 neighbour). An auditor replaying on other
hardware uses the log to reproduce the trainer's FP32 values bit-exactly.

The file is produced by an untrusted party. The reader therefore never unpickles anything, checks
every length, offset and checksum, bounds decompressed sizes, and reports every defect as a
:class:`RoundLogError` (a ``ValueError``) whose message names the file and the problem. The exact
byte layout is specified in ``docs/roundlog.md``; the constants below mirror it.

Note that the CRC32 checksums only detect accidental corruption. A dishonest trainer can always
write a well-formed log with wrong content (see :func:`rewrite`); catching that is the job of
the replaying auditor, not of this module.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import zstandard

__all__ = [
    "FORMAT_VERSION",
    "OpEntries",
    "RoundLogError",
    "RoundLogReader",
    "RoundLogWriter",
    "dense_reference_bytes",
    "rewrite",
]

FORMAT_VERSION: int = 1

# --- byte layout (all little-endian; see docs/roundlog.md) -------------------------------------
FILE_MAGIC = b"DTRLRLOG"
END_MAGIC = b"DTRLREND"
SEGMENT_TAG = b"RSEG"
# magic[8] | version u16 | flags u16 | reserved u32
_FILE_HEADER = struct.Struct("<8sHHI")
# tag[4] | step u64 | n_ops u32 | raw_len u64 | comp_len u64 | crc32 u32
_SEG_HEADER = struct.Struct("<4sQIQQI")
# op u32 | count u32 | width u8   (then count*width delta bytes, then ceil(count/8) bit bytes)
_RECORD_HEADER = struct.Struct("<IIB")
# step u64 | segment offset u64
_INDEX_ENTRY = struct.Struct("<QQ")
# index_offset u64 | n_segments u64 | index_crc32 u32 | reserved u32 | end magic[8]
_TRAILER = struct.Struct("<QQII8s")

#: Set in a record's width byte: the record holds pinned FP32 values instead of direction bits.
PINNED_FLAG = 0x80
_U32_LIMIT = 1 << 32
_U64_LIMIT = 1 << 64
_I64_LIMIT = 1 << 63
# Smallest possible record: header plus one 4-byte delta plus one direction byte.
_MIN_RECORD_BYTES = _RECORD_HEADER.size + 4 + 1


class RoundLogError(ValueError):
    """A rounding log file is malformed, truncated, corrupted or unreadable."""


@dataclass
class OpEntries:
    """Logged elements of one rounded op output within one step.

    Attributes:
        op: op position within the step (0 <= op < 2**32).
        indices: int64, shape (n,), strictly increasing logical row-major flat element indices >= 0.
        up: bool, shape (n,); True = the larger-magnitude FP32 neighbour was chosen.
        pinned_indices: int64, shape (m,), strictly increasing, disjoint from ``indices``: elements whose
            uncertainty spans more than a fraction of their own FP32 spacing (results of heavy
            cancellation), for which a direction bit cannot name the value; their FP32 value is stored.
        pinned_values: float32, shape (m,): the FP32 values chosen for ``pinned_indices``.
    """

    op: int
    indices: np.ndarray
    up: np.ndarray
    pinned_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pinned_values: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))

    def __eq__(self, other: object) -> bool:
        # The generated dataclass __eq__ would compare arrays with ==, which is ambiguous.
        if not isinstance(other, OpEntries):
            return NotImplemented
        return (
            self.op == other.op
            and np.array_equal(self.indices, other.indices)
            and np.array_equal(self.up, other.up)
            and np.array_equal(self.pinned_indices, other.pinned_indices)
            and np.array_equal(
                np.asarray(self.pinned_values, dtype=np.float32).view(np.uint32),
                np.asarray(other.pinned_values, dtype=np.float32).view(np.uint32),
            )
        )


def dense_reference_bytes(n_rounded_elements: int) -> int:
    """Bytes of the reference dense encoding: one base-3 digit per rounded element, 5 per byte."""
    if n_rounded_elements < 0:
        raise ValueError(f"n_rounded_elements must be >= 0, got {n_rounded_elements}")
    return -(-n_rounded_elements // 5)


# --- writer ------------------------------------------------------------------------------------


def _check_uint(name: str, value: object, limit: int) -> int:
    """Return ``value`` as a Python int in [0, limit) or raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    v = int(value)
    if not 0 <= v < limit:
        raise ValueError(f"{name} must be in [0, {limit}), got {v}")
    return v


def _validated_arrays(e: OpEntries) -> tuple[np.ndarray, np.ndarray]:
    """Return (indices int64 (n,), up bool (n,)) of ``e`` after validating them; raise ValueError."""
    idx = np.asarray(e.indices)
    up = np.asarray(e.up)
    if idx.ndim != 1 or up.ndim != 1:
        raise ValueError(f"op {e.op}: indices and up must be 1-D, got shapes {idx.shape} and {up.shape}")
    if idx.shape != up.shape:
        raise ValueError(f"op {e.op}: indices ({idx.size}) and up ({up.size}) differ in length")
    if idx.size and idx.dtype.kind not in "iu":
        raise ValueError(f"op {e.op}: indices must be integers, got dtype {idx.dtype}")
    if up.size and up.dtype.kind not in "biu":
        raise ValueError(f"op {e.op}: up must be bool, got dtype {up.dtype}")
    if idx.size >= _U32_LIMIT:
        raise ValueError(f"op {e.op}: too many entries ({idx.size})")
    if idx.size:
        if int(idx.min()) < 0:
            raise ValueError(f"op {e.op}: indices must be >= 0")
        if int(idx.max()) >= _I64_LIMIT:
            raise ValueError(f"op {e.op}: indices must be < 2**63")
        idx = idx.astype(np.int64, copy=False)
        if idx.size > 1 and not np.all(idx[1:] > idx[:-1]):
            raise ValueError(f"op {e.op}: indices must be strictly increasing (sorted, unique)")
        if up.dtype.kind != "b":
            if not np.all((up == 0) | (up == 1)):
                raise ValueError(f"op {e.op}: up must contain only 0/1")
            up = up.astype(bool)
    return idx.astype(np.int64, copy=False), up.astype(bool, copy=False)


def _planes(deltas: np.ndarray, width: int) -> bytes:
    # Byte planes: all lowest bytes, then all second bytes, ... The high planes of small deltas are
    # mostly zero, which zstd compresses far better than interleaved words (about 15 % smaller logs).
    return deltas.astype("<u4" if width == 4 else "<u8").view(np.uint8).reshape(-1, width).T.tobytes()


def _validated_pinned(e: OpEntries, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (pinned indices int64 (m,), values float32 (m,)) of ``e`` after validating them."""
    pidx = np.asarray(e.pinned_indices)
    vals = np.asarray(e.pinned_values)
    if pidx.ndim != 1 or vals.ndim != 1 or pidx.shape != vals.shape:
        raise ValueError(f"op {e.op}: pinned_indices and pinned_values must be 1-D and of equal length")
    if pidx.size:
        if pidx.dtype.kind not in "iu" or vals.dtype != np.float32:
            raise ValueError(f"op {e.op}: pinned indices must be integers and values float32")
        if int(pidx.min()) < 0 or int(pidx.max()) >= _I64_LIMIT or pidx.size >= _U32_LIMIT:
            raise ValueError(f"op {e.op}: pinned indices must be in [0, 2**63)")
        pidx = pidx.astype(np.int64, copy=False)
        if pidx.size > 1 and not np.all(pidx[1:] > pidx[:-1]):
            raise ValueError(f"op {e.op}: pinned indices must be strictly increasing")
        if np.intersect1d(pidx, idx, assume_unique=True).size:
            raise ValueError(f"op {e.op}: an element cannot have both a direction and a pinned value")
    return pidx.astype(np.int64, copy=False), vals.astype(np.float32, copy=False)


def _encode_record(op: int, idx: np.ndarray, payload: np.ndarray, pinned: bool) -> bytes:
    """One payload record: header, delta-coded indices (first absolute), then packed direction bits
    (a direction record) or FP32 values in byte planes (a pinned record, flagged in the width byte)."""
    deltas = np.diff(idx, prepend=np.int64(0))  # deltas[0] = idx[0]; all >= 0 after validation
    width = 4 if int(deltas.max()) < _U32_LIMIT else 8
    if pinned:
        tail = np.asarray(payload, dtype="<f4").view(np.uint8).reshape(-1, 4).T.tobytes()
    else:
        tail = np.packbits(payload).tobytes()  # MSB-first, zero padding bits
    return (
        _RECORD_HEADER.pack(op, idx.size, width | (PINNED_FLAG if pinned else 0))
        + _planes(deltas, width)
        + tail
    )


class RoundLogWriter:
    """Appends one segment per training step to a new rounding log, then an index on close.

    Each :meth:`write_step` writes and flushes a complete segment, so a crash loses at most the
    current step (but a file without index/trailer is rejected by :class:`RoundLogReader`).
    """

    def __init__(self, path: str | os.PathLike, level: int = 3) -> None:
        self.path = os.fspath(path)
        self._cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
        self._f: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._index: list[tuple[int, int]] = []  # (step, segment offset in bytes)
        self._last_step: int | None = None
        self._pos = 0
        self._write(_FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, 0, 0))

    @property
    def bytes_written(self) -> int:
        """Total bytes written to the file so far."""
        return self._pos

    def _write(self, data: bytes) -> None:
        assert self._f is not None
        self._f.write(data)
        self._pos += len(data)

    def write_step(self, step: int, ops: list[OpEntries]) -> int:
        """Append the segment for ``step`` and flush; return its size in bytes (header included).

        ``step`` must exceed every previously written step. ``ops`` must be in strictly increasing
        op order; ops with zero entries are dropped (they carry no information). A step with no
        (non-empty) ops still gets an empty segment, recording that the step was logged.
        Invalid input raises ValueError before anything is written.
        """
        if self._f is None:
            raise ValueError(f"roundlog: {self.path}: writer is closed")
        step = _check_uint("step", step, _U64_LIMIT)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} must be greater than the previous step {self._last_step}")
        records: list[bytes] = []
        prev_op = -1
        for e in ops:
            if not isinstance(e, OpEntries):
                raise ValueError(f"ops must contain OpEntries, got {type(e).__name__}")
            op = _check_uint("op", e.op, _U32_LIMIT)
            if op <= prev_op:
                raise ValueError(f"op positions must be strictly increasing, got {op} after {prev_op}")
            prev_op = op
            idx, up = _validated_arrays(e)
            pidx, vals = _validated_pinned(e, idx)
            if idx.size:
                records.append(_encode_record(op, idx, up, pinned=False))
            if pidx.size:
                records.append(_encode_record(op, pidx, vals, pinned=True))
        raw = b"".join(records)
        comp = self._cctx.compress(raw)
        head = _SEG_HEADER.pack(SEGMENT_TAG, step, len(records), len(raw), len(comp), 0)[:-4]
        crc = zlib.crc32(comp, zlib.crc32(head))  # covers header fields and compressed payload
        offset = self._pos
        self._write(head + struct.pack("<I", crc) + comp)
        self._f.flush()
        self._index.append((step, offset))
        self._last_step = step
        return self._pos - offset

    def close(self) -> None:
        """Write the index and trailer and close the file. Idempotent."""
        if self._f is None:
            return
        try:
            index_offset = self._pos
            index = b"".join(_INDEX_ENTRY.pack(s, o) for s, o in self._index)
            self._write(index)
            self._write(_TRAILER.pack(index_offset, len(self._index), zlib.crc32(index), 0, END_MAGIC))
            self._f.flush()
        finally:
            self._f.close()
            self._f = None

    def __enter__(self) -> RoundLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        # Finalise even on error: the steps written so far form a valid log.
        self.close()


# --- reader ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Segment:
    index: int  # position in the file's segment sequence
    offset: int  # byte offset of the segment header
    header: bytes  # the header bytes preceding the crc field (CRC input)
    n_ops: int
    raw_len: int
    comp_len: int
    crc: int


class RoundLogReader:
    """Validating reader for a complete rounding log (index and trailer present).

    Opening checks the file header, trailer, index (bounds, CRC, strictly increasing steps) and
    every segment header (segments must tile the region between file header and index exactly, and
    agree with the index). Payload checksums and record structure are checked by :meth:`read_step`.
    """

    def __init__(self, path: str | os.PathLike, max_raw_bytes: int = 1 << 30) -> None:
        self.path = os.fspath(path)
        self.max_raw_bytes = max_raw_bytes
        self._dctx = zstandard.ZstdDecompressor()
        try:
            self._f: BinaryIO | None = open(self.path, "rb")  # noqa: SIM115 - closed in close()
            self._size = os.fstat(self._f.fileno()).st_size
        except OSError as exc:
            raise RoundLogError(f"roundlog: {self.path}: cannot open: {exc}") from exc
        try:
            self._segments = self._load()
        except BaseException:
            self.close()
            raise
        self.steps: list[int] = list(self._segments)

    def _err(self, msg: str) -> RoundLogError:
        return RoundLogError(f"roundlog: {self.path}: {msg}")

    def _read_at(self, offset: int, n: int, what: str) -> bytes:
        """Read exactly ``n`` bytes at ``offset`` or raise a 'truncated' RoundLogError."""
        if self._f is None:
            raise self._err("reader is closed")
        try:
            self._f.seek(offset)
            data = self._f.read(n)
        except OSError as exc:
            raise self._err(f"read error in {what} at byte {offset}: {exc}") from exc
        if len(data) != n:
            raise self._err(f"truncated in {what} at byte {offset} (need {n} bytes, got {len(data)})")
        return data

    def _load(self) -> dict[int, _Segment]:
        """Validate header, trailer, index and segment headers; return step -> segment."""
        min_size = _FILE_HEADER.size + _TRAILER.size
        if self._size < min_size:
            raise self._err(f"truncated: file is {self._size} bytes, a complete log has >= {min_size}")
        magic, version, flags, reserved = _FILE_HEADER.unpack(self._read_at(0, _FILE_HEADER.size, "header"))
        if magic != FILE_MAGIC:
            raise self._err(f"bad magic {magic!r} (not a detrl rounding log)")
        if version != FORMAT_VERSION:
            raise self._err(
                f"unsupported format version {version} (this detrl reads version {FORMAT_VERSION})"
            )
        if flags != 0 or reserved != 0:
            raise self._err(f"unsupported header flags 0x{flags:04x} / reserved 0x{reserved:08x}")

        trailer_at = self._size - _TRAILER.size
        index_offset, n_seg, index_crc, t_reserved, end = _TRAILER.unpack(
            self._read_at(trailer_at, _TRAILER.size, "trailer")
        )
        if end != END_MAGIC:
            raise self._err("no trailer at end of file (truncated, or the writer never called close())")
        if t_reserved != 0:
            raise self._err(f"trailer reserved field is 0x{t_reserved:08x}, expected 0")
        if index_offset < _FILE_HEADER.size or index_offset + n_seg * _INDEX_ENTRY.size != trailer_at:
            raise self._err(
                f"index at byte {index_offset} with {n_seg} entries does not end at the trailer "
                f"(byte {trailer_at}): bad index offset or count"
            )
        index = self._read_at(index_offset, trailer_at - index_offset, "index")
        if zlib.crc32(index) != index_crc:
            raise self._err("index checksum mismatch")

        segments: dict[int, _Segment] = {}
        expected_offset = _FILE_HEADER.size  # segments are contiguous, in index order
        prev_step = -1
        for i, (step, offset) in enumerate(_INDEX_ENTRY.iter_unpack(index)):
            if step <= prev_step:
                raise self._err(f"index entry {i}: step {step} not greater than previous step {prev_step}")
            if offset != expected_offset:
                raise self._err(f"index entry {i}: segment offset {offset}, expected {expected_offset}")
            if offset + _SEG_HEADER.size > index_offset:
                raise self._err(f"index entry {i}: segment header at byte {offset} overruns the index")
            raw_head = self._read_at(offset, _SEG_HEADER.size, f"segment {i} header")
            tag, h_step, n_ops, raw_len, comp_len, crc = _SEG_HEADER.unpack(raw_head)
            if tag != SEGMENT_TAG:
                raise self._err(f"segment {i}: bad segment tag {tag!r} at byte {offset}")
            if h_step != step:
                raise self._err(f"segment {i}: header says step {h_step}, index says step {step}")
            if raw_len > self.max_raw_bytes:
                raise self._err(
                    f"segment {i} (step {step}): raw length {raw_len} exceeds limit {self.max_raw_bytes}"
                )
            if n_ops * _MIN_RECORD_BYTES > raw_len:
                raise self._err(
                    f"segment {i} (step {step}): {n_ops} op records cannot fit in {raw_len} bytes"
                )
            end_offset = offset + _SEG_HEADER.size + comp_len
            if end_offset > index_offset:
                raise self._err(f"segment {i} (step {step}): compressed length {comp_len} overruns the index")
            segments[step] = _Segment(i, offset, raw_head[:-4], n_ops, raw_len, comp_len, crc)
            expected_offset = end_offset
            prev_step = step
        if expected_offset != index_offset:
            raise self._err(f"{index_offset - expected_offset} unindexed bytes before the index")
        return segments

    def segment_bytes(self, step: int) -> int:
        """Size in bytes of ``step``'s segment, header included (0 if the step has no segment)."""
        seg = self._segments.get(step)
        return 0 if seg is None else _SEG_HEADER.size + seg.comp_len

    def read_step(self, step: int) -> dict[int, OpEntries]:
        """Return op position -> entries for ``step`` ({} if the step has no segment).

        Verifies the checksum, the decompressed length and the record structure.
        """
        seg = self._segments.get(step)
        if seg is None:
            return {}
        where = f"segment {seg.index} (step {step})"
        comp = self._read_at(seg.offset + _SEG_HEADER.size, seg.comp_len, f"{where} payload")
        if zlib.crc32(comp, zlib.crc32(seg.header)) != seg.crc:
            raise self._err(f"{where}: checksum mismatch")
        raw = self._decompress(comp, seg.raw_len, where)
        return self._decode(raw, seg.n_ops, where)

    def _decompress(self, comp: bytes, raw_len: int, where: str) -> bytes:
        # The frame must declare its content size: zstd then refuses to produce more than that,
        # which bounds memory by raw_len (already checked against max_raw_bytes).
        try:
            declared = zstandard.frame_content_size(comp)
            if declared != raw_len:
                raise self._err(f"{where}: zstd frame declares {declared} bytes, header says {raw_len}")
            dobj = self._dctx.decompressobj()
            raw = dobj.decompress(comp)
        except zstandard.ZstdError as exc:
            raise self._err(f"{where}: zstd decompression failed: {exc}") from exc
        if not dobj.eof or dobj.unused_data:
            raise self._err(f"{where}: payload is not exactly one complete zstd frame")
        if len(raw) != raw_len:
            raise self._err(f"{where}: decompressed to {len(raw)} bytes, header says {raw_len}")
        return raw

    def _decode(self, raw: bytes, n_ops: int, where: str) -> dict[int, OpEntries]:
        """Parse ``n_ops`` records that must consume ``raw`` exactly."""
        out: dict[int, OpEntries] = {}
        pos = 0
        prev: tuple[int, bool] = (-1, True)  # (op, pinned) of the previous record
        for r in range(n_ops):
            if pos + _RECORD_HEADER.size > len(raw):
                raise self._err(f"{where}: record {r} header overruns the payload at byte {pos}")
            op, count, width_byte = _RECORD_HEADER.unpack_from(raw, pos)
            pinned, width = bool(width_byte & PINNED_FLAG), width_byte & ~PINNED_FLAG
            rec = f"{where} record {r} (op {op})"
            pos += _RECORD_HEADER.size
            # Ops increase; an op may have a direction record followed by a pinned record.
            if not (op > prev[0] or (op == prev[0] and pinned and not prev[1])):
                raise self._err(f"{rec}: op not greater than previous op {prev[0]}")
            if count == 0:
                raise self._err(f"{rec}: empty record")
            if width not in (4, 8):
                raise self._err(f"{rec}: index width {width}, expected 4 or 8")
            n_tail = 4 * count if pinned else (count + 7) // 8
            if pos + count * width + n_tail > len(raw):
                raise self._err(f"{rec}: {count} entries overrun the payload")
            planes = np.frombuffer(raw, dtype=np.uint8, count=count * width, offset=pos).reshape(width, count)
            deltas = planes.T.copy().view("<u4" if width == 4 else "<u8").ravel()
            pos += count * width
            tail = np.frombuffer(raw, dtype=np.uint8, count=n_tail, offset=pos)
            pos += n_tail
            if width == 8 and int(deltas.max()) < _U32_LIMIT:
                raise self._err(f"{rec}: non-canonical index width 8 (all deltas fit in 4 bytes)")
            # uint64 cumsum wraps on overflow; since each delta < 2**64, a wrap shows up as a
            # decrease, so the strict-increase check also rejects overflow.
            idx = np.cumsum(deltas.astype(np.uint64), dtype=np.uint64)
            if count > 1 and not np.all(idx[1:] > idx[:-1]):
                raise self._err(f"{rec}: indices not strictly increasing (zero delta or overflow)")
            if int(idx[-1]) >= _I64_LIMIT:
                raise self._err(f"{rec}: index {int(idx[-1])} exceeds 2**63 - 1")
            idx = idx.astype(np.int64)
            if pinned:
                values = tail.reshape(4, count).T.copy().view("<f4").ravel().astype(np.float32)
                entries = out.get(op) or OpEntries(op=op, indices=np.zeros(0, np.int64), up=np.zeros(0, bool))
                if np.intersect1d(idx, entries.indices, assume_unique=True).size:
                    raise self._err(f"{rec}: a pinned element also has a direction entry")
                entries.pinned_indices, entries.pinned_values = idx, values
                out[op] = entries
            else:
                if count % 8 and int(tail[-1]) & ((1 << (8 - count % 8)) - 1):
                    raise self._err(f"{rec}: nonzero padding bits in direction bytes")
                up = np.unpackbits(tail, count=count).astype(bool)
                out[op] = OpEntries(op=op, indices=idx, up=up)
            prev = (op, pinned)
        if pos != len(raw):
            raise self._err(f"{where}: {len(raw) - pos} trailing bytes after {n_ops} records")
        return out

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> RoundLogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rewrite(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    transform: Callable[[int, dict[int, OpEntries]], dict[int, OpEntries] | None],
    level: int = 3,
) -> None:
    """Re-encode ``src`` into a new, well-formed log ``dst`` after ``transform(step, ops)``.

    ``transform`` gets op -> entries for each step with a segment and returns the (possibly
    modified) mapping, or None to drop that step's segment. This is how a dishonest trainer would
    forge a log: the result has valid checksums, so only a replay can detect the change.
    """
    with RoundLogReader(src) as reader, RoundLogWriter(dst, level=level) as writer:
        for step in reader.steps:
            ops = transform(step, reader.read_step(step))
            if ops is not None:
                writer.write_step(step, sorted(ops.values(), key=lambda e: e.op))
