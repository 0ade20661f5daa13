"""The supervised train loop: one function that records (``detrl train``) and replays (``detrl audit``).

It reads top to bottom: data, model, optimizer, then the loop through :class:`detrl.Session`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from detrl.run.config import ConfigError, RunConfig
from detrl.run.tasks import Task
from detrl.supervised import data as datasets
from detrl.supervised.models import MODELS
from detrl.supervised.weights import file_sha256, load_init

if TYPE_CHECKING:  # the loop is handed a Session; it never builds one
    from detrl.core.engine import Session


def load_data(cfg: RunConfig, path: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The training set ``(x, y)`` named by ``cfg.data`` (without its ``data.holdout`` test examples).

    ``path``: where to read a corpus (``text_file``) or an image set (``cifar10``, ``image_folder``). The
    auditor always passes its own (``--data``): a bundle's config never names a file the auditor opens.
    Without it, a recording reads ``data.path``.
    """
    return load_split(cfg, path)[0]


def load_test_data(cfg: RunConfig, path: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``data.holdout`` held-out test examples ``(x, y)`` (a fixed split: see :func:`data.split`)."""
    if cfg.data.holdout < 1:
        raise ValueError("config error: data.holdout must be positive to hold out a test set")
    return load_split(cfg, path)[1]


def load_split(
    cfg: RunConfig, path: Path | None = None
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``(train, test)``, each ``(x, y)``; the test set is empty unless ``data.holdout`` is positive.

    CIFAR-10 has its own test set: the first ``data.holdout`` images of ``test_batch`` (at most 10000),
    and all of ``data_batch_1..5`` train. Other sets hold out examples of a fixed permutation.
    """
    x, y = _load_all(cfg, path)
    if cfg.data.holdout == 0:
        return (x, y), (x[:0], y[:0])
    if cfg.data.name == "cifar10":
        tx, ty = datasets.cifar10(_source(cfg, path), test=True)
        if cfg.data.holdout > len(tx):
            raise ConfigError(
                f"config error: data.holdout={cfg.data.holdout}: test_batch has {len(tx)} images"
            )
        return (x, y), (tx[: cfg.data.holdout], ty[: cfg.data.holdout])
    return datasets.split(x, y, cfg.data.holdout)


#: Data sets read from a path: the auditor must supply its own copy (``detrl audit --data PATH``).
PATH_DATA = {
    "text_file": "the run trains on a corpus",
    "cifar10": "the run trains on CIFAR-10 read from a directory",
    "image_folder": "the run trains on an image folder",
}
#: Text data sets: token windows ``(n, seq_len)``.
TEXT_DATA = ("synthetic_text", "text_file", "corpus")


def _source(cfg: RunConfig, path: Path | None) -> Path:
    """Where a path data set is read: the caller's ``path`` (the auditor's), else the config's."""
    source = path if path is not None else cfg.data.path
    if not source:
        raise ValueError(f"config error: data.path is required for data.name={cfg.data.name}")
    return Path(source)


def _corpus(cfg: RunConfig, path: Path | None) -> bytes:
    """The raw bytes of a text corpus: the shipped one (``corpus``) or a file (``text_file``)."""
    if cfg.data.name == "corpus":
        return datasets.corpus_bytes()
    return datasets.read_text(_source(cfg, path))


def _load_all(cfg: RunConfig, path: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    d = cfg.data
    if d.name == "digits":
        return datasets.digits()
    if d.name == "digits32":
        return datasets.digits32()
    if d.name == "cifar10":
        return datasets.cifar10(_source(cfg, path))
    if d.name == "image_folder":
        return datasets.image_folder(_source(cfg, path))
    if d.name == "synthetic_text":
        return datasets.synthetic_text(vocab=d.vocab, seq_len=d.seq_len, n=d.n)
    if d.name in ("text_file", "corpus"):
        tokens = datasets.tokenize(_corpus(cfg, path), d.tokenizer, d.vocab_size)
        return datasets.windows(tokens, d.seq_len, d.n)
    return datasets.synthetic_images(n=d.n)


def tokenizer_json(cfg: RunConfig, path: Path | None = None) -> str | None:
    """The JSON of the BPE tokenizer trained on the run's corpus (None for byte tokens or other data)."""
    d = cfg.data
    if d.name not in ("text_file", "corpus") or d.tokenizer != "bpe":
        return None
    return datasets.train_bpe(_corpus(cfg, path), d.vocab_size)


def data_vocab(cfg: RunConfig) -> int:
    """The token vocabulary of text data: ``data.vocab`` (synthetic), ``data.vocab_size`` (BPE), else 256."""
    d = cfg.data
    if d.name == "synthetic_text":
        return d.vocab
    return d.vocab_size if d.tokenizer == "bpe" else 256


def build_model(cfg: RunConfig, x: torch.Tensor, classes: int = 10) -> torch.nn.Module:
    """The model ``cfg.model`` names, randomly initialised, for inputs shaped like ``x`` (no weights file)."""
    m, name = cfg.model, cfg.model.name
    dropout = m.dropout if m.dropout is not None else (0.0 if name == "cnn_bn" else 0.1)
    if name == "cnn_bn":
        return MODELS[name](channels=m.channels, classes=classes, dropout=dropout)
    if name == "mlp_dropout":
        return MODELS[name](features=int(x[0].numel()), hidden=m.hidden, classes=classes, dropout=dropout)
    if name == "tiny_transformer":
        return MODELS[name](
            vocab=data_vocab(cfg),
            d_model=m.d_model,
            heads=m.heads,
            layers=m.layers,
            seq_len=x.shape[1],
            dropout=dropout,
        )
    if name == "lstm_lm":
        return MODELS[name](vocab=data_vocab(cfg), d_model=m.d_model, hidden=m.hidden, layers=m.layers)
    if name in ("gpt2", "llama"):
        _check_text_model(cfg, x)
        # the sizes both text models take; each adds its own below
        text = {k: getattr(m, k) for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}
    if name == "gpt2":
        return MODELS[name](**text, dropout=dropout)
    if name == "llama":
        if m.dropout:  # an explicit nonzero value: the default (None) is Llama's own 0
            raise ConfigError(
                f"config error: model.dropout={m.dropout}: model.name=llama has no dropout (Llama trains "
                "without; its attention dropout would run inside SDPA, which drops differently by device)"
            )
        return MODELS[name](
            **text,
            n_kv_head=m.n_kv_head,
            intermediate=m.intermediate,
            attention=m.attention,
        )
    if name == "vit":
        if x.ndim != 4 or x.shape[-1] != x.shape[-2]:
            raise ConfigError(
                f"config error: model.name=vit needs square images (N, C, H, W); data.name={cfg.data.name} "
                f"gives {tuple(x.shape[1:])}"
            )
        return MODELS[name](
            image_size=int(x.shape[-1]),
            channels=int(x.shape[1]),
            classes=classes,
            patch_size=m.patch_size,
            n_embd=m.n_embd,
            n_layer=m.n_layer,
            n_head=m.n_head,
            intermediate=m.intermediate,
            dropout=m.dropout or 0.0,  # ViT's default hidden dropout is 0
            attention=m.attention,
        )
    return MODELS[name](classes=classes, width=m.width)


def _check_text_model(cfg: RunConfig, x: torch.Tensor) -> None:
    """A language model (gpt2, llama) fits its data: token windows ``x`` ``(N, T)``, a vocabulary at least
    the data's, positions at least ``T``; otherwise one ConfigError line."""
    m = cfg.model
    if cfg.data.name not in TEXT_DATA or x.ndim != 2:
        raise ConfigError(
            f"config error: model.name={m.name} trains on text (data.name: {', '.join(TEXT_DATA)}), not "
            f"data.name={cfg.data.name}"
        )
    if m.vocab_size < data_vocab(cfg):
        raise ConfigError(
            f"config error: model.vocab_size={m.vocab_size} is smaller than the data's vocabulary "
            f"({data_vocab(cfg)})"
        )
    if m.n_positions < x.shape[1]:
        raise ConfigError(
            f"config error: model.n_positions={m.n_positions} is shorter than data.seq_len={x.shape[1]}"
        )


def model_builder(
    cfg: RunConfig, x: torch.Tensor, classes: int = 10, init_from: Path | None = None
) -> Callable[[], torch.nn.Module]:
    """A zero-argument callable building the model for inputs shaped like ``x`` (for :meth:`Session.init`).

    With ``model.init_from``, the built model is filled from that safetensors file (``init_from``: the
    auditor's copy; default the config's path), so step 0 commits the loaded weights.
    """
    weights = init_from if init_from is not None else cfg.model.init_from

    def build() -> torch.nn.Module:
        model = build_model(cfg, x, classes)
        if weights:
            load_init(model, weights)
        return model

    return build


def base_lr(cfg: RunConfig) -> float:
    """``optimizer.lr`` at ``train.batch_size``: scaled linearly from ``optimizer.reference_batch`` where the
    config gives one (a recipe written for batch 64 run at batch 8 trains at an eighth of its rate)."""
    o = cfg.optimizer
    if o.reference_batch is None:
        return o.lr
    return o.lr * cfg.train.batch_size / o.reference_batch


def make_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    o, lr = cfg.optimizer, base_lr(cfg)
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def learning_rate(cfg: RunConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based) of ``train.steps``.

    ``lr`` is :func:`base_lr`. ``constant``: ``lr``. ``cosine``: from ``lr`` down a half cosine over the run. ``cyclic``: ``cycles``
    such half cosines, each restarting at ``lr`` (Huang et al. 2017's snapshot ensembles): the model at the
    end of each cycle (:func:`cycle_ends`) is one member of the ensemble. ``warmup_linear`` (GPT-2
    fine-tuning's schedule): ``lr * step / W`` over the first ``W = warmup_steps`` steps, then a straight
    line from ``lr`` at step ``W + 1`` to ``lr / (steps - W)`` at the last step (zero one step later).
    """
    o, steps, lr = cfg.optimizer, cfg.train.steps, base_lr(cfg)
    if o.schedule == "constant":
        return lr
    if o.schedule == "warmup_linear":
        w = o.warmup_steps
        if step <= w:
            return lr * step / w
        return lr * (steps - step + 1) / (steps - w)
    cycles = o.cycles if o.schedule == "cyclic" else 1
    ends = cycle_ends(steps, cycles)
    start = max([0, *(e for e in ends if e < step)])
    end = min(e for e in ends if e >= step)
    return lr * 0.5 * (1.0 + math.cos(math.pi * (step - 1 - start) / (end - start)))


def cycle_ends(steps: int, cycles: int) -> list[int]:
    """The last step of each of ``cycles`` near-equal cycles of ``steps`` steps."""
    if not 1 <= cycles <= steps:
        raise ValueError(f"config error: optimizer.cycles={cycles} must lie in [1, train.steps={steps}]")
    return [(k * steps) // cycles for k in range(1, cycles + 1)]


def predict(cfg: RunConfig, model: torch.nn.Module, x: torch.Tensor, tta: bool = False) -> torch.Tensor:
    """Test logits ``(N, classes)`` (``(N, T, vocab)`` for text) as float64 on the CPU, the model in eval mode
    (restored afterwards).

    ``tta``: the log of the mean softmax over :func:`data.tta_views` (so argmax, cross-entropy and
    correlations read it as logits). Outside any step: nothing here is committed or logged.
    """
    param = next(model.parameters())
    dtype = param.dtype
    # The test set is on the CPU (the data loaders'), the model where the Session put it (a GPU, say).
    # Images are cast to the model's dtype; token ids stay integers.
    x = x.to(param.device, dtype) if x.is_floating_point() else x.to(param.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if not tta:
                return model(x).double().cpu()  # the callers read it with numpy (a no-op on the CPU)
            views = datasets.tta_views(x, cfg.data.augment, cfg.data.crop_padding)
            probs = torch.stack([model(v.to(dtype)).double().softmax(-1) for v in views]).mean(0)
            return probs.log().cpu()
    finally:
        model.train(was_training)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over classes; sequence outputs ``(N, T, V)`` are flattened to ``(N*T, V)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def training_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The scalar loss one training step minimises on the batch ``(x, y)``.

    A model that defines ``training_loss(x, y)`` gives its own (the Hugging Face wrappers
    :class:`~.models.Llama` and :class:`~.models.ViT`: the loss transformers computes from ``labels=``,
    with its own shifting, upcasting and reduction); every other model is scored by :func:`loss_fn` on
    ``model(x)``, the logits. ``forward`` stays logits either way, so :func:`predict` serves both.
    """
    own = getattr(model, "training_loss", None)
    if callable(own):
        return own(x, y)
    return loss_fn(model(x), y)


def run(
    cfg: RunConfig,
    session: Session,
    progress: bool = False,
    writer: Any = None,
    data: Path | None = None,
    init_from: Path | None = None,
) -> dict[str, float]:
    """Train ``cfg.train.steps`` steps inside ``session`` (recording, replaying or resuming). Stops after a
    whole step once ``session.stop_requested`` is set. Returns final metrics.

    ``data`` and ``init_from``: the auditor's copies of the data and the init weights (default: the
    config's paths). A recording with a BPE tokenizer writes it beside the bundle as ``tokenizer.json``.
    """
    x, y = load_data(cfg, data)
    if session.mode == "record" and session.dir is not None:
        tok = tokenizer_json(cfg, data)
        if tok is not None:  # for people who sample from the model; not part of the bundle
            (session.dir / "tokenizer.json").write_text(tok)
    classes = int(y.max()) + 1 if cfg.data.name == "image_folder" else 10
    model = session.init(model_builder(cfg, x, classes, init_from))
    opt = session.track(make_optimizer(cfg, model))
    model.train()
    steps = cfg.train.steps
    if cfg.optimizer.schedule == "cyclic":
        cycle_ends(steps, cfg.optimizer.cycles)  # a bad cycle count fails before the first step
    batches = session.loader((x, y), batch_size=cfg.train.batch_size, steps=steps)
    start = session.restore()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=steps,
            initial=start,
            desc=f"{session.mode} {cfg.name}",
            unit="step",
            leave=False,
            disable=None,
        )
    loss_value = float("nan")
    for batch in batches if not session.stop_requested else ():
        if cfg.optimizer.schedule != "constant":  # a function of the step: a resumed run picks it up
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg, session.step_index + 1)
        # Crops and flips are data movement, exact in any precision: they run outside the step, on the
        # augment stream, so the rounding mode and the dropout routing never see them.
        inputs = batch.x
        if cfg.data.augment != "none":
            inputs = datasets.augment(
                inputs, cfg.data.augment, cfg.data.crop_padding, session.sources.torch("augment")
            )
        with session.step():
            loss = training_loss(model, inputs, batch.y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
        step = session.step_index
        if writer is not None and (step % cfg.train.log_every == 0 or step == steps):
            writer.add_scalar("train/loss", loss_value, step)
            writer.add_scalar("train/step_seconds", session.step_seconds[-1], step)
            if session.step_stats:
                writer.add_scalar("verify/logged_elements", session.step_stats[-1].logged, step)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}")
        if session.stop_requested:  # Ctrl-C, or the end of what a replayed bundle holds
            break
    if bar is not None:
        bar.close()
    return {"loss": loss_value, "steps": float(session.step_index)}


def fingerprint(cfg: RunConfig, data: Path | None = None, init_from: Path | None = None) -> str:
    """SHA-256 of what the run starts from besides its config (checked by the auditor before any step):
    the training data; with a BPE tokenizer, the tokenizer JSON trained on the corpus; with
    ``model.init_from``, the weights file. Runs with neither keep the plain data fingerprint."""
    parts = [datasets.fingerprint(*load_data(cfg, data))]
    tok = tokenizer_json(cfg, data)
    if tok is not None:
        parts.append("tokenizer " + hashlib.sha256(tok.encode()).hexdigest())
    weights = init_from if init_from is not None else cfg.model.init_from
    if weights:
        parts.append("init_from " + file_sha256(weights))
    if len(parts) == 1:
        return parts[0]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def inputs(cfg: RunConfig) -> dict[str, str]:
    """The files an auditor must supply for ``cfg`` (``detrl audit --data``, ``--init-from``), with why."""
    needed = {}
    if cfg.data.name in PATH_DATA:
        needed["data"] = PATH_DATA[cfg.data.name]
    if cfg.model.init_from:
        needed["init_from"] = "the run starts from a weights file"
    return needed


#: The auditor's default bounds on a bundle's supervised config (``detrl audit --cap KEY=VALUE``): the
#: shipped configs fit with room (ResNet-50 at batch 64, GPT-2 small and larger), a hostile one cannot
#: make the auditor allocate tens of gigabytes (``size.params`` bounds what the values multiply into).
CAPS = {
    "data.n": 100_000, "data.seq_len": 4096, "data.vocab": 65_536, "data.vocab_size": 65_536,
    "model.channels": 1024, "model.hidden": 65_536, "model.d_model": 4096, "model.heads": 64,
    "model.layers": 64, "model.width": 1024, "model.n_layer": 64, "model.n_embd": 4096, "model.n_head": 64,
    "model.n_positions": 8192, "model.vocab_size": 262_144, "model.n_kv_head": 64, "model.intermediate": 65_536,
    "model.patch_size": 256,
    "train.steps": 1_000_000, "train.batch_size": 4096, "threads": 256,
}  # fmt: skip

#: Image sets of a fixed size: (examples, channels, height, width).
_IMAGE_SHAPES = {"digits": (1797, 1, 8, 8), "digits32": (1797, 3, 32, 32), "cifar10": (50_000, 3, 32, 32)}


def size(cfg: RunConfig) -> dict[str, int]:
    """Parameters (counted on the meta device: nothing allocated) and training-data bytes of ``cfg``: what
    the generator or loader allocates, and for FP64 and verifiable precision the FP64 copy the run casts to.

    An ``image_folder`` holds what the auditor's own directory holds: nothing in the bundle sizes it, so
    it counts one image here (the shape the model is built for).
    """
    d = cfg.data
    if d.name in _IMAGE_SHAPES:
        x_shape, x_bytes, y_bytes = _IMAGE_SHAPES[d.name], 4, 8
    elif d.name == "synthetic_images":
        x_shape, x_bytes, y_bytes = (d.n, 3, 32, 32), 4, 8
    elif d.name == "image_folder":
        x_shape, x_bytes, y_bytes = (1, 3, 32, 32), 4, 8
    else:  # token windows: x and y both (n, seq_len) int64
        x_shape, x_bytes, y_bytes = (d.n, d.seq_len), 8, 8 * d.seq_len
    with torch.device("meta"):
        model = build_model(cfg, torch.empty(x_shape, device="meta"))
    n = x_shape[0]
    if x_bytes == 4 and cfg.precision != "fp32":  # float images, cast to FP64: both copies are alive at once
        x_bytes += 8
    data_bytes = n * int(torch.Size(x_shape[1:]).numel()) * x_bytes + n * y_bytes
    return {"params": sum(p.numel() for p in model.parameters()), "data_bytes": data_bytes}


TASK = Task(
    name="supervised",
    config=RunConfig,
    run=run,
    planned_steps=lambda cfg: cfg.train.steps,
    fingerprint=fingerprint,
    # The loader's order does not depend on the total, so a finished run can be extended.
    resume_keys=frozenset({"train.steps", "train.log_every"}),
    caps=CAPS,
    size=size,
    inputs=inputs,
)
