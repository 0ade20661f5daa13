"""Datasets for the supervised recipes. Defaults ship with a dependency or are generated; real corpora by path.

Every loader returns ``(x, y)`` tensors on the CPU: images as float32 in ``[0, 1]``, tokens as int64. Every
one is a pure function of its input files, so the same files give the same bytes (and the same
:func:`fingerprint`) on every machine.

Images: ``digits`` (8x8, scikit-learn), ``digits32`` (the same upscaled to 32x32x3, the default for
ResNet-50), ``cifar10`` (the python-pickle CIFAR-10 directory: the one pickle detrl reads, through an
unpickler that builds numpy arrays and nothing else) and ``image_folder`` (class subfolders of PNG/JPEG).
Text: a byte-level corpus, tokenized as bytes or by a BPE tokenizer trained on the corpus itself; the
default corpus ships with the package (:func:`corpus_bytes`).
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import pickle
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F


@functools.lru_cache(maxsize=1)  # a run reads its training and its test split: parse the CSV once
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    table = _digits_table()
    x = table[:, :64].reshape(-1, 8, 8).astype(np.float32) / 16.0
    y = table[:, 64].astype(np.int64)
    x.flags.writeable = y.flags.writeable = False
    return x, y


#: scikit-learn's digits file, inside its installed package: 1797 rows of 64 pixel values (0..16) and a label.
_DIGITS_CSV = ("datasets", "data", "digits.csv.gz")


def _digits_table() -> np.ndarray:
    """The digits as scikit-learn ships them, ``(1797, 65)`` float64: the CSV read straight from the installed
    package, as ``load_digits`` reads it. Why not call ``load_digits``: importing any part of scikit-learn
    imports scipy, 1.3 s of every process that trains or audits on the digits (a parallel audit's workers
    each paid it). Where the file is not where this version keeps it, ``load_digits`` it is."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root).joinpath(*_DIGITS_CSV)
        if path.is_file():
            with gzip.open(path, "rt") as f:
                table = np.loadtxt(f, delimiter=",")
            if table.shape == (1797, 65):
                return table
    from sklearn.datasets import load_digits

    d = load_digits()
    return np.concatenate([d.data, d.target[:, None].astype(np.float64)], axis=1)


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits: x ``(1797, 1, 8, 8)`` float32 in [0, 1], y ``(1797,)`` int64 (fresh
    tensors: a caller may write to them)."""
    x, y = _digits_arrays()
    return torch.from_numpy(x.copy()).unsqueeze(1), torch.from_numpy(y.copy())


def digits32() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as CIFAR-shaped images: x ``(1797, 3, 32, 32)`` float32 in [0, 1], y ``(1797,)``.

    Each 8x8 pixel becomes a 4x4 block (nearest-neighbour upscaling: copies, no arithmetic, so the bytes are
    the same everywhere) repeated over three identical channels.
    """
    x, y = digits()
    x = x.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)
    return x.expand(-1, 3, -1, -1).contiguous(), y


#: The only globals the CIFAR-10 unpickler resolves: what a pickled numpy array needs (``_reconstruct``,
#: ``ndarray``, ``dtype``; numpy 2 writes ``numpy._core`` where numpy 1 wrote ``numpy.core``), and
#: ``_codecs.encode``, which Python 3 writes for bytes in protocol-2 pickles. Dicts, lists, str and bytes
#: need no global.
_RECONSTRUCT = np.zeros(0).__reduce__()[0]  # numpy's array reconstructor, wherever this numpy keeps it
_CIFAR_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,
}


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that builds dicts, lists, strings, bytes and numpy arrays, and refuses every other
    global (a pickle can name any callable, e.g. ``os.system``, and have it called while loading)."""

    def find_class(self, module: str, name: str) -> object:
        target = _CIFAR_GLOBALS.get((module, name))
        if target is None:
            raise pickle.UnpicklingError(f"refused global {module}.{name} (only numpy arrays are allowed)")
        return target


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch file: images ``(n, 3072)`` uint8 and labels ``(n,)`` int64, checked."""
    if not path.is_file():
        raise FileNotFoundError(
            f"cifar10: {path} not found (data.path is the cifar-10-batches-py directory of the python version)"
        )
    try:
        with path.open("rb") as f:
            batch = _ArraysOnly(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"cifar10: {path}: not a CIFAR-10 batch ({str(e)[:160]})") from None
    data = batch.get(b"data") if isinstance(batch, dict) else None
    labels = batch.get(b"labels") if isinstance(batch, dict) else None
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise ValueError(f"cifar10: {path}: b'data' is not a uint8 array of shape (n, 3072)")
    if not isinstance(labels, list) or len(labels) != len(data):
        raise ValueError(f"cifar10: {path}: b'labels' is not a list of {len(data)} labels")
    y = np.asarray(labels, dtype=np.int64) if all(type(v) is int for v in labels) else None
    if y is None or (len(y) and (y.min() < 0 or y.max() > 9)):
        raise ValueError(f"cifar10: {path}: labels must be integers in 0..9")
    return data, y


def cifar10(path: str | Path, test: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 from the python-pickle directory (``data_batch_1`` .. ``data_batch_5``, ``test_batch``):
    x ``(50000, 3, 32, 32)`` float32 in [0, 1] (``test``: the 10000 of ``test_batch``), y int64."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"cifar10: {path} is not a directory")
    names = ["test_batch"] if test else [f"data_batch_{i}" for i in range(1, 6)]
    parts = [_cifar_batch(root / name) for name in names]
    x = np.concatenate([d for d, _ in parts]).reshape(-1, 3, 32, 32)  # rows are R, G, B planes of 32x32
    y = np.concatenate([labels for _, labels in parts])
    return torch.from_numpy(x.astype(np.float32) / np.float32(255.0)), torch.from_numpy(y)


#: Image files :func:`image_folder` reads (case-insensitive suffixes); other files are ignored.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def image_folder(path: str | Path, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """An ImageFolder-style directory: one subfolder per class, PNG/JPEG images inside.

    Classes are the sorted subfolder names (label = position), images their sorted file names: the order
    is the same on every machine. Each image is converted to RGB and, unless already ``size x size``,
    resized bilinearly (Pillow's fixed-point resampling). x ``(n, 3, size, size)`` float32 in [0, 1].
    JPEG decoders can differ between library builds by a few pixel values; the data fingerprint shows it.
    """
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as e:  # pillow comes with matplotlib, a dependency
        from detrl.run.config import ConfigError

        raise ConfigError(f"data.name=image_folder needs Pillow: pip install pillow ({e})") from None
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"image_folder: {path} is not a directory")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise ValueError(f"image_folder: {path} has no class subfolders")
    images, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(
            f.name for f in (root / name).iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
        )
        if not found:
            raise ValueError(f"image_folder: class folder {root / name} holds no PNG or JPEG images")
        for fname in found:
            try:
                with Image.open(root / name / fname) as im:
                    rgb = im.convert("RGB")
            except (UnidentifiedImageError, OSError) as e:
                raise ValueError(f"image_folder: {root / name / fname}: not a readable image ({e})") from None
            if rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
            images.append(np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1))  # (3, H, W)
            labels.append(label)
    x = np.stack(images).astype(np.float32) / np.float32(255.0)
    return torch.from_numpy(x), torch.from_numpy(np.asarray(labels, dtype=np.int64))


#: Seed of the fixed permutation that splits a dataset into train and held-out test examples.
SPLIT_SEED = 20211231


def split(
    x: torch.Tensor, y: torch.Tensor, holdout: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``((x_train, y_train), (x_test, y_test))``: the last ``holdout`` examples of a fixed permutation are
    the test set. The permutation comes from its own seed (:data:`SPLIT_SEED`), not from any stream: every
    run of a sweep, whatever its seeds, is tested on the same examples."""
    n = len(x)
    if not 0 <= holdout < n:  # a config no run can train on; found only with the data (its size)
        from detrl.run.config import ConfigError

        raise ConfigError(f"config error: data.holdout={holdout}: must leave training examples out of {n}")
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
    # The draws come from the stream's CPU generator (the same numbers whatever the device); the crops and
    # flips run where the batch is (the Session's device).
    dev = x.device
    padded = F.pad(x, (padding, padding, padding, padding))
    oy = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(dev)
    ox = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(dev)
    rows = (oy[:, None] + torch.arange(h, device=dev))[:, :, None]  # (N, H, 1)
    cols = (ox[:, None] + torch.arange(w, device=dev))[:, None, :]  # (N, 1, W)
    images = torch.arange(n, device=dev)[:, None, None]  # (N, 1, 1)
    out = padded[images, :, rows, cols].permute(0, 3, 1, 2)  # (N, C, H, W)
    if mode == "crop_flip":
        flip = torch.randint(0, 2, (n,), generator=generator).bool().to(dev)
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


def windows(tokens: np.ndarray, seq_len: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    return windows(toks, seq_len, n)


def read_text(path: str | Path) -> bytes:
    """The bytes of a text corpus at ``path``."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text corpus not found: {path}")
    return p.read_bytes()


#: The corpus that ships with detrl (``data.name: corpus``): the opening 47,906 bytes of Tiny Shakespeare
#: (Karpathy's char-rnn data set), i.e. the start of Shakespeare's *Coriolanus*: public-domain text.
CORPUS = "coriolanus.txt"


def corpus_bytes() -> bytes:
    """The bytes of the shipped corpus (package data ``detrl/supervised/corpus/``)."""
    return (files("detrl.supervised") / "corpus" / CORPUS).read_bytes()


def text_file(path: str, seq_len: int = 32, n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """A character-level corpus read from ``path`` (bytes as tokens, vocab 256)."""
    return windows(tokenize(read_text(path), "bytes"), seq_len, n)


def tokenize(raw: bytes, tokenizer: str, vocab_size: int = 1024) -> np.ndarray:
    """Token ids ``(length,)`` int64 of a corpus: its bytes (``"bytes"``, vocab 256) or the ids of the BPE
    tokenizer :func:`train_bpe` trains on the corpus itself (``"bpe"``, at most ``vocab_size``)."""
    if tokenizer == "bytes":
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    if tokenizer != "bpe":
        raise ValueError(f"config error: data.tokenizer: unknown tokenizer {tokenizer!r}")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(train_bpe(raw, vocab_size))
    return np.asarray(tok.encode(_utf8(raw)).ids, dtype=np.int64)


@functools.lru_cache(maxsize=2)  # the recorder and the fingerprint train on the same corpus: once is enough
def train_bpe(raw: bytes, vocab_size: int) -> str:
    """The JSON of a byte-level BPE tokenizer (GPT-2's scheme: bytes mapped to printable characters, so
    any text encodes with no unknown token) trained on ``raw`` by Hugging Face ``tokenizers``.

    Deterministic: the trainer breaks ties between equally frequent pairs by the pairs themselves, so the
    same corpus gives the same JSON whatever the thread count (``tests/test_recipes.py`` checks it twice).
    The vocabulary holds the 256 byte symbols, then merges of pairs seen at least twice, up to
    ``vocab_size`` (fewer when the corpus runs out of pairs).
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:  # an optional extra: detrl[gpt2]
        from detrl.run.config import ConfigError

        raise ConfigError(
            f"data.tokenizer=bpe needs Hugging Face tokenizers: pip install 'detrl[gpt2]' ({e})"
        ) from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_utf8(raw)], trainer=trainer)
    return tok.to_str()


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"the corpus is not UTF-8 text (byte {e.start}): data.tokenizer=bpe needs UTF-8; bytes reads any file"
        ) from None


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
