"""Tests for detrl.formats.roundlog: round trips, size, torn tails, streaming cursors, appending, and
rejection of every kind of malformed file.

Forged files are built by hand from the layout in docs/roundlog.md (not via the module's
private helpers), so these tests also check that the implementation matches the spec.
"""

from __future__ import annotations

import io
import os
import resource
import signal
import struct
import subprocess
import sys
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from detrl.formats.roundlog import (
    FORMAT_VERSION,
    MAX_WINDOW_BYTES,
    OpEntries,
    RoundLogError,
    RoundLogReader,
    RoundLogWriter,
    dense_reference_bytes,
    encode_segment,
    from_key32,
    key32,
    nearest_with_low16,
    segment_compressor,
)
from detrl.testing.logrewrite import rewrite

HEADER = struct.Struct("<8sHHI")
SEG = struct.Struct("<4sQIQQI")


# --- helpers -------------------------------------------------------------------------------------


def random_ops(
    rng: np.random.Generator, n_ops: int, max_entries: int, space: int = 1 << 20, pinned: bool = False
) -> list[OpEntries]:
    """Random sparse entries: ``n_ops`` distinct sorted op positions, each with sorted unique indices
    (and, with ``pinned``, sometimes disjoint pinned values, some of them short, or only pinned values)."""
    ops = []
    for op in np.sort(rng.choice(5000, size=n_ops, replace=False)):
        n = int(rng.integers(1, max_entries + 1))
        idx = np.sort(rng.choice(space, size=n, replace=False)).astype(np.int64)
        e = OpEntries(int(op), idx, rng.random(n) < 0.5)
        if pinned and rng.random() < 0.5:
            which = rng.random(n) < 0.3
            if rng.random() < 0.2:
                which[:] = True  # an op with only pinned values
            short = which & (rng.random(n) < 0.5)
            which &= ~short
            e = OpEntries(
                int(op),
                idx[~which & ~short],
                e.up[~which & ~short],
                pinned_indices=idx[which],
                pinned_values=rng.standard_normal(int(which.sum())).astype(np.float32),
                short_indices=idx[short],
                short_bits=rng.integers(0, 1 << 16, size=int(short.sum())).astype(np.uint16),
            )
        ops.append(e)
    return ops


def as_dict(ops: list[OpEntries]) -> dict[int, OpEntries]:
    return {e.op: e for e in ops if e.indices.size or e.pinned_indices.size or e.short_indices.size}


def n_records(e: OpEntries) -> int:
    return bool(e.indices.size) + bool(e.pinned_indices.size) + bool(e.short_indices.size)


def record(op: int, deltas: list[int], bits: bytes, width: int = 4, flag: int = 0) -> bytes:
    """One raw op record, per the spec: header, deltas in byte planes (all byte 0s, then all byte 1s, ...)."""
    words = [d.to_bytes(width, "little") for d in deltas]
    planes = bytes(w[b] for b in range(width) for w in words)
    return struct.pack("<IIB", op, len(deltas), width | flag) + planes + bits


def pinned_record(op: int, deltas: list[int], values: list[float]) -> bytes:
    v = np.array(values, "<f4").view(np.uint8).reshape(-1, 4).T.tobytes()  # byte planes
    return record(op, deltas, v, flag=0x80)


def short_record(op: int, deltas: list[int], low: list[int], width: int = 4) -> bytes:
    lo = np.array(low, "<u2").view(np.uint8).reshape(-1, 2).T.tobytes()  # 2 byte planes
    return record(op, deltas, lo, width=width, flag=0x40)


def segment(
    step: int, n_ops: int, raw: bytes, raw_len: int | None = None, comp: bytes | None = None
) -> bytes:
    """A segment with a correct CRC; ``raw_len``/``comp`` let a test make the header lie."""
    comp = zstandard.ZstdCompressor().compress(raw) if comp is None else comp
    head = SEG.pack(b"RSEG", step, n_ops, len(raw) if raw_len is None else raw_len, len(comp), 0)[:32]
    return head + struct.pack("<I", zlib.crc32(comp, zlib.crc32(head))) + comp


#: The format version of the records the helpers above write by hand (``record``: version 3's layout, which
#: the reader still reads; ``record4`` writes version 4's).
V3 = 3


def file_header(version: int = V3) -> bytes:
    return HEADER.pack(b"DTRLRLOG", version, 0, 0)


def forge(path: Path, segments: list[bytes], version: int = V3) -> None:
    """Write a file from segment bytes (hand-made records: version 3 unless said otherwise): file header,
    then the segments back to back."""
    path.write_bytes(file_header(version) + b"".join(segments))


def read_all(source: Path | io.BytesIO, numel: int = (1 << 63) - 1) -> dict[int, dict[int, OpEntries]]:
    """Every step via read_step, and again via a cursor taking every op; both must agree."""
    with RoundLogReader(source) as r:
        out = {s: r.read_step(s) for s in r.steps}
        for s in r.steps:
            with r.cursor(s) as c:
                got = {op: c.take(op, numel) for op in out[s]}
                c.finish()
                assert got == out[s] and c.skipped_records == 0
        return out


def assert_rejected(path: Path, match: str = "") -> RoundLogError:
    """Opening and reading every step (read_step, and a cursor taking ops 0..7) must raise
    RoundLogError naming the file."""
    for way in ("read_step", "cursor"):
        with pytest.raises(RoundLogError) as info, RoundLogReader(path) as r:
            for s in r.steps:
                if way == "read_step":
                    r.read_step(s)
                else:
                    with r.cursor(s) as c:
                        for op in range(8):  # the forged records use ops < 8
                            c.take(op, (1 << 63) - 1)
                        c.finish()
        msg = str(info.value)
        assert msg.startswith(f"roundlog: {path}"), msg
        assert match in msg, msg
        assert "\n" not in msg
    return info.value


def detected(path: Path) -> bool:
    """True if reading ``path`` raises RoundLogError or shows a torn tail; any other exception fails."""
    try:
        with RoundLogReader(path) as r:
            if r.torn_bytes:
                return True
            for s in r.steps:
                r.read_step(s)
            for s in r.steps:
                with r.cursor(s) as c:
                    c.finish()
    except RoundLogError:
        return True
    return False


@pytest.fixture
def small_log(tmp_path: Path) -> Path:
    """A small valid log: 3 segments, one empty, one with a width-8 record."""
    p = tmp_path / "small.rlog"
    with RoundLogWriter(p) as w:
        w.write_step(0, [OpEntries(2, np.array([1, 5, 6, 100]), np.array([1, 0, 1, 1], bool))])
        w.write_step(3, [])
        w.write_step(7, [OpEntries(0, np.array([3, 1 << 40]), np.array([0, 1], bool))])
    return p


def segment_offsets(path: Path) -> list[tuple[int, int, int]]:
    """(step, start, end) of every complete segment, from the reader's public API."""
    with RoundLogReader(path) as r:
        return [(s, r.segment_end(s) - r.segment_bytes(s), r.segment_end(s)) for s in r.steps]


# --- round trips -------------------------------------------------------------------------------


def test_round_trip_many_steps(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    p = tmp_path / "log.rlog"
    expected: dict[int, dict[int, OpEntries]] = {}
    with RoundLogWriter(p) as w:
        assert w.bytes_written == 16
        for step in range(0, 200, 3):  # gaps between steps
            ops = [] if step % 4 == 0 else random_ops(rng, int(rng.integers(1, 20)), 50, pinned=True)
            n = w.write_step(step, ops)
            assert n > 0 and w.bytes_written > n
            expected[step] = as_dict(ops)
        # large indices above 2**32 (width-8 deltas), and one huge step
        big = np.array([5, 1 << 32, (1 << 33) + 7, (1 << 62) + 1], np.int64)
        w.write_step(1000, [OpEntries(1, big, np.array([1, 0, 0, 1], bool))])
        idx = np.sort(rng.choice(1 << 24, size=100_000, replace=False)).astype(np.int64)
        huge = [OpEntries(9, idx, rng.random(idx.size) < 0.3)]
        w.write_step(1001, huge)
        expected[1000] = {1: OpEntries(1, big, np.array([1, 0, 0, 1], bool))}
        expected[1001] = as_dict(huge)
    size = p.stat().st_size
    assert w.bytes_written == size
    assert read_all(p) == expected
    with RoundLogReader(p) as r:
        assert r.steps == sorted(expected)
        assert r.torn_bytes == 0 and r.end_of_segments == size
        for e in r.read_step(1001).values():
            assert e.indices.dtype == np.int64 and e.up.dtype == bool
        assert r.read_step(1) == {} and r.segment_bytes(1) == 0
        assert sum(r.segment_bytes(s) for s in r.steps) == size - 16
        # segment_end: past the last segment with step <= the argument; the header size before any
        assert r.segment_end(-1) == 16 and r.segment_end(0) == 16 + r.segment_bytes(0)
        assert r.segment_end(1) == r.segment_end(2) == r.segment_end(0)
        assert r.segment_end(1001) == r.segment_end(10**9) == size
        ends = [r.segment_end(s) for s in r.steps]
        assert ends == sorted(ends) and all(
            b - a == r.segment_bytes(s) for a, b, s in zip([16, *ends], ends, r.steps)
        )


def test_empty_file_and_empty_ops_dropped(tmp_path: Path) -> None:
    p = tmp_path / "empty.rlog"
    RoundLogWriter(p).close()
    assert p.stat().st_size == 16 and read_all(p) == {}
    q = tmp_path / "e2.rlog"
    with RoundLogWriter(q) as w:
        w.write_step(5, [OpEntries(0, np.array([], np.int64), np.array([], bool)), OpEntries(1, [4], [True])])
        w.close()
        w.close()  # idempotent
    assert read_all(q) == {5: {1: OpEntries(1, np.array([4]), np.array([True]))}}


def test_size_clustered(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    starts = np.sort(rng.choice(1 << 22, size=100, replace=False)) * 64
    idx = np.unique((starts[:, None] + rng.integers(0, 2000, size=(100, 120))).ravel())[:10_000]
    p = tmp_path / "size.rlog"
    with RoundLogWriter(p) as w:
        w.write_step(0, [OpEntries(3, idx.astype(np.int64), rng.random(idx.size) < 0.5)])
    assert idx.size == 10_000 and p.stat().st_size / idx.size < 4
    assert read_all(p)[0][3].indices.size == idx.size


def test_dense_reference_bytes() -> None:
    assert [dense_reference_bytes(n) for n in (0, 1, 5, 6, 10, 11)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        dense_reference_bytes(-1)


def test_rewrite(small_log: Path, tmp_path: Path) -> None:
    def flip(step: int, ops: dict[int, OpEntries]) -> dict[int, OpEntries] | None:
        if step == 3:
            return None  # drop the step
        return {k: OpEntries(k, e.indices, ~e.up) for k, e in ops.items()}

    dst = tmp_path / "forged.rlog"
    rewrite(small_log, dst, flip)
    orig, forged = read_all(small_log), read_all(dst)
    assert sorted(forged) == [0, 7]
    for s in forged:
        for k, e in forged[s].items():
            assert np.array_equal(e.indices, orig[s][k].indices)
            assert np.array_equal(e.up, ~orig[s][k].up)


# --- writer ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ops",
    [
        [OpEntries(1, [1, 2], [0, 1]), OpEntries(1, [3], [1])],  # op not increasing
        [OpEntries(2, [1], [0]), OpEntries(1, [3], [1])],
        [OpEntries(-1, [1], [0])],
        [OpEntries(1 << 32, [1], [0])],
        [OpEntries(0, [2, 1], [0, 1])],  # unsorted
        [OpEntries(0, [1, 1], [0, 1])],  # duplicate
        [OpEntries(0, [-1, 1], [0, 1])],  # negative
        [OpEntries(0, [1, 2], [0])],  # length mismatch
        [OpEntries(0, [1.5], [0])],  # float index
        [OpEntries(0, [1], [2])],  # up not 0/1
        [OpEntries(0, np.array([1 << 63], np.uint64), [1])],
        [
            OpEntries(0, np.array([0, 1 << 62, -(1 << 63)], np.int64), np.array([0, 1, 0], bool))
        ],  # deltas wrap
        [OpEntries(0, [[1]], [[1]])],  # not 1-D
        ["not an OpEntries"],
    ],
)
def test_writer_rejects_bad_input(tmp_path: Path, ops: list) -> None:
    with RoundLogWriter(tmp_path / "w.rlog") as w:
        with pytest.raises(ValueError):
            w.write_step(0, ops)
        assert w.bytes_written == 16  # nothing written
    with pytest.raises(ValueError):
        encode_segment(0, ops, segment_compressor())


def test_writer_rejects_bad_steps_and_levels(tmp_path: Path) -> None:
    with RoundLogWriter(tmp_path / "w.rlog") as w:
        w.write_step(4, [])
        for bad in (4, 3, -1, 1 << 64, True, 5.0):
            with pytest.raises(ValueError):
                w.write_step(bad, [])
    for call in (lambda: w.write_step(10, []), w.sync):
        with pytest.raises(ValueError, match="closed"):
            call()
    for level in (20, 22, 3.0):
        with pytest.raises(ValueError, match="level"):
            RoundLogWriter(tmp_path / "l.rlog", level=level)


def test_header_flushed_at_construction_and_segments_at_each_step(tmp_path: Path) -> None:
    p = tmp_path / "live.rlog"
    w = RoundLogWriter(p)
    assert p.read_bytes() == file_header(FORMAT_VERSION)  # visible to another reader before any step
    with RoundLogReader(p) as r:
        assert r.steps == [] and r.torn_bytes == 0
    w.write_step(1, [OpEntries(0, [3], [True])])
    w.sync()
    assert read_all(p) == {1: {0: OpEntries(0, np.array([3]), np.array([True]))}}
    w.close()


def test_killed_writer_leaves_a_readable_log(tmp_path: Path) -> None:
    p = tmp_path / "killed.rlog"
    code = (
        "import os, signal, numpy as np\n"
        "from detrl.formats.roundlog import OpEntries, RoundLogWriter\n"
        f"w = RoundLogWriter({str(p)!r})\n"
        "for s in range(1, 4):\n"
        "    w.write_step(s, [OpEntries(s, np.arange(s) * 3, np.ones(s, bool))])\n"
        "w._f.write(b'RSEG' + bytes(20))  # half a segment header in the buffer, then killed\n"
        "w._f.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with RoundLogReader(p) as r:
        assert r.steps == [1, 2, 3] and r.torn_bytes == 24
        assert r.read_step(3) == {3: OpEntries(3, np.array([0, 3, 6]), np.ones(3, bool))}


def test_encode_segment_is_the_bytes_written(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    p = tmp_path / "enc.rlog"
    steps = {s: random_ops(rng, 5, 30, pinned=True) for s in (1, 2, 5)}
    with RoundLogWriter(p, level=9) as w:
        for s, ops in steps.items():
            w.write_step(s, ops)
    data = p.read_bytes()
    cctx = segment_compressor(9)
    with RoundLogReader(p) as r:
        for s, start, end in segment_offsets(p):
            assert encode_segment(s, steps[s], cctx) == data[start:end] == r.raw_bytes(start, end - start)
        with pytest.raises(RoundLogError, match="outside the complete segments"):
            r.raw_bytes(16, len(data))


def _both_encoders(
    step: int,
    ops: list,
    cctx: zstandard.ZstdCompressor,
    monkeypatch: pytest.MonkeyPatch,
    version: int = FORMAT_VERSION,
) -> list:
    """encode_segment's bytes (or the ValueError's text) with the C record encoder and with the Python one."""
    from detrl.formats import roundlog

    out = []
    for native in (True, False):
        monkeypatch.setattr(roundlog, "NATIVE_RECORDS", native)
        try:
            out.append(encode_segment(step, ops, cctx, version))
        except ValueError as e:
            out.append(f"ValueError: {e}")
    return out


def test_the_c_record_encoder_writes_the_reference_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C encoder (detrl/formats/_segment.c) writes what the Python encoder writes, in versions 4 and 3:
    on random steps of direction, pinned and short entries, with indices past 2**32 (8-byte deltas, Rice
    parameters past 32), dense runs (parameter 0) and ops without entries; and entries it declines
    (unsorted, overlapping kinds, negative, out of order, strided, other dtypes) get the reference's error."""
    from detrl.formats import roundlog

    if roundlog._segment is None:
        pytest.skip("the C record encoder is not built here")
    rng = np.random.default_rng(11)
    cctx = segment_compressor()
    for trial in range(300):
        space = (1 << 62, 1 << 40, 1 << 16, 64)[trial % 4]
        ops = random_ops(rng, int(rng.integers(0, 8)), int(rng.integers(1, 40)), space=space, pinned=True)
        if ops and trial % 3 == 0:  # an op with no entries at all
            ops[0] = OpEntries(ops[0].op, np.zeros(0, np.int64), np.zeros(0, bool))
        for version in (4, 3):
            assert roundlog._segment.encode_records(ops, version) is not None, trial  # taken by the C encoder
            native, reference = _both_encoders(trial, ops, cctx, monkeypatch, version)
            assert isinstance(native, bytes) and native == reference, trial
    idx, up = np.array([3, 9, 40], np.int64), np.array([True, False, True])

    def entries(**changes: object) -> OpEntries:
        fields = {"op": 2, "indices": idx, "up": up, **changes}
        return OpEntries(**fields)  # type: ignore[arg-type]

    declined = [
        [entries(indices=idx[::-1].copy())],
        [entries(indices=np.array([-1, 9, 40], np.int64))],
        [entries(), entries(op=1)],
        [entries(op=1 << 32)],
        [entries(indices=np.array([3, 9, 9], np.int64))],
        [entries(pinned_indices=np.array([9], np.int64), pinned_values=np.ones(1, np.float32))],
        [entries(short_indices=np.array([40], np.int64), short_bits=np.ones(1, np.uint16))],
        [entries(pinned_values=np.zeros(0, np.float64))],
        [entries(indices=np.arange(6, dtype=np.int64)[::2], up=np.ones(3, bool))],  # strided, valid
        [entries(indices=idx.astype(np.int32))],  # valid
        [entries(up=up.astype(np.uint8))],  # valid
        [entries(op=np.int64(2))],  # valid
    ]
    for ops in declined:
        assert roundlog._segment.encode_records(ops, FORMAT_VERSION) is None, ops
        native, reference = _both_encoders(1, ops, cctx, monkeypatch)
        assert native == reference, ops
    assert roundlog._segment.encode_records([entries()], 5) is None  # a version it does not write


# --- appending (resume) ------------------------------------------------------------------------


def test_append_continues_a_truncated_file_bit_identically(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    steps = {s: random_ops(rng, 4, 40, pinned=True) for s in range(1, 9)}
    full = tmp_path / "full.rlog"
    with RoundLogWriter(full, level=5) as w:
        for s, ops in steps.items():
            w.write_step(s, ops)
    ref = full.read_bytes()
    _, _, end5 = segment_offsets(full)[4]
    for cut in (end5, end5 + 7, end5 + 40, end5 + 36 + 1):  # clean cut, torn header, torn payload
        p = tmp_path / f"cut{cut}.rlog"
        p.write_bytes(ref[:cut])
        with RoundLogReader(p) as r:
            assert r.steps == [1, 2, 3, 4, 5] and r.torn_bytes == cut - end5
            resume = 4  # resume from a checkpoint at step 4: steps 5.. are recorded again
            offset = r.segment_end(resume)
        with RoundLogWriter.append(p, offset, last_step=resume, level=5) as w:
            assert w.bytes_written == offset
            with pytest.raises(ValueError, match="greater"):
                w.write_step(resume, [])
            for s in range(resume + 1, 9):
                w.write_step(s, steps[s])
        assert p.read_bytes() == ref
    # from the header (nothing kept)
    p = tmp_path / "none.rlog"
    p.write_bytes(ref[:30])
    with RoundLogWriter.append(p, 16, last_step=None, level=5) as w:
        for s, ops in steps.items():
            w.write_step(s, ops)
    assert p.read_bytes() == ref


def test_append_refuses_bad_offsets_and_files(tmp_path: Path, small_log: Path) -> None:
    size = small_log.stat().st_size
    for bad in (0, 15, size + 1, -1):
        with pytest.raises(ValueError):
            RoundLogWriter.append(small_log, bad, last_step=None)
    assert small_log.stat().st_size == size  # untouched
    other = tmp_path / "other"
    other.write_bytes(b"not a log at all, do not truncate me")
    with pytest.raises(RoundLogError, match="not a version 3 or 4 rounding log"):
        RoundLogWriter.append(other, 16, last_step=None)
    assert other.read_bytes() == b"not a log at all, do not truncate me"
    with pytest.raises(RoundLogError, match="cannot open"):
        RoundLogWriter.append(tmp_path / "missing", 16, last_step=None)


# --- torn tails and malformed files ------------------------------------------------------------


def test_truncated_at_every_byte_is_a_torn_tail(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    p = tmp_path / "t.rlog"
    with RoundLogWriter(p) as w:
        for s in (1, 2, 4, 5):
            w.write_step(s, random_ops(rng, 3, 10, pinned=True) if s != 2 else [])
    data = p.read_bytes()
    segs = segment_offsets(p)
    full = read_all(p)
    cut_file = tmp_path / "cut.rlog"
    for cut in range(len(data) + 1):
        cut_file.write_bytes(data[:cut])
        if cut < 16:
            with pytest.raises(RoundLogError, match="truncated"):
                RoundLogReader(cut_file)
            continue
        complete = [(s, end) for s, _, end in segs if end <= cut]
        with RoundLogReader(io.BytesIO(data[:cut])) as r:  # never raises from the header on
            assert r.steps == [s for s, _ in complete]
            assert r.end_of_segments == (complete[-1][1] if complete else 16)
            assert r.torn_bytes == cut - r.end_of_segments
            for s in r.steps:
                assert r.read_step(s) == full[s]


def test_any_flipped_byte_is_detected(small_log: Path, tmp_path: Path) -> None:
    data = small_log.read_bytes()
    p = tmp_path / "flip.rlog"
    for pos in range(len(data)):
        for mask in (0x01, 0x80):
            bad = bytearray(data)
            bad[pos] ^= mask
            p.write_bytes(bytes(bad))
            assert detected(p), (pos, mask)


def test_payload_flip_reports_checksum(small_log: Path, tmp_path: Path) -> None:
    data = bytearray(small_log.read_bytes())
    data[16 + 36 + 3] ^= 0xFF  # inside segment 0's compressed payload
    p = tmp_path / "crc.rlog"
    p.write_bytes(bytes(data))
    with RoundLogReader(p) as r:  # open only checks headers; the payload CRC is checked on read
        assert r.read_step(3) == {}
        with pytest.raises(RoundLogError, match="segment 0 \\(step 0\\): checksum mismatch"):
            r.read_step(0)
        with pytest.raises(RoundLogError, match="checksum mismatch"):
            r.cursor(0)  # checked when the cursor is created


def test_random_garbage_only_raises_roundlog_error(small_log: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    data = small_log.read_bytes()
    p = tmp_path / "fuzz.rlog"
    for _ in range(300):
        bad = bytearray(data)
        for pos in rng.integers(0, len(bad), size=int(rng.integers(1, 6))):
            bad[pos] = int(rng.integers(0, 256))
        if bytes(bad) == data:
            continue
        p.write_bytes(bytes(bad))
        assert detected(p)


def test_wrong_magic_and_version(small_log: Path, tmp_path: Path) -> None:
    data = small_log.read_bytes()
    p = tmp_path / "m.rlog"
    p.write_bytes(b"NOTALOG!" + data[8:])
    assert_rejected(p, "bad magic")
    forge(p, [], version=7)
    assert_rejected(p, "unsupported format version 7 (this detrl reads versions 3 and 4)")
    p.write_bytes(file_header(1) + data[16:])  # a version-1 file (its index and trailer not needed)
    err = assert_rejected(p, "unsupported format version 1 (this detrl reads versions 3 and 4)")
    assert "\n" not in str(err)
    p.write_bytes(file_header(2) + data[16:])  # a version-2 file (no short pinned records)
    assert_rejected(p, "unsupported format version 2 (this detrl reads versions 3 and 4)")
    p.write_bytes(HEADER.pack(b"DTRLRLOG", FORMAT_VERSION, 1, 0) + data[16:])
    assert_rejected(p, "unsupported header flags")


def test_zero_length_and_directory(tmp_path: Path) -> None:
    p = tmp_path / "zero.rlog"
    p.write_bytes(b"")
    assert_rejected(p, "truncated")
    assert_rejected(tmp_path, "cannot open")
    assert_rejected(tmp_path / "missing.rlog", "cannot open")


def test_segment_scan(tmp_path: Path) -> None:
    p = tmp_path / "scan.rlog"
    a, b, c = segment(1, 0, b""), segment(2, 0, b""), segment(5, 0, b"")
    forge(p, [a, b, c])
    assert read_all(p) == {1: {}, 2: {}, 5: {}}
    forge(p, [a, segment(1, 0, b""), c])
    assert_rejected(p, "segment 1: step 1 not greater than previous step 1")
    forge(p, [a, segment(0, 0, b"")])
    assert_rejected(p, "not greater than previous step")
    forge(p, [a, b"XSEG" + b[4:], c])  # bad tag in the middle
    assert_rejected(p, "segment 1: bad segment tag b'XSEG'")
    # bytes after the last segment: >= one header's worth must be a segment, fewer are torn
    forge(p, [a, b, b"\x00" * 36])
    assert_rejected(p, "bad segment tag")
    forge(p, [a, b, b"\x00" * 35])
    with RoundLogReader(p) as r:
        assert r.steps == [1, 2] and r.torn_bytes == 35
    # a segment whose payload runs past the end of the file is a torn tail, wherever it is
    forge(p, [a, SEG.pack(b"RSEG", 2, 0, 0, 1 << 40, 0) + b"\x00" * 9, c])
    with RoundLogReader(p) as r:
        assert r.steps == [1] and r.torn_bytes == p.stat().st_size - 16 - len(a)


def test_raw_length_lies(tmp_path: Path) -> None:
    raw = record(0, [1, 2, 3], b"\xa0")
    p = tmp_path / "raw.rlog"
    forge(p, [segment(0, 1, raw)])
    assert read_all(p)[0][0] == OpEntries(0, np.array([1, 3, 6]), np.array([1, 0, 1], bool))
    forge(p, [segment(0, 1, raw, raw_len=1 << 40)])
    assert_rejected(p, "exceeds limit")
    forge(p, [segment(0, 1, raw, raw_len=len(raw) + 1)])
    assert_rejected(p, "zstd frame declares")
    forge(p, [segment(0, 1, raw, raw_len=len(raw) - 1)])
    assert_rejected(p, "zstd frame declares")
    # frame without a declared content size
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    forge(p, [segment(0, 1, raw, comp=no_size)])
    assert_rejected(p, "zstd frame declares no content size")
    # trailing data after the frame, two frames, a cut frame, garbage
    comp = zstandard.ZstdCompressor().compress(raw)
    forge(p, [segment(0, 1, raw, comp=comp + b"xyz")])
    assert_rejected(p, "exactly one complete zstd frame (3 bytes after it)")
    forge(p, [segment(0, 1, raw, comp=comp + comp)])
    assert_rejected(p, "exactly one complete zstd frame")
    forge(p, [segment(0, 1, raw, comp=comp[:-2])])
    assert_rejected(p)
    forge(p, [segment(0, 1, raw, comp=b"garbage!" * 4)])
    assert_rejected(p, "zstd")
    skippable = struct.pack("<II", 0x184D2A50, 4) + b"abcd" + comp  # a skippable frame first
    forge(p, [segment(0, 1, raw, comp=skippable)])
    assert_rejected(p, "not a zstd frame")
    # a frame with a content checksum is fine
    with_sum = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    forge(p, [segment(0, 1, raw, comp=with_sum)])
    assert read_all(p)[0][0].indices.tolist() == [1, 3, 6]
    forge(p, [segment(0, 1, raw)])
    with pytest.raises(RoundLogError, match="exceeds limit 4"):
        RoundLogReader(p, max_raw_bytes=4)


def test_zstd_window_is_bounded(tmp_path: Path) -> None:
    raw = record(0, [1], b"\x80") + bytes(MAX_WINDOW_BYTES + (1 << 20))  # trailing zeros: never read
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=24)
    comp = zstandard.ZstdCompressor(compression_params=params).compress(raw)
    assert zstandard.get_frame_parameters(comp).window_size > MAX_WINDOW_BYTES
    p = tmp_path / "win.rlog"
    forge(p, [segment(0, 1, raw, comp=comp)])
    assert_rejected(p, "zstd window")


@pytest.mark.parametrize(
    ("raw", "n_ops", "match"),
    [
        (record(0, [1, 2], b"\x80") + b"\x00", 1, "1 trailing bytes"),  # payload not consumed
        (record(0, [1, 2], b"\x80") + record(1, [3], b"\x00"), 1, "trailing bytes"),
        (record(0, [1, 2], b"\x80") + record(1, [3], b"\x00"), 3, "cannot fit"),
        (record(0, [1, 2], b"\x80") + b"\x00" * 14, 2, "record 1"),  # second record op 0 again
        (
            record(0, [1, 2, 3, 4], b"\x00") + b"\x00" * 5,
            2,
            "record 1 header overruns",
        ),  # second record count 0
        (record(0, [1, 0, 3], b"\x80"), 1, "not strictly increasing"),  # zero delta
        (record(0, [5, 1 << 63], b"\x00", width=8), 1, "exceeds 2**63"),
        (record(0, [5, (1 << 64) - 1], b"\x00", width=8), 1, "not strictly increasing"),  # wraps
        (record(0, [5, 6], b"\x00", width=8), 1, "non-canonical"),
        (record(0, [5, 6], b"\x00", width=2) + b"\x00" * 4, 1, "width 2"),
        (record(0, [1, 2], b"\x81"), 1, "padding bits"),
        (record(3, [1], b"\x00") + record(3, [1], b"\x00"), 2, "op not greater"),
        (record(3, [1], b"\x00") + record(2, [1], b"\x00"), 2, "op not greater"),
        (pinned_record(3, [1], [1.0]) + record(3, [2], b"\x00"), 2, "op not greater"),  # pinned first
        (pinned_record(3, [1], [1.0]) + pinned_record(3, [2], [1.0]), 2, "op not greater"),
        # short records: after the op's direction and pinned records, once, well-formed
        (short_record(3, [1], [7]) + record(3, [2], b"\x00"), 2, "direction record after its short pinned"),
        (short_record(3, [1], [7]) + pinned_record(3, [2], [1.0]), 2, "pinned record after its short pinned"),
        (short_record(3, [1], [7]) + short_record(3, [2], [7]), 2, "short pinned record after its short"),
        (short_record(3, [1], [7]) + short_record(2, [2], [7]), 2, "op not greater than previous op 3"),
        (record(3, [1], b"\x00") + short_record(3, [1], [7]), 2, "short pinned element also has a direction"),
        (
            pinned_record(3, [1], [1.0]) + short_record(3, [1], [7]),
            2,
            "short pinned element also has a pinned",
        ),
        (short_record(3, [1, 0], [7, 8]), 1, "not strictly increasing"),
        (short_record(3, [5, 6], [7, 8], width=8), 1, "non-canonical"),
        (short_record(3, [1, 2], [7, 8])[:-1], 1, "overrun the payload"),  # one low byte missing
        (short_record(3, [1, 2], [7, 8]) + b"\x00", 1, "1 trailing bytes"),
        (record(3, [1], b"\x00\x00", flag=0xC0), 1, "flags both pinned and short"),
        (struct.pack("<IIB", 0, 1000, 4) + b"\x00" * 20, 1, "overrun the payload"),
        (struct.pack("<IIB", 0, 0, 4) + b"\x00" * 5, 1, "empty record"),
        (record(0, [1], b"\x00")[:-1] + b"\x00" * 5, 1, "trailing"),
    ],
)
def test_bad_records(tmp_path: Path, raw: bytes, n_ops: int, match: str) -> None:
    p = tmp_path / "rec.rlog"
    forge(p, [segment(0, 0, b""), segment(4, n_ops, raw)])
    assert_rejected(p, match)


def record4(
    op: int, count: int, k: int, unary: bytes, remainders: bytes, tail: bytes, flag: int = 0
) -> bytes:
    """One raw version-4 record, per the spec: header (op, count, kind byte, unary bytes), then the unary
    code, the remainders and the payload as given."""
    return struct.pack("<IIBI", op, count, k | flag, len(unary)) + unary + remainders + tail


def test_a_version_4_record_by_hand(tmp_path: Path) -> None:
    """The Rice code as docs/roundlog.md spells it: indices [5, 6, 20] have gaps [5, 0, 13]; with k = 2 the
    quotients [1, 0, 3] are unary 01 1 0001 (then zero padding) and the remainders [1, 0, 1] are
    01 00 01; the writer picks k = 2 (the smallest k of the shortest code), and the reader reads it back."""
    raw = record4(7, 3, 2, bytes([0b01100010]), bytes([0b01000100]), bytes([0b10100000]))
    entries = OpEntries(7, np.array([5, 6, 20], np.int64), np.array([True, False, True]))
    from detrl.formats import roundlog

    assert roundlog._encode_records([entries]) == (raw, 1)
    assert roundlog.rice_parameter(np.array([5, 0, 13], np.uint64)) == 2
    p = tmp_path / "v4.rlog"
    forge(p, [segment(4, 1, raw)], version=4)
    assert read_all(p) == {4: {7: entries}}


@pytest.mark.parametrize(
    ("raw", "n_ops", "match"),
    [
        # unary code with a fourth one bit for three entries
        (record4(7, 3, 2, bytes([0b01100011]), bytes([0b01000100]), b"\xa0"), 1, "more than 3 quotients"),
        # two one bits for three entries
        (record4(7, 3, 2, bytes([0b01100000]), bytes([0b01000100]), b"\xa0"), 1, "holds 2 quotients, not 3"),
        # a trailing zero byte after the last quotient
        (record4(7, 3, 2, bytes([0b01100010, 0]), bytes([0b01000100]), b"\xa0"), 1, "runs past its last"),
        # nonzero padding after the remainders (6 bits used of 8)
        (record4(7, 3, 2, bytes([0b01100010]), bytes([0b01000101]), b"\xa0"), 1, "padding bits after"),
        # a Rice parameter past 62
        (record4(7, 1, 63, b"\x80", bytes(8), b"\x80"), 1, "Rice parameter 63 above 62"),
        # fewer unary bytes than a one bit per entry needs
        (record4(7, 9, 0, b"\xff", b"", b"\x00\x00"), 1, "cannot hold 9 quotients"),
        # a gap of 2**63: quotient 2 with k = 62
        (record4(7, 1, 62, b"\x20", bytes(8), b"\x80"), 1, "index exceeds 2**63 - 1"),
        # two gaps of 2**63 - 1 each: indices past 2**63
        (
            record4(7, 2, 62, b"\x50", b"\xff" * 15 + b"\xf0", b"\x00"),
            1,
            "index 18446744073709551615 exceeds",
        ),
        # the unary code overruns the payload
        (struct.pack("<IIBI", 7, 1, 0, 1000) + b"\x80\x80", 1, "overrun the payload"),
        (record4(7, 0, 0, b"", b"", b"\x00\x00"), 1, "empty record"),
        (record4(7, 1, 0, b"\x80", b"", b"\x80", flag=0xC0), 1, "flags both pinned and short"),
        (
            record4(7, 1, 0, b"\x80", b"", b"\x80") + record4(7, 1, 0, b"\x80", b"", b"\x80"),
            2,
            "op not greater",
        ),
        (record4(7, 1, 0, b"\x80", b"", b"\x80") + b"\x00", 1, "1 trailing bytes"),
    ],
)
def test_bad_version_4_records(tmp_path: Path, raw: bytes, n_ops: int, match: str) -> None:
    p = tmp_path / "rec4.rlog"
    forge(p, [segment(0, 0, b""), segment(4, n_ops, raw)], version=4)
    assert_rejected(p, match)


def test_a_version_3_log_is_read_and_continued_in_version_3(tmp_path: Path) -> None:
    """A log recorded before version 4 reads as before, and a resumed recording continues it in its own
    version, byte for byte what a version-3 writer would have written."""
    rng = np.random.default_rng(8)
    steps = {s: random_ops(rng, 4, 30, pinned=True) for s in range(1, 6)}
    cctx = segment_compressor()
    p = tmp_path / "old.rlog"
    forge(p, [encode_segment(s, steps[s], cctx, version=3) for s in (1, 2, 3)])
    with RoundLogReader(p) as r:
        assert r.version == 3 and r.steps == [1, 2, 3]
        end = r.segment_end(3)
    with RoundLogWriter.append(p, end, last_step=3) as w:
        assert w.version == 3
        for s in (4, 5):
            w.write_step(s, steps[s])
    expected = file_header(3) + b"".join(encode_segment(s, steps[s], cctx, version=3) for s in steps)
    assert p.read_bytes() == expected
    assert read_all(p) == {s: as_dict(ops) for s, ops in steps.items()}
    with pytest.raises(ValueError, match="format version 5"):
        encode_segment(1, steps[1], cctx, version=5)


def test_version_4_is_smaller_on_clustered_and_sparse_indices(tmp_path: Path) -> None:
    """The point of version 4: the same entries in fewer bytes than version 3, for sparse indices spread
    over a large output (geometric gaps, as near-midpoint elements are) and for dense clusters."""
    rng = np.random.default_rng(9)
    cctx = segment_compressor(9)
    for space, n in ((1 << 24, 2000), (4096, 1500)):
        idx = np.sort(rng.choice(space, size=n, replace=False)).astype(np.int64)
        ops = [OpEntries(3, idx, rng.random(n) < 0.5)]
        v3, v4 = (len(encode_segment(1, ops, cctx, version=v)) for v in (3, 4))
        assert v4 < 0.95 * v3, (space, v3, v4)


def test_bad_segment_header(tmp_path: Path) -> None:
    p = tmp_path / "seg.rlog"
    good = segment(2, 0, b"")
    forge(p, [b"XSEG" + good[4:]])
    assert_rejected(p, "bad segment tag")
    forge(p, [segment(2, 0, b"", raw_len=0, comp=b"")])  # empty payload is not a zstd frame
    assert_rejected(p, "zstd")
    forge(p, [segment(2, 1, b"", raw_len=13)])
    assert_rejected(p, "1 op records cannot fit in 13 bytes")


def _pinned_entries() -> OpEntries:
    return OpEntries(
        op=3,
        indices=np.array([1, 5, 9], dtype=np.int64),
        up=np.array([True, False, True]),
        pinned_indices=np.array([2, 7, 2**40], dtype=np.int64),
        pinned_values=np.array([1.5e-30, -2.0, np.inf], dtype=np.float32),
    )


def test_pinned_values_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "log"
    only_pinned = OpEntries(
        op=4,
        indices=np.zeros(0, np.int64),
        up=np.zeros(0, bool),
        pinned_indices=np.array([0], np.int64),
        pinned_values=np.array([3.25], np.float32),
    )
    with RoundLogWriter(path) as w:
        w.write_step(1, [_pinned_entries(), only_pinned])
    with RoundLogReader(path) as r:
        got = r.read_step(1)
        assert got[3] == _pinned_entries() and got[4] == only_pinned
        assert got[3].pinned_values.dtype == np.float32
        with r.cursor(1) as c:
            assert c.take(3, 2**40 + 1) == _pinned_entries() and c.take(4, 1) == only_pinned
            c.finish()
        with (
            r.cursor(1) as c,
            pytest.raises(RoundLogError, match=f"outside the op output's {2**40} elements"),
        ):
            c.take(3, 2**40)


def test_a_log_that_does_not_fit_the_replays_op_says_what_the_replay_ran(tmp_path: Path) -> None:
    """An entry past the end of the replay's op is a misfit (RoundLogMisfit, a RoundLogError): the bundle
    was altered, or the replay runs other ops than the recording (a tensor cached by an earlier run in the
    same process: Hugging Face's RT-DETR caches its position embeddings across model instances). The
    replay says which op it ran, so the user can tell."""
    from detrl.core.rounding import StepRounding
    from detrl.formats.roundlog import RoundLogMisfit

    path = tmp_path / "log"
    with RoundLogWriter(path) as w:
        w.write_step(1, [_pinned_entries()])
    with RoundLogReader(path) as r, pytest.raises(RoundLogMisfit) as raised:
        StepRounding(replay=r.cursor(1)).entries(3, 32, "sum")
    message = str(raised.value)
    assert "outside the op output's 32 elements" in message
    assert "this replay's op 3 (sum) has 32: the bundle was altered, or this replay runs other ops" in message


def test_pinned_values_are_validated(tmp_path: Path) -> None:
    bad = _pinned_entries()
    bad.pinned_indices = np.array([1, 7, 2**40], dtype=np.int64)  # element 1 also has a direction
    with (
        RoundLogWriter(tmp_path / "log") as w,
        pytest.raises(ValueError, match="both a direction and a pinned"),
    ):
        w.write_step(1, [bad])
    # a forged pinned record overlapping a direction record, with a valid checksum
    raw = record(0, [1, 4], bytes([0x80])) + pinned_record(0, [2, 3], [1.0, 2.0])  # pinned 2, 5
    path = tmp_path / "forged"
    forge(path, [segment(1, 2, raw)])
    with RoundLogReader(path) as r, pytest.raises(RoundLogError, match="also has a direction entry"):
        r.read_step(1)
    assert_rejected(path, "also has a direction entry")


def _short_entries() -> OpEntries:
    e = _pinned_entries()
    e.short_indices = np.array([0, 3, 8, 2**41], dtype=np.int64)
    e.short_bits = np.array([0, 1, 0xFFFF, 0x8000], dtype=np.uint16)
    return e


def test_short_pinned_values_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "log"
    only_short = OpEntries(
        op=5,
        indices=np.zeros(0, np.int64),
        up=np.zeros(0, bool),
        short_indices=np.array([4, 9], np.int64),
        short_bits=np.array([0x1234, 0xABCD], np.uint16),
    )
    direction_and_short = OpEntries(
        op=6,
        indices=np.array([1], np.int64),
        up=np.array([True]),
        short_indices=np.array([0], np.int64),
        short_bits=np.array([3], np.uint16),
    )
    ops = [_short_entries(), only_short, direction_and_short]
    with RoundLogWriter(path) as w:
        w.write_step(1, ops)
    with RoundLogReader(path) as r:
        got = r.read_step(1)
        assert [got[e.op] for e in ops] == ops
        assert got[3].short_bits.dtype == np.uint16 and got[3].short_indices.dtype == np.int64
        assert got[3] != _pinned_entries()  # __eq__ compares the short entries too
        with r.cursor(1) as c:
            assert [c.take(e.op, 2**41 + 1) for e in ops] == ops
            c.finish()
        with r.cursor(1) as c, pytest.raises(RoundLogError, match=f"index {2**41} is outside"):
            c.take(3, 2**41)


def test_short_pinned_values_are_validated(tmp_path: Path) -> None:
    for field, value, match in [
        ("short_indices", np.array([0, 3, 9, 2**41]), "both a direction and a short"),
        ("short_indices", np.array([0, 3, 7, 2**41]), "both a pinned and a short"),
        ("short_indices", np.array([0, 3, 3, 2**41]), "strictly increasing"),
        ("short_indices", np.array([0, 3, 8]), "equal length"),
        ("short_bits", np.array([0, 1, 2, 3], np.int32), "uint16"),
    ]:
        bad = _short_entries()
        setattr(bad, field, value)
        with RoundLogWriter(tmp_path / "log") as w, pytest.raises(ValueError, match=match):
            w.write_step(1, [bad])
    # numel bounds the direction, pinned and short records together, checked before allocating
    raw = record(0, [0, 1], b"\x00") + pinned_record(0, [2], [1.0]) + short_record(0, [3, 1], [1, 2])
    path = tmp_path / "forged"
    forge(path, [segment(1, 3, raw)])
    with RoundLogReader(path) as r:
        with r.cursor(1) as c, pytest.raises(RoundLogError, match="record 2 \\(op 0\\): 2 entries plus 3"):
            c.take(0, 4)
        with r.cursor(1) as c:
            assert c.take(0, 5).short_indices.tolist() == [3, 4]
            c.finish()


# --- order-preserving FP32 keys ----------------------------------------------------------------

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=True, allow_subnormal=True)
EDGES = [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 1.1754944e-38, 3.4028235e38, -3.4028235e38, np.inf, -np.inf]


def test_keys_at_the_edges() -> None:
    v = np.array(EDGES, np.float32)
    k = key32(v).astype(np.int64)
    assert k[1] + 1 == k[0]  # -0 and +0 adjacent, -0 first
    assert k[0] + 1 == k[2] and k[3] + 1 == k[1]  # the smallest subnormals next to the zeros
    assert k[6] + 1 == key32(np.array([np.inf], np.float32))[0]  # FLT_MAX next to inf
    assert np.array_equal(from_key32(key32(v)).view(np.uint32), v.view(np.uint32))


@settings(max_examples=300, deadline=None)
@given(st.lists(finite32, min_size=2, max_size=20))
def test_key32_round_trips_and_is_monotone(xs: list[float]) -> None:
    v = np.array(xs, np.float32)
    k = key32(v)
    assert k.dtype == np.uint32
    assert np.array_equal(from_key32(k).view(np.uint32), v.view(np.uint32))
    for a, b, ka, kb in zip(v[:-1], v[1:], k[:-1], k[1:], strict=True):
        if a < b:
            assert ka < kb
        elif a > b:
            assert ka > kb
        else:  # equal values: the same key, except -0 < +0
            assert (ka == kb) == (np.signbit(a) == np.signbit(b))
        if a != np.inf:  # neighbouring values have neighbouring keys
            with np.errstate(over="ignore"):
                up = np.nextafter(a, np.float32(np.inf))  # FLT_MAX -> inf
            step = int(key32(np.array([up], np.float32))[0]) - int(ka)
            assert step == (2 if a == 0 and np.signbit(a) else 1)  # nextafter(-0) skips +0


@settings(max_examples=300, deadline=None)
@given(finite32, st.integers(-(1 << 15) + 1, (1 << 15) - 1))
def test_low16_reconstruction_is_exact_within_2_15_keys(x: float, diff: int) -> None:
    v = np.array([x], np.float32)
    k = int(key32(v)[0])
    near_key = k + diff
    if not 0 <= near_key < 1 << 32:
        near_key = k - diff
    near = from_key32(np.array([near_key], np.uint32))  # any bit pattern, NaN included
    got = nearest_with_low16(near, (key32(v) & 0xFFFF).astype(np.uint16))
    assert got.view(np.uint32)[0] == v.view(np.uint32)[0]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, (1 << 32) - 1), st.integers(0, (1 << 16) - 1))
def test_low16_reconstruction_stays_close_and_congruent(near_key: int, low: int) -> None:
    near = from_key32(np.array([near_key], np.uint32))
    got = int(key32(nearest_with_low16(near, np.array([low], np.uint16)))[0])
    assert got & 0xFFFF == low and abs(got - near_key) <= 1 << 16
    if (1 << 15) <= near_key < (1 << 32) - (1 << 15):
        assert abs(got - near_key) <= 1 << 15


# --- file objects ------------------------------------------------------------------------------


class SeekReadOnly:
    """A file object offering only seek, read and close: the reader must need nothing else."""

    def __init__(self, data: bytes) -> None:
        self._b = io.BytesIO(data)
        self.closed = False

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._b.seek(offset, whence)

    def read(self, n: int = -1) -> bytes:
        return self._b.read(n)

    def close(self) -> None:
        self.closed = True


def test_reader_accepts_file_objects(small_log: Path) -> None:
    expected = read_all(small_log)
    f = SeekReadOnly(small_log.read_bytes())
    with RoundLogReader(f) as r:  # type: ignore[arg-type]
        assert r.path is None and {s: r.read_step(s) for s in r.steps} == expected
    assert f.closed  # close() closes the file object
    fd = os.open(small_log, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fo, RoundLogReader(fo) as r:
        assert {s: r.read_step(s) for s in r.steps} == expected
    assert fo.closed
    # messages name the file "roundlog" (or the given name), never a path
    bad = bytearray(small_log.read_bytes())
    bad[16 + 36 + 3] ^= 0xFF
    with RoundLogReader(io.BytesIO(bytes(bad))) as r, pytest.raises(RoundLogError) as info:
        r.read_step(0)
    assert str(info.value) == "roundlog: segment 0 (step 0): checksum mismatch"
    with pytest.raises(RoundLogError, match="^bundle/roundlog: bad magic"):
        RoundLogReader(io.BytesIO(b"x" * 40), name="bundle/roundlog")
    closed = io.BytesIO(b"")
    closed.close()
    with pytest.raises(RoundLogError, match="^roundlog: cannot seek"):
        RoundLogReader(closed)


def test_closed_reader(small_log: Path) -> None:
    r = RoundLogReader(small_log)
    c = r.cursor(0)
    r.close()
    r.close()
    with pytest.raises(RoundLogError, match="reader is closed"):
        r.read_step(0)
    with pytest.raises(RoundLogError, match="reader is closed"):
        c.take(2, 1000)


# --- streaming cursor --------------------------------------------------------------------------


def test_cursor_matches_read_step_on_random_logs(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    p = tmp_path / "c.rlog"
    with RoundLogWriter(p) as w:
        for s in range(1, 30):
            w.write_step(s, random_ops(rng, int(rng.integers(0, 12)), 300, pinned=True))
    with RoundLogReader(p) as r:
        for s in r.steps:
            full = r.read_step(s)
            records = sum(n_records(e) for e in full.values())
            # ask for a random subset of the logged ops, plus ops that were not logged
            asked = sorted(set(rng.choice(5010, size=8).tolist()) | {op for op in full if rng.random() < 0.6})
            with r.cursor(s) as c:
                for op in asked:
                    got = c.take(op, 1 << 20)
                    assert got == full.get(op)
                c.finish()
                unasked = [e for op, e in full.items() if op not in asked]
                assert c.skipped_records == sum(n_records(e) for e in unasked)
                assert records - c.skipped_records == sum(n_records(full[op]) for op in asked if op in full)
                c.finish()  # idempotent
                with pytest.raises(ValueError, match="finished"):
                    c.take(6000, 1)


def test_cursor_on_step_without_segment_and_order_rule(small_log: Path) -> None:
    with RoundLogReader(small_log) as r:
        with r.cursor(1) as c:  # no segment: no records
            assert c.take(0, 10) is None
            c.finish()
        with r.cursor(0) as c:
            assert c.take(1, 1000) is None  # op 2 is later
            with pytest.raises(ValueError, match="increasing order"):
                c.take(1, 1000)
            with pytest.raises(ValueError):
                c.take(3, -1)
            assert c.take(2, 101).indices.tolist() == [1, 5, 6, 100]
            c.finish()


def test_cursor_bounds_counts_by_numel(tmp_path: Path) -> None:
    p = tmp_path / "n.rlog"

    def log(dir_deltas: list[int], pinned_deltas: list[int]) -> RoundLogReader:
        raw = record(0, dir_deltas, b"\x00") + pinned_record(0, pinned_deltas, [1.0] * len(pinned_deltas))
        forge(p, [segment(1, 2, raw)])
        return RoundLogReader(p)

    def refused(r: RoundLogReader, numel: int, match: str) -> None:
        with r.cursor(1) as c, pytest.raises(RoundLogError, match=match):
            c.take(0, numel)

    with log([0, 1, 1], [3, 1]) as r:  # direction 0, 1, 2; pinned 3, 4
        refused(r, 2, "record 0 \\(op 0\\): 3 entries exceed the op output's 2 elements")
        # the pinned count is bounded by what the direction record left, before reading it
        refused(r, 4, "record 1 \\(op 0\\): 2 entries plus 3 direction entries exceed the op output's 4")
        with r.cursor(1) as c:
            e = c.take(0, 5)
            assert e.indices.tolist() == [0, 1, 2] and e.pinned_indices.tolist() == [3, 4]
            c.finish()
        with pytest.raises(RoundLogError, match="exceed the limit of 2 per record"):
            r.read_step(1, max_entries=2)
        assert r.read_step(1, max_entries=3)[0] == e
    with log([0, 1, 4], [2, 1]) as r:  # direction 0, 1, 5
        refused(r, 5, "record 0 \\(op 0\\): index 5 is outside the op output's 5 elements")
    with log([0, 1, 1], [3, 4]) as r:  # pinned 3, 7
        refused(r, 7, "record 1 \\(op 0\\): index 7 is outside the op output's 7 elements")


def test_cursor_refuses_a_huge_count_before_allocating(tmp_path: Path) -> None:
    # a record claiming 2**32 - 1 entries; the payload is tiny, so the header already overruns it
    p = tmp_path / "huge.rlog"
    forge(p, [segment(1, 1, struct.pack("<IIB", 0, (1 << 32) - 1, 8) + b"\x00" * 100)])
    with RoundLogReader(p) as r:
        tracemalloc.start()
        try:
            for numel in (10, 1 << 40):
                with r.cursor(1) as c, pytest.raises(RoundLogError, match="overrun the payload"):
                    c.take(0, numel)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 4 << 20


def test_finish_catches_leftovers(tmp_path: Path) -> None:
    p = tmp_path / "left.rlog"
    good = record(0, [1], b"\x80") + record(5, [2], b"\x00") + pinned_record(5, [3], [1.0])
    forge(p, [segment(1, 3, good)])
    with RoundLogReader(p) as r, r.cursor(1) as c:
        assert c.take(0, 10) is not None
        c.finish()  # op 5's two records: skipped and counted, not an error
        assert c.skipped_records == 2
    forge(p, [segment(1, 2, good)])  # the third record is garbage left over: trailing bytes
    with RoundLogReader(p) as r, r.cursor(1) as c:
        assert c.take(0, 10) is not None and c.take(5, 10) is not None
        with pytest.raises(RoundLogError, match="trailing bytes after 2 records"):
            c.finish()
    broken = record(0, [1], b"\x80") + record(3, [1], b"\x80") + struct.pack("<IIB", 3, 1, 4) + bytes(5)
    forge(p, [segment(1, 3, broken)])
    with RoundLogReader(p) as r, r.cursor(1) as c:
        assert c.take(0, 10) is not None
        with pytest.raises(RoundLogError, match="record 2 \\(op 3\\): op not greater"):
            c.finish()  # op 3's record is skipped; the one after it is broken


def _bomb_segment(step: int, count: int, raw_len: int) -> bytes:
    """A segment whose ~32 KB zstd frame decompresses to ``raw_len`` bytes: one direction-record
    header claiming ``count`` entries, then zeros. Compressed in a stream, never held raw."""
    cobj = zstandard.ZstdCompressor(level=1).compressobj(size=raw_len)
    parts = [cobj.compress(struct.pack("<IIB", 0, count, 4))]
    zeros, left = bytes(1 << 24), raw_len - 9
    while left:
        n = min(left, len(zeros))
        parts.append(cobj.compress(zeros if n == len(zeros) else zeros[:n]))
        left -= n
    parts.append(cobj.flush())
    comp = b"".join(parts)
    head = SEG.pack(b"RSEG", step, 1, raw_len, len(comp), 0)[:32]
    return head + struct.pack("<I", zlib.crc32(comp, zlib.crc32(head))) + comp


def test_decompression_bomb_is_refused_with_bounded_memory(tmp_path: Path) -> None:
    k = 32_000_000
    count, raw_len = 8 * k, 9 + 33 * k  # 256 M entries: 4-byte deltas + bits fill 1.06 GB exactly
    p = tmp_path / "bomb.rlog"
    forge(p, [_bomb_segment(1, count, raw_len)])
    assert p.stat().st_size < 64 << 10
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    tracemalloc.start()
    try:
        with RoundLogReader(p, max_raw_bytes=1 << 31) as r:
            with r.cursor(1) as c, pytest.raises(RoundLogError, match="exceed the op output's 1000000"):
                c.take(0, 1_000_000)  # refused from the header alone
            with pytest.raises(RoundLogError, match="exceed the limit of 67108864 per record"):
                r.read_step(1)  # read_step's own cap
            with r.cursor(1) as c:  # never asked for: the whole GB is read and discarded in chunks
                assert c.take(1, 10) is None
                c.finish()
                assert c.skipped_records == 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    assert peak < 8 << 20, peak
    assert rss_growth < 100 << 10, rss_growth  # KiB; zstd's own buffers are not traced
    # a header that claims more than the frame holds is caught before decompressing anything
    data = bytearray(p.read_bytes())
    data[16 + 16 : 16 + 24] = struct.pack("<Q", 1 << 30)
    head = bytes(data[16 : 16 + 32])
    data[16 + 32 : 16 + 36] = struct.pack("<I", zlib.crc32(bytes(data[16 + 36 :]), zlib.crc32(head)))
    p.write_bytes(bytes(data))
    assert_rejected(p, f"zstd frame declares {raw_len} bytes, header says {1 << 30}")


def test_take_memory_is_bounded_by_numel(tmp_path: Path) -> None:
    """The docs' bound: one take() allocates at most 12 bytes per output element, plus a few MiB."""
    numel = 1 << 20
    rng = np.random.default_rng(8)
    every = np.arange(numel, dtype=np.int64)
    half = rng.random(numel) < 0.5
    ones = np.ones(numel, np.float32)
    steps = {
        1: OpEntries(0, every[:0], half[:0], every, ones),  # all pinned: the worst case
        2: OpEntries(0, every, half),  # all directions
        3: OpEntries(0, every[half], half[half], every[~half], ones[~half]),
    }
    p = tmp_path / "mem.rlog"
    with RoundLogWriter(p, level=1) as w:
        for s, e in steps.items():
            w.write_step(s, [e])
    with RoundLogReader(p) as r:
        for s, e in steps.items():
            tracemalloc.start()
            try:
                with r.cursor(s) as c:
                    got = c.take(0, numel)
                    c.finish()
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert got == e
            assert peak < 12 * numel + (4 << 20), (s, peak / numel)
            del got


def test_cursor_is_closed_after_an_error(tmp_path: Path) -> None:
    p = tmp_path / "e.rlog"
    forge(p, [segment(1, 2, record(0, [1, 2], b"\x81") + record(3, [1], b"\x80"))])
    with RoundLogReader(p) as r, r.cursor(1) as c:
        with pytest.raises(RoundLogError, match="padding bits"):
            c.take(0, 10)
        with pytest.raises(ValueError, match="closed"):
            c.take(3, 10)
        c.finish()  # closed: nothing left to check
