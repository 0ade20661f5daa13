"""Hostile bundles: whole-bundle attacks on the auditor (a hang, a big allocation, a file outside the
bundle), shared by tests/test_hostile.py and ``detrl bench hostile``: one copy of each construction.

Each case plants its damage in a copy of an honest bundle; :func:`audit_subprocess` then audits it in a
fresh process and measures its exit code, peak RSS and wall time.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import struct
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from detrl.formats import bundle as bundle_mod
from detrl.formats import safeio
from detrl.formats.roundlog import RECORD_HEADER, SEGMENT_HEADER, SEGMENT_TAG, RoundLogReader


def read_manifest(run: Path) -> dict[str, Any]:
    return json.loads((run / bundle_mod.MANIFEST).read_text())


def write_manifest(run: Path, manifest: Any) -> None:
    (run / bundle_mod.MANIFEST).write_bytes(safeio.dumps_json(manifest))


def set_field(run: Path, path: tuple[str, ...], value: Any, validate: bool = True) -> None:
    """Set one manifest field; with ``validate`` the result must still parse as a manifest (what the test
    changes is then checked past the schema: caps, config, switchboard)."""
    m = read_manifest(run)
    node = m
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    write_manifest(run, m)
    if validate:
        bundle_mod.parse_manifest((run / bundle_mod.MANIFEST).read_bytes())


def set_literal(run: Path, path: tuple[str, ...], literal: bytes) -> None:
    """Put a raw JSON literal (one ``json`` cannot write, e.g. ``1e999``) at a manifest field."""
    set_field(run, path, "__LITERAL__", validate=False)
    p = run / bundle_mod.MANIFEST
    p.write_bytes(p.read_bytes().replace(b'"__LITERAL__"', literal))


def write_commitments(run: Path, leaves: Sequence[tuple[bytes, bytes]]) -> None:
    """Write ``leaves`` (state hash, batch hash per step) as the bundle's commitments file, every record's
    CRC valid: the forgery then reaches the replay (reseal the manifest's Merkle root after it)."""
    out = bundle_mod.COMMIT_HEADER.pack(bundle_mod.COMMIT_MAGIC, 1, 0, 0)
    out += b"".join(
        bundle_mod.commit_record(step, state, batch) for step, (state, batch) in enumerate(leaves)
    )
    (run / bundle_mod.COMMITMENTS).write_bytes(out)


def rewrite_checkpoint(run: Path, step: int, change: Callable[[dict[str, Any]], None]) -> None:
    """Decode the checkpoint of ``step``, let ``change(tensors)`` edit it, and encode it again with its own
    metadata (the manifest's SHA-256 is then stale: :func:`rehash_checkpoints`)."""
    rel = bundle_mod.checkpoint_name(step)
    tensors, meta = bundle_mod.decode_checkpoint((run / rel).read_bytes(), rel, bundle_mod.Caps())
    change(tensors)
    (run / rel).write_bytes(bundle_mod.encode_checkpoint(tensors, meta))


def rehash_checkpoints(run: Path) -> None:
    """Re-sign every listed checkpoint's SHA-256 in the manifest (so damage reaches the decoder)."""
    m = read_manifest(run)
    for rel in m["checkpoints"]:
        m["checkpoints"][rel] = hashlib.sha256((run / rel).read_bytes()).hexdigest()
    write_manifest(run, m)


def zstd_bomb_segment(step: int, raw_bytes: int) -> bytes:
    """A well-formed log segment for ``step`` (valid CRC, one zstd frame declaring its size) whose one
    record, for an op position no replay asks for, is ``raw_bytes`` of zeros once decompressed."""
    import zstandard

    # a 13-byte record header, then a byte of (zero) unary code and a direction bit per entry
    count = (raw_bytes - RECORD_HEADER.size) * 8 // 9
    raw_len = RECORD_HEADER.size + count + (count + 7) // 8
    buf = io.BytesIO()
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=True)
    with cctx.stream_writer(buf, size=raw_len, closefd=False) as w:
        w.write(RECORD_HEADER.pack(2**32 - 1, count, 0, count))
        zeros, left = bytes(1 << 20), raw_len - RECORD_HEADER.size
        while left:
            w.write(zeros[: min(left, len(zeros))])
            left -= min(left, len(zeros))
    comp = buf.getvalue()
    head = SEGMENT_HEADER.pack(SEGMENT_TAG, step, 1, raw_len, len(comp), 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(comp, zlib.crc32(head))) + comp


def plant_bomb(run: Path, step: int, raw_bytes: int) -> bytes:
    """Replace ``step``'s log segment with a bomb and re-sign the log length in the manifest."""
    log = run / bundle_mod.ROUNDLOG
    data = log.read_bytes()
    with RoundLogReader(log) as reader:
        start, end = reader.segment_end(step - 1), reader.segment_end(step)
    bomb = zstd_bomb_segment(step, raw_bytes)
    log.write_bytes(data[:start] + bomb + data[end:])
    m = read_manifest(run)
    with RoundLogReader(log) as reader:
        m["durable"]["roundlog_bytes"] = reader.segment_end(m["durable"]["step"])
    write_manifest(run, m)
    return bomb


# Run by audit_subprocess as ``python -I -S -c _SPAWN_AND_WAIT OUT CMD...``: spawns CMD, reaps it with
# wait4 and writes "exit_code ru_maxrss_kib wall_s" to OUT. It imports only os, sys and time: it stays small.
_SPAWN_AND_WAIT = (
    "import os, sys, time\n"
    "t0 = time.perf_counter()\n"
    "pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "wall = time.perf_counter() - t0\n"
    "with open(sys.argv[1], 'w') as f:\n"
    "    f.write(f'{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss} {wall}')\n"
)


def audit_subprocess(
    run: Path, *args: str, timeout: float = 120.0, cwd: str | os.PathLike | None = None
) -> tuple[int | None, str, str, int | None, float]:
    """``python -m detrl.cli audit RUN --quiet ARGS`` in a fresh process: (exit code, or None if it was
    still running after ``timeout`` s and was killed; stdout; stderr; peak RSS in bytes, None where
    unknown; wall seconds). ``DETRL_DEBUG`` is dropped, so an internal error reads as in production.

    The peak is the child's own ``ru_maxrss`` from ``os.wait4`` (KiB on Linux), so other children do not
    count. The child is started by a small launcher process rather than by the caller: on Linux ``exec``
    folds the RSS high-water mark of the process image it replaces into ``ru_maxrss``, so a child started
    straight from a caller that has imported torch (or recorded a bundle) reports the caller's peak as
    its own whenever that is larger; started from the launcher, its floor is the launcher's ~10 MB."""
    import signal
    import subprocess
    import sys
    import tempfile
    import threading
    import time

    env = {k: v for k, v in os.environ.items() if k != "DETRL_DEBUG"}
    cmd = [sys.executable, "-m", "detrl.cli", "audit", str(run), "--quiet", *args]
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryDirectory(prefix="detrl-audit-") as tmp,
    ):
        report = Path(tmp) / "wait4"
        launcher = [sys.executable, "-I", "-S", "-c", _SPAWN_AND_WAIT, str(report), *cmd]
        t0 = time.perf_counter()
        proc = subprocess.Popen(launcher, stdout=out, stderr=err, cwd=cwd, env=env, start_new_session=True)
        # wait for the launcher without reaping it, so that the killer never signals a recycled process
        # group; on a timeout the whole group goes, the audit with its launcher
        killed = threading.Event()
        killer = threading.Timer(timeout, lambda: (killed.set(), os.killpg(proc.pid, signal.SIGKILL)))
        killer.start()
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        finally:
            killer.cancel()
            killer.join()
        proc.wait()
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if killed.is_set() and proc.returncode == -signal.SIGKILL:
            return None, stdout, stderr, None, wall
        try:
            code, maxrss_kib, child_wall = report.read_text().split()
        except (OSError, ValueError):  # the launcher itself failed (its stderr says why)
            return proc.returncode, stdout, stderr, None, wall
        return int(code), stdout, stderr, int(maxrss_kib) * 1024, float(child_wall)


def _plant_fifo_manifest(run: Path, scratch: Path) -> list[Path]:
    (run / bundle_mod.MANIFEST).unlink()
    os.mkfifo(run / bundle_mod.MANIFEST)
    return []


def _plant_dev_zero(entry: str) -> Callable[[Path, Path], list[Path]]:
    def plant(run: Path, scratch: Path) -> list[Path]:
        (run / entry).unlink()
        (run / entry).symlink_to("/dev/zero")
        return []

    return plant


def _plant_checkpoints_outside(run: Path, scratch: Path) -> list[Path]:
    """checkpoints/ is a link to a faithful copy outside the bundle: only being a link is wrong with it."""
    src, outside = run / bundle_mod.CHECKPOINTS, scratch / "outside"
    outside.mkdir()
    shutil.copytree(src, outside / src.name)
    shutil.rmtree(src)
    src.symlink_to(outside / src.name)
    return []


def _plant_pickle_checkpoint(run: Path, scratch: Path) -> list[Path]:
    """The first checkpoint becomes a ``torch.save`` pickle whose unpickling creates a marker file (a
    stand-in for running code), re-signed so it reaches the decoder; the marker must never appear."""
    import torch

    marker = scratch / "UNPICKLED"

    class Plant:
        def __reduce__(self) -> tuple[Any, tuple[str, str]]:
            return (open, (str(marker), "w"))

    rel = sorted(read_manifest(run)["checkpoints"])[0]
    torch.save({"state": Plant(), "w": torch.zeros(3)}, run / rel)
    rehash_checkpoints(run)
    return [marker]


def _plant_garbage_commitments(run: Path, scratch: Path) -> list[Path]:
    """A valid commitments header followed by 10**6 records of random bytes (76 MB)."""
    path = run / bundle_mod.COMMITMENTS
    header = path.read_bytes()[: bundle_mod.COMMIT_HEADER.size]
    path.write_bytes(header + random.Random(0).randbytes(bundle_mod.COMMIT_RECORD.size * 10**6))
    return []


def _plant_field(path: tuple[str, ...], value: Any) -> Callable[[Path, Path], list[Path]]:
    def plant(run: Path, scratch: Path) -> list[Path]:
        set_field(run, path, value)
        return []

    return plant


def _plant_literal(path: tuple[str, ...], literal: bytes) -> Callable[[Path, Path], list[Path]]:
    def plant(run: Path, scratch: Path) -> list[Path]:
        set_literal(run, path, literal)
        return []

    return plant


def _plant_bomb_512mib(run: Path, scratch: Path) -> list[Path]:
    plant_bomb(run, 1, 512 << 20)
    return []


def _plant_zero_commitments(run: Path, scratch: Path) -> list[Path]:
    """A commitments file of 10**9 zero bytes (sparse): its bad magic is in its first 8 bytes."""
    with open(run / bundle_mod.COMMITMENTS, "wb") as f:
        f.truncate(10**9)
    return []


def _plant_sparse_checkpoint(run: Path, scratch: Path) -> list[Path]:
    """A listed checkpoint replaced by a 2 GiB sparse file (the manifest's SHA-256 left as it was)."""
    rel = sorted(read_manifest(run)["checkpoints"])[0]
    with open(run / rel, "wb") as f:
        f.truncate(2 << 30)
    return []


def _plant_many_tensors(run: Path, scratch: Path) -> list[Path]:
    """The first checkpoint with 600,000 empty tensors added, re-signed so it reaches the decoder."""
    import torch

    def add(tensors: dict[str, Any]) -> None:
        empty = torch.zeros(0)
        tensors.update({f"x{i}": empty for i in range(600_000)})

    step = int(sorted(read_manifest(run)["checkpoints"])[0][-20:-12])
    rewrite_checkpoint(run, step, add)
    rehash_checkpoints(run)
    return []


def _plant_lowered_thresholds(run: Path, scratch: Path) -> list[Path]:
    """The log emptied, every threshold and the calibration steps 0, resealed: a forgery that replicated."""
    from detrl.testing.logrewrite import rewrite

    rewrite(run / bundle_mod.ROUNDLOG, scratch / "roundlog", lambda step, ops: {})
    (scratch / "roundlog").replace(run / bundle_mod.ROUNDLOG)
    bundle_mod.reseal(run)
    m = read_manifest(run)
    m["thresholds"] = {"default": 0.0, "per_op": {name: 0.0 for name in m["thresholds"]["per_op"]}}
    m["calibration_steps"] = 0
    write_manifest(run, m)
    return []


def _plant_batch_hash(run: Path, scratch: Path) -> list[Path]:
    """One bit of step 1's batch hash flipped, its CRC and the Merkle root fixed."""
    leaves, _ = bundle_mod.parse_commitments((run / bundle_mod.COMMITMENTS).read_bytes())
    state, batch = leaves[1]
    leaves[1] = (state, bytes([batch[0] ^ 1]) + batch[1:])
    write_commitments(run, leaves)
    bundle_mod.reseal(run)
    return []


def _plant_unreached_op(run: Path, scratch: Path) -> list[Path]:
    """A well-formed log record at step 1 for op position 2**32 - 1, which no replay reaches."""
    import numpy as np

    from detrl.formats.roundlog import OpEntries
    from detrl.testing.logrewrite import rewrite

    last = 2**32 - 1

    def plant(step: int, ops: dict[int, OpEntries]) -> dict[int, OpEntries]:
        if step == 1:
            ops[last] = OpEntries(last, np.array([0], dtype=np.int64), np.array([True]))
        return ops

    rewrite(run / bundle_mod.ROUNDLOG, scratch / "roundlog", plant)
    (scratch / "roundlog").replace(run / bundle_mod.ROUNDLOG)
    bundle_mod.reseal(run)
    return []


#: The verdict (exit code) a case must give, where only one is right: a forgery consistent in every
#: checksum must never replicate, and a bundle that is no bundle is bad input.
EXPECTED_EXIT = {
    "honest bundle": 0,
    "commitments: 10**9 zero bytes": 2,
    "checkpoint: a 2 GiB sparse file": 2,
    "checkpoint: 600,000 empty tensors": 2,
    "log emptied, thresholds and calibration 0": 2,
    "step 1's batch hash forged": 1,
    "a log record for op 2**32-1": 4,
}


def hostile_cases() -> list[tuple[str, Callable[[Path, Path], list[Path]]]]:
    """``(name, plant)`` for each case of ``detrl bench hostile``, the honest bundle (the control) first.
    ``plant(run, scratch)`` damages the bundle copy ``run`` in place (``scratch``: a folder outside it) and
    returns the paths that must not exist after the audit (tripwires)."""
    return [
        ("honest bundle", lambda run, scratch: []),
        ("zstd bomb in a durable segment, 512 MiB", _plant_bomb_512mib),
        ("model.channels=20000", _plant_field(("config", "model", "channels"), 20000)),
        ("data.n=10**7", _plant_field(("config", "data", "n"), 10**7)),
        ("manifest.json is a FIFO", _plant_fifo_manifest),
        ("manifest.json -> /dev/zero", _plant_dev_zero(bundle_mod.MANIFEST)),
        ("roundlog -> /dev/zero", _plant_dev_zero(bundle_mod.ROUNDLOG)),
        (
            "config JSON nested 1000 deep",
            _plant_literal(("config", "model", "deep"), b"[" * 1000 + b"]" * 1000),
        ),
        (
            "10**400 literal at config.optimizer.lr",
            _plant_literal(("config", "optimizer", "lr"), b"1" + b"0" * 400),
        ),
        ("checkpoints/ -> outside the bundle", _plant_checkpoints_outside),
        ("checkpoint is a pickle (torch.save)", _plant_pickle_checkpoint),
        ("commitments: 10**6 garbage records", _plant_garbage_commitments),
        ("commitments: 10**9 zero bytes", _plant_zero_commitments),
        ("checkpoint: a 2 GiB sparse file", _plant_sparse_checkpoint),
        ("checkpoint: 600,000 empty tensors", _plant_many_tensors),
        ("log emptied, thresholds and calibration 0", _plant_lowered_thresholds),
        ("step 1's batch hash forged", _plant_batch_hash),
        ("a log record for op 2**32-1", _plant_unreached_op),
    ]
