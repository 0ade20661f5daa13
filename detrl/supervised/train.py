"""The supervised train loop: one function that records (``detrl train``) and replays (``detrl audit``).

It reads top to bottom: data, model, optimizer, then the loop through :class:`detrl.Session`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from detrl.config import RunConfig
from detrl.engine import Session
from detrl.supervised import data as datasets
from detrl.supervised.models import MODELS
from detrl.tasks import Task


def load_data(cfg: RunConfig, path: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The training set ``(x, y)`` named by ``cfg.data`` (without its ``data.holdout`` test examples).

    ``path``: where to read a corpus (``text_file``). The auditor always passes its own (``--data``): a
    bundle's config never names a file the auditor opens. Without it, a recording reads ``data.path``.
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
    """``(train, test)``, each ``(x, y)``; the test set is empty unless ``data.holdout`` is positive."""
    x, y = _load_all(cfg, path)
    if cfg.data.holdout == 0:
        return (x, y), (x[:0], y[:0])
    return datasets.split(x, y, cfg.data.holdout)


def _load_all(cfg: RunConfig, path: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    d = cfg.data
    if d.name == "digits":
        return datasets.digits()
    if d.name == "synthetic_text":
        return datasets.synthetic_text(vocab=d.vocab, seq_len=d.seq_len, n=d.n)
    if d.name == "text_file":
        source = path if path is not None else d.path
        if not source:
            raise ValueError("config error: data.path is required for data.name=text_file")
        return datasets.text_file(str(source), seq_len=d.seq_len, n=d.n)
    return datasets.synthetic_images(n=d.n)


def model_builder(cfg: RunConfig, x: torch.Tensor) -> Any:
    """A zero-argument callable building the model for inputs shaped like ``x``."""
    m, name = cfg.model, cfg.model.name
    dropout = m.dropout if m.dropout is not None else (0.0 if name == "cnn_bn" else 0.1)
    if name == "cnn_bn":
        return lambda: MODELS[name](channels=m.channels, dropout=dropout)
    if name == "mlp_dropout":
        return lambda: MODELS[name](features=int(x[0].numel()), hidden=m.hidden, dropout=dropout)
    if name == "tiny_transformer":
        vocab = cfg.data.vocab if cfg.data.name == "synthetic_text" else 256
        kw = dict(
            vocab=vocab,
            d_model=m.d_model,
            heads=m.heads,
            layers=m.layers,
            seq_len=x.shape[1],
            dropout=dropout,
        )
        return lambda: MODELS[name](**kw)
    return lambda: MODELS[name]()


def make_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
    )


def learning_rate(cfg: RunConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based) of ``train.steps``.

    ``constant``: ``lr``. ``cosine``: from ``lr`` down a half cosine over the run. ``cyclic``: ``cycles``
    such half cosines, each restarting at ``lr`` (Huang et al. 2017's snapshot ensembles): the model at the
    end of each cycle (:func:`cycle_ends`) is one member of the ensemble.
    """
    o, steps = cfg.optimizer, cfg.train.steps
    if o.schedule == "constant":
        return o.lr
    cycles = o.cycles if o.schedule == "cyclic" else 1
    ends = cycle_ends(steps, cycles)
    start = max([0, *(e for e in ends if e < step)])
    end = min(e for e in ends if e >= step)
    return o.lr * 0.5 * (1.0 + math.cos(math.pi * (step - 1 - start) / (end - start)))


def cycle_ends(steps: int, cycles: int) -> list[int]:
    """The last step of each of ``cycles`` near-equal cycles of ``steps`` steps."""
    if not 1 <= cycles <= steps:
        raise ValueError(f"config error: optimizer.cycles={cycles} must lie in [1, train.steps={steps}]")
    return [(k * steps) // cycles for k in range(1, cycles + 1)]


def predict(cfg: RunConfig, model: torch.nn.Module, x: torch.Tensor, tta: bool = False) -> torch.Tensor:
    """Test logits ``(N, classes)`` as float64, the model in eval mode (restored afterwards).

    ``tta``: the log of the mean softmax over :func:`data.tta_views` (so argmax, cross-entropy and
    correlations read it as logits). Outside any step: nothing here is committed or logged.
    """
    dtype = next(model.parameters()).dtype
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if not tta:
                return model(x.to(dtype)).double()
            views = datasets.tta_views(x, cfg.data.augment, cfg.data.crop_padding)
            probs = torch.stack([model(v.to(dtype)).double().softmax(-1) for v in views]).mean(0)
            return probs.log()
    finally:
        model.train(was_training)


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over classes; sequence outputs ``(N, T, V)`` are flattened to ``(N*T, V)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def run(
    cfg: RunConfig, session: Session, progress: bool = False, writer: Any = None, data: Path | None = None
) -> dict[str, float]:
    """Train ``cfg.train.steps`` steps inside ``session`` (recording, replaying or resuming). Stops after a
    whole step once ``session.stop_requested`` is set. Returns final metrics."""
    x, y = load_data(cfg, data)
    model = session.init(model_builder(cfg, x))
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
            loss = loss_fn(model(inputs), batch.y)
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


def fingerprint(cfg: RunConfig, data: Path | None = None) -> str:
    """SHA-256 of the training data the config names (checked by the auditor before replay)."""
    return datasets.fingerprint(*load_data(cfg, data))


#: The auditor's default bounds on a bundle's supervised config (``detrl audit --cap KEY=VALUE``): the
#: shipped configs fit with room (ResNet-50 at batch 8, GPT-2-sized transformers), a hostile one cannot
#: make the auditor allocate tens of gigabytes.
CAPS = {
    "data.n": 100_000, "data.seq_len": 4096, "data.vocab": 65_536,
    "model.channels": 1024, "model.hidden": 65_536, "model.d_model": 4096, "model.heads": 64,
    "model.layers": 64, "train.steps": 1_000_000, "train.batch_size": 4096, "threads": 256,
}  # fmt: skip


def size(cfg: RunConfig) -> dict[str, int]:
    """Parameters (counted on the meta device: nothing allocated) and training-data bytes of ``cfg``."""
    d = cfg.data
    if d.name == "digits":
        x_shape, x_bytes, y_bytes = (1797, 1, 8, 8), 4, 8
    elif d.name == "synthetic_images":
        x_shape, x_bytes, y_bytes = (d.n, 3, 32, 32), 4, 8
    else:  # token windows: x and y both (n, seq_len) int64
        x_shape, x_bytes, y_bytes = (d.n, d.seq_len), 8, 8 * d.seq_len
    with torch.device("meta"):
        model = model_builder(cfg, torch.empty(x_shape, device="meta"))()
    n = x_shape[0]
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
)
