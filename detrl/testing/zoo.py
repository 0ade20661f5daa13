"""A zoo of architectures built from their configs (no download), each recorded and replayed as a script.

Each :class:`Specimen` builds a small model, one batch and the loss a user trains it with (Hugging Face
models through their own ``labels=`` loss). :func:`record` trains it for a few steps in verifiable precision
into a bundle, :func:`replay` replays that bundle under another hardware profile; a replay that does not
replicate raises :class:`detrl.Divergence`. The zoo test and the op walk (:mod:`detrl.testing.opwalk`)
use them; so can anyone trying a model of their own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from detrl.core.engine import Session
from detrl.core.hardware import Profile
from detrl.core.sources import Sources


@dataclasses.dataclass(frozen=True)
class Size:
    """How big the zoo's models are: ``width`` is the hidden size (``2 * width`` the MLP's), each sequence
    ``seq`` tokens of a ``vocab``-token vocabulary, each image ``image`` x ``image`` pixels, each batch
    ``batch`` sequences or images, or ``4 * batch`` rows of ``width // 2`` features. The tests use the small
    default; ``detrl bench zoo`` takes any (BENCHMARKS.md has the sizes where the log matters)."""

    width: int = 32
    seq: int = 12
    batch: int = 4
    vocab: int = 64
    image: int = 16


@dataclasses.dataclass(frozen=True)
class Specimen:
    """A model to record: ``build()`` (called under the ``init`` stream), ``batch()`` (a tuple of tensors,
    the same every step) and ``loss(model, batch) -> scalar``."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    needs: str = ""  # a transformers class it needs ("" when torch alone builds it)


def tokens(size: Size = Size()) -> tuple[torch.Tensor, ...]:
    """``(batch, seq)`` token ids."""
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, size.vocab, (size.batch, size.seq), generator=g),)


def images(size: Size = Size()) -> tuple[torch.Tensor, ...]:
    """``(batch, 3, image, image)`` pixels in [0, 1) and ``(batch,)`` labels of 3 classes."""
    g = torch.Generator().manual_seed(2)
    x = torch.rand(size.batch, 3, size.image, size.image, generator=g)
    return x, torch.randint(0, 3, (size.batch,), generator=g)


def features(size: Size = Size()) -> tuple[torch.Tensor, ...]:
    """``(4 * batch, width // 2)`` standard-normal features and ``(4 * batch,)`` labels of 5 classes."""
    g = torch.Generator().manual_seed(3)
    n = size.batch * 4
    return torch.randn(n, size.width // 2, generator=g), torch.randint(0, 5, (n,), generator=g)


def _hf(name: str, config: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config)(**kw)
        return getattr(transformers, name)(cfg)

    return build


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A Hugging Face causal LM through its own ``labels=`` loss (which upcasts the logits to float32)."""
    return model(input_ids=batch[0], labels=batch[0]).loss


def lm_loss_outside(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The same causal-LM loss as :func:`lm_loss`, computed outside the model on its ``(B, T, vocab)`` logits
    in the run's own precision (no float32 upcast)."""
    logits = model(input_ids=batch[0]).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[0][:, 1:].reshape(-1))


def _cls_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0][:, 0] % 3).loss


def _decoder(size: Size, **kw: Any) -> dict[str, Any]:
    w = size.width
    return {
        "vocab_size": size.vocab, "hidden_size": w, "intermediate_size": 2 * w, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": max(64, size.seq), **kw,
    }  # fmt: skip


class UpcastMLP(nn.Module):
    """An MLP whose forward ends in ``logits.float().log_softmax(-1)``, a common stability idiom."""

    def __init__(self, width: int = 32, upcast: bool = True) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width // 2, width), nn.Linear(width, 5)
        self.upcast = upcast  # False: the same MLP in the run's own precision (its FP64 twin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, width // 2) -> (N, 5) log-probabilities
        logits = self.fc2(torch.tanh(self.fc1(x)))
        return (logits.float() if self.upcast else logits).log_softmax(-1)


class Activations(nn.Module):
    """An MLP through PReLU, then SiLU, hard sigmoid and leaky ReLU in place, Mish and a threshold: the
    activations rules revision 11 rounds by their own kinds (before, each was logged as a reduction)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inner = nn.ModuleList(nn.Linear(width // 2 if i == 0 else width, width) for i in range(4))
        self.prelu, self.head = nn.PReLU(width), nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, width // 2) -> (N, 5) logits
        a, b, c, d = self.inner
        h = self.prelu(a(x))
        h = F.silu(b(h), inplace=True)
        h = F.hardsigmoid(c(h), inplace=True)
        h = F.mish(F.leaky_relu(d(h), 0.1, inplace=True))
        return self.head(F.threshold(h, 0.1, 0.3))


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (fused SDPA attention inside) over token embeddings, next-token loss."""

    def __init__(self, width: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        return self.head(self.body(self.emb(tokens)))


class MaskedEncoder(Encoder):
    """:class:`Encoder` with the masks plain torch code writes: a causal mask of ``-inf`` above the diagonal
    (``nn.Transformer.generate_square_subsequent_mask``) and a key padding mask (ids below 8 pad, past the
    first position): attention scores infinite by design, in a matrix product's output."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.emb(tokens)  # (B, T, width)
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], dtype=x.dtype)  # (T, T)
        pads = (tokens < 8) & (torch.arange(tokens.shape[1]) > 0)  # the first key stays: no NaN row
        padding = torch.zeros(tokens.shape, dtype=x.dtype).masked_fill(pads, float("-inf"))  # (B, T)
        return self.head(self.body(x, mask=causal, src_key_padding_mask=padding))


class ExtremeMasks(nn.Module):
    """Self-attention masked as Hugging Face code masks it: scores filled with ``torch.finfo(dtype).min``
    (asked of the dtype the model runs in) where a key is padding, and where the query is too, so that a
    padded query's row is masked whole (DeBERTa's pairwise mask). The minimum comes as a number to
    ``masked_fill``, as ``torch.tensor(...)`` to it, and as ``torch.where``'s number: in FP32 it is -3.4e38, a
    whole row of which softmaxes to a uniform row; rounded to FP32 from FP64's it was -inf, and the row NaN
    (rules revision 12)."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.emb, self.qkv = nn.Embedding(vocab, width), nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        x = self.emb(tokens)  # (B, T, width)
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, width) each
        scores = q @ k.transpose(1, 2) / math.sqrt(x.shape[-1])  # (B, T, T)
        keep = tokens >= 8  # ids below 8 pad
        pair = keep[:, :, None] & keep[:, None, :]  # (B, T, T): a padded query's row masked whole
        lowest = torch.finfo(scores.dtype).min
        scores = scores.masked_fill(~pair, lowest)
        scores = scores.masked_fill(~pair, torch.tensor(lowest))
        scores = torch.where(pair, scores, lowest)
        attn = scores.softmax(-1)  # (B, T, T): a padded query attends to every key alike, as in FP32
        return self.head(x + attn @ v)


class LSTMNet(nn.Module):
    def __init__(self, width: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.emb, self.lstm, self.head = (
            nn.Embedding(vocab, width // 2),
            nn.LSTM(width // 2, width, batch_first=True),
            nn.Linear(width, vocab),
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        return self.head(self.lstm(self.emb(tokens))[0])


class PackedRecurrent(nn.Module):
    """Sequences of different lengths as NLP code runs them: packed (unsorted) through a two-layer
    bidirectional LSTM with dropout between its layers, padded back, packed again through a GRU. The layers
    shrink their batch as sequences end (ATen's packed layers), and the padding never reaches the loss."""

    def __init__(self, width: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width // 2)
        self.lstm = nn.LSTM(width // 2, width // 2, num_layers=2, bidirectional=True, dropout=0.2)
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        b, t = tokens.shape
        lengths = [t - i % t for i in range(b)]  # T, T - 1, ...: unsorted once sorted is undone
        x = nn.utils.rnn.pack_padded_sequence(self.emb(tokens).transpose(0, 1), lengths, enforce_sorted=False)
        h, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(x)[0], batch_first=True)  # (B, T, width)
        h = nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        h, _ = nn.utils.rnn.pad_packed_sequence(self.gru(h)[0], batch_first=True, total_length=t)
        return self.head(h)


class RotaryFourier(nn.Module):
    """Complex arithmetic as models write it: the rotary embedding of Meta's Llama (frequencies from
    ``torch.polar``, queries and keys rotated as complex64 numbers), FNet's Fourier mixing (the real part of
    ``fft2``) and a spectral filter (``rfft`` along the sequence, a learned complex gain held as real pairs,
    ``irfft`` back)."""

    def __init__(self, width: int = 32, vocab: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.emb, self.qkv, self.head = (
            nn.Embedding(vocab, width),
            nn.Linear(width, 3 * width),
            nn.Linear(width, vocab),
        )
        self.heads, self.norm = heads, nn.LayerNorm(width)
        # (width,) complex gains, held as real pairs near 1
        self.gain = nn.Parameter(torch.randn(width, 2) / 4 + torch.tensor([1.0, 0.0]))
        half = width // heads // 2
        freqs = 1.0 / 10000 ** (torch.arange(half) / half)
        self.register_buffer("angles", torch.outer(torch.arange(64.0), freqs), persistent=False)  # (64, half)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, heads, head_width), rotated by position
        t = x.shape[1]
        freqs = torch.polar(torch.ones_like(self.angles[:t]), self.angles[:t])  # (T, half) complex
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, heads, half)
        return torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3).type_as(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        h = self.emb(tokens)  # (B, T, width)
        b, t, w = h.shape
        q, k, v = (z.view(b, t, self.heads, -1) for z in self.qkv(h).chunk(3, -1))
        q, k, v = self.rotate(q).transpose(1, 2), self.rotate(k).transpose(1, 2), v.transpose(1, 2)
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)
        h = h + torch.fft.fft2(h).real / t  # mixing over positions and features (B, T, width)
        spectrum = torch.fft.rfft(h, dim=1) * torch.view_as_complex(self.gain)  # (B, T // 2 + 1, width)
        return self.head(self.norm(h + torch.fft.irfft(spectrum, n=t, dim=1)))


class SpectralOperator(nn.Module):
    """A Fourier neural operator as neuraloperator writes one: each spectral layer holds ``torch.cfloat``
    weights (a complex parameter), keeps the lowest ``modes`` frequencies of an ``rfft``, mixes their channels
    with an ``einsum`` into a complex64 ``zeros`` spectrum, and goes back with ``irfft``; a pointwise
    convolution runs beside it. Each row of features is a signal of ``points`` samples."""

    def __init__(self, width: int = 32, classes: int = 5, modes: int = 4) -> None:
        super().__init__()
        c = max(4, width // 4)
        self.modes, self.lift, self.head = modes, nn.Conv1d(1, c, 1), nn.Linear(c, classes)
        self.spectral = nn.ParameterList(
            nn.Parameter(torch.rand(c, c, modes, dtype=torch.cfloat) / (c * c)) for _ in range(2)
        )  # (in, out, modes) each
        self.pointwise = nn.ModuleList(nn.Conv1d(c, c, 1) for _ in range(2))

    def spectral_conv(self, h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:  # (B, c, points)
        points = h.shape[-1]
        spectrum = torch.fft.rfft(h)  # (B, c, points // 2 + 1) complex
        out = torch.zeros(*spectrum.shape, dtype=torch.cfloat, device=h.device)
        out[..., : self.modes] = torch.einsum("bix,iox->box", spectrum[..., : self.modes], weights)
        return torch.fft.irfft(out, n=points)  # float32: a narrow result, cast back to h's dtype below

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, points) -> (B, classes)
        h = self.lift(x[:, None, :])  # (B, c, points)
        for weights, pointwise in zip(self.spectral, self.pointwise):
            h = F.gelu(self.spectral_conv(h, weights).type_as(h) + pointwise(h))
        return self.head(h.mean(-1))


class AutocastCNN(nn.Module):
    """A small CNN whose forward runs under ``torch.autocast(dtype=torch.bfloat16)``."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        c = max(1, width // 4)
        self.conv1, self.conv2 = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.fc = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.relu(self.conv2(F.relu(self.conv1(x)))).mean((2, 3))  # (B, c)
            return self.fc(h)


class BatchNormCNN(nn.Module):
    """A small CNN with batch norm in training mode: 2-d after the convolution (affine, running statistics),
    1-d before the head without affine parameters or running statistics."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        c = max(1, width // 4)
        self.conv = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn2d = nn.BatchNorm2d(c)
        self.bn1d = nn.BatchNorm1d(c, affine=False, track_running_stats=False)
        self.fc = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 3)
        h = F.relu(self.bn2d(self.conv(x))).mean((2, 3))  # (B, c)
        return self.fc(self.bn1d(h))


class NormsThenMeans(nn.Module):
    """Normalisations followed at once by a mean over what they normalised: instance norm and group norm
    (a channel a group) then global average pooling, layer norm (no bias) then a mean over its features.
    Their backward sums ``grad_out * xhat`` cancel to rounding noise (the pooled gradient is constant where
    the normalised values sum to zero)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        c = max(1, width // 4)
        self.conv, self.inorm, self.gnorm = (
            nn.Conv2d(3, c, 3),
            nn.InstanceNorm2d(c, affine=True),
            nn.GroupNorm(c, c),
        )
        self.fc, self.lnorm = nn.Linear(c, width), nn.LayerNorm(width, bias=False)
        self.head = nn.Linear(c + 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 3)
        h = self.conv(x)  # (B, c, H - 2, W - 2)
        pooled = self.inorm(h).mean((2, 3)) + self.gnorm(h).mean((2, 3))  # (B, c)
        feature = self.lnorm(self.fc(pooled)).mean(-1, keepdim=True)  # (B, 1)
        return self.head(torch.cat([pooled, feature], 1))


class ConditionedProjection(nn.Module):
    """Features concatenated with a learned constant map (a conditioning input, as FiLM and CoordConv add),
    then a 1x1 projection into a training-mode batch norm, as an EfficientNet block's project_conv and
    project_bn. Batch norm's backward leaves the projection's output gradient summing to zero over each
    channel, so the projection's weight gradient on the constant channels cancels to rounding noise."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        c = max(2, width // 4)
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.condition = nn.Parameter(torch.randn(1, c, 1, 1))
        self.project, self.bn = nn.Conv2d(2 * c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, 3)
        h = F.relu(self.conv(x))  # (B, c, H, W)
        h = torch.cat([h, self.condition.expand_as(h)], 1)  # (B, 2c, H, W)
        return self.fc(F.relu(self.bn(self.project(h))).mean((2, 3)))


def next_token(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross-entropy of ``model``'s ``(B, T-1, vocab)`` logits against the next tokens."""
    logits = model(batch[0][:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[0][:, 1:].reshape(-1))


def classify(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross-entropy of ``model(x)`` against ``y``."""
    return F.cross_entropy(model(batch[0]), batch[1])


def nll(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Negative log-likelihood of ``model(x)`` (log-probabilities) against ``y``."""
    return F.nll_loss(model(batch[0]), batch[1])


def _pixels_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A Hugging Face vision model through its own ``labels=`` loss (classification or segmentation)."""
    return model(pixel_values=batch[0], labels=batch[1]).loss


def _t5_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0].flip(1)).loss


class LayerNormThenMean(nn.Module):
    """Tokens through a linear layer into a layer norm (weight 1, bias 0 at init), whose mean over its features
    is added back to every feature. That mean is zero up to rounding, so its backward row sums
    (``grad_out * xhat`` summed over the features) cancel: to exactly 0.0 in some rows on one order of the
    sum, and to noise like 1e-19 on another."""

    def __init__(self, width: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(vocab, width), nn.Linear(width, width)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        h = self.emb(tokens)  # (B, T, width)
        return self.head(h + self.norm(self.fc(h)).mean(-1, keepdim=True))


def specimens(size: Size = Size()) -> dict[str, Specimen]:
    """Every zoo architecture at ``size``, by name."""
    w, v, pos = size.width, size.vocab, max(64, size.seq)
    toks, imgs, feats = (functools.partial(f, size) for f in (tokens, images, features))
    return {
        s.name: s
        for s in [
            Specimen("upcast_mlp", functools.partial(UpcastMLP, w), feats, nll),
            Specimen("activations", functools.partial(Activations, w), feats, classify),
            Specimen(
                "hf_gpt2", _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=v, n_positions=pos, n_embd=w,
                               n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None), toks, lm_loss, "GPT2LMHeadModel"),
            Specimen("hf_llama_eager", _hf("LlamaForCausalLM", "LlamaConfig",
                                           **_decoder(size, attn_implementation="eager")),
                     toks, lm_loss, "LlamaForCausalLM"),
            Specimen("hf_llama_sdpa", _hf("LlamaForCausalLM", "LlamaConfig",
                                          **_decoder(size, attn_implementation="sdpa")),
                     toks, lm_loss, "LlamaForCausalLM"),
            Specimen("hf_qwen2_eager", _hf("Qwen2ForCausalLM", "Qwen2Config",
                                           **_decoder(size, attn_implementation="eager")),
                     toks, lm_loss, "Qwen2ForCausalLM"),
            Specimen("hf_mistral", _hf("MistralForCausalLM", "MistralConfig", **_decoder(size)), toks, lm_loss,
                     "MistralForCausalLM"),
            Specimen("hf_mixtral", _hf("MixtralForCausalLM", "MixtralConfig", num_local_experts=4,
                                       num_experts_per_tok=2, **_decoder(size)), toks, lm_loss, "MixtralForCausalLM"),
            Specimen(
                "hf_bert", _hf("BertForSequenceClassification", "BertConfig", vocab_size=v, hidden_size=w,
                               num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * w,
                               max_position_embeddings=pos, num_labels=3), toks, _cls_loss,
                "BertForSequenceClassification"),
            Specimen(
                "hf_vit", _hf("ViTForImageClassification", "ViTConfig", image_size=size.image, patch_size=4,
                              hidden_size=w, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * w,
                              num_labels=3), imgs, _pixels_loss, "ViTForImageClassification"),
            Specimen(
                "hf_t5", _hf("T5ForConditionalGeneration", "T5Config", vocab_size=v, d_model=w, d_kv=w // 4,
                             d_ff=2 * w, num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0),
                toks, _t5_loss, "T5ForConditionalGeneration"),
            Specimen("transformer_encoder", functools.partial(Encoder, w, v), toks, next_token),
            Specimen("masked_encoder", functools.partial(MaskedEncoder, w, v), toks, next_token),
            Specimen("extreme_masks", functools.partial(ExtremeMasks, w, v), toks, next_token),
            Specimen("lstm", functools.partial(LSTMNet, w, v), toks, next_token),
            Specimen("packed_recurrent", functools.partial(PackedRecurrent, w, v), toks, next_token),
            Specimen("rotary_fourier", functools.partial(RotaryFourier, w, v), toks, next_token),
            Specimen("spectral_operator", functools.partial(SpectralOperator, w), feats, classify),
            Specimen("autocast_bf16", functools.partial(AutocastCNN, w), imgs, classify),
            Specimen("cnn_batch_norm", functools.partial(BatchNormCNN, w), imgs, classify),
            Specimen("norms_then_means", functools.partial(NormsThenMeans, w), imgs, classify),
            Specimen("conditioned_projection", functools.partial(ConditionedProjection, w), imgs, classify),
            Specimen("layer_norm_then_mean", functools.partial(LayerNormThenMean, max(8, w // 4), v), toks, next_token),
        ]
    }  # fmt: skip


def _padded_cls_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """:func:`_cls_loss` with ids below 8 as padding, which the attention mask leaves out."""
    ids = batch[0]
    return model(input_ids=ids, attention_mask=(ids >= 8).long(), labels=ids[:, 0] % 3).loss


def _depth_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean squared error of a depth estimator's ``(B, H, W)`` prediction against 1."""
    return ((model(pixel_values=batch[0]).predicted_depth - 1.0) ** 2).mean()


def _segmentation_maps(size: Size = Size()) -> tuple[torch.Tensor, ...]:
    """``(batch, 3, 2 * image, 2 * image)`` pixels and a class (of 3) per pixel."""
    g = torch.Generator().manual_seed(5)
    side = 2 * size.image
    x = torch.rand(size.batch, 3, side, side, generator=g)
    return x, torch.randint(0, 3, (size.batch, side, side), generator=g)


def _waveforms(size: Size = Size()) -> tuple[torch.Tensor, ...]:
    """``(batch // 2, 100 * image)`` raw audio samples and ``(batch // 2, 4)`` CTC labels in ``1..7``."""
    g = torch.Generator().manual_seed(6)
    n = max(1, size.batch // 2)
    return torch.randn(n, 100 * size.image, generator=g), torch.randint(1, 8, (n, 4), generator=g)


def _left_padded(size: Size = Size()) -> tuple[torch.Tensor, ...]:
    """:func:`tokens` with every other sequence left-padded (its first 4 positions), and the attention mask
    that says so: a batch ready for generation."""
    (ids,) = tokens(size)
    mask = torch.ones_like(ids)
    mask[::2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _masked_lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A causal LM's own loss with an attention mask, the padding left out of the labels."""
    ids, mask = batch
    return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss


def _ctc_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(input_values=batch[0], labels=batch[1]).loss


def regressions(size: Size = Size()) -> dict[str, Specimen]:
    """Hugging Face models that an earlier detrl failed on, kept as cases (a slow test replays them): BigBird's
    block-sparse attention (an ``unsqueeze_`` on a float32 mask), SegFormer's segmentation loss over
    channels-last logits, EfficientNet (a weight gradient that cancels before a batch norm), DPT (its
    residual convolutions' thresholds looked up under a layout), wav2vec2 with its CTC loss (SpecAugment
    draws its training masks from NumPy's global RNG, which no step seeded), and FNet and Llama 4 (Fourier
    mixing and complex rotary embeddings: complex tensors were refused), and DeBERTa-v2 on a padded batch and
    GPT-2 (eager attention) on a left-padded one (a row masked whole with FP64's minimum was NaN: rules
    revision 12)."""
    w, v = size.width, size.vocab
    toks = functools.partial(tokens, dataclasses.replace(size, seq=16))
    wide = functools.partial(images, dataclasses.replace(size, image=2 * size.image))
    imgs = functools.partial(images, size)
    return {
        s.name: s
        for s in [
            Specimen("hf_bigbird_block_sparse", _hf("BigBirdForSequenceClassification", "BigBirdConfig",
                     attention_type="block_sparse", block_size=2, num_random_blocks=1, vocab_size=v, hidden_size=w,
                     intermediate_size=2 * w, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                     num_labels=3), toks, _cls_loss, "BigBirdForSequenceClassification"),
            Specimen("hf_segformer_segmentation", _hf("SegformerForSemanticSegmentation", "SegformerConfig",
                     num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[7, 3],
                     strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16,
                     num_labels=3), functools.partial(_segmentation_maps, size), _pixels_loss,
                     "SegformerForSemanticSegmentation"),
            Specimen("hf_efficientnet", _hf("EfficientNetForImageClassification", "EfficientNetConfig",
                     image_size=2 * size.image, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=128,
                     num_labels=3), wide, _pixels_loss, "EfficientNetForImageClassification"),
            Specimen("hf_dpt", _hf("DPTForDepthEstimation", "DPTConfig", image_size=size.image, patch_size=4,
                     hidden_size=w, num_hidden_layers=4, num_attention_heads=4, intermediate_size=2 * w,
                     neck_hidden_sizes=[8, 8, 16, 16], fusion_hidden_size=16, backbone_out_indices=[0, 1, 2, 3],
                     head_in_index=-1), imgs, _depth_loss, "DPTForDepthEstimation"),
            Specimen("hf_wav2vec2_ctc", _hf("Wav2Vec2ForCTC", "Wav2Vec2Config", vocab_size=8, hidden_size=w,
                     num_hidden_layers=1, num_attention_heads=4, intermediate_size=2 * w, conv_dim=(8, 8),
                     conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
                     num_conv_pos_embedding_groups=2, feat_extract_norm="group", mask_time_prob=0.2,
                     ctc_loss_reduction="mean", pad_token_id=0), functools.partial(_waveforms, size), _ctc_loss,
                     "Wav2Vec2ForCTC"),
            Specimen("hf_fnet", _hf("FNetForSequenceClassification", "FNetConfig", vocab_size=v, hidden_size=w,
                     num_hidden_layers=2, intermediate_size=2 * w, max_position_embeddings=64, num_labels=3),
                     toks, _cls_loss, "FNetForSequenceClassification"),
            Specimen("hf_deberta_v2_padded", _hf("DebertaV2ForSequenceClassification", "DebertaV2Config",
                     vocab_size=v, hidden_size=w, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * w,
                     max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"],
                     max_relative_positions=16, num_labels=3), toks, _padded_cls_loss,
                     "DebertaV2ForSequenceClassification"),
            Specimen("hf_gpt2_left_padded", _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=v, n_positions=64,
                     n_embd=w, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None, attn_implementation="eager"),
                     functools.partial(_left_padded, size), _masked_lm_loss, "GPT2LMHeadModel"),
            Specimen("hf_llama4", _hf("Llama4ForCausalLM", "Llama4TextConfig", head_dim=w // 4, num_local_experts=4,
                     num_experts_per_tok=1, intermediate_size_mlp=2 * w, interleave_moe_layer_step=1,
                     attention_chunk_size=4, **_decoder(size)), toks, lm_loss, "Llama4ForCausalLM"),
        ]
    }  # fmt: skip


#: The zoo at the tests' size (seconds a model).
SPECIMENS: dict[str, Specimen] = specimens()
#: ... and the regression cases (:func:`regressions`).
REGRESSIONS: dict[str, Specimen] = regressions()


def fp64_twins(size: Size = Size()) -> dict[str, tuple[Specimen, Specimen]]:
    """Models with float32 islands beside their FP64 twins (the same model and batch, computed in the run's
    own precision throughout), for measuring what an island costs: name -> (island model, twin)."""
    zoo = specimens(size)
    gpt2 = zoo["hf_gpt2"]
    return {
        "upcast_mlp": (
            zoo["upcast_mlp"],
            dataclasses.replace(zoo["upcast_mlp"], name="fp64_mlp",
                                build=functools.partial(UpcastMLP, size.width, upcast=False)),
        ),
        "hf_gpt2": (gpt2, dataclasses.replace(gpt2, name="hf_gpt2_loss_outside", loss=lm_loss_outside)),
    }  # fmt: skip


def _gpt2_small_tokens() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4)
    return (torch.randint(0, 50257, (8, 64), generator=g),)  # the paper's batch: 8 x 64 tokens


#: Full-size models, for the ``zoo`` benchmark (minutes a step on a CPU; the tests use SPECIMENS).
FULL_SIZE: dict[str, Specimen] = {
    "hf_gpt2_small": Specimen(
        "hf_gpt2_small", _hf("GPT2LMHeadModel", "GPT2Config", bos_token_id=None, eos_token_id=None),
        _gpt2_small_tokens, lm_loss, "GPT2LMHeadModel"),  # GPT-2 small: 124M parameters
}  # fmt: skip


def available(specimen: Specimen) -> bool:
    """Whether this installation can build ``specimen`` (its transformers class exists)."""
    if not specimen.needs:
        return True
    try:
        import transformers
    except ImportError:
        return False
    return hasattr(transformers, specimen.needs)


def train(session: Session, specimen: Specimen, steps: int) -> Session:
    with session:
        model = session.init(specimen.build)
        model.train()
        opt = session.track(torch.optim.AdamW(model.parameters(), lr=3e-3))
        # as Session.loader gives them: in the run's precision, on its device
        batch = tuple(session.precision.cast(t).to(session.device) for t in specimen.batch())
        for _ in range(steps):
            if session.stop_requested:  # a replay at the end of what its bundle holds
                break
            with session.step(batch=batch):
                loss = specimen.loss(model, batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
    return session


def record(
    specimen: Specimen, run_dir: str | Path, steps: int = 2, hardware: str | Profile = "native"
) -> Session:
    """Train ``specimen`` for ``steps`` steps in verifiable precision into the bundle ``run_dir``."""
    session = Session(
        run_dir, mode="record", sources=Sources(), hardware=hardware, planned_steps=steps, checkpoint_every=0
    )
    return train(session, specimen, steps)


def replay(specimen: Specimen, run_dir: str | Path, hardware: str | Profile, steps: int = 2) -> Session:
    """Replay the bundle ``run_dir`` of ``specimen`` under ``hardware`` (raises Divergence if it differs)."""
    return train(Session(run_dir, mode="replay", hardware=hardware), specimen, steps)
