"""Sparse rounding log: which FP32 neighbour was chosen for near-midpoint FP64 results.

Verifiable training computes every op in FP64 and rounds each result to FP32. Elements whose
FP64 value lies very close to an FP32 rounding midpoint could round either way on different
hardware, so the trainer records, per training step and per op position (sequence number of the
rounded op output within the step), the logical row-major flat indices of those elements and the
chosen direction (``up=True``: the larger-magnitude FP32 neighbour). An auditor replaying on other
hardware uses the log to reproduce the trainer's FP32 values bit-exactly.

A log is a file header followed by one self-contained segment per logged step, with no index: a
writer killed mid-step leaves a file that is readable up to its last complete segment (the partial
segment after it is a *torn tail*, reported by :attr:`RoundLogReader.torn_bytes`, not an error).

The file is produced by an untrusted party. The reader therefore never unpickles anything, checks
every length, offset and checksum, bounds every allocation (decompression is streamed; see
:class:`StepCursor` for the memory bound), and reports every defect as a :class:`RoundLogError`
(a ``ValueError``) whose message names the file and the problem. The exact byte layout is
specified in ``docs/roundlog.md``; the constants below mirror it.

Note that the CRC32 checksums only detect accidental corruption. A dishonest trainer can always
write a well-formed log with wrong content (see :func:`detrl.testing.logrewrite.rewrite`); catching that is the job of
the replaying auditor, not of this module.
"""

from __future__ import annotations

import bisect
import os
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import zstandard

try:  # the record encoding in C (detrl/formats/_segment.c): the same bytes, one call a step
    from detrl.formats import _segment
except ImportError:  # built without a C compiler: the Python encoder below does it
    _segment = None

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAX_LEVEL",
    "MAX_WINDOW_BYTES",
    "OpEntries",
    "RoundLogError",
    "RoundLogMisfit",
    "RoundLogReader",
    "RoundLogWriter",
    "StepCursor",
    "dense_reference_bytes",
    "encode_segment",
    "from_key32",
    "key32",
    "nearest_with_low16",
    "segment_compressor",
]

FORMAT_VERSION: int = 4
#: The versions the reader reads: 3 (indices as delta byte planes) and 4 (indices Rice-coded). A writer
#: continuing a log (:meth:`RoundLogWriter.append`) writes the file's own version.
READABLE_VERSIONS: tuple[int, ...] = (3, 4)
if _segment is not None and getattr(_segment, "FORMAT_VERSIONS", None) != READABLE_VERSIONS:
    _segment = None  # built from an older source: it would write other bytes; the Python encoder does it

# --- byte layout (all little-endian; see docs/roundlog.md) -------------------------------------
FILE_MAGIC = b"DTRLRLOG"
SEGMENT_TAG = b"RSEG"
# magic[8] | version u16 | flags u16 | reserved u32
_FILE_HEADER = struct.Struct("<8sHHI")
#: Size in bytes of the file header; the first segment (if any) starts here.
HEADER_BYTES: int = _FILE_HEADER.size
# tag[4] | step u64 | n_ops u32 | raw_len u64 | comp_len u64 | crc32 u32
SEGMENT_HEADER = struct.Struct("<4sQIQQI")
# op u32 | count u32 | kind u8 | unary u32   (version 4: then `unary` bytes of Rice quotients, the
# remainders in ceil(count*k/8) bytes, then the payload; k: the kind byte's low 6 bits)
RECORD_HEADER = struct.Struct("<IIBI")
# op u32 | count u32 | width u8   (version 3: then count*width delta bytes, then the payload)
RECORD_HEADER_V3 = struct.Struct("<IIB")

#: Set in a record's kind (version 3: width) byte: the record holds pinned FP32 values, not direction bits.
PINNED_FLAG = 0x80
#: Set in a record's kind (width) byte: it holds the low 16 bits of pinned values' keys (:func:`key32`).
SHORT_FLAG = 0x40
#: The largest Rice parameter (the kind byte's low 6 bits): every gap is below 2**63.
RICE_MAX = 62
#: Record kinds, in the order an op's records must come: direction, pinned, short.
_DIRECTION, _PINNED, _SHORT = 0, 1, 2
_KIND_NAMES = ("direction", "pinned", "short pinned")
_U32_LIMIT = 1 << 32
_U64_LIMIT = 1 << 64
_I64_LIMIT = 1 << 63
# Smallest possible record per version: header, one 4-byte delta (3) or one byte of unary code (4), and one
# direction byte.
_MIN_RECORD_BYTES = {3: RECORD_HEADER_V3.size + 4 + 1, 4: RECORD_HEADER.size + 1 + 1}

#: Highest zstd level the writer accepts. Levels 1..19 use windows of at most 8 MiB; the "ultra"
#: levels 20..22 use up to 128 MiB, which a reader would have to allocate per open cursor.
MAX_LEVEL: int = 19
#: Largest zstd window (bytes) the reader accepts; it is the decompressor's fixed memory per cursor.
MAX_WINDOW_BYTES: int = 1 << 23
#: Default cap on the entries of one record decoded by :meth:`RoundLogReader.read_step`.
DEFAULT_MAX_ENTRIES: int = 1 << 26

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_HEADER_MAX = 18  # ZSTD_FRAMEHEADERSIZE_MAX: magic through frame content size
_ZSTD_BLOCK_MAX = 1 << 17  # largest block (raw or regenerated) a frame may hold
_IO_CHUNK = 1 << 20  # bytes per bounded read of compressed or decompressed data
_ELEM_CHUNK = 1 << 16  # entries per step of chunked array work (bounds the temporaries)
_UNARY_CHUNK = 1 << 13  # bytes of unary code per step (its 2**16 bits, and their positions, are temporaries)
# remainders per step (a whole number of bytes; their bits, a byte each, are temporaries)
_RICE_CHUNK = 1 << 13


class RoundLogError(ValueError):
    """A rounding log file is malformed, corrupted or unreadable."""


class RoundLogMisfit(RoundLogError):
    """An op's records do not fit the output the reader was given (more entries than it has elements, or
    an index past its end): the log is of another op sequence than the one being replayed."""


# --- order-preserving keys of FP32 values ------------------------------------------------------


def key32(values: np.ndarray) -> np.ndarray:
    """Order-preserving unsigned keys (uint32, same shape) of FP32 ``values``.

    ``key = bits ^ 0x80000000`` for a clear sign bit, ``~bits`` for a set one: keys increase with the
    value, -0 and +0 are adjacent (0x7FFFFFFF, 0x80000000), and neighbouring FP32 values (including
    across zero, the subnormals and up to the infinities) have neighbouring keys. NaNs get keys beyond
    the infinities'.
    """
    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    return np.where(bits & np.uint32(0x80000000), ~bits, bits ^ np.uint32(0x80000000)).astype(np.uint32)


def from_key32(keys: np.ndarray) -> np.ndarray:
    """FP32 values (float32, same shape) of :func:`key32` keys; the exact inverse."""
    k = np.asarray(keys, dtype=np.uint32)
    bits = np.where(k & np.uint32(0x80000000), k ^ np.uint32(0x80000000), ~k).astype(np.uint32)
    return bits.view(np.float32)


def nearest_with_low16(near: np.ndarray, low: np.ndarray) -> np.ndarray:
    """The FP32 values (float32) whose key is congruent to ``low`` (uint16) mod 2**16 and nearest the key
    of ``near`` (float32, same shape): the value ``v`` itself whenever ``|key32(v) - key32(near)| < 2**15``
    and ``low == key32(v) & 0xFFFF``. Keys past either end of the uint32 range are moved by 2**16 back
    into it (still congruent, within 2**16 of ``near``'s key)."""
    k = key32(near).astype(np.int64)
    d = (np.asarray(low, dtype=np.int64) - k) & 0xFFFF
    d = np.where(d >= 1 << 15, d - (1 << 16), d)
    got = k + d
    got = np.where(got < 0, got + (1 << 16), np.where(got >= _U32_LIMIT, got - (1 << 16), got))
    return from_key32(got.astype(np.uint32))


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
        short_indices: int64, shape (k,), strictly increasing, disjoint from ``indices`` and
            ``pinned_indices``: pinned elements whose uncertainty is small enough that the replayer's own
            rounded value names all but the low 16 bits of the value's key (:func:`key32`).
        short_bits: uint16, shape (k,): ``key32(value) & 0xFFFF`` for ``short_indices``; the replayer
            takes the key congruent to it nearest its own value's (:func:`nearest_with_low16`).
    """

    op: int
    indices: np.ndarray
    up: np.ndarray
    pinned_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pinned_values: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    short_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    short_bits: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint16))

    def last_index(self) -> int:
        """The largest element index of any kind of entry, -1 when there are none (each kind's indices are
        strictly increasing, so it is one of their last)."""
        return max(
            (int(a[-1]) for a in (self.indices, self.pinned_indices, self.short_indices) if len(a)),
            default=-1,
        )

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
            and np.array_equal(self.short_indices, other.short_indices)
            and np.array_equal(self.short_bits, other.short_bits)
        )


def dense_reference_bytes(n_rounded_elements: int) -> int:
    """Bytes of the reference dense encoding: one base-3 digit per rounded element, 5 per byte."""
    if n_rounded_elements < 0:
        raise ValueError(f"n_rounded_elements must be >= 0, got {n_rounded_elements}")
    return -(-n_rounded_elements // 5)


# --- writer ------------------------------------------------------------------------------------


def _check_version(version: object) -> None:
    """Raise ValueError unless ``version`` is a format version this detrl writes (:data:`READABLE_VERSIONS`)."""
    if version not in READABLE_VERSIONS:
        raise ValueError(f"roundlog format version {version!r}: this detrl writes {READABLE_VERSIONS}")


def _check_uint(name: str, value: object, limit: int) -> int:
    """Return ``value`` as a Python int in [0, limit) or raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    v = int(value)
    if not 0 <= v < limit:
        raise ValueError(f"{name} must be in [0, {limit}), got {v}")
    return v


def _deltas(idx: np.ndarray) -> np.ndarray:
    """The delta code of int64 indices (n,): the first absolute, then each minus the one before."""
    deltas = np.empty(idx.size, dtype=np.int64)
    if idx.size:
        deltas[0] = idx[0]
        np.subtract(idx[1:], idx[:-1], out=deltas[1:])
    return deltas


def _valid_deltas(idx: object) -> np.ndarray | None:
    """The deltas of ``idx`` when it is what the engine writes, a 1-D int64 array of strictly increasing
    indices >= 0, which its deltas prove; else None (a validator then says what is wrong)."""
    if not (type(idx) is np.ndarray and idx.dtype == np.int64 and idx.ndim == 1 and idx.size < _U32_LIMIT):
        return None
    deltas = _deltas(idx)
    # compared as indices, not as deltas: an int64 delta wraps past 2**63 ([0, 2**62, -2**63])
    return deltas if not idx.size or (idx[0] >= 0 and bool((idx[1:] > idx[:-1]).all())) else None


def _validated_arrays(e: OpEntries) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (indices int64 (n,), up bool (n,), their deltas) of ``e`` after validating them; raise
    ValueError."""
    deltas = _valid_deltas(e.indices)
    up = e.up
    if deltas is not None and type(up) is np.ndarray and up.dtype == np.bool_ and up.shape == e.indices.shape:
        return e.indices, up, deltas
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
    idx = idx.astype(np.int64, copy=False)
    return idx, up.astype(bool, copy=False), _deltas(idx)


def _planes(deltas: np.ndarray, width: int) -> bytes:
    # Byte planes: all lowest bytes, then all second bytes, ... The high planes of small deltas are
    # mostly zero, which zstd compresses far better than interleaved words (about 15 % smaller logs).
    return deltas.astype("<u4" if width == 4 else "<u8").view(np.uint8).reshape(-1, width).T.tobytes()


def _validated_values(
    e: OpEntries,
    what: str,
    fields: tuple[str, str],
    dtype: type,
    dtype_text: str,
    others: tuple[tuple[str, np.ndarray], ...],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return the indices (int64), values (``dtype``) and index deltas of ``e``'s entries of one value kind
    after validating them: ``fields`` names their two attributes, ``what`` the kind (``"pinned"``,
    ``"short"``); ``others`` are ``(entry kind, indices)`` the indices must be disjoint from."""
    idx_name, val_name = fields
    kidx, vals = getattr(e, idx_name), getattr(e, val_name)
    arrays = type(kidx) is np.ndarray and type(vals) is np.ndarray
    if arrays and kidx.size == 0 == vals.size and kidx.ndim == 1 == vals.ndim:  # none, the usual case
        return kidx.astype(np.int64, copy=False), vals.astype(dtype, copy=False), _deltas(kidx[:0])
    kidx, vals = np.asarray(kidx), np.asarray(vals)
    if kidx.ndim != 1 or vals.ndim != 1 or kidx.shape != vals.shape:
        raise ValueError(f"op {e.op}: {idx_name} and {val_name} must be 1-D and of equal length")
    if kidx.size:
        if kidx.dtype.kind not in "iu" or vals.dtype != dtype:
            raise ValueError(f"op {e.op}: {what} indices must be integers and {dtype_text}")
        if int(kidx.min()) < 0 or int(kidx.max()) >= _I64_LIMIT or kidx.size >= _U32_LIMIT:
            raise ValueError(f"op {e.op}: {what} indices must be in [0, 2**63)")
        kidx = kidx.astype(np.int64, copy=False)
        if kidx.size > 1 and not np.all(kidx[1:] > kidx[:-1]):
            raise ValueError(f"op {e.op}: {what} indices must be strictly increasing")
        entry = "pinned value" if what == "pinned" else "short pinned value"
        for other_kind, other in others:
            if np.intersect1d(kidx, other, assume_unique=True).size:
                raise ValueError(f"op {e.op}: an element cannot have both a {other_kind} and a {entry}")
    kidx = kidx.astype(np.int64, copy=False)
    return kidx, vals.astype(dtype, copy=False), _deltas(kidx)


def _validated_pinned(e: OpEntries, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (pinned indices int64 (m,), values float32 (m,), index deltas) of ``e`` after validating
    them."""
    fields = ("pinned_indices", "pinned_values")
    return _validated_values(e, "pinned", fields, np.float32, "values float32", (("direction", idx),))


def _validated_short(
    e: OpEntries, idx: np.ndarray, pidx: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (short indices int64 (k,), low key bits uint16 (k,), index deltas) of ``e`` after validating
    them."""
    fields, others = ("short_indices", "short_bits"), (("direction", idx), ("pinned", pidx))
    return _validated_values(e, "short", fields, np.uint16, "short bits uint16", others)


def _payload(payload: np.ndarray, kind: int) -> tuple[bytes, int]:
    """A record's payload bytes and the flag its kind byte carries: packed direction bits (MSB first), FP32
    values in 4 byte planes (pinned, 0x80) or the low 16 key bits in 2 byte planes (short, 0x40)."""
    if kind == _PINNED:
        return np.asarray(payload, dtype="<f4").view(np.uint8).reshape(-1, 4).T.tobytes(), PINNED_FLAG
    if kind == _SHORT:
        return np.asarray(payload, dtype="<u2").view(np.uint8).reshape(-1, 2).T.tobytes(), SHORT_FLAG
    return np.packbits(payload).tobytes(), 0  # MSB-first, zero padding bits


def _encode_record_v3(op: int, deltas: np.ndarray, payload: np.ndarray, kind: int) -> bytes:
    """One version-3 record: header, delta-coded indices (``deltas``: the first absolute; all >= 0 after
    validation) in 4 or 8 byte planes, then the payload (:func:`_payload`)."""
    width = 4 if int(deltas.max()) < _U32_LIMIT else 8
    tail, flag = _payload(payload, kind)
    return RECORD_HEADER_V3.pack(op, deltas.size, width | flag) + _planes(deltas, width) + tail


def rice_parameter(gaps: np.ndarray) -> int:
    """The Rice parameter k of a record's gaps (uint64, shape (n,), each < 2**63): the smallest k that
    minimises its code's length in bits, ``n * (k + 1) + sum(gaps >> k)``.

    That length is convex in k: from k to k + 1 it changes by ``n - D(k)``, ``D(k) = S(k) - S(k + 1)`` with
    ``S(k) = sum(gaps >> k)``, and D never grows with k. So k is the first with ``D(k) <= n``; at
    :data:`RICE_MAX` it holds (every gap is below 2**63). The C encoder takes the same k."""
    n, k = gaps.size, 0
    total = int(gaps.sum())  # below 2**63: the gaps of indices below 2**63 add up to less than the last
    while k < RICE_MAX:
        following = int((gaps >> np.uint64(k + 1)).sum())
        if total - following <= n:
            break
        k, total = k + 1, following
    return k


def _rice(gaps: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """The Rice code of ``gaps`` (uint64, shape (n,)) with parameter ``k``: the quotients ``gap >> k`` in
    unary (that many 0 bits, then a 1 bit; MSB first, zero padding) and the remainders' low ``k`` bits
    (each MSB first, packed back to back, zero padding). The unary part is at most 3n bits at the k of
    :func:`rice_parameter` (its quotients add up to at most 2n)."""
    quotients = gaps >> np.uint64(k)
    bits = np.zeros(int(quotients.sum()) + gaps.size, np.uint8)
    bits[np.cumsum(quotients + np.uint64(1)) - np.uint64(1)] = 1
    unary = np.packbits(bits).tobytes()
    if not k:
        return unary, b""
    shifts = np.arange(k - 1, -1, -1, dtype=np.uint64)
    return unary, np.packbits(((gaps[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)).tobytes()


def _encode_record(op: int, deltas: np.ndarray, payload: np.ndarray, kind: int) -> bytes:
    """One version-4 record: header, the Rice code of the index gaps (:func:`_rice`: the first index, then
    each index minus the one before minus 1; ``deltas`` are the version-3 deltas, all >= 0 after
    validation), then the payload (:func:`_payload`). Gaps between the logged elements of an output are
    close to geometric, for which a Rice code is within a few % of the entropy: on a ResNet-50 step it
    takes 14 bits an index where zstd over delta byte planes took 19."""
    gaps = deltas.astype(np.uint64)
    gaps[1:] -= np.uint64(1)
    k = rice_parameter(gaps)
    unary, remainders = _rice(gaps, k)
    tail, flag = _payload(payload, kind)
    return RECORD_HEADER.pack(op, deltas.size, k | flag, len(unary)) + unary + remainders + tail


def segment_compressor(level: int = 3) -> zstandard.ZstdCompressor:
    """The zstd compressor the writer uses at ``level`` (frames declare their content size).

    Raises ValueError for a level above :data:`MAX_LEVEL` (its window could exceed what the reader
    accepts).
    """
    if isinstance(level, bool) or not isinstance(level, int) or level > MAX_LEVEL:
        raise ValueError(f"zstd level must be an integer <= {MAX_LEVEL}, got {level!r}")
    return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)


def encode_segment(
    step: int, ops: Iterable[OpEntries], cctx: zstandard.ZstdCompressor, version: int = FORMAT_VERSION
) -> bytes:
    """The exact bytes of the segment for ``step`` (36-byte header + compressed payload).

    ``ops`` must be in strictly increasing op order; ops with zero entries are dropped. ``cctx``
    should come from :func:`segment_compressor`; with the same level (and ``version``, one of
    :data:`READABLE_VERSIONS`), the result is identical to what :meth:`RoundLogWriter.write_step` writes, so a
    resumed run can compare a re-recorded step with the bytes on disk. Invalid input raises ValueError.
    Pure: writes nothing.
    """
    step = _check_uint("step", step, _U64_LIMIT)
    _check_version(version)
    ops = list(ops)
    encoded = None
    if _segment is not None and NATIVE_RECORDS and all(type(e) is OpEntries for e in ops):
        encoded = _segment.encode_records(ops, version)  # None: not entries as the engine writes them
    # the reference, which says what is wrong with entries the C encoder declined
    raw, n_records = encoded if encoded is not None else _encode_records(ops, version)
    comp = cctx.compress(raw)
    head = SEGMENT_HEADER.pack(SEGMENT_TAG, step, n_records, len(raw), len(comp), 0)[:-4]
    crc = zlib.crc32(comp, zlib.crc32(head))  # covers header fields and compressed payload
    return head + struct.pack("<I", crc) + comp


#: Whether :func:`encode_segment` takes the C encoder where it is built (tests compare it with the Python one).
NATIVE_RECORDS = True


def _encode_records(ops: list[OpEntries], version: int = FORMAT_VERSION) -> tuple[bytes, int]:
    """The payload of a segment, uncompressed, and its number of records: each op's direction, pinned and
    short records (:func:`_encode_record`, or :func:`_encode_record_v3` for ``version`` 3) after validating
    its entries; raises ValueError."""
    encode_record = _encode_record if version == 4 else _encode_record_v3
    records: list[bytes] = []
    prev_op = -1
    for e in ops:
        if not isinstance(e, OpEntries):
            raise ValueError(f"ops must contain OpEntries, got {type(e).__name__}")
        op = _check_uint("op", e.op, _U32_LIMIT)
        if op <= prev_op:
            raise ValueError(f"op positions must be strictly increasing, got {op} after {prev_op}")
        prev_op = op
        idx, up, deltas = _validated_arrays(e)
        pidx, vals, pinned_deltas = _validated_pinned(e, idx)
        sidx, low, short_deltas = _validated_short(e, idx, pidx)
        if idx.size:
            records.append(encode_record(op, deltas, up, _DIRECTION))
        if pidx.size:
            records.append(encode_record(op, pinned_deltas, vals, _PINNED))
        if sidx.size:
            records.append(encode_record(op, short_deltas, low, _SHORT))
    return b"".join(records), len(records)


class RoundLogWriter:
    """Appends one segment per training step to a rounding log.

    The constructor creates (truncates) the file and writes and flushes the file header; each
    :meth:`write_step` writes and flushes one complete segment. A process killed at any point
    therefore leaves a file that :class:`RoundLogReader` reads up to the last complete segment.
    Flushing hands the bytes to the operating system (they survive the process being killed);
    :meth:`sync` also forces them to the disk (they survive a power loss).
    """

    def __init__(self, path: str | os.PathLike, level: int = 3, version: int = FORMAT_VERSION) -> None:
        _check_version(version)
        self._setup(path, level, version)
        self._f = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._write(_FILE_HEADER.pack(FILE_MAGIC, self.version, 0, 0))
        self._f.flush()

    def _setup(self, path: str | os.PathLike, level: int, version: int) -> None:
        self.path = os.fspath(path)
        self._cctx = segment_compressor(level)
        self._f: BinaryIO | None = None
        self._last_step: int | None = None
        self._pos = 0
        #: the format version written: :data:`FORMAT_VERSION`, or the version of the log being continued
        self.version = version

    @classmethod
    def append(
        cls, path: str | os.PathLike, offset: int, last_step: int | None, level: int = 3
    ) -> RoundLogWriter:
        """Reopen an existing log of a version this detrl reads (:data:`READABLE_VERSIONS`) to continue it
        (resuming a run), in that version: a run recorded before a format change resumes as it began.

        The file is truncated to ``offset`` bytes (>= the 16-byte header and <= the file size;
        normally :meth:`RoundLogReader.segment_end` of the last step to keep), and later
        :meth:`write_step` calls must use steps greater than ``last_step`` (None: no constraint,
        for a log with no segment kept). The caller is responsible for ``offset`` lying on a segment
        boundary. With the same ``level``, continuing a truncated file writes the same bytes as an
        uninterrupted run. Raises RoundLogError if the file is not a log of such a version, ValueError for
        a bad offset or step.
        """
        self = cls.__new__(cls)
        self._setup(path, level, FORMAT_VERSION)  # the file's own version once its header is read
        offset = _check_uint("offset", offset, _U64_LIMIT)
        if offset < HEADER_BYTES:
            raise ValueError(f"offset {offset} is inside the {HEADER_BYTES}-byte file header")
        if last_step is not None:
            last_step = _check_uint("last_step", last_step, _U64_LIMIT)
        try:
            f = open(self.path, "r+b")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise RoundLogError(f"roundlog: {self.path}: cannot open: {exc}") from exc
        try:
            head = f.read(HEADER_BYTES)
            fields = _FILE_HEADER.unpack(head) if len(head) == HEADER_BYTES else None
            if (
                fields is None
                or fields[0] != FILE_MAGIC
                or fields[1:] not in [(v, 0, 0) for v in READABLE_VERSIONS]
            ):
                versions = " or ".join(map(str, READABLE_VERSIONS))
                raise RoundLogError(f"roundlog: {self.path}: not a version {versions} rounding log")
            self.version = fields[1]
            size = f.seek(0, os.SEEK_END)
            if offset > size:
                raise ValueError(f"offset {offset} is past the end of the {size}-byte file")
            f.truncate(offset)
            f.seek(offset)
            f.flush()
        except BaseException:
            f.close()
            raise
        self._f, self._pos, self._last_step = f, offset, last_step
        return self

    @property
    def bytes_written(self) -> int:
        """Size of the file in bytes so far (for an appending writer: the kept prefix included)."""
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
        seg = encode_segment(step, ops, self._cctx, self.version)
        self._write(seg)
        self._f.flush()
        self._last_step = step
        return len(seg)

    def sync(self) -> None:
        """Flush and ``os.fsync`` the file, so the segments written so far survive a power loss."""
        if self._f is None:
            raise ValueError(f"roundlog: {self.path}: writer is closed")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        """Flush and close the file (there is nothing to finalise). Idempotent."""
        if self._f is None:
            return
        try:
            self._f.flush()
        finally:
            self._f.close()
            self._f = None

    def __enter__(self) -> RoundLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- reader ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Segment:
    index: int  # position in the file's segment sequence
    offset: int  # byte offset of the segment header
    header: bytes  # the header bytes preceding the crc field (CRC input)
    step: int
    n_ops: int
    raw_len: int
    comp_len: int
    crc: int

    @property
    def end(self) -> int:
        return self.offset + SEGMENT_HEADER.size + self.comp_len


class RoundLogReader:
    """Validating reader for a rounding log, complete or left behind by a killed writer.

    ``source`` is a path or an already-open binary file object (only its ``seek`` and ``read`` are
    used; :meth:`close` closes it). Opening checks the file header, then scans the segments
    back to back: each header must have the tag ``RSEG``, a step greater than the previous one,
    ``raw_len <= max_raw_bytes`` (bytes) and room for its ``n_ops`` records. A file ending inside a
    segment is a *torn tail*: the scan stops there, :attr:`torn_bytes` says how many bytes follow
    the last complete segment, and nothing is raised. Every other defect raises
    :class:`RoundLogError`. Payload checksums and record structure are checked when a step is
    read (:meth:`read_step`, :meth:`cursor`).

    Error messages start with ``roundlog: <path>:`` for a path, and with ``name`` (default
    ``roundlog``) for a file object or when ``name`` is given.

    Attributes:
        steps: the steps with a complete segment, strictly increasing.
        end_of_segments: byte offset just past the last complete segment (16 without segments).
        torn_bytes: bytes after the last complete segment (0 for a cleanly written file).
        path: the path read, or None for a file object.
    """

    def __init__(
        self,
        source: str | os.PathLike | BinaryIO,
        max_raw_bytes: int = 1 << 30,
        name: str | None = None,
    ) -> None:
        self.max_raw_bytes = max_raw_bytes
        self._f: BinaryIO | None = None
        if isinstance(source, (str, os.PathLike)):
            self.path: str | None = os.fspath(source)
            self._label = f"roundlog: {self.path}" if name is None else name
            try:
                self._f = open(self.path, "rb")  # noqa: SIM115 - closed in close()
            except OSError as exc:
                raise self._err(f"cannot open: {exc}") from exc
        else:
            self.path = None
            self._label = "roundlog" if name is None else name
            self._f = source
        try:
            try:
                self._size = self._f.seek(0, os.SEEK_END)
            except (OSError, ValueError) as exc:  # ValueError: a closed file object
                raise self._err(f"cannot seek: {exc}") from exc
            self._segments = self._scan()
        except BaseException:
            self.close()
            raise
        self.steps: list[int] = list(self._segments)
        self._ends = [seg.end for seg in self._segments.values()]

    def _err(self, msg: str) -> RoundLogError:
        return RoundLogError(f"{self._label}: {msg}")

    def _read_at(self, offset: int, n: int, what: str) -> bytes:
        """Read exactly ``n`` bytes at ``offset`` or raise a 'truncated' RoundLogError."""
        if self._f is None:
            raise self._err("reader is closed")
        parts: list[bytes] = []
        got = 0
        try:
            self._f.seek(offset)
            while got < n:  # an unbuffered file object may return short reads
                part = self._f.read(n - got)
                if not part:
                    break
                parts.append(bytes(part))
                got += len(part)
        except (OSError, ValueError) as exc:  # ValueError: the file object was closed
            raise self._err(f"read error in {what} at byte {offset}: {exc}") from exc
        if got != n:
            raise self._err(f"truncated in {what} at byte {offset} (need {n} bytes, got {got})")
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _scan(self) -> dict[int, _Segment]:
        """Validate the file header and the segment headers; return step -> complete segment."""
        if self._size < HEADER_BYTES:
            raise self._err(f"truncated: file is {self._size} bytes, the file header needs {HEADER_BYTES}")
        magic, version, flags, reserved = _FILE_HEADER.unpack(self._read_at(0, HEADER_BYTES, "header"))
        if magic != FILE_MAGIC:
            raise self._err(f"bad magic {magic!r} (not a detrl rounding log)")
        if version not in READABLE_VERSIONS:
            versions = " and ".join(map(str, READABLE_VERSIONS))
            raise self._err(f"unsupported format version {version} (this detrl reads versions {versions})")
        #: the file's format version (one of :data:`READABLE_VERSIONS`)
        self.version: int = version
        if flags != 0 or reserved != 0:
            raise self._err(f"unsupported header flags 0x{flags:04x} / reserved 0x{reserved:08x}")
        segments: dict[int, _Segment] = {}
        offset, prev_step = HEADER_BYTES, -1
        # Fewer bytes left than a segment header: the writer died while writing it (torn tail).
        while self._size - offset >= SEGMENT_HEADER.size:
            i = len(segments)
            raw_head = self._read_at(offset, SEGMENT_HEADER.size, f"segment {i} header")
            tag, step, n_ops, raw_len, comp_len, crc = SEGMENT_HEADER.unpack(raw_head)
            if tag != SEGMENT_TAG:
                raise self._err(f"segment {i}: bad segment tag {tag!r} at byte {offset}")
            if step <= prev_step:
                raise self._err(f"segment {i}: step {step} not greater than previous step {prev_step}")
            if raw_len > self.max_raw_bytes:
                raise self._err(
                    f"segment {i} (step {step}): raw length {raw_len} exceeds limit {self.max_raw_bytes}"
                )
            if n_ops * _MIN_RECORD_BYTES[version] > raw_len:
                raise self._err(
                    f"segment {i} (step {step}): {n_ops} op records cannot fit in {raw_len} bytes"
                )
            if comp_len > self._size - offset - SEGMENT_HEADER.size:
                break  # the payload runs past the end of the file: torn tail
            seg = _Segment(i, offset, raw_head[:-4], step, n_ops, raw_len, comp_len, crc)
            segments[step] = seg
            offset, prev_step = seg.end, step
        self.end_of_segments: int = offset
        self.torn_bytes: int = self._size - offset
        return segments

    def segment_bytes(self, step: int) -> int:
        """Size in bytes of ``step``'s segment, header included (0 if the step has no segment)."""
        seg = self._segments.get(step)
        return 0 if seg is None else SEGMENT_HEADER.size + seg.comp_len

    def segment_end(self, step: int) -> int:
        """Byte offset just past the last complete segment whose step is <= ``step``.

        This is where a log resumed after ``step`` continues (see :meth:`RoundLogWriter.append`);
        it is the 16-byte header size when no segment has a step <= ``step``.
        """
        k = bisect.bisect_right(self.steps, step)
        return self._ends[k - 1] if k else HEADER_BYTES

    def raw_bytes(self, offset: int, length: int) -> bytes:
        """The file's bytes ``offset .. offset + length`` (bounded by the complete segments): a resumed
        recording compares the segments it re-records with these."""
        if offset < 0 or length < 0 or offset + length > self.end_of_segments:
            raise self._err(f"byte range {offset}+{length} outside the complete segments")
        return self._read_at(offset, length, "segments")

    def cursor(self, step: int) -> StepCursor:
        """A streaming decoder for ``step``'s segment (one with no records if it has none).

        Checks the segment's checksum and zstd frame structure first, reading the compressed
        payload in chunks of at most 1 MiB. See :class:`StepCursor`.
        """
        return StepCursor(self, self._segments.get(step), step)

    def read_step(self, step: int, max_entries: int = DEFAULT_MAX_ENTRIES) -> dict[int, OpEntries]:
        """Return op position -> entries for ``step`` ({} if the step has no segment).

        Decodes every record with the same checks as :class:`StepCursor` (checksum, frame,
        decompressed length, record structure) but without an op output size to bound it; instead
        a record of more than ``max_entries`` entries is refused before anything is allocated for
        it. Memory: the returned arrays (up to 12 bytes per entry, whatever its kind) plus the
        cursor's constant.
        """
        with self.cursor(step) as cur:
            out: dict[int, OpEntries] = {}
            while (head := cur._peek()) is not None:
                e = cur._take_group(head, None, max_entries)
                out[e.op] = e
            cur.finish()
        return out

    def close(self) -> None:
        """Close the file (also a file object passed in). Idempotent."""
        if self._f is not None:
            f, self._f = self._f, None
            f.close()

    def __enter__(self) -> RoundLogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Span:
    """``read()`` over bytes [start, start + length) of the reader's file, seeking on every call,
    so that several cursors (and read_step) can share one file object."""

    def __init__(self, reader: RoundLogReader, start: int, length: int, what: str) -> None:
        self._reader, self._pos, self.remaining, self._what = reader, start, length, what

    def read(self, n: int = -1) -> bytes:
        n = self.remaining if n < 0 else min(n, self.remaining)
        if n == 0:
            return b""
        data = self._reader._read_at(self._pos, n, self._what)
        self._pos += n
        self.remaining -= n
        return data


class _FrameWalk:
    """Finds where one zstd frame ends from its block headers (RFC 8878, section 3.1.1), fed the
    compressed payload in order, without decompressing. The streaming decompressor does not say
    how much input it consumed, so this is how trailing data after the frame is detected."""

    def __init__(self) -> None:
        self.fed = 0  # payload bytes fed so far
        self.problem: str | None = None
        self.params: zstandard.FrameParameters | None = None
        self.end: int | None = None  # payload offset just past the frame, once known
        self._next = 0  # payload offset of the next block header
        self._carry = b""  # the first bytes of a block header split between two chunks

    def feed(self, chunk: bytes) -> None:
        base = self.fed - len(self._carry)  # payload offset of data[0]
        data = self._carry + chunk if self._carry else chunk
        self.fed += len(chunk)
        self._carry = b""
        if self.problem is not None or self.end is not None:
            return
        if self.params is None:  # the first chunk holds the whole frame header (or the whole payload)
            if data[:4] != _ZSTD_MAGIC:
                self.problem = (
                    f"payload is not a zstd frame (starts with {bytes(data[:4]).hex() or 'nothing'})"
                )
                return
            try:
                head = bytes(data[:_ZSTD_HEADER_MAX])
                self.params = zstandard.get_frame_parameters(head)
                self._next = zstandard.frame_header_size(head)
            except zstandard.ZstdError as exc:
                self.problem = f"bad zstd frame header: {exc}"
                return
        while True:
            off = self._next - base
            if off + 3 > len(data):
                if off < len(data):
                    self._carry = bytes(data[off:])
                return
            h = int.from_bytes(data[off : off + 3], "little")
            btype, bsize = (h >> 1) & 3, h >> 3
            if btype == 3:
                self.problem = f"reserved zstd block type at payload byte {self._next}"
                return
            if bsize > _ZSTD_BLOCK_MAX:
                self.problem = f"zstd block of {bsize} bytes at payload byte {self._next} exceeds 128 KiB"
                return
            self._next += 3 + (1 if btype == 1 else bsize)  # an RLE block stores its byte once
            if h & 1:  # last block; an optional 4-byte content checksum follows
                self.end = self._next + (4 if self.params.has_checksum else 0)
                return

    def result(self, comp_len: int) -> str | None:
        """None if the fed payload of ``comp_len`` bytes is exactly one frame, else the problem."""
        if self.problem is not None:
            return self.problem
        if self.end is None or self.end > comp_len:
            return "payload is not exactly one complete zstd frame (the frame is cut short)"
        if self.end < comp_len:
            return f"payload is not exactly one complete zstd frame ({comp_len - self.end} bytes after it)"
        return None


@dataclass(frozen=True)
class _Head:
    """A record header read from the payload (its body not yet read)."""

    r: int  # record number within the segment
    op: int
    count: int
    width: int  # version 3: bytes per delta, 4 or 8; version 4: the Rice parameter k
    kind: int  # _DIRECTION, _PINNED or _SHORT
    body: int  # bytes of the index code and the payload after the header
    unary: int = 0  # version 4: bytes of the unary code (the quotients)


class StepCursor:
    """Streaming, memory-bounded decoder of one step's segment; get one from
    :meth:`RoundLogReader.cursor`.

    A replayer asks for each op position in increasing order with :meth:`take`, giving the op
    output's element count; records for op positions it never asks for are read in bounded chunks
    and discarded (counted in :attr:`skipped_records`). :meth:`finish` then checks the rest of the
    segment. The payload is decompressed incrementally; nothing is allocated from a length in the
    file before that length has been checked against the op output size.

    Memory bound: one :meth:`take` allocates at most 12 bytes per element of the op output
    (``numel``): an int64 index plus a direction bit in a byte, an int64 index plus an FP32 value,
    or an int64 index plus 16 key bits, for each logged element, and the entries of one op (all
    three kinds together) are disjoint indices < ``numel``.
    On top of that, a cursor holds a constant of at most about 10 MiB (the zstd window, at most
    :data:`MAX_WINDOW_BYTES` = 8 MiB, plus chunk buffers of 1 MiB or less).

    Attributes:
        step: the training step.
        skipped_records: records read and discarded because no :meth:`take` asked for their op.
        first_skipped_op: the op position of the first of those (None while there is none).
    """

    def __init__(self, reader: RoundLogReader, seg: _Segment | None, step: int) -> None:
        self.step = step
        self.skipped_records = 0
        self.first_skipped_op: int | None = None
        self._reader = reader
        self._seg = seg
        self._n_ops = 0 if seg is None else seg.n_ops
        self._raw_len = 0 if seg is None else seg.raw_len
        self._where = "" if seg is None else f"segment {seg.index} (step {step})"
        self._raw_pos = 0  # decompressed bytes consumed
        self._records = 0  # record headers read
        self._prev: tuple[int, int] = (-1, _SHORT)  # (op, kind) of the previous record
        self._pending: _Head | None = None  # a record header read but whose body is not
        self._last_take = -1
        self._zr: zstandard.ZstdDecompressionReader | None = None
        self._scratch: np.ndarray | None = None
        self._done = False
        if seg is not None:
            self._open()

    def _err(self, msg: str) -> RoundLogError:
        return self._reader._err(f"{self._where}: {msg}")

    def _misfit(self, msg: str) -> RoundLogMisfit:
        return RoundLogMisfit(str(self._err(msg)))

    def _open(self) -> None:
        """Check the payload's CRC and frame structure, then start the decompressor."""
        seg = self._seg
        assert seg is not None
        start, what = seg.offset + SEGMENT_HEADER.size, f"{self._where} payload"
        crc, walk, pos = zlib.crc32(seg.header), _FrameWalk(), 0
        while pos < seg.comp_len:  # comp_len fits in the file (checked by the scan)
            chunk = self._reader._read_at(start + pos, min(_IO_CHUNK, seg.comp_len - pos), what)
            crc = zlib.crc32(chunk, crc)
            walk.feed(chunk)
            pos += len(chunk)
        if crc != seg.crc:
            raise self._err("checksum mismatch")
        if walk.params is None:
            raise self._err(walk.result(seg.comp_len) or "payload is not a zstd frame")
        declared = walk.params.content_size
        if declared != seg.raw_len:
            shown = "no content size" if declared == zstandard.CONTENTSIZE_UNKNOWN else f"{declared} bytes"
            raise self._err(f"zstd frame declares {shown}, header says {seg.raw_len}")
        if walk.params.dict_id != 0:
            raise self._err(f"zstd frame needs dictionary {walk.params.dict_id}")
        if walk.params.window_size > MAX_WINDOW_BYTES:
            raise self._err(
                f"zstd window of {walk.params.window_size} bytes exceeds the limit of {MAX_WINDOW_BYTES}"
            )
        problem = walk.result(seg.comp_len)
        if problem is not None:
            raise self._err(problem)
        self._span = _Span(self._reader, start, seg.comp_len, what)
        # A decompressor per cursor: a stream reader holds its decompressor's state while open.
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)
        self._zr = dctx.stream_reader(self._span, read_size=1 << 17, read_across_frames=False, closefd=False)

    # -- decompressed input ----------------------------------------------------------------------

    def _readinto(self, buf: memoryview) -> None:
        """Fill ``buf`` with the next decompressed bytes (the caller checked they are within raw_len)."""
        if self._zr is None:
            raise ValueError(f"cursor for step {self.step} is closed")
        got, n = 0, len(buf)
        while got < n:
            try:
                k = self._zr.readinto(buf[got:])
            except zstandard.ZstdError as exc:
                raise self._err(f"zstd decompression failed: {exc}") from exc
            if not k:
                raise self._err(f"decompressed to {self._raw_pos + got} bytes, header says {self._raw_len}")
            got += k
        self._raw_pos += n

    def _chunk(self, n: int) -> np.ndarray:
        """The next ``n`` <= 1 MiB decompressed bytes, as a view of a reused uint8 buffer."""
        if self._scratch is None:
            self._scratch = np.empty(_IO_CHUNK, np.uint8)
        view = self._scratch[:n]
        self._readinto(memoryview(view))
        return view

    # -- records ---------------------------------------------------------------------------------

    def _peek(self) -> _Head | None:
        """The next record's header (read and checked once), or None after the last record."""
        if self._pending is not None or self._records == self._n_ops:
            return self._pending
        r = self._records
        v4 = self._reader.version == 4
        header = RECORD_HEADER if v4 else RECORD_HEADER_V3
        if self._raw_pos + header.size > self._raw_len:
            raise self._err(f"record {r} header overruns the payload at byte {self._raw_pos}")
        buf = bytearray(header.size)
        self._readinto(memoryview(buf))
        op, count, kind_byte, *rest = header.unpack(buf)
        width = kind_byte & ~(PINNED_FLAG | SHORT_FLAG)
        rec = f"record {r} (op {op})"
        if kind_byte & PINNED_FLAG and kind_byte & SHORT_FLAG:
            what = "kind" if v4 else "width"
            raise self._err(f"{rec}: {what} byte 0x{kind_byte:02x} flags both pinned and short")
        kind = _PINNED if kind_byte & PINNED_FLAG else _SHORT if kind_byte & SHORT_FLAG else _DIRECTION
        # Ops increase; an op's records come in the order direction, pinned, short (each optional).
        prev_op, prev_kind = self._prev
        if op < prev_op or (op == prev_op and kind <= prev_kind):
            order = ""
            if op == prev_op:
                order = f" ({_KIND_NAMES[kind]} record after its {_KIND_NAMES[prev_kind]} record;"
                order += " an op's records come in the order direction, pinned, short)"
            raise self._err(f"{rec}: op not greater than previous op {prev_op}{order}")
        if count == 0:
            raise self._err(f"{rec}: empty record")
        payload = ((count + 7) // 8, 4 * count, 2 * count)[kind]
        unary = 0
        if v4:
            (unary,) = rest
            if width > RICE_MAX:
                raise self._err(f"{rec}: Rice parameter {width} above {RICE_MAX}")
            if unary * 8 < count:  # a one bit ends each of count quotients
                raise self._err(f"{rec}: {unary} bytes of unary code cannot hold {count} quotients")
            body = unary + (count * width + 7) // 8 + payload
        else:
            if width not in (4, 8):
                raise self._err(f"{rec}: index width {width}, expected 4 or 8")
            body = count * width + payload
        if self._raw_pos + body > self._raw_len:
            raise self._err(f"{rec}: {count} entries overrun the payload")
        self._records += 1
        self._prev = (op, kind)
        self._pending = _Head(r, op, count, width, kind, body, unary)
        return self._pending

    def _skip(self, head: _Head) -> None:
        """Read and discard ``head``'s body in bounded chunks."""
        left = head.body
        while left:
            n = min(left, _IO_CHUNK)
            self._chunk(n)
            left -= n
        self._pending = None
        if self.first_skipped_op is None:
            self.first_skipped_op = head.op
        self.skipped_records += 1

    def _planes(self, count: int, n_planes: int, acc: np.ndarray) -> bool:
        """OR ``n_planes`` byte planes of ``count`` bytes into ``acc`` (uint, shape (count,));
        return whether any byte of planes 4 and up is nonzero."""
        high = False
        for b in range(n_planes):
            shift = acc.dtype.type(8 * b)
            for i in range(0, count, _ELEM_CHUNK):
                chunk = self._chunk(min(_ELEM_CHUNK, count - i))
                if b >= 4 and not high:
                    high = bool(chunk.any())
                acc[i : i + chunk.size] |= chunk.astype(acc.dtype) << shift
        return high

    def _rice(self, head: _Head, acc: np.ndarray) -> None:
        """Read ``head``'s Rice code (version 4) into ``acc`` (uint64, shape (count,)) as version 3's deltas:
        the first index, then each index minus the one before (gap + 1), each below 2**63 + 1.

        The unary code is read in chunks of :data:`_UNARY_CHUNK` bytes (its bits and one bits' positions are
        the temporaries); it must hold exactly ``count`` one bits, the last in its last byte, with zero bits
        after it. The remainders are read :data:`_RICE_CHUNK` entries at a time (a whole number of bytes,
        their bits under 0.5 MiB); their padding bits must be zero."""
        rec, count, k = f"record {head.r} (op {head.op})", head.count, head.width
        filled, last_one = 0, -1  # quotients read; bit position of the one bit that ended the last
        for start in range(0, head.unary, _UNARY_CHUNK):
            ones = np.flatnonzero(np.unpackbits(self._chunk(min(_UNARY_CHUNK, head.unary - start))))
            if filled + ones.size > count:
                raise self._err(f"{rec}: unary code holds more than {count} quotients")
            ones += 8 * start
            quotients = acc[filled : filled + ones.size]
            quotients[:] = ones
            quotients[1:] -= ones[:-1].astype(np.uint64) + np.uint64(1)
            if ones.size:
                quotients[0] -= np.uint64(last_one + 1)
                last_one = int(ones[-1])
            filled += ones.size
        if filled != count:
            raise self._err(f"{rec}: unary code holds {filled} quotients, not {count}")
        if last_one < 8 * (head.unary - 1):
            raise self._err(f"{rec}: unary code runs past its last quotient")
        # a gap (quotient << k | remainder) below 2**63: the quotient below 2**(63 - k)
        if int(acc.max()) >> (63 - k):
            raise self._err(f"{rec}: index exceeds 2**63 - 1")
        acc <<= np.uint64(k)
        if k:
            weights = np.uint64(1) << np.arange(k - 1, -1, -1, dtype=np.uint64)
            for i in range(0, count, _RICE_CHUNK):
                n = min(_RICE_CHUNK, count - i)
                packed = self._chunk((n * k + 7) // 8)
                if (n * k) % 8 and int(packed[-1]) & ((1 << (8 - (n * k) % 8)) - 1):
                    raise self._err(f"{rec}: nonzero padding bits after the remainders")
                bits = np.unpackbits(packed, count=n * k).reshape(n, k)
                acc[i : i + n] |= bits @ weights
        acc[1:] += np.uint64(1)  # gaps back to deltas

    def _indices(
        self, head: _Head, numel: int | None, taken: int, max_entries: int, before: str = ""
    ) -> np.ndarray:
        """Read ``head``'s delta-coded indices: int64, shape (count,), strictly increasing, < numel.

        ``taken`` entries of the same op were already read (its earlier records, of the kinds named
        in ``before``); the count is checked against ``max_entries`` and ``numel - taken`` before
        anything is allocated.
        """
        rec = f"record {head.r} (op {head.op})"
        count = head.count
        if count > max_entries:
            raise self._err(f"{rec}: {count} entries exceed the limit of {max_entries} per record")
        if numel is not None and count > numel - taken:
            also = f" plus {taken} {before} entries" if taken else ""
            raise self._misfit(f"{rec}: {count} entries{also} exceed the op output's {numel} elements")
        acc = np.zeros(count, np.uint64)
        if self._reader.version == 4:
            self._rice(head, acc)
        else:
            high = self._planes(count, head.width, acc)
            if head.width == 8 and not high:
                raise self._err(f"{rec}: non-canonical index width 8 (all deltas fit in 4 bytes)")
        # uint64 cumsum wraps on overflow; since each delta < 2**64, a wrap shows up as a
        # decrease, so the strict-increase check also rejects overflow. In place: no copy.
        np.cumsum(acc, out=acc)
        for i in range(0, count - 1, _ELEM_CHUNK):
            a = acc[i : i + _ELEM_CHUNK + 1]
            if not np.all(a[1:] > a[:-1]):
                raise self._err(f"{rec}: indices not strictly increasing (zero delta or overflow)")
        last = int(acc[-1])
        if last >= _I64_LIMIT:
            raise self._err(f"{rec}: index {last} exceeds 2**63 - 1")
        if numel is not None and last >= numel:
            raise self._misfit(f"{rec}: index {last} is outside the op output's {numel} elements")
        return acc.view(np.int64)

    def _take_group(self, head: _Head, numel: int | None, max_entries: int) -> OpEntries:
        """Read the direction, pinned and short records of ``head.op`` (each optional, in that order;
        head is the pending record). All of the op's entries together are checked against ``numel``
        and must be disjoint."""
        op = head.op
        got: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        taken = 0
        while True:
            rec = f"record {head.r} (op {op})"
            before = " and ".join(_KIND_NAMES[k] for k in got)
            idx = self._indices(head, numel, taken, max_entries, before)
            if head.kind == _DIRECTION:
                packed = np.empty((head.count + 7) // 8, np.uint8)
                self._readinto(memoryview(packed))
                self._pending = None
                if head.count % 8 and int(packed[-1]) & ((1 << (8 - head.count % 8)) - 1):
                    raise self._err(f"{rec}: nonzero padding bits in direction bytes")
                payload = np.unpackbits(packed, count=head.count).view(bool)
                del packed
            elif head.kind == _PINNED:
                bits = np.zeros(head.count, np.uint32)
                self._planes(head.count, 4, bits)
                self._pending = None
                payload = bits.view(np.float32)
            else:
                low = np.zeros(head.count, np.uint16)
                self._planes(head.count, 2, low)
                self._pending = None
                payload = low
            for k, (other, _) in got.items():  # disjointness; chunked searchsorted keeps temporaries small
                for i in range(0, idx.size, _ELEM_CHUNK):
                    p = idx[i : i + _ELEM_CHUNK]
                    at = np.minimum(np.searchsorted(other, p), other.size - 1)
                    if np.any(other[at] == p):
                        what = "pinned" if head.kind == _PINNED else "short pinned"
                        raise self._err(f"{rec}: a {what} element also has a {_KIND_NAMES[k]} entry")
            got[head.kind] = (idx, payload)
            taken += head.count
            nxt = self._peek()
            if nxt is None or nxt.op != op:
                break
            head = nxt  # a later record of the op (the order check in _peek allows nothing else)
        empty = (np.zeros(0, np.int64),)
        idx, up = got.get(_DIRECTION, (*empty, np.zeros(0, bool)))
        pidx, values = got.get(_PINNED, (*empty, np.zeros(0, np.float32)))
        sidx, low = got.get(_SHORT, (*empty, np.zeros(0, np.uint16)))
        return OpEntries(
            op=op,
            indices=idx,
            up=up,
            pinned_indices=pidx,
            pinned_values=values,
            short_indices=sidx,
            short_bits=low,
        )

    # -- public API ------------------------------------------------------------------------------

    def take(self, op: int, numel: int) -> OpEntries | None:
        """The entries logged for op position ``op``, whose output has ``numel`` elements.

        Returns the op's direction, pinned and short entries exactly as
        :meth:`RoundLogReader.read_step` would, or None if the step logged nothing for ``op``. Ops
        must be asked in strictly increasing order (ValueError otherwise); records of smaller ops not
        asked for are skipped. More entries than ``numel`` (the op's records together), or an index
        >= ``numel``, raises RoundLogError; the count is checked before allocating. After a
        RoundLogError the cursor is closed (further calls raise ValueError).
        """
        if self._done:
            raise ValueError(f"cursor for step {self.step} is finished or closed")
        op = _check_uint("op", op, _U32_LIMIT)
        numel = _check_uint("numel", numel, _I64_LIMIT)
        if op <= self._last_take:
            raise ValueError(f"ops must be taken in increasing order, got {op} after {self._last_take}")
        self._last_take = op
        try:
            while (head := self._peek()) is not None and head.op < op:
                self._skip(head)
            if head is None or head.op > op:
                return None
            # No cap but numel: a record's count is a u32, so _U32_LIMIT never refuses one.
            return self._take_group(head, numel, _U32_LIMIT)
        except RoundLogError:
            self.close()  # the stream is mid-record now; nothing after this can be trusted
            raise

    def finish(self) -> None:
        """Check the rest of the segment, then close the cursor.

        Records not yet taken are skipped (counted in :attr:`skipped_records`; their headers must
        still be well-formed). Then exactly ``n_ops`` records must have consumed exactly
        ``raw_len`` decompressed bytes, and the zstd frame must end there, complete. Raises
        RoundLogError otherwise. The cursor is closed afterwards either way; calling finish again
        does nothing.
        """
        if self._done:
            return
        try:
            self._finish()
        finally:
            self.close()

    def _finish(self) -> None:
        while (head := self._peek()) is not None:
            self._skip(head)
        if self._zr is not None:
            if self._raw_pos != self._raw_len:
                raise self._err(f"{self._raw_len - self._raw_pos} trailing bytes after {self._n_ops} records")
            extra = bytearray(1)
            try:
                more = self._zr.readinto(extra)
            except zstandard.ZstdError as exc:
                raise self._err(f"zstd decompression failed: {exc}") from exc
            if more:
                raise self._err(f"zstd frame decompresses to more than {self._raw_len} bytes")
            if self._span.remaining:
                raise self._err("payload is not exactly one complete zstd frame")

    def close(self) -> None:
        """Release the decompressor without checking the rest. Idempotent."""
        self._done = True
        self._scratch = None
        if self._zr is not None:
            zr, self._zr = self._zr, None
            zr.close()

    def __enter__(self) -> StepCursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
