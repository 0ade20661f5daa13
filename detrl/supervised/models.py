"""Models for the supervised recipes: small ones for tests and demos, ResNet-50 and GPT-2 at paper scale,
and Hugging Face's Llama and ViT beside GPT-2.

Attention is written with explicit matmuls and softmax rather than a fused kernel so that every reduction
is an aten op the hardware profiles and the rounding mode can see, and so that every device runs the same
aten ops in the same order (the rounding log is keyed by op position; see :class:`GPT2`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from detrl.run.config import ConfigError


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU x2, max-pool, dropout, linear. Input ``(N, 1, 8, 8)``, output logits ``(N, classes)``.

    ``dropout`` (default 0: none) drops features before the linear head, drawing from the ``dropout`` stream.
    """

    def __init__(self, channels: int = 16, classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.fc = nn.Linear(2 * channels * 4 * 4, classes)
        # No module at p=0: a run without dropout has exactly the op sequence it always had.
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.dropout(x.flatten(1)))


class MLPDropout(nn.Module):
    """Two hidden layers with dropout. Input ``(N, features)`` (images are flattened)."""

    def __init__(
        self, features: int = 64, hidden: int = 128, classes: int = 10, dropout: float = 0.2
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(F.relu(self.fc1(x.flatten(1))))
        x = self.dropout(F.relu(self.fc2(x)))
        return self.out(x)


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape  # batch, sequence length, d_model
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)  # each (N, T, d)
        # (N, T, d) -> (N, h, T, hs): h heads of hs = d / h channels each
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))  # (N, h, T, T)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # (T, T): a token sees its past
        att = self.dropout(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(n, t, d)  # (N, h, T, hs) -> (N, T, d): heads side by side
        x = x + self.dropout(self.proj(y))
        return x + self.dropout(self.mlp(self.ln2(x)))  # (N, T, d)


class TinyTransformer(nn.Module):
    """A GPT-style character model. Input tokens ``(N, T)`` int64, output logits ``(N, T, vocab)``."""

    def __init__(
        self,
        vocab: int = 65,
        d_model: int = 32,
        heads: int = 2,
        layers: int = 1,
        seq_len: int = 32,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
        x = self.tok(tokens) + self.pos(pos)  # (N, T, d_model)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # (N, T, vocab)


class LSTMLM(nn.Module):
    """A character LSTM language model: tokens ``(N, T)`` int64 -> embedding ``d_model`` -> ``layers``
    LSTM layers of ``hidden`` units -> logits ``(N, T, vocab)``.

    Its weight gradients' rows (one per gate unit) differ in magnitude by orders and drift apart over
    training, which made it the model whose rounding log grew fastest before ``mm`` took its threshold's
    unit per row and column (detrl/core/scale.py)."""

    def __init__(self, vocab: int = 65, d_model: int = 64, hidden: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.lstm = nn.LSTM(d_model, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(tokens))[0])


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """ResNet-50 (bottleneck blocks 3-4-6-3) in its CIFAR form: 3x3 stem, no max-pool. Input ``(N,3,32,32)``,
    output logits ``(N, classes)``.

    ``width``: the stem's channels and the first stage's bottleneck width; the stages use ``width``,
    ``2 width``, ``4 width``, ``8 width`` (64: ResNet-50 itself, 23.5M parameters with 10 classes; 4: the
    same 50 layers at 0.1M parameters, for tests).
    """

    def __init__(self, classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers, cin = [], width
        for mult, blocks, stride in [(1, 3, 1), (2, 4, 2), (4, 6, 2), (8, 3, 2)]:
            for i in range(blocks):
                layers.append(Bottleneck(cin, width * mult, stride if i == 0 else 1))
                cin = width * mult * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


class Dropout(nn.Module):
    """Dropout that reaches the dispatcher as ``aten.native_dropout`` on every device.

    ``nn.Dropout`` calls ``aten.dropout``, which ATen decomposes by device *above* the dispatch modes:
    into one fused ``native_dropout`` on CUDA, into ``empty_like``, ``bernoulli_``, ``div_`` and ``mul``
    on the CPU. Record and replay on different devices would then see different op sequences, and the
    rounding log (keyed by op position) would not line up. Calling ``native_dropout`` directly gives one
    sequence everywhere; the ``dropout`` stream draws its mask (:mod:`detrl.core.randomness`).
    """

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return canonical_dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def canonical_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """The function form of :class:`Dropout` (identity outside training and at ``p = 0``: no op at all)."""
    if not training or p == 0.0:
        return x
    return torch.ops.aten.native_dropout(x, p, True)[0]


def canonical_dropouts(module: nn.Module) -> int:
    """Replace every ``nn.Dropout`` inside ``module`` (in place) by a :class:`Dropout` of the same ``p``, so
    the op sequence is the same on every device (see :class:`Dropout`). Returns how many were replaced.

    Hugging Face models build their dropouts as ``nn.Dropout`` children; their parameters and state-dict
    names are untouched (a dropout has neither).
    """
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Dropout):
                setattr(parent, name, Dropout(child.p))
                replaced += 1
    return replaced


#: The name detrl's attention is registered under in transformers' ``AttentionInterface``.
ATTENTION = "detrl_causal"


def causal_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal self-attention as explicit aten ops: ``q k^T * scale``, a boolean causal mask, softmax,
    dropout, ``@ v``. Inputs ``(N, heads, T, head_dim)``; returns ``((N, T, heads, head_dim), weights)``,
    the contract of transformers' attention functions.

    Never ``F.scaled_dot_product_attention``: it picks a fused kernel per device and backend (flash,
    memory-efficient, cuDNN, math), each a different op sequence and summation order. The mask is built
    here from the sequence lengths (no padding: training windows are full), so transformers' mask
    machinery, whose construction varies with its version, never runs.
    """
    if attention_mask is not None:
        raise ValueError("detrl's GPT-2 attention is causal only: it takes no attention_mask (no padding)")
    t_q, t_k = query.shape[-2], key.shape[-2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # (N, heads, T_q, T_k)
    future = torch.ones(t_q, t_k, dtype=torch.bool, device=query.device).triu(t_k - t_q + 1)
    weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    weights = canonical_dropout(weights, dropout, module.training)
    return torch.matmul(weights, value).transpose(1, 2), weights


class GPT2(nn.Module):
    """GPT-2 (Radford et al. 2019) as Hugging Face's ``GPT2LMHeadModel``, randomly initialised from a
    ``GPT2Config`` (no weights are downloaded; load some with ``model.init_from``). Input tokens ``(N, T)``
    int64, output logits ``(N, T, vocab_size)``. Defaults: GPT-2 small, 124M parameters.

    Two changes make its op sequence the same on every device, as verifiable replay needs: attention is
    :func:`causal_attention` (registered with transformers as ``detrl_causal``) instead of SDPA, and every
    ``nn.Dropout`` is a :class:`Dropout`. The weights are those of ``GPT2LMHeadModel`` (``self.lm``), so a
    GPT-2 state dict loads into ``lm``; the output head is tied to the token embedding, as in GPT-2.
    """

    def __init__(
        self,
        vocab_size: int = 50257,
        n_positions: int = 1024,
        n_embd: int = 768,
        n_layer: int = 12,
        n_head: int = 12,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        try:  # an optional extra: detrl[gpt2]
            from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel
        except ImportError as e:
            from detrl.run.config import ConfigError

            raise ConfigError(
                f"model.name=gpt2 needs Hugging Face transformers: pip install 'detrl[gpt2]' ({e})"
            ) from None
        if n_embd % n_head:
            raise ValueError(f"config error: model.n_embd={n_embd} is not divisible by model.n_head={n_head}")
        AttentionInterface.register(ATTENTION, causal_attention)
        config = GPT2Config(
            vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=None,
            eos_token_id=None, use_cache=False,
        )  # fmt: skip
        config._attn_implementation = ATTENTION
        self.lm = GPT2LMHeadModel(config)
        canonical_dropouts(self.lm)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, use_cache=False).logits

    def adapt_state_dict(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face's GPT-2 names to this module's, for ``model.init_from``.

        ``transformer.h.0.attn.c_attn.weight`` (``save_pretrained``) and ``h.0.attn.c_attn.weight`` (the
        original GPT-2 checkpoints) become ``lm.transformer.h.0.attn.c_attn.weight``; detrl's own names
        (``lm.``...) pass unchanged. The legacy causal-mask buffers (``attn.bias``, ``attn.masked_bias``)
        are dropped, as transformers drops them; ``lm_head.weight`` is dropped when it equals the token
        embedding it is tied to, and refused otherwise.
        """
        if any(k.startswith("lm.") for k in tensors):
            return tensors
        out = {}
        for key, t in tensors.items():
            if key.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            out[f"lm.{key}" if key.startswith(("transformer.", "lm_head.")) else f"lm.transformer.{key}"] = t
        head, wte = out.pop("lm.lm_head.weight", None), out.get("lm.transformer.wte.weight")
        if head is not None and (wte is None or not torch.equal(head, wte)):
            raise ValueError(
                "model.init_from: lm_head.weight is not the token embedding it is tied to in GPT-2"
            )
        return out


def _transformers(model: str) -> Any:
    """The ``transformers`` module, or one ConfigError line naming ``model.name`` when it is missing."""
    try:  # an optional extra: detrl[gpt2] (the test extra has it too)
        import transformers
    except ImportError as e:
        raise ConfigError(
            f"model.name={model} needs Hugging Face transformers: pip install 'detrl[gpt2]' ({e})"
        ) from None
    return transformers


def checkpoint_names(hf_model: nn.Module) -> dict[str, str]:
    """``{name in a Hugging Face checkpoint: the name in hf_model}`` for the model's parameters and
    persistent buffers: the names ``save_pretrained`` writes, and the module's own.

    transformers 5 renames some modules (ViT's ``encoder.layer.0.attention.attention.query`` is
    ``layers.0.attention.q_proj``) and writes checkpoints in the old names; its own
    ``revert_weight_conversion`` (what ``save_pretrained`` calls) gives them. A rename carries the tensor
    object through, so identity pairs the names; a conversion that computes new tensors (none in Llama or
    ViT) pairs nothing, and ``load_init`` then names the first missing key. Without that function
    (transformers 4) the checkpoint names are the module's own.
    """
    own = hf_model.state_dict()
    names = {k: k for k in own}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return names
    by_id = {id(t): k for k, t in own.items()}
    for saved, t in revert_weight_conversion(hf_model, dict(own)).items():
        if id(t) in by_id:
            names.setdefault(saved, by_id[id(t)])
    return names


def _adapted(tensors: dict[str, torch.Tensor], hf_model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint's tensors under this wrapper's names (``prefix`` + the module's name; see
    :func:`checkpoint_names`); a dict already in the wrapper's names (``export_safetensors`` of a detrl
    run) passes unchanged. Keys neither knows pass through prefixed, for ``load_init`` to name."""
    if any(k.startswith(prefix) for k in tensors):
        return tensors
    names = checkpoint_names(hf_model)
    return {prefix + names.get(k, k): t for k, t in tensors.items()}


def llama_intermediate(n_embd: int) -> int:
    """LLaMA's SwiGLU width for a model ``n_embd`` wide: ``8/3 n_embd`` rounded up to a multiple of 256
    (Touvron et al. 2023's ``multiple_of``): 2048 at 768, 11008 at 4096 (LLaMA-7B's)."""
    return -(-(8 * n_embd // 3) // 256) * 256


class Llama(nn.Module):
    """Llama (Touvron et al. 2023) as Hugging Face's ``LlamaForCausalLM``, randomly initialised from a
    ``LlamaConfig`` (no download; load weights with ``model.init_from``): RMSNorm, rotary position
    embeddings, a SwiGLU MLP of ``intermediate`` units, grouped-query attention (``n_kv_head`` key-value
    heads shared by ``n_head`` query heads), an untied output head. Input tokens ``(N, T)`` int64, output
    logits ``(N, T, vocab_size)``.

    Trained through its own loss (:meth:`training_loss`: ``labels=tokens``, shifted inside transformers).
    Attention is transformers' ``sdpa`` or ``eager``: inside a verifiable step SDPA is its math
    decomposition (``detrl.core.portable``), the same aten ops on every device. Llama has no dropout
    module, and its attention dropout (SDPA's or eager's, an ``aten.dropout`` that decomposes differently
    on a CPU and a GPU) is kept at 0, as Llama is trained; :func:`canonical_dropouts` still swaps any ``nn.Dropout``
    for :class:`Dropout`, so a transformers version that adds one keeps one op sequence.
    """

    def __init__(
        self,
        vocab_size: int = 32000,
        n_positions: int = 2048,
        n_embd: int = 768,
        n_layer: int = 12,
        n_head: int = 12,
        n_kv_head: int | None = None,
        intermediate: int | None = None,
        attention: str = "sdpa",
    ) -> None:
        super().__init__()
        transformers = _transformers("llama")
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if n_embd % n_head or (n_embd // n_head) % 2:
            raise ConfigError(
                f"config error: model.n_embd={n_embd} must be model.n_head={n_head} times an even head "
                "width (rotary embeddings rotate pairs of channels)"
            )
        if n_head % n_kv_head:
            raise ConfigError(
                f"config error: model.n_kv_head={n_kv_head} must divide model.n_head={n_head} (grouped-query "
                "attention shares each key-value head among n_head / n_kv_head query heads)"
            )
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=n_embd, num_hidden_layers=n_layer, num_attention_heads=n_head,
            num_key_value_heads=n_kv_head, intermediate_size=intermediate or llama_intermediate(n_embd),
            max_position_embeddings=n_positions, attention_dropout=0.0, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=False,
            attn_implementation=attention,
        )  # fmt: skip
        self.lm = transformers.LlamaForCausalLM(config)
        canonical_dropouts(self.lm)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, use_cache=False).logits

    def training_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Llama's own causal-LM loss: ``lm(input_ids=tokens, labels=tokens).loss``, the mean cross-entropy
        of the ``N (T - 1)`` next tokens inside the windows (transformers shifts the labels; the logits are
        upcast to float32 first, an island detrl computes in FP64 and rounds). ``targets`` ``(N, T)`` (the
        windows shifted by one) is not read: its last column, the one token past each window, is the one
        target this loss leaves out."""
        del targets
        return self.lm(input_ids=tokens, labels=tokens, use_cache=False).loss

    def adapt_state_dict(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face's names (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``, as
        ``save_pretrained`` writes them) to this module's (``lm.model.layers.0...``), for
        ``model.init_from``; detrl's own (``lm.``...) pass unchanged."""
        return _adapted(tensors, self.lm, "lm.")


class ViT(nn.Module):
    """The Vision Transformer (Dosovitskiy et al. 2021) as Hugging Face's ``ViTForImageClassification``,
    randomly initialised from a ``ViTConfig`` (no download): ``patch_size`` x ``patch_size`` patches
    embedded by a strided convolution, a class token and learned position embeddings, ``n_layer`` pre-LN
    blocks (``n_head`` heads, a GELU MLP of ``intermediate`` units), a linear head on the class token.
    Input images ``(N, channels, image_size, image_size)``, output logits ``(N, classes)``.

    Trained through its own loss (:meth:`training_loss`). ``dropout`` is ViT's hidden dropout (embeddings,
    attention output, MLP output): every ``nn.Dropout`` is a :class:`Dropout`, drawing from the ``dropout``
    stream. The attention-probability dropout is kept at 0: it runs inside the attention function as an
    ``aten.dropout``, which decomposes differently on a CPU and a GPU (ViT's default is 0 too).
    """

    def __init__(
        self,
        image_size: int = 32,
        channels: int = 3,
        classes: int = 10,
        patch_size: int = 4,
        n_embd: int = 384,
        n_layer: int = 12,
        n_head: int = 6,
        intermediate: int | None = None,
        dropout: float = 0.0,
        attention: str = "sdpa",
    ) -> None:
        super().__init__()
        transformers = _transformers("vit")
        if image_size % patch_size:
            raise ConfigError(
                f"config error: model.patch_size={patch_size} does not divide the images' side ({image_size})"
            )
        if n_embd % n_head:
            raise ConfigError(
                f"config error: model.n_embd={n_embd} is not divisible by model.n_head={n_head}"
            )
        if classes < 2:
            raise ConfigError(
                f"config error: model.name=vit needs at least 2 classes, the data has {classes}"
            )
        config = transformers.ViTConfig(
            image_size=image_size, patch_size=patch_size, num_channels=channels, hidden_size=n_embd,
            num_hidden_layers=n_layer, num_attention_heads=n_head,
            intermediate_size=intermediate or 4 * n_embd, hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=0.0, num_labels=classes, attn_implementation=attention,
            # written out: transformers otherwise infers it from the first labels and stores it in the config
            problem_type="single_label_classification",
        )  # fmt: skip
        self.net = transformers.ViTForImageClassification(config)
        canonical_dropouts(self.net)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values=images).logits

    def training_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """ViT's own loss: ``net(pixel_values=images, labels=labels).loss``, the mean cross-entropy of the
        ``N`` labels ``(N,)`` int64 (transformers' single-label classification loss)."""
        return self.net(pixel_values=images, labels=labels).loss

    def adapt_state_dict(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face's names (``vit.encoder.layer.0.attention.attention.query.weight``,
        ``classifier.weight``, as ``save_pretrained`` writes them) to this module's
        (``net.vit.layers.0.attention.q_proj.weight``: transformers 5's modules), for ``model.init_from``;
        detrl's own (``net.``...) pass unchanged."""
        return _adapted(tensors, self.net, "net.")


MODELS = {
    "cnn_bn": DigitsCNN,
    "mlp_dropout": MLPDropout,
    "tiny_transformer": TinyTransformer,
    "lstm_lm": LSTMLM,
    "resnet50": ResNet50,
    "gpt2": GPT2,
    "llama": Llama,
    "vit": ViT,
}
