"""Run configs: YAML files validated by pydantic, with ``--set key=value`` overrides.

Every user mistake (unknown key, wrong type, missing file) becomes one :class:`ConfigError` line.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from detrl.core.hardware import get_profile
from detrl.core.sources import Sources
from detrl.formats import safeio
from detrl.run import tasks


class ConfigError(ValueError):
    """A config file or override is invalid."""


def check_tensorboard_dir(path: Path, remedy: str = "remove it, or use --no-tensorboard") -> None:
    """Refuse a TensorBoard folder (``tb/`` beside a bundle, or in an ablation's run) that is a symbolic link
    or not a directory, in one line that ends with ``remedy``: a bundle comes from another party, and event
    files are written only inside it, never through a link."""
    if path.is_symlink():
        raise ConfigError(
            f"{path}: is a symbolic link; TensorBoard writes only into a directory of the bundle's own ({remedy})"
        )
    if os.path.lexists(path) and not path.is_dir():
        raise ConfigError(f"{path}: exists and is not a directory ({remedy})")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(Strict):
    name: Literal[
        "digits",
        "digits32",
        "cifar10",
        "image_folder",
        "synthetic_images",
        "synthetic_text",
        "text_file",
        "corpus",
    ] = "digits"
    path: str | None = Field(
        None,
        description="text_file: a text file; cifar10: the python-pickle CIFAR-10 directory (data_batch_1..5, "
        "test_batch); image_folder: a directory of class subfolders of PNG/JPEG images. The recorder's path: "
        "an auditor passes its own copy (detrl audit --data)",
    )
    seq_len: int = Field(32, ge=2, description="tokens per example (text data)")
    n: int = Field(512, ge=1, description="examples to generate or read (text, synthetic images)")
    vocab: int = Field(
        65,
        ge=2,
        le=4096,
        description="vocabulary size of synthetic_text (at most 4096: its bigram table is vocab x vocab)",
    )
    tokenizer: Literal["bytes", "bpe"] = Field(
        "bytes",
        description="text_file and corpus: bytes as tokens (vocab 256), or a byte-level BPE tokenizer trained "
        "on the corpus itself (Hugging Face tokenizers; deterministic)",
    )
    vocab_size: int = Field(1024, ge=256, description="bpe: the tokenizer's vocabulary size (at most)")
    holdout: int = Field(
        0,
        ge=0,
        description="images: examples held out as the test set (a fixed split, the same on every machine; "
        "cifar10: the first examples of test_batch)",
    )
    augment: Literal["none", "crop", "crop_flip"] = Field(
        "none",
        description="images: random crop with zero padding (and horizontal flip), from the augment stream",
    )
    crop_padding: int = Field(
        1, ge=0, le=64, description="pixels of zero padding around each image for crops"
    )


class ModelConfig(Strict):
    name: Literal[
        "cnn_bn", "mlp_dropout", "tiny_transformer", "lstm_lm", "resnet50", "gpt2", "llama", "vit"
    ] = "cnn_bn"
    channels: int = Field(16, ge=1, description="cnn_bn: channels of the first conv")
    hidden: int = Field(128, ge=1, description="mlp_dropout and lstm_lm: hidden units")
    dropout: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="dropout probability (default: 0 for cnn_bn, llama and vit, 0.1 for mlp, transformer "
        "and gpt2; vit: its hidden dropout; llama: must be 0, Llama has none)",
    )
    d_model: int = Field(32, ge=2, description="tiny_transformer: width; lstm_lm: embedding width")
    heads: int = Field(2, ge=1)
    layers: int = Field(1, ge=1, description="tiny_transformer: blocks; lstm_lm: LSTM layers")
    width: int = Field(64, ge=1, description="resnet50: base width (stem and first stage; 64 is ResNet-50)")
    n_layer: int = Field(12, ge=1, description="gpt2, llama, vit: transformer blocks")
    n_embd: int = Field(768, ge=1, description="gpt2, llama, vit: embedding (hidden) width")
    n_head: int = Field(12, ge=1, description="gpt2, llama, vit: attention heads (must divide n_embd)")
    n_kv_head: int | None = Field(
        None,
        ge=1,
        description="llama: key-value heads of grouped-query attention (must divide n_head; default n_head)",
    )
    intermediate: int | None = Field(
        None,
        ge=1,
        description="llama: SwiGLU width (default 8/3 n_embd rounded up to 256); vit: MLP width (default "
        "4 n_embd)",
    )
    patch_size: int = Field(
        4, ge=1, description="vit: side of the square patches, in pixels (divides the image's)"
    )
    attention: Literal["sdpa", "eager"] = Field(
        "sdpa",
        description="llama and vit: transformers' attention implementation (inside a verifiable step SDPA is "
        "its math decomposition: the same ops on every device)",
    )
    n_positions: int = Field(
        1024, ge=1, description="gpt2 and llama: longest sequence (at least data.seq_len)"
    )
    vocab_size: int = Field(50257, ge=2, description="gpt2 and llama: vocabulary (at least the data's)")
    init_from: str | None = Field(
        None,
        description="a safetensors file of weights loaded after building (keys and shapes checked). The "
        "recorder's path: an auditor passes its own copy (detrl audit --init-from)",
    )


class OptimizerConfig(Strict):
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.05, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="sgd only")
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    schedule: Literal["constant", "cosine", "cyclic", "warmup_linear"] = Field(
        "constant",
        description="learning rate over steps: constant, cosine to 0, `cycles` cosine cycles, or a linear "
        "warmup over `warmup_steps` then a linear decay to 0",
    )
    cycles: int = Field(1, ge=1, description="cyclic: cosine cycles over train.steps (snapshot ensembles)")
    warmup_steps: int = Field(0, ge=0, description="warmup_linear: steps of linear warmup to lr")
    reference_batch: int | None = Field(
        None,
        ge=1,
        description="the batch size lr is given for: a run trains at lr * train.batch_size / reference_batch "
        "(the linear scaling rule of Goyal et al. 2017), so a recipe keeps its schedule at a smaller batch; "
        "none: lr as given",
    )


class TrainConfig(Strict):
    steps: int = Field(30, ge=1, description="optimizer steps")
    batch_size: int = Field(32, ge=1, description="examples per step")
    log_every: int = Field(5, ge=1, description="steps between TensorBoard scalars")


class VerifyConfig(Strict):
    checkpoint_every: int = Field(10, ge=0, description="steps between checkpoints (0: only the last)")
    margin: float = Field(16.0, ge=1.0, description="threshold = margin x largest calibrated disagreement")


class RunBase(Strict):
    """What every run config has: name, task, precision, hardware profile, threads, the switchboard."""

    name: str = "run"
    precision: Literal["verifiable", "fp64", "fp32"] = "verifiable"
    hardware: str = "native"
    hardware_seed: int | None = Field(
        None,
        ge=0,
        lt=2**63,
        description="seeds emulated:atomic's random orders (default: the OS, like real atomics)",
    )
    threads: int = Field(1, ge=1, description="torch intra-op threads")
    sources: dict[str, Any] = Field(default_factory=lambda: {"seed": 0})
    verify: VerifyConfig = Field(default_factory=VerifyConfig)

    @field_validator("hardware")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        get_profile(v)
        return v

    @field_validator("sources")
    @classmethod
    def _valid_sources(cls, v: dict[str, Any]) -> dict[str, Any]:
        Sources.from_config(v)
        return v


class RunConfig(RunBase):
    """A supervised run: what ``detrl train`` records and ``detrl audit`` rebuilds from the manifest."""

    task: Literal["supervised"] = "supervised"
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)


def _set_path(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = cfg
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[keys[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML scalars) to a raw config dict."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        _set_path(out, key.strip(), value)
    return out


def validate(raw: dict[str, Any]) -> RunBase:
    """Validate a raw config dict; the first problem becomes one ConfigError line."""
    if not isinstance(raw, dict):
        raise ConfigError("config must be a mapping")
    task = raw.get("task", "supervised")
    try:
        schema = tasks.get(task if isinstance(task, str) else repr(task)[:40]).config
    except tasks.UnknownTask as e:
        raise ConfigError(str(e)) from None
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = safeio.error_location(err["loc"], "config")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + _did_you_mean(schema, err["loc"])
        elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
            msg = str(err["ctx"]["error"])  # a validator's own words, without pydantic's "Value error, "
        raise ConfigError(f"config error: {where}: {msg}") from None


def _did_you_mean(schema: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """``' (did you mean optimizer.lr?)'`` for the unknown key at ``loc``, or ``''`` if nothing is close."""
    import difflib
    from typing import get_args

    def submodel(annotation: Any) -> type[BaseModel] | None:  # the model in X, X | None, list[X], ...
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation
        for arg in get_args(annotation):
            if (found := submodel(arg)) is not None:
                return found
        return None

    model: type[BaseModel] | None = schema
    for key in loc[:-1]:
        if isinstance(key, int):  # an index into a list of models: same model
            continue
        field = model.model_fields.get(str(key)) if model is not None else None
        model = submodel(field.annotation) if field is not None else None
        if model is None:
            return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    if not close:
        return ""
    return " (did you mean " + ".".join([*(str(k) for k in loc[:-1]), close[0]]) + "?)"


def _configs_dir() -> Any:
    """The ``configs`` folder inside the installed package (an importlib.resources Traversable)."""
    from importlib.resources import files

    return files("detrl") / "configs"


def packaged_configs() -> list[str]:
    """Names of the configs shipped in the package, e.g. ``dqn/tiny.yaml`` (sorted)."""
    root = _configs_dir()
    if not root.is_dir():
        return []
    return sorted(
        f"{group.name}/{f.name}"
        for group in root.iterdir()
        if group.is_dir()
        for f in group.iterdir()
        if f.name.endswith(".yaml") and f.is_file()
    )


def _packaged_config(path: Path) -> Any:
    """The packaged config that relative ``configs/X/Y.yaml`` or ``X/Y.yaml`` names, or None."""
    parts = path.parts
    if path.is_absolute() or not parts or ".." in parts:
        return None
    if parts[0] == "configs":
        parts = parts[1:]
    if not parts:
        return None
    candidate = _configs_dir()
    for part in parts:  # one level at a time: Python 3.10's Traversable joins one name
        candidate = candidate / part
    return candidate if candidate.is_file() else None


def read_raw(path: str | Path) -> dict[str, Any]:
    """The raw (unvalidated) mapping of a YAML config file.

    A relative path that does not exist, of the form ``configs/dqn/tiny.yaml`` or ``dqn/tiny.yaml``, is
    read from the configs shipped inside the package (``detrl/configs``), so they work from any directory.
    """
    p: Any = Path(path)
    if not p.is_file():
        packaged = _packaged_config(p)
        if packaged is None:
            names = ", ".join(packaged_configs()) or "none"
            raise ConfigError(f"config file not found: {path} (packaged, as configs/NAME or NAME: {names})")
        p = packaged
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path}: must be a mapping of keys to values")
    return raw


def load(path: str | Path, overrides: list[str] | None = None) -> RunBase:
    """Read (see :func:`read_raw`), override and validate a YAML run config."""
    return validate(apply_overrides(read_raw(path), overrides or []))
