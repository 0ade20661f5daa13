"""Tests for detrl.roundlog: round trips, size, and rejection of every kind of malformed file.

Forged files are built by hand from the layout in docs/roundlog.md (not via the module's
private helpers), so these tests also check that the implementation matches the spec.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import zstandard

from detrl.roundlog import (
    FORMAT_VERSION,
    OpEntries,
    RoundLogError,
    RoundLogReader,
    RoundLogWriter,
    dense_reference_bytes,
    rewrite,
)

HEADER = struct.Struct("<8sHHI")
SEG = struct.Struct("<4sQIQQI")
TRAILER = struct.Struct("<QQII8s")


# --- helpers -------------------------------------------------------------------------------------


def random_ops(
    rng: np.random.Generator, n_ops: int, max_entries: int, space: int = 1 << 20
) -> list[OpEntries]:
    """Random sparse entries: ``n_ops`` distinct sorted op positions, each with sorted unique indices."""
    ops = []
    for op in np.sort(rng.choice(5000, size=n_ops, replace=False)):
        n = int(rng.integers(1, max_entries + 1))
        idx = np.sort(rng.choice(space, size=n, replace=False)).astype(np.int64)
        ops.append(OpEntries(int(op), idx, rng.random(n) < 0.5))
    return ops


def as_dict(ops: list[OpEntries]) -> dict[int, OpEntries]:
    return {e.op: e for e in ops}


def record(op: int, deltas: list[int], bits: bytes, width: int = 4) -> bytes:
    """One raw op record, per the spec: header, deltas in byte planes (all byte 0s, then all byte 1s, ...)."""
    words = [d.to_bytes(width, "little") for d in deltas]
    planes = bytes(w[b] for b in range(width) for w in words)
    return struct.pack("<IIB", op, len(deltas), width) + planes + bits


def segment(
    step: int, n_ops: int, raw: bytes, raw_len: int | None = None, comp: bytes | None = None
) -> bytes:
    """A segment with a correct CRC; ``raw_len``/``comp`` let a test make the header lie."""
    comp = zstandard.ZstdCompressor().compress(raw) if comp is None else comp
    head = SEG.pack(b"RSEG", step, n_ops, len(raw) if raw_len is None else raw_len, len(comp), 0)[:32]
    return head + struct.pack("<I", zlib.crc32(comp, zlib.crc32(head))) + comp


def forge(path: Path, segments: list[tuple[int, bytes]], version: int = FORMAT_VERSION) -> None:
    """Write a complete file from (step, segment bytes) with a correct index and trailer."""
    body = HEADER.pack(b"DTRLRLOG", version, 0, 0)
    index = b""
    for step, seg in segments:
        index += struct.pack("<QQ", step, len(body))
        body += seg
    trailer = TRAILER.pack(len(body), len(segments), zlib.crc32(index), 0, b"DTRLREND")
    path.write_bytes(body + index + trailer)


def reindex(data: bytes, entries: list[tuple[int, int]]) -> bytes:
    """Replace the index of a complete file by ``entries`` with a correct CRC."""
    index_offset, n, _, _, _ = TRAILER.unpack(data[-32:])
    index = b"".join(struct.pack("<QQ", s, o) for s, o in entries)
    trailer = TRAILER.pack(index_offset, len(entries), zlib.crc32(index), 0, b"DTRLREND")
    return data[:index_offset] + index + trailer


def read_all(path: Path) -> dict[int, dict[int, OpEntries]]:
    with RoundLogReader(path) as r:
        return {s: r.read_step(s) for s in r.steps}


def assert_rejected(path: Path, match: str = "") -> RoundLogError:
    """Opening and reading every step must raise RoundLogError naming the file."""
    with pytest.raises(RoundLogError) as info:
        read_all(path)
    msg = str(info.value)
    assert msg.startswith(f"roundlog: {path}"), msg
    assert match in msg, msg
    return info.value


@pytest.fixture
def small_log(tmp_path: Path) -> Path:
    """A small valid log: 3 segments, one empty, one with a width-8 record."""
    p = tmp_path / "small.rlog"
    with RoundLogWriter(p) as w:
        w.write_step(0, [OpEntries(2, np.array([1, 5, 6, 100]), np.array([1, 0, 1, 1], bool))])
        w.write_step(3, [])
        w.write_step(7, [OpEntries(0, np.array([3, 1 << 40]), np.array([0, 1], bool))])
    return p


# --- round trips -------------------------------------------------------------------------------


def test_round_trip_many_steps(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    p = tmp_path / "log.rlog"
    expected: dict[int, dict[int, OpEntries]] = {}
    with RoundLogWriter(p) as w:
        for step in range(0, 200, 3):  # gaps between steps
            ops = [] if step % 4 == 0 else random_ops(rng, int(rng.integers(1, 20)), 50)
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
    with RoundLogReader(p) as r:
        assert r.steps == sorted(expected)
        for step, ops in expected.items():
            got = r.read_step(step)
            assert got == ops
            for e in got.values():
                assert e.indices.dtype == np.int64 and e.up.dtype == bool
        assert r.read_step(1) == {} and r.segment_bytes(1) == 0
        assert sum(r.segment_bytes(s) for s in r.steps) == size - 16 - 16 * len(r.steps) - 32


def test_empty_file_and_empty_ops_dropped(tmp_path: Path) -> None:
    p = tmp_path / "empty.rlog"
    RoundLogWriter(p).close()
    assert read_all(p) == {}
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


# --- writer input validation -------------------------------------------------------------------


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
        [OpEntries(0, [[1]], [[1]])],  # not 1-D
        ["not an OpEntries"],
    ],
)
def test_writer_rejects_bad_input(tmp_path: Path, ops: list) -> None:
    with RoundLogWriter(tmp_path / "w.rlog") as w, pytest.raises(ValueError):
        w.write_step(0, ops)


def test_writer_rejects_bad_steps(tmp_path: Path) -> None:
    with RoundLogWriter(tmp_path / "w.rlog") as w:
        w.write_step(4, [])
        for bad in (4, 3, -1, 1 << 64, True, 5.0):
            with pytest.raises(ValueError):
                w.write_step(bad, [])
    with pytest.raises(ValueError):
        w.write_step(10, [])  # closed


# --- malformed files ---------------------------------------------------------------------------


def test_truncated_everywhere(small_log: Path, tmp_path: Path) -> None:
    data = small_log.read_bytes()
    p = tmp_path / "cut.rlog"
    for cut in range(len(data)):  # header, segment headers, payloads, index, trailer
        p.write_bytes(data[:cut])
        assert_rejected(p)
    p.write_bytes(b"")
    assert_rejected(p, "truncated")
    p.write_bytes(data[:-1])
    assert_rejected(p, "trailer")


def test_any_flipped_byte_is_detected(small_log: Path, tmp_path: Path) -> None:
    data = small_log.read_bytes()
    p = tmp_path / "flip.rlog"
    for pos in range(len(data)):
        for mask in (0x01, 0x80):
            bad = bytearray(data)
            bad[pos] ^= mask
            p.write_bytes(bytes(bad))
            assert_rejected(p)


def test_payload_flip_reports_checksum(small_log: Path, tmp_path: Path) -> None:
    data = bytearray(small_log.read_bytes())
    data[16 + 36 + 3] ^= 0xFF  # inside segment 0's compressed payload
    p = tmp_path / "crc.rlog"
    p.write_bytes(bytes(data))
    with RoundLogReader(p) as r:  # open only checks headers; the payload CRC is checked on read
        assert r.read_step(3) == {}
        with pytest.raises(RoundLogError, match="segment 0 \\(step 0\\): checksum mismatch"):
            r.read_step(0)


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
        assert_rejected(p)


def test_wrong_magic_and_version(small_log: Path, tmp_path: Path) -> None:
    data = small_log.read_bytes()
    p = tmp_path / "m.rlog"
    p.write_bytes(b"NOTALOG!" + data[8:])
    assert_rejected(p, "bad magic")
    forge(p, [], version=7)
    assert_rejected(p, "unsupported format version 7 (this detrl reads version 1)")


def test_zero_length_and_directory(tmp_path: Path) -> None:
    p = tmp_path / "zero.rlog"
    p.write_bytes(b"")
    assert_rejected(p, "truncated")
    assert_rejected(tmp_path, "cannot open")
    assert_rejected(tmp_path / "missing.rlog", "cannot open")


def test_index_out_of_bounds_and_disagreeing(small_log: Path, tmp_path: Path) -> None:
    data = small_log.read_bytes()
    with RoundLogReader(small_log) as r:
        sizes = [r.segment_bytes(s) for s in r.steps]
    offsets = [16, 16 + sizes[0], 16 + sizes[0] + sizes[1]]
    p = tmp_path / "idx.rlog"
    cases = [
        ("segment offset", [(0, 16), (3, 1 << 40), (7, offsets[2])]),
        ("segment offset", [(0, 16), (3, offsets[1] + 1), (7, offsets[2])]),
        ("not greater than previous", [(0, 16), (0, offsets[1]), (7, offsets[2])]),
        ("index says step 4", [(0, 16), (4, offsets[1]), (7, offsets[2])]),
        ("unindexed bytes", [(0, 16), (3, offsets[1])]),
    ]
    for match, entries in cases:
        p.write_bytes(reindex(data, entries))
        assert_rejected(p, match)
    # trailer pointing outside the file
    idx_off, n, crc, _, _ = TRAILER.unpack(data[-32:])
    for bad_off, bad_n in ((1 << 60, n), (0, n), (idx_off, n + 1), (idx_off, 1 << 62)):
        p.write_bytes(data[:-32] + TRAILER.pack(bad_off, bad_n, crc, 0, b"DTRLREND"))
        assert_rejected(p, "does not end at the trailer")
    p.write_bytes(data[:-32] + TRAILER.pack(idx_off, n, crc ^ 1, 0, b"DTRLREND"))
    assert_rejected(p, "index checksum mismatch")


def test_raw_length_lies(tmp_path: Path) -> None:
    raw = record(0, [1, 2, 3], b"\xa0")
    p = tmp_path / "raw.rlog"
    forge(p, [(0, segment(0, 1, raw))])
    assert read_all(p)[0][0] == OpEntries(0, np.array([1, 3, 6]), np.array([1, 0, 1], bool))
    forge(p, [(0, segment(0, 1, raw, raw_len=1 << 40))])
    assert_rejected(p, "exceeds limit")
    forge(p, [(0, segment(0, 1, raw, raw_len=len(raw) + 1))])
    assert_rejected(p, "zstd frame declares")
    # frame without a declared content size
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    forge(p, [(0, segment(0, 1, raw, comp=no_size))])
    assert_rejected(p, "zstd frame declares")
    # trailing data after the frame, and two frames
    comp = zstandard.ZstdCompressor().compress(raw)
    forge(p, [(0, segment(0, 1, raw, comp=comp + b"xyz"))])
    assert_rejected(p, "exactly one complete zstd frame")
    forge(p, [(0, segment(0, 1, raw, comp=comp[:-2]))])
    assert_rejected(p)
    forge(p, [(0, segment(0, 1, raw, comp=b"garbage!" * 4))])
    assert_rejected(p, "zstd")
    forge(p, [(0, segment(0, 1, raw))])
    with pytest.raises(RoundLogError, match="exceeds limit 4"):
        RoundLogReader(p, max_raw_bytes=4)


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
        (struct.pack("<IIB", 0, 1000, 4) + b"\x00" * 20, 1, "overrun the payload"),
        (struct.pack("<IIB", 0, 0, 4) + b"\x00" * 5, 1, "empty record"),
        (record(0, [1], b"\x00")[:-1] + b"\x00" * 5, 1, "trailing"),
    ],
)
def test_bad_records(tmp_path: Path, raw: bytes, n_ops: int, match: str) -> None:
    p = tmp_path / "rec.rlog"
    forge(p, [(0, segment(0, 0, b"")), (4, segment(4, n_ops, raw))])
    assert_rejected(p, match)


def test_bad_segment_header(tmp_path: Path) -> None:
    p = tmp_path / "seg.rlog"
    good = segment(2, 0, b"")
    forge(p, [(2, b"XSEG" + good[4:])])
    assert_rejected(p, "bad segment tag")
    forge(p, [(2, segment(3, 0, b""))])
    assert_rejected(p, "header says step 3, index says step 2")
    forge(p, [(2, segment(2, 0, b"", raw_len=0, comp=b""))])  # empty payload is not a zstd frame
    assert_rejected(p, "zstd")
    # comp_len pointing past the index
    head = SEG.pack(b"RSEG", 2, 0, 0, 1 << 40, 0)
    forge(p, [(2, head + b"\x00" * 9)])
    assert_rejected(p, "overruns the index")


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
        op=4, indices=np.zeros(0, np.int64), up=np.zeros(0, bool),
        pinned_indices=np.array([0], np.int64), pinned_values=np.array([3.25], np.float32),
    )  # fmt: skip
    with RoundLogWriter(path) as w:
        w.write_step(1, [_pinned_entries(), only_pinned])
    with RoundLogReader(path) as r:
        got = r.read_step(1)
    assert got[3] == _pinned_entries() and got[4] == only_pinned


def test_pinned_values_are_validated(tmp_path: Path) -> None:
    bad = _pinned_entries()
    bad.pinned_indices = np.array([1, 7, 2**40], dtype=np.int64)  # element 1 also has a direction
    with (
        RoundLogWriter(tmp_path / "log") as w,
        pytest.raises(ValueError, match="both a direction and a pinned"),
    ):
        w.write_step(1, [bad])
    # a forged pinned record overlapping a direction record, with a valid checksum
    planes = bytes([1]) + bytes(3)  # one delta = 1, byte planes
    pinned = struct.pack("<IIB", 0, 1, 4 | 0x80) + planes + np.array([1.0], "<f4").tobytes()
    raw = record(0, [1], bytes([0x80])) + pinned
    path = tmp_path / "forged"
    forge(path, [(1, segment(1, 2, raw))])
    with RoundLogReader(path) as r, pytest.raises(RoundLogError, match="also has a direction entry"):
        r.read_step(1)
