"""What the benchmarks share: the models they time, the goals they check, and small helpers (progress on
stderr, recording a run, the base bundle of the trust benchmarks)."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch

from detrl.run import config as config_mod
from detrl.run import sessions, tasks

#: The paper's code writes this much rounding log per ResNet-50 step at batch 8 (measured with its published code).
PAPER_LOG_BYTES_PER_STEP = 26.2e6
#: The goal: a log at least this many times smaller than the paper's.
LOG_GOAL_FACTOR = 1000
EMULATED = ("emulated:splitk", "emulated:reversed", "emulated:pairwise", "emulated:atomic")

# The models, as in configs/supervised/*.yaml (precision and steps are set per benchmark).
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "digits_cnn": {
        "data": {"name": "digits"},
        "model": {"name": "cnn_bn", "channels": 16},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"batch_size": 32},
    },
    "mlp_dropout": {
        "data": {"name": "digits"},
        "model": {"name": "mlp_dropout", "hidden": 128, "dropout": 0.2},
        "optimizer": {"name": "adamw", "lr": 0.001, "weight_decay": 0.01},
        "train": {"batch_size": 32},
    },
    "tiny_transformer": {
        "data": {"name": "synthetic_text", "seq_len": 32, "n": 512, "vocab": 65},
        "model": {"name": "tiny_transformer", "d_model": 32, "heads": 2, "layers": 1, "dropout": 0.1},
        "optimizer": {"name": "adamw", "lr": 0.003},
        "train": {"batch_size": 16},
    },
    "lstm_lm": {
        "data": {"name": "synthetic_text", "seq_len": 32, "n": 512, "vocab": 64},
        "model": {"name": "lstm_lm", "d_model": 64, "hidden": 128, "layers": 2},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "train": {"batch_size": 16},
    },
    "resnet50": {
        "data": {"name": "synthetic_images", "n": 64},
        "model": {"name": "resnet50"},
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "train": {"batch_size": 8},
    },
    # GPT-2 small (124M, GPT-2's 50,257-token vocabulary; needs the gpt2 extra), batch 8 x 64, AdamW
    "gpt2": {
        "data": {"name": "corpus", "tokenizer": "bpe", "vocab_size": 8192, "seq_len": 64, "n": 4096},
        "model": {"name": "gpt2"},
        "optimizer": {"name": "adamw", "lr": 0.0003, "weight_decay": 0.01},
        "train": {"batch_size": 8},
    },
}
#: Models whose steps take seconds: timed with --big-steps / --big-repeats.
BIG_MODELS = ("resnet50", "gpt2")


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def make_config(model: str, precision: str, steps: int, threads: int = 1, **train: Any) -> Any:
    raw = json.loads(json.dumps(MODEL_CONFIGS[model]))
    raw.update(name=f"bench_{model}", precision=precision, threads=threads)
    raw["train"].update(steps=steps, **train)
    raw["verify"] = {"checkpoint_every": 0}
    return config_mod.validate(raw)


def model_list(text: str) -> list[str]:
    """Comma-separated model names, each checked against MODEL_CONFIGS (ValueError: exit 2 in the CLI)."""
    models = [m.strip() for m in text.split(",") if m.strip()]
    for m in models:
        if m not in MODEL_CONFIGS:
            raise ValueError(f"unknown model {m!r}; known: {', '.join(MODEL_CONFIGS)}")
    return models


def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Reset VmHWM (peak RSS) to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def record(cfg: Any, run_dir: Path) -> Any:
    """Record ``cfg`` into ``run_dir`` (replacing a bundle there) in this process; returns the Session."""
    session = sessions.session_for(cfg, run_dir, "record", force=True)
    with session:
        tasks.get(cfg.task).run(cfg, session)
    return session


def record_small_digits(run_dir: Path) -> None:
    """The base bundle of the fuzz and hostile benchmarks: digits_cnn, 8 steps, checkpoints at 4 and 8."""
    cfg = config_mod.load(
        "configs/supervised/digits_cnn.yaml", ["train.steps=8", "verify.checkpoint_every=4"]
    )
    torch.set_num_threads(cfg.threads)
    record(cfg, run_dir)


def mean_sd(values: list[float], scale: float = 1.0, digits: int = 4) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{scale * statistics.mean(values):.{digits}f} ± {scale * sd:.{digits}f}"


class PartTimer:
    """Wall time and calls of named parts of a run: :meth:`timed` wraps a callable. Parts do not nest: a
    part called inside another (a DQN's target network forward inside its update) counts as the outer one."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._inside = False

    def timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        self.seconds.setdefault(label, 0.0)
        self.calls.setdefault(label, 0)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._inside:
                return fn(*args, **kwargs)
            self._inside = True
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1
                self._inside = False

        return wrapper


@contextlib.contextmanager
def timed_parts(
    timer: PartTimer, parts: list[tuple[Any, str, str]], returns_timed: Collection[str] = ()
) -> Iterator[None]:
    """Within: each ``(owner, attribute, label)`` of ``parts`` timed by ``timer``, restored on exit. An
    attribute named in ``returns_timed`` is a factory (a DQN's ``greedy_policy``): the callable it returns
    is what runs in the loop, so that is timed."""
    originals = [getattr(owner, name) for owner, name, _ in parts]
    try:
        for (owner, name, label), original in zip(parts, originals):
            if name in returns_timed:
                setattr(owner, name, lambda *a, make=original, label=label: timer.timed(make(*a), label))
            else:
                setattr(owner, name, timer.timed(original, label))
        yield
    finally:
        for (owner, name, _), original in zip(parts, originals):
            setattr(owner, name, original)
