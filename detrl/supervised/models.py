"""Models for the supervised recipes: small ones for tests and demos, ResNet-50 and GPT-2 at paper scale.

Attention is written with explicit matmuls and softmax rather than a fused kernel so that every reduction
is an aten op the hardware profiles and the rounding mode can see, and so that every device runs the same
aten ops in the same order (the rounding log is keyed by op position; see :class:`GPT2`).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


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
        for parent in list(self.lm.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Dropout):
                    setattr(parent, name, Dropout(child.p))

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


MODELS = {
    "cnn_bn": DigitsCNN,
    "mlp_dropout": MLPDropout,
    "tiny_transformer": TinyTransformer,
    "lstm_lm": LSTMLM,
    "resnet50": ResNet50,
    "gpt2": GPT2,
}
