"""Commitments: canonical SHA-256 of training state, and a Merkle tree over the per-step hashes.

The canonical bytes of a state are name-sorted records ``name, dtype, shape, raw little-endian bytes``,
so two machines that hold the same tensors produce the same hash whatever their memory layout or device.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

LEAF_TAG = b"detrl/leaf/v1"
NODE_TAG = b"detrl/node/v1"


def _tensor_buffer(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw little-endian bytes as a C-contiguous array (a view when already on the CPU and
    contiguous: hashing a copy of a ResNet-50's state cost as much as the hash)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: hash the raw 16-bit words
        t = t.view(torch.int16)
    return t.numpy()


@functools.lru_cache(maxsize=4096)
def _record_header(name: str, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> bytes:
    header = f"{name}\0{str(dtype).removeprefix('torch.')}\0{shape}\0".encode()
    return struct.pack("<I", len(header)) + header + struct.pack("<Q", nbytes)


def tensor_digest(name: str, t: torch.Tensor) -> bytes:
    """SHA-256 of one named tensor's canonical record ``name, dtype, shape, raw bytes``.

    A DQN commits every environment step: the per-tensor fixed cost (header, views) mattered more than the
    bytes, so headers are cached and the array is hashed through the buffer protocol without reshaping."""
    data = _tensor_buffer(t)
    h = hashlib.sha256(_record_header(name, t.dtype, tuple(t.shape), data.nbytes))
    h.update(data)
    return h.digest()


class DigestCache:
    """The per-tensor digests of the last commitment, reused for a step declared not to write the state.

    A DQN commits after every environment step, but its weights change only every few steps; rehashing
    them each time cost as much as the step. Reuse is the recorder's claim (``Session.step(frozen=True)``),
    never inferred: torch's version counters miss fused and foreach writes. The auditor never reuses, so a
    false claim shows up as a divergence at that step.
    """

    def __init__(self) -> None:
        self._digests: dict[str, bytes] = {}

    def digest(self, name: str, t: torch.Tensor, reuse: bool) -> bytes:
        d = self._digests.get(name) if reuse else None
        if d is None:
            d = self._digests[name] = tensor_digest(name, t)
        return d


def hash_tensors(
    tensors: Mapping[str, torch.Tensor],
    extra: Iterable[tuple[str, bytes]] = (),
    cache: DigestCache | None = None,
    reuse: bool = False,
) -> bytes:
    """SHA-256 over name-sorted per-tensor digests (see :func:`tensor_digest`), then name-sorted extra blobs.

    ``cache``/``reuse``: take the tensors' digests from ``cache`` when ``reuse`` (see :class:`DigestCache`).
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(cache.digest(name, t, reuse) if cache is not None else tensor_digest(name, t))
    for name, blob in sorted(extra):
        h.update(struct.pack("<I", len(name)) + name.encode())
        h.update(struct.pack("<Q", len(blob)))
        h.update(blob)
    return h.digest()


def state_hash(
    tensors: Mapping[str, torch.Tensor],
    sources: bytes,
    parts: Mapping[str, bytes],
    cache: DigestCache | None = None,
    reuse: bool = False,
) -> bytes:
    """A step's state commitment: the state tensors, the switchboard's canonical bytes (``sources``) and
    each attached part's digest (``parts``: name -> digest, e.g. a replay buffer's hash chain)."""
    extra = [("sources", sources), *((f"part/{name}", digest) for name, digest in parts.items())]
    return hash_tensors(tensors, extra, cache, reuse)


def optimizer_tensors(opt: torch.optim.Optimizer, param_names: Mapping[int, str]) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors keyed ``opt.<param name>.<state key>`` (scalars as 0-d tensors)."""
    out: dict[str, torch.Tensor] = {}
    for p, state in opt.state.items():
        pname = param_names.get(id(p), "?")
        for key, value in state.items():
            out[f"opt.{pname}.{key}"] = (
                value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            )
    return out


def state_tensors(
    model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()
) -> dict[str, torch.Tensor]:
    """Everything tensor-valued that determines the future: parameters, buffers, optimizer state."""
    out: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        out[f"param.{name}"] = p
        names[id(p)] = name
    for name, b in model.named_buffers():
        out[f"buffer.{name}"] = b
    for i, opt in enumerate(optimizers):
        for k, v in optimizer_tensors(opt, names).items():
            out[f"{i}.{k}"] = v
    return out


def leaf(step: int, state_hash: bytes, batch_hash: bytes) -> bytes:
    """The Merkle leaf of one step: binds the step number, the state after it and the batch it used."""
    return hashlib.sha256(LEAF_TAG + struct.pack("<Q", step) + state_hash + batch_hash).digest()


def merkle_root(leaves: list[bytes]) -> bytes:
    """Merkle root (SHA-256, domain-separated; an odd node is carried up unchanged). Empty -> hash of tag."""
    if not leaves:
        return hashlib.sha256(NODE_TAG).digest()
    level = list(leaves)
    while len(level) > 1:
        nxt = [
            hashlib.sha256(NODE_TAG + level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)
        ]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def hash_batch(*tensors: Any) -> bytes:
    """Digest of a training batch (tensors, arrays or bytes), so a changed example shows at its step."""
    items = {}
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            items[f"{i}"] = t
        else:
            items[f"{i}"] = torch.as_tensor(t)
    return hash_tensors(items)
