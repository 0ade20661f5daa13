"""Datasets for the supervised recipes. Defaults ship with a dependency or are generated; real corpora by path.

Every loader returns ``(x, y)`` tensors on the CPU: images as float32 in ``[0, 1]``, tokens as int64.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits: x ``(1797, 1, 8, 8)`` float32 in [0, 1], y ``(1797,)`` int64."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0).unsqueeze(1)
    return x, torch.from_numpy(d.target.astype(np.int64))


#: Seed of the fixed permutation that splits a dataset into train and held-out test examples.
SPLIT_SEED = 20211231


def split(
    x: torch.Tensor, y: torch.Tensor, holdout: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``((x_train, y_train), (x_test, y_test))``: the last ``holdout`` examples of a fixed permutation are
    the test set. The permutation comes from its own seed (:data:`SPLIT_SEED`), not from any stream: every
    run of a sweep, whatever its seeds, is tested on the same examples."""
    n = len(x)
    if not 0 <= holdout < n:
        raise ValueError(f"data.holdout={holdout}: must leave training examples out of {n}")
    order = torch.from_numpy(np.random.Generator(np.random.PCG64(SPLIT_SEED)).permutation(n))
    train, test = order[: n - holdout], order[n - holdout :]
    return (x[train], y[train]), (x[test], y[test])


def augment(x: torch.Tensor, mode: str, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Random crops (zero padding of ``padding`` pixels, then a crop of the original size at a random
    offset) and, for ``crop_flip``, random horizontal flips of a batch ``(N, C, H, W)``. Draws exactly
    ``N`` offsets per axis and, with flips, ``N`` coin flips from ``generator``, whatever the values."""
    if mode == "none":
        return x
    n, _, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    oy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    ox = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    rows = (oy[:, None] + torch.arange(h))[:, :, None]  # (N, H, 1)
    cols = (ox[:, None] + torch.arange(w))[:, None, :]  # (N, 1, W)
    out = padded[torch.arange(n)[:, None, None], :, rows, cols].permute(0, 3, 1, 2)  # (N, C, H, W)
    if mode == "crop_flip":
        flip = torch.randint(0, 2, (n,), generator=generator).bool()
        out = torch.where(flip[:, None, None, None], out.flip(-1), out)
    return out.contiguous()


def tta_views(x: torch.Tensor, mode: str, padding: int) -> list[torch.Tensor]:
    """Test-time augmentation views of ``(N, C, H, W)`` images: the image itself and its four crops shifted
    by ``padding`` pixels (up, down, left, right), and the horizontal flips of all five for ``crop_flip``
    (or when training used no augmentation: flips and crops, the usual TTA)."""
    p = max(padding, 1)
    padded = F.pad(x, (p, p, p, p))
    h, w = x.shape[-2:]
    views = [x] + [
        padded[..., p + dy : p + dy + h, p + dx : p + dx + w] for dy, dx in ((-p, 0), (p, 0), (0, -p), (0, p))
    ]
    if mode != "crop":
        views += [v.flip(-1) for v in views]
    return views


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
