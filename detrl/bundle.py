"""The run bundle: a directory another party hands to an auditor.

::

    manifest.json        format, version, config, switchboard, thresholds, Merkle root, SHA-256 of every file
    commitments.json     per step: SHA-256 of the state after it and of the batch it consumed (Merkle leaves)
    roundlog             the sparse rounding log (detrl/roundlog.py, docs/roundlog.md)
    checkpoints/         step_NNNNNNNN.safetensors every k steps: parameters, buffers, optimizer state

A bundle is untrusted: nothing in it is unpickled, every length is checked, and every defect raises
:class:`BundleError` whose message names the file and the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from detrl import commit
from detrl.roundlog import RoundLogError, RoundLogReader

FORMAT = "detrl-bundle"
#: 2: state hashes are SHA-256 over per-tensor digests (v1 hashed the records flat); checkpoints carry
#: attached parts (replay buffer, env) under `resume/`.
VERSION = 2
MANIFEST = "manifest.json"
COMMITMENTS = "commitments.json"
ROUNDLOG = "roundlog"
CHECKPOINTS = "checkpoints"
_MAX_JSON_BYTES = 64 << 20
_CKPT_RE = re.compile(r"^checkpoints/step_(\d{8})\.safetensors$")


class BundleError(ValueError):
    """The bundle is malformed, incomplete or inconsistent (a bad input, not a divergence)."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINTS}/step_{step:08d}.safetensors"


def _read_json(path: Path, what: str) -> Any:
    try:
        size = path.stat().st_size
    except OSError:
        raise BundleError(f"{what}: missing ({path})") from None
    if size > _MAX_JSON_BYTES:
        raise BundleError(f"{what}: {size} bytes, larger than the {_MAX_JSON_BYTES} allowed")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, OSError) as e:
        raise BundleError(f"{what}: not valid JSON ({e})") from None


def _require(obj: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise BundleError(f"{what}: missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BundleError(f"{what}: key {key!r} has the wrong type")
    return value


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    """Hash every bundle file into the manifest and write it (atomically)."""
    files = {}
    for rel in [COMMITMENTS, ROUNDLOG]:
        if (run_dir / rel).exists():
            files[rel] = sha256_file(run_dir / rel)
    for p in sorted((run_dir / CHECKPOINTS).glob("step_*.safetensors")):
        rel = f"{CHECKPOINTS}/{p.name}"
        files[rel] = sha256_file(p)
    manifest = {"format": FORMAT, "version": VERSION, **manifest, "files": files}
    tmp = run_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, run_dir / MANIFEST)


def write_commitments(run_dir: Path, leaves: list[tuple[bytes, bytes]]) -> None:
    obj = {"version": 1, "steps": [{"state": s.hex(), "batch": b.hex()} for s, b in leaves]}
    (run_dir / COMMITMENTS).write_text(json.dumps(obj))


def save_checkpoint(run_dir: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    (run_dir / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    clean = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    save_file(
        clean, str(run_dir / checkpoint_name(step)), metadata={"detrl": json.dumps(meta, sort_keys=True)}
    )


class Bundle:
    """A validated bundle, read for replay. Construction checks the manifest and every file hash."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.dir = Path(run_dir)
        if not self.dir.is_dir():
            raise BundleError(f"{self.dir}: not a run bundle directory")
        m = _read_json(self.dir / MANIFEST, MANIFEST)
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise BundleError(f"{MANIFEST}: not a detrl bundle manifest (format is not {FORMAT!r})")
        version = m.get("version")
        if version != VERSION:
            raise BundleError(
                f"{MANIFEST}: unsupported bundle version {version!r} (this detrl reads {VERSION})"
            )
        self.manifest = m
        self.config: dict[str, Any] = _require(m, "config", dict, MANIFEST)
        self.precision: str = _require(m, "precision", str, MANIFEST)
        self.sources: dict[str, Any] = _require(m, "sources", dict, MANIFEST)
        self.steps: int = _require(m, "steps", int, MANIFEST)
        self.merkle_root: str = _require(m, "merkle_root", str, MANIFEST)
        self.thresholds: dict[str, Any] = _require(m, "thresholds", dict, MANIFEST)
        files = _require(m, "files", dict, MANIFEST)
        self.checkpoint_steps: list[int] = []
        for rel, digest in files.items():
            if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise BundleError(f"{MANIFEST}: bad hash for {rel!r}")
            ck = _CKPT_RE.match(rel)
            if rel not in (COMMITMENTS, ROUNDLOG) and not ck:
                raise BundleError(f"{MANIFEST}: unexpected file name {rel!r}")
            path = self.dir / rel
            if not path.is_file():
                raise BundleError(f"{rel}: missing (listed in {MANIFEST})")
            if sha256_file(path) != digest:
                raise BundleError(f"{rel}: SHA-256 does not match {MANIFEST} (file changed or corrupted)")
            if ck:
                self.checkpoint_steps.append(int(ck.group(1)))
        self.checkpoint_steps.sort()
        if COMMITMENTS not in files:
            raise BundleError(f"{MANIFEST}: {COMMITMENTS} not listed")
        if self.precision == "verifiable" and ROUNDLOG not in files:
            raise BundleError(f"{MANIFEST}: verifiable run without a {ROUNDLOG}")
        self.leaves = self._read_commitments()
        root = commit.merkle_root([commit.leaf(i, s, b) for i, (s, b) in enumerate(self.leaves)]).hex()
        if root != self.merkle_root:
            raise BundleError(f"{COMMITMENTS}: Merkle root does not match {MANIFEST}")
        self.roundlog: RoundLogReader | None = None
        if ROUNDLOG in files:
            try:
                self.roundlog = RoundLogReader(self.dir / ROUNDLOG)
            except RoundLogError as e:
                raise BundleError(str(e)) from None
            if self.roundlog.steps and (self.roundlog.steps[0] < 1 or self.roundlog.steps[-1] > self.steps):
                raise BundleError(f"{ROUNDLOG}: has steps outside 1..{self.steps}")

    def _read_commitments(self) -> list[tuple[bytes, bytes]]:
        obj = _read_json(self.dir / COMMITMENTS, COMMITMENTS)
        steps = _require(obj, "steps", list, COMMITMENTS)
        if len(steps) != self.steps + 1:
            raise BundleError(
                f"{COMMITMENTS}: {len(steps)} entries, manifest says {self.steps} steps (+ init)"
            )
        leaves = []
        for i, e in enumerate(steps):
            s = _require(e, "state", str, f"{COMMITMENTS} step {i}")
            b = _require(e, "batch", str, f"{COMMITMENTS} step {i}")
            if not (re.fullmatch(r"[0-9a-f]{64}", s) and re.fullmatch(r"[0-9a-f]{64}", b)):
                raise BundleError(f"{COMMITMENTS}: step {i}: hashes must be 64 hex digits")
            leaves.append((bytes.fromhex(s), bytes.fromhex(b)))
        return leaves

    def read_log_step(self, step: int) -> dict:
        if self.roundlog is None:
            return {}
        try:
            return self.roundlog.read_step(step)
        except RoundLogError as e:
            raise BundleError(str(e)) from None

    def load_checkpoint(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Tensors and metadata of the checkpoint at ``step`` (safetensors: no code is executed)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        rel = checkpoint_name(step)
        path = self.dir / rel
        try:
            tensors = load_file(str(path))
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n > _MAX_JSON_BYTES:
                    raise BundleError(f"{rel}: header of {n} bytes is too large")
                header = json.loads(f.read(n))
            meta = json.loads(header.get("__metadata__", {}).get("detrl", "{}"))
        except BundleError:
            raise
        except (SafetensorError, OSError, ValueError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BundleError(
                f"{rel}: not a valid safetensors checkpoint ({str(e).splitlines()[0]})"
            ) from None
        if not isinstance(meta, dict):
            raise BundleError(f"{rel}: bad detrl metadata")
        return tensors, meta

    def close(self) -> None:
        if self.roundlog is not None:
            self.roundlog.close()
