"""A zoo of architectures built from their configs (no download), each recorded and replayed as a script.

Each :class:`Specimen` builds a small model, one batch and the loss a user trains it with (Hugging Face
models through their own ``labels=`` loss). :func:`record` trains it for a few steps in verifiable precision
into a bundle, :func:`replay` replays that bundle under another hardware profile; a replay that does not
replicate raises :class:`detrl.Divergence`. The zoo test and the op walk (:mod:`detrl.testing.opwalk`)
use them; so can anyone trying a model of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from detrl.core.engine import Session
from detrl.core.hardware import Profile
from detrl.core.sources import Sources

VOCAB, SEQ, BATCH = 64, 12, 4


@dataclasses.dataclass(frozen=True)
class Specimen:
    """A model to record: ``build()`` (called under the ``init`` stream), ``batch()`` (a tuple of tensors,
    the same every step) and ``loss(model, batch) -> scalar``."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    needs: str = ""  # a transformers class it needs ("" when torch alone builds it)


def _tokens() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),)


def _images() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    return torch.rand(BATCH, 3, 16, 16, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _features() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(BATCH * 4, 16, generator=g), torch.randint(0, 5, (BATCH * 4,), generator=g)


def _hf(name: str, config: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config)(**kw)
        return getattr(transformers, name)(cfg)

    return build


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _cls_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0][:, 0] % 3).loss


def _decoder(**kw: Any) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, **kw,
    }  # fmt: skip


class UpcastMLP(nn.Module):
    """An MLP whose forward ends in ``logits.float().log_softmax(-1)``, a common stability idiom."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))).float().log_softmax(-1)


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (fused SDPA attention inside) over token embeddings, next-token loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(tokens)))


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm, self.head = (
            nn.Embedding(VOCAB, 16),
            nn.LSTM(16, 32, batch_first=True),
            nn.Linear(32, VOCAB),
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(tokens))[0])


class AutocastCNN(nn.Module):
    """A small CNN whose forward runs under ``torch.autocast(dtype=torch.bfloat16)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.relu(self.conv(x)).mean((2, 3))
            return self.fc(h)


def _next_token(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    logits = model(batch[0][:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[0][:, 1:].reshape(-1))


def _classify(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _nll(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.nll_loss(model(batch[0]), batch[1])


def _vit_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(pixel_values=batch[0], labels=batch[1]).loss


def _t5_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0].flip(1)).loss


SPECIMENS: dict[str, Specimen] = {
    s.name: s
    for s in [
        Specimen("upcast_mlp", UpcastMLP, _features, _nll),
        Specimen(
            "hf_gpt2", _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=64, n_embd=32,
                           n_layer=2, n_head=4), _tokens, _lm_loss, "GPT2LMHeadModel"),
        Specimen("hf_llama_eager", _hf("LlamaForCausalLM", "LlamaConfig", **_decoder(attn_implementation="eager")),
                 _tokens, _lm_loss, "LlamaForCausalLM"),
        Specimen("hf_llama_sdpa", _hf("LlamaForCausalLM", "LlamaConfig", **_decoder(attn_implementation="sdpa")),
                 _tokens, _lm_loss, "LlamaForCausalLM"),
        Specimen("hf_qwen2_eager", _hf("Qwen2ForCausalLM", "Qwen2Config", **_decoder(attn_implementation="eager")),
                 _tokens, _lm_loss, "Qwen2ForCausalLM"),
        Specimen("hf_mistral", _hf("MistralForCausalLM", "MistralConfig", **_decoder()), _tokens, _lm_loss,
                 "MistralForCausalLM"),
        Specimen(
            "hf_bert", _hf("BertForSequenceClassification", "BertConfig", vocab_size=VOCAB, hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           max_position_embeddings=64, num_labels=3), _tokens, _cls_loss,
            "BertForSequenceClassification"),
        Specimen(
            "hf_vit", _hf("ViTForImageClassification", "ViTConfig", image_size=16, patch_size=4, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=3),
            _images, _vit_loss, "ViTForImageClassification"),
        Specimen(
            "hf_t5", _hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                         num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0),
            _tokens, _t5_loss, "T5ForConditionalGeneration"),
        Specimen("transformer_encoder", Encoder, _tokens, _next_token),
        Specimen("lstm", LSTMNet, _tokens, _next_token),
        Specimen("autocast_bf16", AutocastCNN, _images, _classify),
    ]
}  # fmt: skip


def _gpt2_small_tokens() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4)
    return (torch.randint(0, 50257, (8, 64), generator=g),)  # the paper's batch: 8 x 64 tokens


#: Full-size models, for the ``zoo`` benchmark (minutes a step on a CPU; the tests use SPECIMENS).
FULL_SIZE: dict[str, Specimen] = {
    "hf_gpt2_small": Specimen(
        "hf_gpt2_small", _hf("GPT2LMHeadModel", "GPT2Config", bos_token_id=None, eos_token_id=None),
        _gpt2_small_tokens, _lm_loss, "GPT2LMHeadModel"),  # GPT-2 small: 124M parameters
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


def _train(session: Session, specimen: Specimen, steps: int) -> Session:
    with session:
        model = session.init(specimen.build)
        model.train()
        opt = session.track(torch.optim.AdamW(model.parameters(), lr=3e-3))
        dtype = session.precision.dtype  # float inputs in the run's precision, as Session.loader gives them
        batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in specimen.batch())
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
    return _train(session, specimen, steps)


def replay(specimen: Specimen, run_dir: str | Path, hardware: str | Profile, steps: int = 2) -> Session:
    """Replay the bundle ``run_dir`` of ``specimen`` under ``hardware`` (raises Divergence if it differs)."""
    return _train(Session(run_dir, mode="replay", hardware=hardware), specimen, steps)
