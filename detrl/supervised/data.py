"""Datasets for the supervised recipes. Defaults ship with a dependency or are generated; real corpora by path.

Every loader returns ``(x, y)`` tensors on the CPU: images as float32 in ``[0, 1]``, tokens as int64.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits: x ``(1797, 1, 8, 8)`` float32 in [0, 1], y ``(1797,)`` int64."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0).unsqueeze(1)
    return x, torch.from_numpy(d.target.astype(np.int64))


def _windows(tokens: np.ndarray, seq_len: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping next-token windows: x ``(n, seq_len)``, y ``(n, seq_len)`` (x shifted by one)."""
    n = min(n, (len(tokens) - 1) // seq_len)
    if n < 1:
        raise ValueError(f"text too short for one window of {seq_len} tokens")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len)[None, :]
    return torch.from_numpy(tokens[idx].astype(np.int64)), torch.from_numpy(tokens[idx + 1].astype(np.int64))


def synthetic_text(vocab: int = 65, seq_len: int = 32, n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens from a fixed random bigram model (generated, so tests need no corpus)."""
    rng = np.random.Generator(np.random.PCG64(20240531))
    logits = rng.standard_normal((vocab, vocab)) * 2.0
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    cdf = probs.cumsum(1)
    length = n * seq_len + 1
    toks = np.empty(length, dtype=np.int64)
    toks[0] = 0
    u = rng.random(length)
    for i in range(1, length):
        toks[i] = min(int(np.searchsorted(cdf[toks[i - 1]], u[i])), vocab - 1)
    return _windows(toks, seq_len, n)


def text_file(path: str, seq_len: int = 32, n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """A character-level corpus read from ``path`` (bytes as tokens, vocab 256)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text corpus not found: {path}")
    toks = np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.int64)
    return _windows(toks, seq_len, n)


def synthetic_images(
    n: int = 64, channels: int = 3, size: int = 32, classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-shaped random images ``(n, channels, size, size)`` and labels, for benchmarks."""
    g = torch.Generator().manual_seed(12345)
    return torch.rand(n, channels, size, size, generator=g), torch.randint(classes, (n,), generator=g)


def fingerprint(x: torch.Tensor, y: torch.Tensor) -> str:
    """SHA-256 hex of a dataset's bytes, shapes and dtypes."""
    h = hashlib.sha256()
    for t in (x, y):
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()
