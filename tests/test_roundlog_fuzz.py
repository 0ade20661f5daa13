"""Property tests for detrl.formats.roundlog on untrusted bytes.

Whatever a rounding log file holds (flipped bits, cuts, random bytes, huge lengths in headers,
forged payloads behind valid checksums, damaged zstd frames), opening it and reading every step,
with :meth:`RoundLogReader.read_step` and with a :class:`StepCursor`, either succeeds or raises
:class:`RoundLogError`; nothing else. When both ways succeed they agree.

:func:`exercise` and :func:`run_fuzz` are a reusable fuzz driver (plain numpy randomness, no
hypothesis), e.g. for a benchmark: ``run_fuzz(n_cases=10_000, seed=0)``.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from detrl.formats.roundlog import (
    FORMAT_VERSION,
    OpEntries,
    RoundLogError,
    RoundLogReader,
    encode_segment,
    segment_compressor,
)

HEADER = struct.Struct("<8sHHI")
SEG = struct.Struct("<4sQIQQI")
NUMEL = 1 << 21  # every op output is this large; the base logs' indices are < 2**20
TAKE_OPS = range(12)  # the cursor asks for these op positions (the base logs use ops < 12)
FILE_HEADER = HEADER.pack(b"DTRLRLOG", FORMAT_VERSION, 0, 0)
HUGE = [0, 1, 13, 14, 255, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40, (1 << 63) - 1]
HUGE += [1 << 63, (1 << 64) - 1]


# --- base logs -----------------------------------------------------------------------------------


def _random_ops(rng: np.random.Generator) -> list[OpEntries]:
    ops = []
    for op in np.sort(rng.choice(12, size=int(rng.integers(0, 5)), replace=False)):
        n = int(rng.integers(1, 40))
        idx = np.sort(rng.choice(1 << 20, size=n, replace=False)).astype(np.int64)
        # each element a direction, a pinned value or a short pinned value (any of the three may be absent)
        kind = rng.choice(3, size=n, p=[0.5, 0.25, 0.25] if rng.random() < 0.5 else [1.0, 0.0, 0.0])
        if rng.random() < 0.2:
            kind[:] = rng.integers(0, 3)  # an op with one kind only
        which, short = kind == 1, kind == 2
        ops.append(
            OpEntries(
                int(op),
                idx[kind == 0],
                rng.random(int((kind == 0).sum())) < 0.5,
                pinned_indices=idx[which],
                pinned_values=rng.standard_normal(int(which.sum())).astype(np.float32),
                short_indices=idx[short],
                short_bits=rng.integers(0, 1 << 16, size=int(short.sum())).astype(np.uint16),
            )
        )
    return ops


def base_log(seed: int) -> tuple[bytes, list[int]]:
    """A valid log of a few small steps, and the byte offsets where its segments start."""
    rng = np.random.default_rng(seed)
    cctx = segment_compressor(3)
    data, starts = bytearray(FILE_HEADER), []
    for step in np.sort(rng.choice(50, size=int(rng.integers(1, 5)), replace=False)):
        starts.append(len(data))
        data += encode_segment(int(step), _random_ops(rng), cctx)
    return bytes(data), starts


BASES = [base_log(seed) for seed in range(6)]


def with_crc(seg: bytes | bytearray) -> bytes:
    """``seg`` (a segment) with its CRC recomputed, so that a forgery reaches the deeper checks."""
    head = bytes(seg[:32])
    return head + struct.pack("<I", zlib.crc32(bytes(seg[36:]), zlib.crc32(head))) + bytes(seg[36:])


def payload_segment(step: int, n_ops: int, raw: bytes, raw_len: int | None = None) -> bytes:
    comp = zstandard.ZstdCompressor(level=1).compress(raw)
    return with_crc(
        SEG.pack(b"RSEG", step, n_ops, len(raw) if raw_len is None else raw_len, len(comp), 0) + comp
    )


# --- driver --------------------------------------------------------------------------------------


def exercise(data: bytes) -> str:
    """Open ``data`` as a log and read every step both ways; return the outcome.

    Outcomes: ``"rejected"`` (RoundLogError on open), ``"step-error"`` (some step raised
    RoundLogError), ``"torn"`` (readable, with a torn tail), ``"ok"``. Any other exception
    propagates, and so does an AssertionError when read_step and a cursor disagree.
    """
    try:
        reader = RoundLogReader(io.BytesIO(data))
    except RoundLogError:
        return "rejected"
    failed = False
    with reader as r:
        assert r.end_of_segments + r.torn_bytes == len(data)
        for step in r.steps:
            try:
                full: dict[int, OpEntries] | None = r.read_step(step)
            except RoundLogError:
                full, failed = None, True
            try:
                with r.cursor(step) as c:
                    got = {op: e for op in TAKE_OPS if (e := c.take(op, NUMEL)) is not None}
                    c.finish()
            except RoundLogError:
                failed = True
                continue
            # A cursor that took every record checked exactly what read_step checks.
            if c.skipped_records == 0:
                assert full is not None and got == full, step
        torn = r.torn_bytes > 0
    return "step-error" if failed else "torn" if torn else "ok"


def mutate(rng: np.random.Generator, data: bytes, starts: list[int]) -> bytes:
    """One random defect of the kinds the hypothesis tests below draw from."""
    kind = int(rng.integers(0, 5))
    b = bytearray(data)
    if kind == 0:  # bit flips
        for pos in rng.integers(0, len(b) * 8, size=int(rng.integers(1, 9))):
            b[pos // 8] ^= 1 << (pos % 8)
    elif kind == 1:  # cut, plus random bytes
        b = b[: int(rng.integers(0, len(b) + 1))] + rng.bytes(int(rng.integers(0, 64)))
    elif kind == 2:  # a huge value in a segment header field, CRC fixed or not
        at = starts[int(rng.integers(0, len(starts)))]
        field, fmt = [(4, "<Q"), (12, "<I"), (16, "<Q"), (24, "<Q")][int(rng.integers(0, 4))]
        limit = 1 << (8 * struct.calcsize(fmt))
        value = HUGE[int(rng.integers(0, len(HUGE)))] % limit
        b[at + field : at + field + struct.calcsize(fmt)] = struct.pack(fmt, value)
        if rng.random() < 0.5:
            end = starts[starts.index(at) + 1] if at != starts[-1] else len(b)
            b[at:end] = with_crc(b[at:end])
    elif kind == 3:  # random bytes
        b = (bytearray(FILE_HEADER) if rng.random() < 0.5 else bytearray()) + rng.bytes(
            int(rng.integers(0, 512))
        )
    else:  # damaged zstd frame behind a valid CRC
        i = int(rng.integers(0, len(starts)))
        at, end = starts[i], starts[i + 1] if i + 1 < len(starts) else len(b)
        seg = bytearray(b[at:end])
        for pos in rng.integers(36 * 8, len(seg) * 8, size=int(rng.integers(1, 4))):
            seg[pos // 8] ^= 1 << (pos % 8)
        b[at:end] = with_crc(seg)
    return bytes(b)


def run_fuzz(n_cases: int, seed: int) -> dict[str, int]:
    """Run ``n_cases`` random defects over the base logs; return outcome -> count.

    Raises (AssertionError or whatever the reader raised) on the first case that reading turns
    into anything but success or RoundLogError, or where read_step and a cursor disagree.
    """
    rng = np.random.default_rng(seed)
    counts: dict[str, int] = {}
    for _ in range(n_cases):
        data, starts = BASES[int(rng.integers(0, len(BASES)))]
        outcome = exercise(mutate(rng, data, starts))
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


# --- properties ----------------------------------------------------------------------------------

FAST = settings(max_examples=300, deadline=None, database=None)
bases = st.integers(0, len(BASES) - 1)


def test_base_logs_are_valid() -> None:
    for data, _ in BASES:
        assert exercise(data) == "ok"


@FAST
@given(bases, st.lists(st.integers(0, 1 << 30), min_size=1, max_size=8))
def test_bit_flips(base: int, bits: list[int]) -> None:
    data, _ = BASES[base]
    b = bytearray(data)
    for bit in bits:
        pos = bit % (len(b) * 8)
        b[pos // 8] ^= 1 << (pos % 8)
    outcome = exercise(bytes(b))
    if bytes(b) != data:
        assert outcome != "ok"  # the CRCs and the scan catch every flip of up to 8 bits here


@FAST
@given(bases, st.integers(0, 1 << 20), st.binary(max_size=64))
def test_truncation_and_tails(base: int, cut: int, tail: bytes) -> None:
    data, _ = BASES[base]
    cut %= len(data) + 1
    outcome = exercise(data[:cut] + tail)
    if not tail and cut >= len(FILE_HEADER):
        assert outcome in ("ok", "torn")  # a cut is never an error once the header is there


@FAST
@given(st.booleans(), st.binary(max_size=600))
def test_random_bytes(header: bool, body: bytes) -> None:
    exercise((FILE_HEADER if header else b"") + body)


@FAST
@given(
    bases,
    st.integers(0, 10),
    st.sampled_from([(4, "<Q"), (12, "<I"), (16, "<Q"), (24, "<Q")]),
    st.one_of(st.sampled_from(HUGE), st.integers(0, (1 << 64) - 1)),
    st.booleans(),
)
def test_huge_header_fields(base: int, which: int, field: tuple[int, str], value: int, fix_crc: bool) -> None:
    data, starts = BASES[base]
    i = which % len(starts)
    at, end = starts[i], starts[i + 1] if i + 1 < len(starts) else len(data)
    offset, fmt = field
    seg = bytearray(data[at:end])
    seg[offset : offset + struct.calcsize(fmt)] = struct.pack(fmt, value % (1 << (8 * struct.calcsize(fmt))))
    exercise(data[:at] + (with_crc(seg) if fix_crc else bytes(seg)) + data[end:])


def _record(op: int, count: int, kind_byte: int, unary: int, body: bytes) -> bytes:
    return struct.pack("<IIBI", op, count, kind_byte, unary) + body  # version 4's record header


records = st.builds(
    _record,
    st.integers(0, 15),
    st.one_of(st.integers(0, 40), st.sampled_from(HUGE).map(lambda v: v % (1 << 32))),
    st.sampled_from([0, 1, 2, 13, 62, 63, 0x84, 0x80, 0xBE, 0x44, 0x40, 0x7F, 0xC4, 0xFF]),
    st.one_of(st.integers(0, 40), st.sampled_from(HUGE).map(lambda v: v % (1 << 32))),
    st.binary(max_size=200),
)


@FAST
@given(st.lists(records, max_size=5), st.integers(0, 6), st.binary(max_size=16), st.booleans())
def test_forged_payloads(recs: list[bytes], n_ops: int, junk: bytes, lie: bool) -> None:
    """Payloads of arbitrary records in a valid frame with a valid CRC: the record parser's turn."""
    raw = b"".join(recs) + junk
    raw_len = len(raw) + 1 if lie else None
    exercise(FILE_HEADER + payload_segment(1, n_ops, raw, raw_len))


@FAST
@given(bases, st.integers(0, 10), st.lists(st.integers(0, 1 << 30), min_size=1, max_size=4))
def test_damaged_zstd_frames(base: int, which: int, bits: list[int]) -> None:
    """Flipped bits in a compressed payload whose CRC is then fixed: the frame walk and zstd's turn."""
    data, starts = BASES[base]
    i = which % len(starts)
    at, end = starts[i], starts[i + 1] if i + 1 < len(starts) else len(data)
    seg = bytearray(data[at:end])
    for bit in bits:
        pos = 36 * 8 + bit % ((len(seg) - 36) * 8)
        seg[pos // 8] ^= 1 << (pos % 8)
    exercise(data[:at] + with_crc(seg) + data[end:])


def test_driver_runs() -> None:
    counts = run_fuzz(n_cases=300, seed=1)
    assert sum(counts.values()) == 300 and counts.get("rejected", 0) + counts.get("step-error", 0) > 0
