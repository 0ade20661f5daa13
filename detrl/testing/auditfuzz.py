"""Production-path fuzzing: the real ``detrl audit`` of a bundle forged consistently, one fork per case.

:mod:`detrl.testing.fuzzing` damages bytes and calls the readers; most of its cases end in a parser. A
dishonest trainer does better: it changes what a bundle *says* and then makes every checksum agree again
(record CRCs, the Merkle root, checkpoint SHA-256s, the log's length), so the forgery reaches the replay.
Each case here does that to one part of a small honest bundle:

- ``log``: entries flipped, dropped, added, moved to other elements or to op positions never reached,
  pinned values changed (NaN, infinities, neighbours), a step's entries removed;
- ``commitments``: a bit of a state or batch hash flipped, a record swapped for another step's;
- ``manifest``: schema-valid claims changed (thresholds, calibration steps, margin, the durable point,
  status, config values, seeds, fingerprint, precision), or values of the wrong type;
- ``checkpoint``: a committed or resume tensor changed, retyped, dropped or added, its metadata edited;
- ``bytes``: the byte-level damage of :mod:`detrl.testing.fuzzing`, re-sealed.

The parent process imports the auditor and warms it up once with one torch thread (so a fork inherits
no thread pool), then forks a child per case that runs ``detrl audit`` exactly as the command does and
exits with its code. An exit code outside the documented verdicts (70: internal error),
a signal, a traceback, or a child still running after the case timeout is a crash. A case is a pure
function of its ``random.Random``: :meth:`Forger.forge` replays it. Like the crash harness, it reaches the
command through the installed ``detrl`` program (:func:`~detrl.testing.program.detrl_program`), so the
CLI stays on top of every layer.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import random
import select
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from detrl.formats import bundle as bundle_mod
from detrl.formats import safeio
from detrl.formats.roundlog import RoundLogReader, RoundLogWriter
from detrl.testing import fuzzing
from detrl.testing.hostile import write_commitments
from detrl.testing.program import detrl_program

#: What :func:`forge` changes (see the module docstring).
KINDS = ("log", "commitments", "manifest", "checkpoint", "bytes")
#: The exit codes ``detrl audit`` documents (the verdicts and 2 for bad input).
VERDICT_EXITS = (0, 1, 2, 3, 4)


@dataclasses.dataclass
class Outcome:
    """One audited case: its exit code (None: killed after the timeout, negative: a signal), the first
    line it printed, the wall seconds and the child's peak RSS (bytes)."""

    code: int | None
    line: str
    seconds: float
    peak_rss: int

    @property
    def crashed(self) -> bool:
        return self.code not in VERDICT_EXITS or "Traceback" in self.line or "internal error" in self.line


class Forger:
    """A small honest bundle (its files, decoded log and checkpoints held in memory) and a scratch copy
    that :meth:`forge` rewrites for each case and :meth:`restore` puts back."""

    def __init__(self, run_dir: Path, workdir: Path) -> None:
        self.base = fuzzing.BaseBundle.load(run_dir, workdir)
        with RoundLogReader(io.BytesIO(self.base.files[bundle_mod.ROUNDLOG])) as reader:
            self.log = {step: reader.read_step(step) for step in reader.steps}
        self.checkpoints = {
            rel: bundle_mod.decode_checkpoint(self.base.files[rel], rel, bundle_mod.Caps())
            for rel in self.base.checkpoint_rels()
        }

    @property
    def workdir(self) -> Path:
        return self.base.workdir

    def restore(self) -> None:
        for rel in (*bundle_mod.BUNDLE_ENTRIES[:3], bundle_mod.CHECKPOINTS):
            self.base.restore(rel)
        outside = self.workdir.parent / "outside"
        if outside.is_symlink() or outside.exists():
            outside.unlink()

    def forge(self, rng: random.Random, kind: str | None = None) -> str:
        """Rewrite the scratch copy as case ``rng`` says; returns ``KIND:what``."""
        kind = kind or rng.choice(KINDS)
        what = _FORGERS[kind](self, rng)
        if kind != "manifest" or rng.random() < 0.5:
            fuzzing.reseal(self.base)
        return f"{kind}:{what}"

    # -- the forgeries -----------------------------------------------------------------------------
    def _log(self, rng: random.Random) -> str:
        steps = {s: dict(ops) for s, ops in self.log.items()}  # entries are replaced, never changed in place
        step = rng.choice(sorted(steps))
        ops = steps[step]
        what = rng.choice(("flip", "drop", "add", "move", "unreached", "pinned", "empty", "swap_steps"))
        if what == "empty" or not ops:
            ops.clear()
        elif what == "swap_steps" and len(steps) > 1:
            other = rng.choice([s for s in steps if s != step])
            steps[step], steps[other] = steps[other], steps[step]
        else:
            op = rng.choice(sorted(ops))
            e = ops[op]
            n = len(e.indices)
            if what == "flip" and n:
                up = e.up.copy()
                for i in rng.sample(range(n), min(n, rng.choice((1, 1, 2, 16)))):
                    up[i] = not up[i]
                ops[op] = dataclasses.replace(e, up=up)
            elif what == "drop" and n:
                keep = np.ones(n, dtype=bool)
                keep[rng.randrange(n)] = False
                ops[op] = dataclasses.replace(e, indices=e.indices[keep], up=e.up[keep])
            elif what in ("add", "move"):
                taken = (
                    set(e.indices.tolist()) | set(e.pinned_indices.tolist()) | set(e.short_indices.tolist())
                )
                span = max(taken, default=0) + 1
                index = rng.choice((0, span, span * 2, 2**31, rng.randrange(span + 1)))
                if index in taken:
                    return "add:collision"
                indices = np.append(e.indices if what == "add" else e.indices[1:], index).astype(np.int64)
                up = np.append(e.up if what == "add" else e.up[1:], rng.random() < 0.5)
                order = np.argsort(indices, kind="stable")
                ops[op] = dataclasses.replace(e, indices=indices[order], up=up[order])
            elif what == "unreached":
                new = rng.choice((2**32 - 1, op + 100_000, op + 1, max(ops) + 1))
                if new in ops:
                    return "unreached:collision"
                ops[new] = dataclasses.replace(ops.pop(op), op=new)
            elif what == "pinned":
                values = e.pinned_values.copy() if len(e.pinned_values) else None
                if values is None:
                    return "pinned:none"
                i = rng.randrange(len(values))
                values[i] = rng.choice(
                    (
                        np.float32("nan"),
                        np.float32("inf"),
                        np.float32(0),
                        np.nextafter(values[i], np.float32(1e30)),
                    )
                )
                ops[op] = dataclasses.replace(e, pinned_values=values)
        path = self.workdir / bundle_mod.ROUNDLOG
        path.unlink()
        with RoundLogWriter(path, level=1) as writer:
            for s in sorted(steps):
                writer.write_step(s, sorted(steps[s].values(), key=lambda x: x.op))
        return what

    def _commitments(self, rng: random.Random) -> str:
        leaves, _ = bundle_mod.parse_commitments(self.base.files[bundle_mod.COMMITMENTS])
        step = rng.randrange(len(leaves))
        state, batch = leaves[step]
        what = rng.choice(("state", "batch", "batch", "other_step", "zeros"))
        if what == "state":
            leaves[step] = (_flip_bit(rng, state), batch)
        elif what == "batch":
            leaves[step] = (state, _flip_bit(rng, batch))
        elif what == "other_step":
            leaves[step] = leaves[rng.randrange(len(leaves))]
        else:
            leaves[step] = (state, bytes(32))
        write_commitments(self.workdir, leaves)
        return f"{what}@{step}"

    def _manifest(self, rng: random.Random) -> str:
        m = json.loads(self.base.files[bundle_mod.MANIFEST])
        if rng.random() < 0.2:
            m, what = fuzzing.mutate_json(rng, m), "json"
        else:
            what = rng.choice(tuple(_CLAIMS))
            _CLAIMS[what](rng, m)
        try:
            data = safeio.dumps_json(m)
        except (TypeError, ValueError):
            data = json.dumps(m, default=str).encode()
        (self.workdir / bundle_mod.MANIFEST).write_bytes(data)
        return what

    def _checkpoint(self, rng: random.Random) -> str:
        rel = rng.choice(sorted(self.checkpoints))
        tensors, meta = self.checkpoints[rel]
        tensors, meta = dict(tensors), json.loads(json.dumps(meta))
        name = rng.choice(sorted(tensors))
        what = rng.choice(("value", "value", "dtype", "drop", "add", "meta"))
        if what == "value":
            t = tensors[name].clone()
            if t.numel():
                flat = t.view(-1)
                i = rng.randrange(flat.numel())
                flat[i] = flat[i] + 1 if not t.dtype.is_floating_point else flat[i] * 1.0000001 + 1e-30
            tensors[name] = t
        elif what == "dtype":
            import torch

            tensors[name] = tensors[name].to(
                torch.float16 if tensors[name].dtype != torch.float16 else torch.float64
            )
        elif what == "drop":
            del tensors[name]
        elif what == "add":
            import torch

            tensors[rng.choice(("resume/loader/extra", "param.extra", "0.opt.fc.weight.step"))] = torch.zeros(
                3
            )
        else:
            meta = fuzzing.mutate_json(rng, meta)
            if not isinstance(meta, dict):
                meta = {"step": meta}
        (self.workdir / rel).write_bytes(bundle_mod.encode_checkpoint(tensors, meta))
        return f"{what}:{name}"

    def _bytes(self, rng: random.Random) -> str:
        rel = rng.choice([*bundle_mod.BUNDLE_ENTRIES[:3], *self.base.checkpoint_rels()])
        if rel == bundle_mod.MANIFEST:
            data = fuzzing.manifest_bytes(rng, self.base)
        elif rel == bundle_mod.COMMITMENTS:
            data = fuzzing.commitments_bytes(rng, self.base)
        elif rel == bundle_mod.ROUNDLOG:
            data = fuzzing.roundlog_bytes(rng, self.base)
        else:
            data = fuzzing.checkpoint_bytes(rng, self.base.files[rel])
        (self.workdir / rel).write_bytes(data)
        return rel


_FORGERS: dict[str, Callable[[Forger, random.Random], str]] = {
    "log": Forger._log,
    "commitments": Forger._commitments,
    "manifest": Forger._manifest,
    "checkpoint": Forger._checkpoint,
    "bytes": Forger._bytes,
}


def _flip_bit(rng: random.Random, digest: bytes) -> bytes:
    i = rng.randrange(len(digest) * 8)
    out = bytearray(digest)
    out[i // 8] ^= 1 << (i % 8)
    return bytes(out)


def _scale_thresholds(rng: random.Random, m: dict[str, Any]) -> None:
    t = m["thresholds"]
    factor = rng.choice((0.0, 0.5, 0.999, 1.001, 2.0, 1e6, -1.0, math.inf))
    names = list(t["per_op"])
    for name in rng.sample(names, rng.randint(1, len(names))) if names else []:
        t["per_op"][name] = t["per_op"][name] * factor
    if rng.random() < 0.3:
        t["default"] = t["default"] * factor


def _drop_threshold(rng: random.Random, m: dict[str, Any]) -> None:
    per_op = m["thresholds"]["per_op"]
    if per_op:
        del per_op[rng.choice(sorted(per_op))]
    if rng.random() < 0.5:
        m["thresholds"]["default"] = rng.choice((2.0**-26, 2.0**-22, 0.5))


def _set(path: tuple[str, ...], *values: Any) -> Callable[[random.Random, dict[str, Any]], None]:
    def change(rng: random.Random, m: dict[str, Any]) -> None:
        node = m
        for key in path[:-1]:
            node = node.setdefault(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[path[-1]] = rng.choice(values)

    return change


def _durable_back(rng: random.Random, m: dict[str, Any]) -> None:
    if m.get("durable"):
        m["durable"]["step"] = rng.randrange(m["durable"]["step"] + 2)


def _seed(rng: random.Random, m: dict[str, Any]) -> None:
    seeds = m["sources"]["seeds"]
    name = rng.choice(sorted(seeds))
    seeds[name] = rng.choice((0, seeds[name] + 1, 2**64 - 1, 2**64, -1))


_CLAIMS: dict[str, Callable[[random.Random, dict[str, Any]], None]] = {
    "thresholds": _scale_thresholds,
    "threshold_dropped": _drop_threshold,
    "calibration_steps": _set(("calibration_steps",), 0, 2, 3, 10**6),
    "margin": _set(("margin",), 1.0, 15.0, 1e6),
    "checkpoint_every": _set(("checkpoint_every",), 0, 1, 3, 10**9),
    "planned_steps": _set(("planned_steps",), 0, 3, 5, 10**12, None),
    "status": _set(("status",), "recording", "stopped", "complete"),
    "stopped_at": _set(("stopped_at",), 0, 2, 4, None),
    "durable": _durable_back,
    "train.steps": _set(("config", "train", "steps"), 1, 3, 5, 10**7),
    "optimizer.lr": _set(("config", "optimizer", "lr"), 0.0, 0.1000001, -1.0, 1e308),
    "model.channels": _set(("config", "model", "channels"), 1, 9, 0, -3),
    "batch_size": _set(("config", "train", "batch_size"), 1, 63, 2000, 0),
    "sources.seed": _set(("config", "sources", "seed"), 0, 1, 2**63),
    "seeds": _seed,
    "fingerprint": _set(("data_fingerprint",), "0" * 64, None),
    "precision": _set(("precision",), "fp64", "fp32"),
    "hardware": _set(("hardware",), "emulated:splitk", "x" * 199),
}


# ---------------------------------------------------------------------------------------- the audit fork
def warm_up(run_dir: Path) -> None:
    """Import and run the auditor once in this process with one torch thread, so that each forked case
    pays only for its own replay and inherits no thread pool."""
    import torch

    from detrl.apps.audit import audit

    torch.set_num_threads(1)
    audit(run_dir)


class _Child:
    """A forked ``detrl audit`` in flight: its pid, the read end of its output pipe, what it printed."""

    def __init__(self, run_dir: Path) -> None:
        read_fd, write_fd = os.pipe()
        self.t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the child: the production command, its output into the pipe
            code = 99
            try:
                os.close(read_fd)
                os.dup2(write_fd, 1)
                os.dup2(write_fd, 2)
                code = detrl_program()(["audit", str(run_dir), "--quiet"])
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException as e:  # noqa: BLE001 - anything that escapes main is a crash signature
                os.write(2, f"Traceback: escaped main: {type(e).__name__}: {e}\n".encode(errors="replace"))
            finally:
                os._exit(code)
        os.close(write_fd)
        self.pid, self.fd = pid, read_fd
        self.chunks: list[bytes] = []
        self.killed = False

    def read(self) -> bool:
        """Read what is ready; False once the child closed its output."""
        chunk = os.read(self.fd, 1 << 16)
        if chunk and sum(map(len, self.chunks)) < 1 << 16:
            self.chunks.append(chunk)
        return bool(chunk)

    def finish(self) -> Outcome:
        os.close(self.fd)
        _, status, usage = os.wait4(self.pid, 0)
        text = b"".join(self.chunks).decode(errors="replace")
        line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        if "Traceback" in text:
            line = "Traceback: " + text.strip().splitlines()[-1][:200]
        code = None if self.killed else os.waitstatus_to_exitcode(status)
        return Outcome(code, line, time.perf_counter() - self.t0, usage.ru_maxrss * 1024)


def audit_forked(run_dir: Path, timeout: float) -> Outcome:
    """``detrl audit RUN_DIR --quiet`` in a fork of this process: its exit code, first line printed, wall
    seconds and peak RSS. The child runs the ``detrl`` program's entry point exactly as the command does."""
    outcome: list[Outcome] = []
    run_forked(
        [run_dir], [None], timeout, lambda slot, case, o: outcome.append(o), prepare=lambda slot, case: None
    )
    return outcome[0]


def run_forked(
    slots: list[Path],
    cases: list[Any],
    timeout: float,
    done: Callable[[int, Any, Outcome], None],
    prepare: Callable[[int, Any], None],
) -> None:
    """Audit every case, up to ``len(slots)`` at a time: ``prepare(slot, case)`` writes the case's bundle
    into ``slots[slot]``, a fork audits it, and ``done(slot, case, outcome)`` gets the result (and may
    restore the slot). A child still running after ``timeout`` seconds is killed (its code is None)."""
    todo = list(enumerate(cases))[::-1]
    running: dict[int, tuple[_Child, Any]] = {}
    free = list(range(len(slots)))[::-1]
    while todo or running:
        while todo and free:
            slot = free.pop()
            _, case = todo.pop()
            prepare(slot, case)
            running[slot] = (_Child(slots[slot]), case)
        by_fd = {child.fd: slot for slot, (child, _) in running.items()}
        ready, _, _ = select.select(list(by_fd), [], [], 0.5)
        now = time.perf_counter()
        for child, _ in running.values():
            if not child.killed and now - child.t0 > timeout:
                os.kill(child.pid, signal.SIGKILL)
                child.killed = True
        for fd in ready:
            slot = by_fd[fd]
            child, case = running[slot]
            if not child.read():
                del running[slot]
                done(slot, case, child.finish())
                free.append(slot)


def signature(outcome: Outcome) -> str:
    """What a crash is counted by: the exit code and its message without the numbers in it."""
    import re

    return f"exit {outcome.code}: " + re.sub(r"\d+", "N", outcome.line)[:160]
