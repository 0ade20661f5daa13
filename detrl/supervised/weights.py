"""Model weights in and out of the supervised recipes, as safetensors files (no pickle, no code executed).

* :func:`load_init` fills a freshly built model from a file (``model.init_from``): every parameter must be
  in the file with its shape; buffers (batch-norm statistics) are taken when present.
* :func:`export_safetensors` writes the model of a bundle's last checkpoint as such a file, so a run can
  start where another ended (fine-tuning) and an auditor can check the file by its SHA-256.

The file is part of the run: its SHA-256 enters the data fingerprint (``train.fingerprint``), so an
auditor holding another file is refused before any step.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import nn

from detrl.core.precision import at_width
from detrl.formats import bundle as bundle_mod


def file_sha256(path: str | Path, what: str = "model.init_from") -> str:
    """SHA-256 hex of the file at ``path`` (read in 1 MiB chunks); a missing one is a line naming ``what``."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what}: {path}: no such file")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_safetensors(path: str | Path, what: str = "model.init_from") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (CPU). A missing or malformed file is one line naming ``what``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what}: {path}: no such file")
    try:
        return load_file(str(p), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{what}: {path}: not a safetensors file ({msg[:160]})") from None


def load_init(model: nn.Module, path: str | Path) -> None:
    """Copy the tensors of the safetensors file at ``path`` into ``model`` (in place, without autograd).

    Keys are the model's parameter and buffer names (``export_safetensors`` writes them so; a model may
    translate other layouts with an ``adapt_state_dict(tensors)`` method, as :class:`~.models.GPT2` does for
    Hugging Face's). Every parameter must be present with the model's shape; buffers are optional. Floating
    tensors of any precision are cast to the parameter's dtype (FP32 at build time: a run starts on the FP32
    grid); so are complex ones to the parameter's complex dtype. Any mismatch (of shape, or of kind: floating,
    complex, integer) is one ``ValueError`` line naming the file and the first offending key.
    """
    tensors = read_safetensors(path)
    adapt = getattr(model, "adapt_state_dict", None)
    if callable(adapt):
        tensors = adapt(tensors)
    params = dict(model.named_parameters())
    targets = {**dict(model.named_buffers()), **params}
    missing = [n for n in params if n not in tensors]
    unexpected = sorted(n for n in tensors if n not in targets)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} parameters missing (first {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} tensors the model does not have (first {unexpected[0]})")
        raise ValueError(f"model.init_from: {path}: keys do not match the model: {'; '.join(parts)}")
    with torch.no_grad():
        for name, t in tensors.items():
            target = targets[name]
            if tuple(t.shape) != tuple(target.shape):
                raise ValueError(
                    f"model.init_from: {path}: {name} has shape {tuple(t.shape)}, the model's is "
                    f"{tuple(target.shape)}"
                )
            if (t.is_floating_point(), t.is_complex()) != (target.is_floating_point(), target.is_complex()):
                raise ValueError(
                    f"model.init_from: {path}: {name} has dtype {t.dtype}, the model's {target.dtype}"
                )
            target.copy_(t.to(target.dtype))


def export_safetensors(run_dir: str | Path, path: str | Path) -> int:
    """Write the model of ``run_dir``'s last checkpoint (parameters and buffers) to ``path`` as safetensors.

    Checkpoints name model tensors ``param.<name>`` and ``buffer.<name>``; the file gets ``<name>``, which
    is what ``model.init_from`` reads. Optimizer and resume state stay behind. Floating tensors are written
    as FP32: exact for a verifiable run, whose values lie on the FP32 grid (an fp64 run's are rounded).
    The metadata names the source (step, Merkle root of the durable commitments, precision). The file is
    written to a temporary name and renamed, so ``path`` is never half-written. Returns the step exported.
    The bundle is read as untrusted input (:class:`detrl.formats.bundle.Bundle`: checked, bounded, SHA-256 verified).
    """
    from safetensors.torch import save

    b = bundle_mod.Bundle(run_dir)
    try:
        if not b.checkpoint_steps:
            raise bundle_mod.BundleError(f"{run_dir}: the bundle holds no checkpoint to export")
        step = b.checkpoint_steps[-1]
        tensors, _ = b.load_checkpoint(step)
        m = b.manifest
    finally:
        b.close()
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        for prefix in ("param.", "buffer."):
            if key.startswith(prefix):
                # FP32 grid values in FP32 (complex64: safetensors has no complex128); integers as they are
                out[key[len(prefix) :]] = t.to(at_width(t, torch.float32)).contiguous()
    if not out:
        raise bundle_mod.BundleError(f"{bundle_mod.checkpoint_name(step)}: no model tensors")
    meta = {
        "detrl.step": str(step),
        "detrl.merkle_root": m.durable.merkle_root if m.durable is not None else "",
        "detrl.core.precision": m.precision,
        "detrl.task": str(m.task),
    }
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_bytes(save(dict(sorted(out.items())), metadata=meta))
    os.replace(tmp, target)
    return step
