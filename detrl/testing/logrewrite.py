"""Forge a rounding log: re-encode it, well formed, after changing its entries.

This is how a dishonest trainer would forge a log: the result has valid checksums, so only a replay can
detect the change. The tampering tests and ``detrl bench tamper`` use it; it lives with the other attack
harnesses, not in :mod:`detrl.formats.roundlog`, so the format module ships no forging tool.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from detrl.formats import bundle as bundle_mod
from detrl.formats.roundlog import FORMAT_VERSION, OpEntries, RoundLogReader, RoundLogWriter


def rewrite(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    transform: Callable[[int, dict[int, OpEntries]], dict[int, OpEntries] | None],
    level: int = 3,
    version: int = FORMAT_VERSION,
) -> None:
    """Re-encode ``src`` into a new, well-formed log ``dst`` (in format ``version``) after
    ``transform(step, ops)``.

    ``transform`` gets op -> entries for each step with a segment and returns the (possibly
    modified) mapping, or None to drop that step's segment. A torn tail of ``src`` is not copied.
    """
    with RoundLogReader(src) as reader, RoundLogWriter(dst, level=level, version=version) as writer:
        for step in reader.steps:
            ops = transform(step, reader.read_step(step))
            if ops is not None:
                writer.write_step(step, sorted(ops.values(), key=lambda e: e.op))


def strip_log(src: Path, dst: Path) -> None:
    """Copy bundle ``src`` to ``dst`` with every step of its rounding log emptied, resealed so it validates."""
    shutil.copytree(src, dst)
    rewrite(src / bundle_mod.ROUNDLOG, dst / bundle_mod.ROUNDLOG, lambda step, ops: {})
    bundle_mod.reseal(dst)
