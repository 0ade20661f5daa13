"""Mutation fuzzing of the run-bundle readers (``detrl bench fuzz`` and ``tests/test_bundle_fuzz.py``).

A bundle comes from an untrusted party, so every reader of its files must either accept the input or
raise its one error type: :class:`~detrl.formats.bundle.BundleError` for the manifest, commitments and
checkpoint readers and for :class:`~detrl.formats.bundle.Bundle`, :class:`~detrl.formats.roundlog.RoundLogError` for the
rounding-log reader and its step cursors. Anything else (an ``IndexError``, a ``RecursionError``, a
``MemoryError``, a ``struct.error`` ...) is a bug.

:func:`fuzz_case` runs one case: it takes a real bundle's files (:class:`BaseBundle`), damages one of
them (truncations, bit flips, insertions and deletions, huge length fields, JSON values of the wrong
type, deep nesting, unrepresentable numbers, rebuilt log segments with valid checksums around damaged
records, files swapped for links, FIFOs or directories), sometimes re-signs the manifest so the damage
gets past the Merkle and SHA-256 checks to the reader behind them, runs the reader and returns the
outcome (``"<target>:accepted"`` or ``"<target>:<ErrorType>"``). An exception the target does not allow
escapes to the caller. A case is a pure function of its ``random.Random``, so ``fuzz_case(Random(s), base)``
replays it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import math
import os
import random
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

from detrl.formats import bundle as bundle_mod
from detrl.formats import safeio
from detrl.formats.bundle import BundleError, Caps
from detrl.formats.roundlog import (
    HEADER_BYTES,
    RECORD_HEADER,
    SEGMENT_HEADER,
    SEGMENT_TAG,
    RoundLogError,
    RoundLogReader,
)

#: What fuzz_case damages; "bundle" damages one file of a bundle directory and opens it with Bundle.
TARGETS = ("manifest", "commitments", "checkpoint", "roundlog", "bundle")

# The layouts come from the format modules (docs/roundlog.md), so a fuzzer never disagrees with the reader.
_LOG_HEADER_BYTES = HEADER_BYTES
_SEG = SEGMENT_HEADER
_REC = RECORD_HEADER
_COMMIT_HEADER_BYTES = bundle_mod.COMMIT_HEADER.size
_COMMIT_RECORD_BYTES = bundle_mod.COMMIT_RECORD.size

INTERESTING_INTS = (
    0, 1, 2, 7, 8, 255, 256, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53 + 1,
    2**62, 2**63 - 1, 2**63, 2**64 - 1,
)  # fmt: skip


def hostile_values() -> list[Any]:
    """JSON values of every type and of awkward size, for replacing a field (all JSON-encodable)."""
    deep: Any = 0
    for _ in range(40):  # deeper than safeio.loads_json allows
        deep = [deep]
    nested: Any = 0
    for _ in range(20):  # deep, but within the limit
        nested = {"a": nested}
    return [
        None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, 10**30, -(10**30), 2**128 - 1, 1.5, -0.0, 1e308,
        -1e308, 5e-324, "", "x", "0" * 64, "f" * 64, "\u0000", "\udcff", "\u2603", "../etc/passwd",
        "/etc/passwd", "x" * 10_000, [], [1, 2], [None], {}, {"a": 1}, {"": None}, deep, nested,
    ]  # fmt: skip


@dataclasses.dataclass
class Segment:
    """One segment of a rounding log: its header fields, compressed and decompressed payload."""

    step: int
    n_ops: int
    comp: bytes
    raw: bytes


@dataclasses.dataclass
class BaseBundle:
    """The files of a real bundle (``rel -> bytes``) and a scratch copy in ``workdir`` that bundle cases
    damage and :func:`fuzz_case` restores afterwards."""

    files: dict[str, bytes]
    manifest: dict[str, Any]
    segments: list[Segment]
    #: step -> [(op, number of elements that op's log entries span)], for cursors that take real ops
    ops: dict[int, list[tuple[int, int]]]
    workdir: Path

    @classmethod
    def load(cls, run_dir: str | os.PathLike, workdir: str | os.PathLike) -> BaseBundle:
        """Read the bundle in ``run_dir`` (it must be valid) and copy it to ``workdir`` (created)."""
        import zstandard

        run_dir, workdir = Path(run_dir), Path(workdir)
        files = {rel: (run_dir / rel).read_bytes() for rel in bundle_mod.BUNDLE_ENTRIES[:3]}
        for p in sorted((run_dir / bundle_mod.CHECKPOINTS).iterdir()):
            files[f"{bundle_mod.CHECKPOINTS}/{p.name}"] = p.read_bytes()
        manifest = json.loads(files[bundle_mod.MANIFEST])
        log = files[bundle_mod.ROUNDLOG]
        segments, pos = [], _LOG_HEADER_BYTES
        dctx = zstandard.ZstdDecompressor()
        while pos + _SEG.size <= len(log):
            _, step, n_ops, raw_len, comp_len, _ = _SEG.unpack_from(log, pos)
            comp = log[pos + _SEG.size : pos + _SEG.size + comp_len]
            segments.append(Segment(step, n_ops, comp, dctx.decompress(comp, max_output_size=raw_len)))
            pos += _SEG.size + comp_len
        ops: dict[int, list[tuple[int, int]]] = {}
        with RoundLogReader(io.BytesIO(log)) as reader:
            for step in reader.steps:
                entries = reader.read_step(step)
                ops[step] = [(op, 1 + max(e.last_index(), 0)) for op, e in sorted(entries.items())]
        if workdir.exists():
            shutil.rmtree(workdir)
        (workdir / bundle_mod.CHECKPOINTS).mkdir(parents=True)
        base = cls(files, manifest, segments, ops, workdir)
        for rel in files:
            base.restore(rel)
        return base

    def checkpoint_rels(self) -> list[str]:
        return [rel for rel in self.files if rel.startswith(bundle_mod.CHECKPOINTS + "/")]

    def restore(self, rel: str) -> None:
        """Put ``rel`` (a file, or the checkpoints folder) in the scratch copy back as it was."""
        path = self.workdir / rel
        _remove(path)
        if rel == bundle_mod.CHECKPOINTS:
            path.mkdir()
            for r in self.checkpoint_rels():
                (self.workdir / r).write_bytes(self.files[r])
        else:
            path.write_bytes(self.files[rel])


def _remove(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


# ------------------------------------------------------------------------------------------ byte edits
def _blob(rng: random.Random, n: int) -> bytes:
    return rng.getrandbits(8 * n).to_bytes(n, "little") if n else b""


def _pos(rng: random.Random, size: int) -> int:
    """A position in ``0..size``, often near the start (where the headers and length fields are)."""
    if size == 0:
        return 0
    return rng.randint(0, min(size, 64)) if rng.random() < 0.4 else rng.randint(0, size)


def _int(rng: random.Random, size: int) -> int:
    """An integer for a length or count field: a boundary value, near the data's size, or random."""
    r = rng.random()
    if r < 0.5:
        return rng.choice(INTERESTING_INTS)
    if r < 0.75:
        return max(0, size + rng.randint(-3, 3))
    return rng.getrandbits(rng.choice((8, 16, 32, 64)))


#: Byte edits: ``(kind, position, argument)``; the position wraps around the data's length (so any
#: integer is a valid position), the argument is a bit index, byte, length or integer value by kind.
EDITS = ("flip", "set", "truncate", "insert", "delete", "dup", "u32", "u64")


def apply_edit(buf: bytearray, kind: str, pos: int, arg: int) -> None:
    """Apply one byte edit to ``buf`` in place (see :data:`EDITS`)."""
    pos %= len(buf) + 1
    last = min(pos, len(buf) - 1)
    if kind == "flip" and buf:
        buf[last] ^= 1 << (arg % 8)
    elif kind == "set" and buf:
        buf[last] = arg % 256
    elif kind == "truncate":
        del buf[pos:]
    elif kind == "insert":
        buf[pos:pos] = (arg.to_bytes(8, "little") * 38)[: arg % 301]
    elif kind == "delete":
        del buf[pos : pos + arg % 301]
    elif kind == "dup":
        buf[pos:pos] = buf[pos : pos + 1 + arg % 200]
    elif kind in ("u32", "u64"):
        width = 4 if kind == "u32" else 8
        buf[pos : pos + width] = (arg % (1 << (8 * width))).to_bytes(width, "little")


def apply_edits(data: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, pos, arg in edits:
        apply_edit(buf, kind, pos, arg)
    return bytes(buf)


def random_edits(rng: random.Random, size: int, n: int | None = None) -> list[tuple[str, int, int]]:
    """1..4 random edits for data of ``size`` bytes, positions often near the start (the headers)."""
    edits = []
    for _ in range(n if n is not None else rng.choice((1, 1, 1, 2, 3, 4))):
        kind = rng.choice(("flip", "flip", "set", "truncate", "insert", "delete", "dup", "u32", "u64"))
        if kind in ("u32", "u64"):
            arg = _int(rng, size)
        elif kind in ("insert", "delete"):
            arg = rng.choice((1, 2, 4, 8, 37, 76, rng.randint(0, 300)))
        else:
            arg = rng.getrandbits(64)
        edits.append((kind, _pos(rng, size), arg))
    return edits


def mutate_bytes(rng: random.Random, data: bytes, edits: int | None = None) -> bytes:
    """``data`` after 1..4 random byte edits (bit flip, byte set, truncation, insertion of random bytes,
    deletion, duplicated range, or a 4- or 8-byte little-endian integer written over it: a length field)."""
    out = apply_edits(data, random_edits(rng, len(data), edits))
    if rng.random() < 0.2:  # random bytes, not a pattern
        at = _pos(rng, len(out))
        out = out[:at] + _blob(rng, rng.randint(1, 64)) + out[at:]
    return out


# ------------------------------------------------------------------------------------------ JSON edits
def json_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every node's path in a JSON value (dict keys and list indices), the root ``()`` first."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += json_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += json_paths(v, (*prefix, i))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def mutate_json(rng: random.Random, obj: Any) -> Any:
    """A copy of ``obj`` with one node replaced by a hostile value, deleted, wrapped, or given a key."""
    obj = copy.deepcopy(obj)
    paths = json_paths(obj)
    shallow = [p for p in paths if 1 <= len(p) <= 2]
    r = rng.random()
    path = rng.choice(shallow if r < 0.4 and shallow else paths[1:] if len(paths) > 1 and r < 0.97 else paths)
    value: Any = rng.choice(hostile_values())
    kind = rng.choice(("replace", "replace", "replace", "delete", "wrap", "add", "number"))
    if not path:
        return value if kind != "wrap" else [obj]
    parent, key = _get(obj, path[:-1]), path[-1]
    node = parent[key]
    if kind == "delete":
        del parent[key]
    elif kind == "wrap":
        parent[key] = rng.choice(([node], {"x": node}, str(node)[:100]))
    elif kind == "add" and isinstance(node, dict):
        node[rng.choice(("extra", "", "format", "step", "__metadata__", "x" * 300))] = value
    elif kind == "number" and isinstance(node, (int, float)) and not isinstance(node, bool):
        big = float(node) * 1e300
        parent[key] = rng.choice(
            (-node, node + 1, node * 2**70, big if math.isfinite(big) else 1e308, int(node) ^ 1)
        )
    else:
        parent[key] = value
    return obj


#: Strings that are not the JSON a field holds: a lone surrogate (not UTF-8), deep, duplicate keys ...
HOSTILE_TEXTS = (
    "\udcff", '{"a": "\udcff"}', "[" * 40 + "]" * 40, "", "null", "[]", "{}", "1e999", '{"a": 1, "a": 2}',
    "\x00", "{" * 5, "NaN",
)  # fmt: skip
_NUMBER = re.compile(rb"(?<![\w.\"])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.\"])")
_UNREPRESENTABLE = (b"1e999", b"-1e999", b"1" + b"0" * 400, b"NaN", b"Infinity", b"-Infinity", b"1" * 41)


def encode_json(rng: random.Random, obj: Any) -> bytes:
    """JSON bytes of ``obj``, sometimes with a number literal swapped for one that JSON or a float cannot
    hold (``1e999``, a 401-digit integer, ``NaN``), a duplicated key, or non-canonical spacing."""
    text = safeio.dumps_json(obj) if rng.random() < 0.7 else json.dumps(obj, allow_nan=False).encode()
    r = rng.random()
    if r < 0.15:
        numbers = list(_NUMBER.finditer(text))
        if numbers:
            m = rng.choice(numbers)
            text = text[: m.start()] + rng.choice(_UNREPRESENTABLE) + text[m.end() :]
    elif r < 0.2 and text.startswith(b"{") and len(text) > 2:
        text = b'{"format": "x", ' + text[1:]  # a duplicate key
    return text


# ------------------------------------------------------------------------------------------ per target
def manifest_bytes(rng: random.Random, base: BaseBundle) -> bytes:
    if rng.random() < 0.6:
        return encode_json(rng, mutate_json(rng, base.manifest))
    return mutate_bytes(rng, base.files[bundle_mod.MANIFEST])


def commitments_bytes(rng: random.Random, base: BaseBundle) -> bytes:
    data = mutate_bytes(rng, base.files[bundle_mod.COMMITMENTS])
    if rng.random() < 0.5:  # re-seal every record, so the step and hash fields are what is damaged
        buf = bytearray(data)
        for start in range(_COMMIT_HEADER_BYTES, len(buf) - _COMMIT_RECORD_BYTES + 1, _COMMIT_RECORD_BYTES):
            body = bytes(buf[start : start + _COMMIT_RECORD_BYTES - 4])
            buf[start + _COMMIT_RECORD_BYTES - 4 : start + _COMMIT_RECORD_BYTES] = struct.pack(
                "<I", zlib.crc32(body)
            )
        data = bytes(buf)
    return data


def checkpoint_bytes(rng: random.Random, data: bytes) -> bytes:
    r = rng.random()
    if r < 0.5 and len(data) >= 8:
        n = int.from_bytes(data[:8], "little")
        try:
            header = json.loads(data[8 : 8 + n])
        except ValueError:
            return mutate_bytes(rng, data)
        meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
        if rng.random() < 0.4 and isinstance(meta, dict) and isinstance(meta.get("detrl"), str):
            if rng.random() < 0.3:  # the metadata string itself: not JSON, deep, a lone surrogate ...
                meta["detrl"] = rng.choice(HOSTILE_TEXTS)
            else:  # a value inside it, the string kept raw (a surrogate stays one) or ASCII-escaped
                inner = mutate_json(rng, json.loads(meta["detrl"]))
                meta["detrl"] = json.dumps(inner, ensure_ascii=rng.random() < 0.5)
        else:
            header = mutate_json(rng, header)
        raw = encode_json(rng, header)
        raw += b" " * (-len(raw) % 8)
        length = len(raw) if rng.random() < 0.9 else _int(rng, len(raw)) % 2**64
        return length.to_bytes(8, "little") + raw + data[8 + n :]
    if r < 0.6:  # a huge or off-by-some header length
        return (_int(rng, len(data)) % 2**64).to_bytes(8, "little") + data[8:]
    return mutate_bytes(rng, data)


def _records(rng: random.Random, raw: bytes) -> bytes:
    """A decompressed payload made of real and invented (version 4) records, or the real one damaged."""
    if rng.random() < 0.6:
        return mutate_bytes(rng, raw)
    out = bytearray()
    op = rng.randint(0, 3)
    for _ in range(rng.randint(0, 4)):
        count = rng.choice((0, 1, 2, 7, 8, 9, 100, rng.randint(1, 5000), 2**31, 2**32 - 1))
        kind = rng.choice((0, 2, 13, 0x80 | 5, 0x40 | 3, 62, 63, 0xC0, 0xFF))
        k = kind & 0x3F
        unary = rng.choice((0, 1, (count + 7) // 8, (3 * count + 7) // 8, rng.randint(0, 1 << 12), 2**32 - 1))
        payload = 4 * count if kind & 0x80 else 2 * count if kind & 0x40 else (count + 7) // 8
        body_len = unary + (count * k + 7) // 8 + payload
        body_len = min(body_len, 1 << 16) if rng.random() < 0.7 else min(body_len, rng.randint(0, 64))
        body = _blob(rng, body_len) if rng.random() < 0.5 else bytes(body_len)
        out += _REC.pack(op % 2**32, count % 2**32, kind, unary % 2**32) + body
        op += rng.choice((0, 1, 1, 2, 50, 2**31))
    return bytes(out)


def _segment_bytes(step: int, n_ops: int, raw_len: int, comp: bytes, comp_len: int | None = None) -> bytes:
    comp_len = len(comp) if comp_len is None else comp_len
    head = _SEG.pack(SEGMENT_TAG, step % 2**64, n_ops % 2**32, raw_len % 2**64, comp_len % 2**64, 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(comp, zlib.crc32(head))) + comp


def roundlog_bytes(rng: random.Random, base: BaseBundle) -> bytes:
    """A rounding log with one segment rebuilt (damaged records, frame or header fields, re-sealed with a
    valid CRC), segments dropped or reordered, or plain byte damage."""
    import zstandard

    log = base.files[bundle_mod.ROUNDLOG]
    if rng.random() < 0.3 or not base.segments:
        return mutate_bytes(rng, log)
    segs = list(base.segments)
    i = rng.randrange(len(segs))
    s = segs[i]
    kind = rng.choice(("records", "records", "fields", "frame", "comp", "order", "bomb"))
    encoded = [_segment_bytes(x.step, x.n_ops, len(x.raw), x.comp) for x in segs]
    if kind == "records":
        raw = _records(rng, s.raw)
        n_ops = (
            s.n_ops if rng.random() < 0.5 else len(raw) // 15 if rng.random() < 0.5 else _int(rng, s.n_ops)
        )
        comp = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
        encoded[i] = _segment_bytes(s.step, n_ops, len(raw), comp)
    elif kind == "fields":
        fields = [s.step, s.n_ops, len(s.raw), len(s.comp)]
        j = rng.randrange(4)
        fields[j] = _int(rng, fields[j])
        encoded[i] = _segment_bytes(fields[0], fields[1], fields[2], s.comp, fields[3])
    elif kind == "frame":
        options = rng.choice(
            (
                {"write_content_size": False},
                {"write_checksum": True, "write_content_size": True},
                {"write_content_size": True, "level": 22},
            )
        )
        level = options.pop("level", 3)
        comp = zstandard.ZstdCompressor(level=level, **options).compress(s.raw)
        if rng.random() < 0.3:  # two frames, or a frame and trailing bytes
            comp += rng.choice((comp, b"\x50\x2a\x4d\x18\x00\x00\x00\x00", b"\x00"))
        encoded[i] = _segment_bytes(s.step, s.n_ops, len(s.raw), comp)
    elif kind == "comp":
        encoded[i] = _segment_bytes(s.step, s.n_ops, len(s.raw), mutate_bytes(rng, s.comp))
    elif kind == "order":
        j = rng.randrange(len(encoded))
        action = rng.choice(("drop", "dup", "swap"))
        if action == "drop":
            del encoded[i]
        elif action == "dup":
            encoded.insert(i, encoded[i])
        else:
            encoded[i], encoded[j] = encoded[j], encoded[i]
    else:  # a small decompression bomb: a well-formed record body of zeros for an op nobody takes
        count = rng.choice((1 << 16, 1 << 19, 1 << 21))
        raw = _REC.pack(2**32 - 1, count, 0, count) + bytes(count + (count + 7) // 8)  # k 0, no one bits
        comp = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
        encoded[i] = _segment_bytes(s.step, 1, len(raw), comp)
    out = log[:_LOG_HEADER_BYTES] + b"".join(encoded)
    return mutate_bytes(rng, out) if rng.random() < 0.15 else out


# ------------------------------------------------------------------------------------------ exercising
def exercise_log(rng: random.Random, reader: RoundLogReader, base: BaseBundle) -> None:
    """Read steps of ``reader`` the way an audit and ``read_step`` do (RoundLogError may escape)."""
    steps = list(reader.steps[:12]) + [rng.choice((0, 10**6, 2**64 - 1))]
    for step in steps:
        if rng.random() < 0.3:
            reader.read_step(step, max_entries=rng.choice((1 << 26, 1 << 26, 1 << 26, 1000, 1)))
            continue
        with reader.cursor(step) as cur:
            known = base.ops.get(step, [])
            picks = sorted(rng.sample(known, min(len(known), rng.randint(0, 8))))
            for op, numel in picks:
                cur.take(op, rng.choice((numel, numel, numel, numel, numel * 4, 1, 2**40)))
            if rng.random() < 0.9:
                cur.finish()


def _exercise_bundle(rng: random.Random, base: BaseBundle) -> str:
    b = bundle_mod.Bundle(base.workdir)
    try:
        for step in range(1, min(b.steps, 12) + 1):
            cur = b.log_cursor(step)
            if cur is None:
                continue
            try:
                with cur:
                    for op, numel in base.ops.get(step, [])[: rng.randint(0, 6)]:
                        cur.take(op, numel)
                    cur.finish()
            except RoundLogError:
                return "bundle:RoundLogError"  # what the engine turns into a BundleError
        for step in b.checkpoint_steps:
            b.load_checkpoint(step)
        if rng.random() < 0.3:
            b.resume_point()
    finally:
        b.close()
    return "bundle:accepted"


def _read_regular(base: BaseBundle, rel: Any) -> bytes | None:
    """``rel`` of the scratch copy if it is a regular file inside it (never a FIFO, link or outside path)."""
    try:
        return safeio.read_file(base.workdir, rel, 1 << 30)
    except safeio.UnsafeInput:
        return None


def reseal(base: BaseBundle) -> None:
    """Re-sign the scratch copy's manifest after damage elsewhere: fresh checkpoint SHA-256s, Merkle root
    and log length, where the damaged files still parse (so the damage reaches the reader behind them)."""
    raw = _read_regular(base, bundle_mod.MANIFEST)
    try:
        m = json.loads(raw) if raw is not None else None
    except ValueError:
        return
    if not isinstance(m, dict):
        return
    if isinstance(m.get("checkpoints"), dict):
        for rel in list(m["checkpoints"]):
            data = _read_regular(base, rel)
            if data is not None:
                m["checkpoints"][rel] = hashlib.sha256(data).hexdigest()
    durable = m.get("durable")
    if isinstance(durable, dict) and isinstance(durable.get("step"), int) and durable["step"] >= 0:
        step = durable["step"]
        commitments, log = (
            _read_regular(base, bundle_mod.COMMITMENTS),
            _read_regular(base, bundle_mod.ROUNDLOG),
        )
        with contextlib.suppress(BundleError):
            leaves, _ = bundle_mod.parse_commitments(commitments or b"")
            if len(leaves) > step:
                durable["merkle_root"] = bundle_mod.merkle_root(leaves[: step + 1])
        with contextlib.suppress(RoundLogError), RoundLogReader(io.BytesIO(log or b"")) as reader:
            durable["roundlog_bytes"] = reader.segment_end(step)
    with contextlib.suppress(TypeError, ValueError):
        (base.workdir / bundle_mod.MANIFEST).write_bytes(safeio.dumps_json(m))


def _odd_file(rng: random.Random, base: BaseBundle, rel: str) -> None:
    """Swap ``rel`` in the scratch copy for a link, a FIFO, a folder, nothing, or an empty file."""
    path = base.workdir / rel
    _remove(path)
    kind = rng.choice(("link", "link_dev", "fifo", "dir", "missing", "empty"))
    if kind == "link":
        path.symlink_to(base.workdir.parent / "outside")
        (base.workdir.parent / "outside").write_bytes(base.files.get(rel, b"{}"))
    elif kind == "link_dev":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")


def _bundle_case(rng: random.Random, base: BaseBundle) -> str:
    rels = [*bundle_mod.BUNDLE_ENTRIES[:3], *base.checkpoint_rels()]
    touched = {rng.choice(rels) for _ in range(rng.choice((1, 1, 1, 2)))}
    try:
        for rel in sorted(touched):
            if rng.random() < 0.08:
                odd = rel if rng.random() < 0.8 else bundle_mod.CHECKPOINTS
                with contextlib.suppress(OSError):  # a checkpoint whose folder was swapped already
                    _odd_file(rng, base, odd)
                touched.add(bundle_mod.CHECKPOINTS)
                continue
            if rel == bundle_mod.MANIFEST:
                data = manifest_bytes(rng, base)
            elif rel == bundle_mod.COMMITMENTS:
                data = commitments_bytes(rng, base)
            elif rel == bundle_mod.ROUNDLOG:
                data = roundlog_bytes(rng, base)
            else:
                data = checkpoint_bytes(rng, base.files[rel])
            with contextlib.suppress(OSError):  # not where the checkpoints folder was swapped for a file
                (base.workdir / rel).write_bytes(data)
        if rng.random() < 0.6 and bundle_mod.MANIFEST not in touched:
            touched.add(bundle_mod.MANIFEST)
            reseal(base)
        return _exercise_bundle(rng, base)
    finally:
        if bundle_mod.CHECKPOINTS in touched:
            touched = {r for r in touched if not r.startswith(bundle_mod.CHECKPOINTS + "/")}
        for rel in touched:
            base.restore(rel)
        outside = base.workdir.parent / "outside"
        if outside.exists():
            outside.unlink()


def fuzz_case(rng: random.Random, base: BaseBundle, target: str | None = None) -> str:
    """Run one fuzz case against ``target`` (random when None); return ``"<target>:<outcome>"``.

    Outcomes: ``accepted``, ``BundleError`` or ``RoundLogError``, whichever the target may raise. Any
    other exception escapes: that is a crash, a bug in a reader.
    """
    target = target or rng.choice(TARGETS)
    try:
        if target == "manifest":
            bundle_mod.parse_manifest(manifest_bytes(rng, base))
        elif target == "commitments":
            bundle_mod.parse_commitments(commitments_bytes(rng, base))
        elif target == "checkpoint":
            rel = rng.choice(base.checkpoint_rels())
            bundle_mod.decode_checkpoint(checkpoint_bytes(rng, base.files[rel]), rel, Caps())
        elif target == "roundlog":
            try:
                with RoundLogReader(io.BytesIO(roundlog_bytes(rng, base)), name="roundlog") as reader:
                    exercise_log(rng, reader, base)
            except RoundLogError:
                return "roundlog:RoundLogError"
        elif target == "bundle":
            return _bundle_case(rng, base)
        else:
            raise ValueError(f"unknown fuzz target {target!r}; known: {', '.join(TARGETS)}")
    except BundleError:
        return f"{target}:BundleError"
    return f"{target}:accepted"
