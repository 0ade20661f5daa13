"""Hugging Face's Llama and ViT as supervised recipes beside GPT-2: configs and sizes, the model's own loss
(``labels=``) as the training loss, weights from a ``save_pretrained`` file, and verifiable recordings of
the tiny configs (``llama_tiny``, ``vit_tiny``) that replay bit for bit on the emulated profiles.

The full-size configs (``llama``: 125M parameters, ``vit``: ViT-S/4, 21M) run the same code; their step
times are in docs/recipes.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from detrl.apps.audit import audit, check_caps
from detrl.core.hardware import profile_names
from detrl.formats.bundle import BundleError
from detrl.run import sessions, tasks
from detrl.run.config import ConfigError, load
from detrl.supervised import models, train
from detrl.supervised.weights import export_safetensors, load_init

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

EMULATED = [p for p in profile_names() if p.startswith("emulated:")]
TINY = ["llama_tiny", "vit_tiny"]
#: The profiles the fast suite replays on (the slow test replays on every emulated profile).
FAST_PROFILES = ["emulated:splitk", "emulated:atomic"]
STEPS = 3


def cfg_of(name: str, *overrides: str):
    return load(f"configs/supervised/{name}.yaml", list(overrides))


def record(cfg, out: Path):
    session = sessions.session_for(cfg, out, "record")
    with session:
        train.run(cfg, session)
    return session


def hf_of(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a detrl wrapper."""
    return model.lm if isinstance(model, (models.Llama, models.GPT2)) else model.net


# --- configs, sizes, caps, shapes ---------------------------------------------------------------------


def test_configs_and_sizes_counted_on_the_meta_device() -> None:
    llama, vit = cfg_of("llama"), cfg_of("vit")
    assert (llama.model.n_layer, llama.model.n_embd, llama.model.n_head, llama.model.n_kv_head) == (
        12,
        768,
        12,
        4,
    )
    assert (llama.model.intermediate, llama.model.vocab_size) == (2048, 32000)
    assert models.llama_intermediate(768) == 2048 and models.llama_intermediate(4096) == 11008  # LLaMA-7B's
    assert (vit.model.patch_size, vit.model.n_embd, vit.model.n_layer, vit.data.name) == (
        4,
        384,
        12,
        "digits32",
    )
    for cfg in (llama, vit, cfg_of("llama_tiny"), cfg_of("vit_tiny")):
        assert cfg.precision == "verifiable" and cfg.optimizer.name == "adamw"
    # 12 x (attention 2 x 768^2 + 2 x 768 x 256, SwiGLU 3 x 768 x 2048, 2 norms) + 2 x 32000 x 768 + norm
    assert train.size(llama)["params"] == 124_668_672
    assert train.size(vit)["params"] == 21_342_346  # ViT-S/4 with a 10-class head
    assert train.size(cfg_of("llama_tiny"))["params"] < 200_000
    assert train.size(cfg_of("vit_tiny"))["params"] < 200_000


def test_caps_bound_the_new_model_keys() -> None:
    caps = {**train.CAPS, **tasks.SIZE_CAPS}
    for name, key, value in [
        ("llama", "n_kv_head", 1000),
        ("llama", "intermediate", 10**7),
        ("vit", "patch_size", 4096),
    ]:
        raw = cfg_of(name).model_dump(mode="json")
        raw["model"][key] = value
        with pytest.raises(BundleError, match=f"model.{key}="):
            check_caps(raw, caps)
    # each value within its cap, together LLaMA-7B (6.7 billion parameters, counted on the meta device):
    # the size cap refuses it
    big = cfg_of("llama", "model.n_layer=32", "model.n_embd=4096", "model.n_head=32", "model.n_kv_head=32",
                 "model.intermediate=11008")  # fmt: skip
    check_caps(big.model_dump(mode="json"), caps)
    assert train.size(big)["params"] == 6_738_415_616  # LLaMA-7B's count (Touvron et al. 2023)
    with pytest.raises(BundleError, match="size.params="):
        check_caps({"size": train.size(big)}, caps)


def test_outputs_are_logits_and_dropouts_are_canonical() -> None:
    for name, expect in [
        ("llama_tiny", lambda c: (3, c.data.seq_len, c.model.vocab_size)),
        ("vit_tiny", lambda c: (3, 10)),
    ]:
        cfg = cfg_of(name)
        x, _ = train.load_data(cfg)
        model = train.build_model(cfg, x)
        assert model(x[:3]).shape == expect(cfg)
        assert not any(type(m) is nn.Dropout for m in model.modules())  # every one is detrl's Dropout
    vit = train.build_model(cfg_of("vit_tiny"), train.load_data(cfg_of("vit_tiny"))[0])
    drops = [m for m in vit.modules() if isinstance(m, models.Dropout)]
    assert len(drops) == 1 + cfg_of("vit_tiny").model.n_layer and all(d.p == 0.1 for d in drops)
    llama = train.build_model(cfg_of("llama_tiny"), train.load_data(cfg_of("llama_tiny"))[0])
    attn = llama.lm.model.layers[0].self_attn
    assert (attn.config.num_attention_heads, attn.config.num_key_value_heads) == (4, 2)  # grouped-query
    assert llama.lm.lm_head.weight is not llama.lm.model.embed_tokens.weight  # untied, as Llama


@pytest.mark.parametrize(
    ("name", "overrides", "match"),
    [
        ("llama_tiny", ["model.n_kv_head=3"], "model.n_kv_head=3 must divide model.n_head=4"),
        ("llama_tiny", ["model.n_head=3"], "model.n_embd=64 must be model.n_head=3 times an even"),
        ("llama_tiny", ["model.dropout=0.1"], "model.dropout=0.1: model.name=llama has no dropout"),
        ("llama_tiny", ["model.vocab_size=300"], "model.vocab_size=300 is smaller"),
        ("llama_tiny", ["model.n_positions=16"], "model.n_positions=16 is shorter"),
        ("llama_tiny", ["data.name=digits32"], "model.name=llama trains on text"),
        ("vit_tiny", ["model.patch_size=5"], "model.patch_size=5 does not divide the images' side .32."),
        ("vit_tiny", ["model.n_head=3"], "model.n_embd=64 is not divisible by model.n_head=3"),
        ("vit_tiny", ["data.name=corpus"], "model.name=vit needs square images"),
    ],
)
def test_config_mistakes_are_one_line(name: str, overrides: list[str], match: str) -> None:
    cfg = cfg_of(name, *overrides)
    with pytest.raises(ConfigError, match=match) as e:
        train.size(cfg)  # the auditor's first look at a bundle's config: on the meta device
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="did you mean model.n_kv_head"):
        cfg_of(name, "model.n_kv_heads=2")


# --- the training loss is the model's own -------------------------------------------------------------


def test_the_loss_is_the_models_own_labels_path() -> None:
    torch.manual_seed(0)
    cfg = cfg_of("llama_tiny")
    x, y = train.load_data(cfg)
    x, y = x[:4], y[:4]
    model = train.build_model(cfg, x).double().eval()
    logits = model(x)  # (4, T, V)
    # transformers shifts labels=x inside: position t predicts x[t + 1], the last position predicts nothing
    shifted = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    own = train.training_loss(model, x, y)
    assert torch.allclose(own.double(), shifted, rtol=1e-6)
    assert own.dtype == torch.float32  # transformers upcasts the logits (an FP32 island in a verifiable step)

    cfg = cfg_of("vit_tiny")
    images, labels = train.load_data(cfg)
    vit = train.build_model(cfg, images).double().eval()
    own = train.training_loss(vit, images[:8].double(), labels[:8])
    assert torch.allclose(own.double(), F.cross_entropy(vit(images[:8].double()), labels[:8]), rtol=1e-6)

    # GPT-2 has no training_loss: it keeps loss_fn on its logits, and its pinned Merkle root
    cfg = cfg_of("gpt2_tiny")
    tokens, targets = train.load_data(cfg)
    gpt2 = train.build_model(cfg, tokens).eval()
    assert not hasattr(gpt2, "training_loss")
    assert torch.equal(
        train.training_loss(gpt2, tokens[:2], targets[:2]), train.loss_fn(gpt2(tokens[:2]), targets[:2])
    )


@pytest.mark.parametrize("name", TINY)
def test_a_recorded_step_trains_on_the_labels_path(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Inside a step, run() calls the Hugging Face model with ``labels=`` and reports that call's loss."""
    import transformers

    cls = transformers.LlamaForCausalLM if name == "llama_tiny" else transformers.ViTForImageClassification
    calls: list[tuple[dict, object]] = []
    forward = cls.forward

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        out = forward(self, *args, **kwargs)
        calls.append((kwargs, out))
        return out

    monkeypatch.setattr(cls, "forward", spy)
    cfg = cfg_of(name, "train.steps=1")
    session = sessions.session_for(cfg, None, "off")
    with session:
        metrics = train.run(cfg, session)
    ((kwargs, out),) = calls  # one forward in the step: the loss's
    if name == "llama_tiny":
        assert torch.equal(kwargs["labels"], kwargs["input_ids"])
    else:
        assert kwargs["labels"].dtype == torch.int64 and kwargs["labels"].shape == (cfg.train.batch_size,)
    assert metrics["loss"] == float(out.loss.detach())


# --- one op sequence on every device ----------------------------------------------------------------------


def _step_ops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """The aten ops a training step's loss and backward dispatch, as the rounding mode would see them."""
    from detrl.testing.opwalk import OpNames

    model.zero_grad(set_to_none=True)
    with OpNames() as names:
        train.training_loss(model, x, y).backward()
    return names.ops


@pytest.mark.parametrize("name", TINY)
def test_a_step_has_one_op_sequence_whatever_the_sdpa_backend(name: str) -> None:
    """Transformers' ``sdpa`` attention calls ``F.scaled_dot_product_attention``, which picks a kernel by
    the selected backend (and on a GPU by the device): inside a verifiable step detrl pins its math
    decomposition (``detrl.core.portable``), so every backend selected outside gives the same ops."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from detrl.core.portable import portable_kernels

    cfg = cfg_of(name)
    x, y = train.load_data(cfg)
    model = train.build_model(cfg, x).double().train()
    x = x[:2].double() if x.is_floating_point() else x[:2]
    inside, outside = {}, {}
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):  # the two this CPU offers
        with sdpa_kernel(backend):
            outside[backend.name] = _step_ops(model, x, y[:2])
            with portable_kernels():
                inside[backend.name] = _step_ops(model, x, y[:2])
    assert inside["MATH"] == inside["FLASH_ATTENTION"] == outside["MATH"]
    assert not any("flash" in op for op in inside["MATH"]) and "aten.bmm.default" in inside["MATH"]
    # Control: outside a step the selected backend changes the ops (a fused flash kernel on this CPU)
    assert any("_scaled_dot_product_flash_attention" in op for op in outside["FLASH_ATTENTION"])


# --- weights from a save_pretrained file ----------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_finetuning_from_a_save_pretrained_file(tmp_path: Path, name: str) -> None:
    cfg = cfg_of(name, "train.steps=2", "verify.checkpoint_every=0")
    x, _ = train.load_data(cfg)
    torch.manual_seed(1234)  # another init than the run's own: loading must replace it
    source = hf_of(train.build_model(cfg, x))
    source.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    from safetensors.torch import load_file

    saved = load_file(weights)
    if name == "llama_tiny":  # Hugging Face's names, as save_pretrained writes them
        assert {"lm_head.weight", "model.layers.0.self_attn.q_proj.weight"} <= set(saved)
    else:
        assert {"classifier.weight", "vit.embeddings.cls_token"} <= set(saved)
        assert any(k.startswith("vit.encoder.layer.0.") for k in saved) or any(
            k.startswith("vit.layers.0.")
            for k in saved  # transformers 4 writes its module names
        )
    expected = {n: p.detach().double() for n, p in source.named_parameters()}

    tuned_cfg = cfg_of(name, f"model.init_from={weights}", "train.steps=2", "verify.checkpoint_every=0")
    first = sessions.session_for(tuned_cfg, None, "off")  # step 0 of the run: the file's weights
    with first:
        model = first.init(train.model_builder(tuned_cfg, x))
    inner = dict(hf_of(model).named_parameters())
    assert set(inner) == set(expected)
    assert all(torch.equal(inner[n].detach(), expected[n]) for n in expected)
    own = sessions.session_for(cfg, None, "off")
    with own:  # the run's own init differs: the file was read
        fresh = own.init(train.model_builder(cfg, x))
    assert any(not torch.equal(p.detach(), expected[n]) for n, p in hf_of(fresh).named_parameters())

    tuned = record(tuned_cfg, tmp_path / "tuned")
    assert tuned.data_fingerprint != train.fingerprint(cfg)  # the weights file is part of what is checked
    report = audit(tmp_path / "tuned", hardware="emulated:splitk", init_from=weights)
    assert report.verdict == "replicated" and report.steps == 2, report.message
    # detrl's own names (an exported checkpoint) load back unchanged
    assert export_safetensors(tmp_path / "tuned", tmp_path / "export.safetensors") == 2
    again = train.build_model(cfg, x)
    load_init(again, tmp_path / "export.safetensors")
    final = dict(tuned.model.named_parameters())
    assert all(torch.equal(p.detach().double(), final[n].detach()) for n, p in again.named_parameters())


# --- verifiable recordings replay bit for bit --------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama_tiny and vit_tiny, ``STEPS`` verifiable steps each on native."""
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the configs say (conftest's one-thread fixture comes after this one)
    try:
        for name in TINY:
            run_dir = tmp_path_factory.mktemp(name) / "run"
            session = record(cfg_of(name, f"train.steps={STEPS}", "verify.checkpoint_every=0"), run_dir)
            assert session.step_index == STEPS and session.totals.logged > 0
            out[name] = run_dir
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("hardware", FAST_PROFILES)
@pytest.mark.parametrize("name", TINY)
def test_tiny_hf_recipe_replicates_bit_for_bit(recorded, name: str, hardware: str) -> None:
    report = audit(recorded[name], hardware=hardware)
    assert report.verdict == "replicated", report.message
    assert report.steps == STEPS and report.unlogged_near == 0 and report.refused == 0


def test_llama_with_eager_attention_replicates(tmp_path: Path) -> None:
    cfg = cfg_of("llama_tiny", "model.attention=eager", "train.steps=2", "verify.checkpoint_every=0")
    record(cfg, tmp_path / "run")
    report = audit(tmp_path / "run", hardware="emulated:splitk")
    assert report.verdict == "replicated" and report.steps == 2, report.message


@pytest.mark.slow  # about 15 s together on 2 cores: two 10-step recordings, eight replays
@pytest.mark.parametrize("name", TINY)
def test_tiny_hf_recipe_replicates_on_every_emulated_profile(tmp_path: Path, name: str) -> None:
    assert len(EMULATED) == 4
    session = record(cfg_of(name), tmp_path / "run")  # the config as shipped: 10 steps, checkpoints at 5, 10
    assert session.step_index == 10
    for hardware in EMULATED:
        report = audit(tmp_path / "run", hardware=hardware)
        assert report.verdict == "replicated", f"{hardware}: {report.message}"
        assert report.steps == 10 and report.unlogged_near == 0 and report.refused == 0
