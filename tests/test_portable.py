"""What a verifiable step does off the CPU so that a recording crosses between devices, checked on the CPU:
dropout and recurrent layers dispatch the CPU's aten ops on any device, a division by a scalar is IEEE
division there, and a Session on a device profile keeps its model and its optimizer state where torch would.

tests/test_cuda.py replays recordings between a CPU and a real GPU, where one exists.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from detrl.core import cpu_composites, portable
from detrl.core.cpu_composites import dropout_as_on_cpu
from detrl.core.engine import Session, _state_device
from detrl.core.hardware import Profile
from detrl.core.portable import cpu_op_sequence, ieee_division
from detrl.testing import zoo

aten = torch.ops.aten


class OpLog(TorchDispatchMode):
    """Every aten op with its non-tensor arguments and its tensors' dtypes, shapes and strides."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append((func, [_described(a) for a in args], kwargs))
        return func(*args, **(kwargs or {}))


def _described(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return (a.dtype, tuple(a.shape), a.stride())
    if isinstance(a, (list, tuple)):
        return [_described(t) for t in a]
    return a


class AsOnCpu(TorchFunctionMode):
    """The CPU compositions of detrl/core/cpu_composites.py, here on CPU tensors (which the step's own mode
    leaves to ATen), to compare with ATen's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        composition = cpu_composites.as_on_cpu(func, args, kwargs)
        return (composition or func)(*args, **kwargs)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("training", [True, False])
def test_dropout_as_on_cpu_dispatches_the_cpu_ops_of_f_dropout(
    inplace: bool, p: float, training: bool
) -> None:
    base = torch.randn(3, 5, dtype=torch.float64)
    seen = []
    for dropout in (F.dropout, dropout_as_on_cpu):
        x = base.clone().requires_grad_()
        with torch.random.fork_rng(), OpLog() as log:
            torch.manual_seed(0)
            y = dropout(x.clone() if inplace else x, p, training, inplace)
            y.square().sum().backward()
        seen.append((log.ops, y.detach(), x.grad))
    (ops_a, y_a, g_a), (ops_b, y_b, g_b) = seen
    assert ops_a == ops_b  # forward and backward, overloads and arguments
    assert torch.equal(y_a, y_b) and torch.equal(g_a, g_b)


def test_dropout_off_the_cpu_takes_the_cpu_ops_and_on_the_cpu_stays_aten(monkeypatch) -> None:
    calls = []
    real = cpu_composites.dropout_as_on_cpu
    monkeypatch.setattr(
        cpu_composites, "dropout_as_on_cpu", lambda *a, **k: calls.append(a[0].device) or real(*a, **k)
    )
    meta = torch.empty(4, 4, dtype=torch.float64, device="meta")
    with cpu_op_sequence():
        F.dropout(meta, 0.2, True)  # a module's nn.Dropout
        F.dropout(input=meta, p=0.2)  # keyword callers
        torch.dropout(meta, 0.2, True)
        torch.dropout_(meta, 0.2, True)
        F.dropout(torch.ones(2, dtype=torch.float64), 0.2)  # a CPU tensor: ATen's own dropout
    assert [d.type for d in calls] == ["meta"] * 4


RNN_CASES = [
    pytest.param(kind, layers, bidirectional, batch_first, bias, dropout, proj, id=f"{kind}-{layers}x{'bi' if bidirectional else 'uni'}-{'bf' if batch_first else 'tf'}-{'b' if bias else 'nb'}-d{dropout}-p{proj}")
    for kind in ("LSTM", "GRU", "RNN", "RNN-relu")
    for layers in (1, 2)
    for bidirectional in (False, True)
    for batch_first in (False, True)
    for bias in (True, False)
    for dropout in (0.0, 0.3)
    for proj in ((0, 2) if kind == "LSTM" else (0,))
    if not (dropout and layers == 1)
]  # fmt: skip


def _run_recurrent(module: torch.nn.Module, x0: torch.Tensor, ours: bool) -> tuple:
    """The ops of a forward and backward pass of ``module`` on ``x0`` (ATen's, or through our compositions),
    the output, and the gradients of the input and of every parameter."""
    x = x0.clone().requires_grad_()
    module.zero_grad()
    with torch.random.fork_rng(), OpLog() as log:
        torch.manual_seed(1)  # the dropout between layers draws the same mask both times
        with AsOnCpu() if ours else contextlib.nullcontext():
            out, hidden = (
                module(x) if not isinstance(module, torch.nn.modules.rnn.RNNCellBase) else (module(x), None)
            )
        states = out if isinstance(out, tuple) else (out,)
        hiddens = hidden if isinstance(hidden, tuple) else (hidden,) if hidden is not None else ()
        loss = sum(t.square().sum() for t in (*states, *hiddens))
        loss.backward()
    return log.ops, [t.detach() for t in (*states, *hiddens)], x.grad, [p.grad for p in module.parameters()]


@pytest.mark.parametrize(
    ("kind", "layers", "bidirectional", "batch_first", "bias", "dropout", "proj"), RNN_CASES
)
def test_recurrent_layers_as_on_cpu_dispatch_atens_cpu_ops(
    kind: str, layers: int, bidirectional: bool, batch_first: bool, bias: bool, dropout: float, proj: int
) -> None:
    options = {"num_layers": layers, "bidirectional": bidirectional, "batch_first": batch_first, "bias": bias}
    options.update(dropout=dropout, **({"proj_size": proj} if proj else {}))
    if kind == "RNN-relu":
        options["nonlinearity"] = "relu"
    torch.manual_seed(0)
    module = getattr(torch.nn, kind.removesuffix("-relu"))(3, 4, **options).double()
    x0 = torch.randn((2, 5, 3) if batch_first else (5, 2, 3), dtype=torch.float64)
    aten_run, ours = _run_recurrent(module, x0, False), _run_recurrent(module, x0, True)
    assert ours[0] == aten_run[0]  # forward and backward: ops, overloads, arguments, shapes and strides
    for a, b in zip(aten_run[1:], ours[1:]):
        for ta, tb in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            assert torch.equal(ta, tb)


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell", "RNNCell", "RNNCell-relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_recurrent_cells_as_on_cpu_dispatch_atens_cpu_ops(kind: str, bias: bool) -> None:
    options = {"bias": bias, **({"nonlinearity": "relu"} if kind.endswith("-relu") else {})}
    torch.manual_seed(0)
    module = getattr(torch.nn, kind.removesuffix("-relu"))(3, 4, **options).double()
    x0 = torch.randn(2, 3, dtype=torch.float64)
    aten_run, ours = _run_recurrent(module, x0, False), _run_recurrent(module, x0, True)
    assert ours[0] == aten_run[0]
    assert all(torch.equal(a, b) for a, b in zip(aten_run[1] + [aten_run[2]], ours[1] + [ours[2]]))
    assert all(torch.equal(a, b) for a, b in zip(aten_run[3], ours[3]) if a is not None)


PACKED_CASES = [
    pytest.param(kind, layers, bidirectional, bias, dropout, proj, lengths, sort,
                 id=f"{kind}-{layers}x{'bi' if bidirectional else 'uni'}-{'b' if bias else 'nb'}-d{dropout}-p{proj}-"
                    f"{'.'.join(map(str, lengths))}{'-sorted' if sort else ''}")
    for kind in ("LSTM", "GRU", "RNN", "RNN-relu")
    for layers in (1, 2)
    for bidirectional in (False, True)
    for bias in (True, False)
    for dropout in (0.0, 0.3)
    for proj in ((0, 2) if kind == "LSTM" else (0,))
    for lengths, sort in (((5, 3, 3, 1), True), ((2, 5, 4), False), ((4, 4), True))
    if not (dropout and layers == 1) and (bias or not dropout)
    and (kind == "LSTM" or (bias and sort))  # the others share the LSTM's layers: their cells and orders
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "layers", "bidirectional", "bias", "dropout", "proj", "lengths", "sort"), PACKED_CASES
)
def test_packed_sequences_as_on_cpu_dispatch_atens_cpu_ops(
    kind: str,
    layers: int,
    bidirectional: bool,
    bias: bool,
    dropout: float,
    proj: int,
    lengths: tuple,
    sort: bool,
) -> None:
    """A packed sequence (sequences of different lengths, sorted or not) through a recurrent layer: the batch
    shrinks as sequences end, and grows again backwards. ATen's CPU ops and values, forward and backward."""
    options = {"num_layers": layers, "bidirectional": bidirectional, "bias": bias, "dropout": dropout}
    options.update(
        {"proj_size": proj} if proj else {}, **({"nonlinearity": "relu"} if kind == "RNN-relu" else {})
    )
    torch.manual_seed(0)
    module = getattr(torch.nn, kind.removesuffix("-relu"))(3, 4, **options).double()
    x0 = torch.randn(max(lengths), len(lengths), 3, dtype=torch.float64)

    def run(ours: bool) -> tuple:
        x = x0.clone().requires_grad_()
        module.zero_grad()
        with torch.random.fork_rng(), OpLog() as log:
            torch.manual_seed(1)
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, list(lengths), enforce_sorted=sort)
            with AsOnCpu() if ours else contextlib.nullcontext():
                out, hidden = module(packed)
            hiddens = hidden if isinstance(hidden, tuple) else (hidden,)
            sum(t.square().sum() for t in (out.data, *hiddens)).backward()
        return (
            log.ops,
            [t.detach() for t in (out.data, *hiddens)],
            x.grad,
            [p.grad for p in module.parameters()],
        )

    aten_run, ours = run(False), run(True)
    assert ours[0] == aten_run[0]  # forward and backward: ops, overloads, arguments, shapes and strides
    assert all(torch.equal(a, b) for a, b in zip(aten_run[1] + [aten_run[2]], ours[1] + [ours[2]]))
    assert all(torch.equal(a, b) for a, b in zip(aten_run[3], ours[3]))


def test_packed_sequences_take_the_packed_composition() -> None:
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(3, 2, 1), [3, 2])
    seen = []
    with _Spy(seen):
        torch.nn.LSTM(1, 2)(packed)
        torch.nn.LSTM(1, 2)(torch.randn(3, 2, 1))
    assert seen == [cpu_composites.lstm_packed, cpu_composites.lstm]


class _Spy(TorchFunctionMode):
    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "lstm":
            self.seen.append(cpu_composites.as_on_cpu(func, args, kwargs))
        return func(*args, **kwargs)


def test_cpu_op_sequence_switches_cudnn_off_and_back() -> None:
    before = torch.backends.cudnn.enabled
    with cpu_op_sequence():
        assert not torch.backends.cudnn.enabled
    assert torch.backends.cudnn.enabled == before


def test_ieee_division_gives_a_device_the_divisor_as_a_tensor_of_its_own() -> None:
    meta = torch.empty(3, dtype=torch.float64, device="meta")
    for func, divisor, want in [
        (aten.div.Scalar, 3, aten.div.Tensor),
        (aten.div_.Scalar, 0.9, aten.div_.Tensor),
        (aten.div.Tensor, torch.tensor(7.0, dtype=torch.float64), aten.div.Tensor),
        (aten.div.Tensor_mode, torch.tensor(2), aten.div.Tensor_mode),
    ]:
        got, args = ieee_division(func, (meta, divisor, "floor") if "mode" in str(func) else (meta, divisor))
        assert got is want and args[1].device.type == "meta" and args[1].dtype == torch.float64
        assert args[1].dim() == 0 and args[2:] == (("floor",) if "mode" in str(func) else ())
    got, args = ieee_division(aten._foreach_div_.Scalar, ([meta, meta], 3.0))
    assert got is aten._foreach_div_.ScalarList and args[1] == [3.0, 3.0]
    cpu = torch.ones(3, dtype=torch.float64)
    unchanged = [
        (aten._foreach_div.Scalar, ([cpu], 3.0)),
        (aten.div.Tensor, (cpu, torch.tensor(3.0))),  # on the CPU: IEEE division already
        (aten.div.Tensor, (meta.float(), torch.tensor(3.0))),  # not FP64: its promotion stays torch's
        (aten.div.Tensor, (meta, torch.ones(3, dtype=torch.float64))),  # a tensor divisor
        (aten.mul.Tensor, (meta, torch.tensor(3.0))),
    ]
    for func, args in unchanged:
        assert ieee_division(func, args) == (func, args)


def test_ieee_division_of_fp64_by_a_tensor_scalar_is_division_on_the_cpu() -> None:
    x = torch.randn(1000, dtype=torch.float64)
    for d in (3, 0.9, 288, 1e-3):
        assert torch.equal(x / d, x / torch.tensor(d, dtype=torch.float64))


def test_a_session_keeps_model_and_data_where_its_profile_says() -> None:
    assert Session(None, mode="off").device == torch.device("cpu")
    assert (
        Session(None, mode="off", hardware=Profile("mine", "a GPU of my own", device="meta")).device.type
        == "meta"
    )
    assert Session(None, mode="off", hardware="emulated:splitk").device == torch.device("cpu")
    # an explicit device wins
    assert Session(None, mode="off", device="meta").device.type == "meta"


def test_restored_optimizer_state_goes_where_torch_keeps_it() -> None:
    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    plain = torch.optim.Adam([p])
    assert _state_device(plain, p, "exp_avg").type == "meta"
    assert _state_device(plain, p, "step").type == "cpu"  # torch's step count lives on the CPU
    capturable = torch.optim.Adam([p], capturable=True)
    assert _state_device(capturable, p, "step").type == "meta"


@pytest.mark.parametrize("name", ["digits_mlp_dropout", "lstm_lm", "tiny_transformer"])
def test_a_recording_through_the_cpu_compositions_is_the_cpu_recording(
    tmp_path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """What a GPU's verifiable step runs (dropout and LSTM written out by cpu_composites, cuDNN off), here
    made to run on the CPU through the rounding mode: its bundle commits to the same states and writes the
    same log as ATen's own CPU path, and replicates on an emulated profile."""
    from detrl.apps.audit import audit
    from detrl.run import sessions, tasks
    from detrl.run.config import load

    cfg = load(f"configs/supervised/{name}.yaml", ["train.steps=4", "verify.checkpoint_every=2"])

    def record(out):
        with sessions.session_for(cfg, out, "record") as session:
            tasks.get(cfg.task).run(cfg, session)
        return session

    plain = record(tmp_path / "plain")
    calls = []
    real = cpu_composites.as_on_cpu

    def counted(func, args, kwargs):  # noqa: ANN001, ANN202
        found = real(func, args, kwargs)
        if found is not None:
            calls.append(func)
        return found

    monkeypatch.setattr(portable, "off_cpu", lambda device: True)
    monkeypatch.setattr(cpu_composites, "as_on_cpu", counted)
    composed = record(tmp_path / "composed")
    monkeypatch.undo()
    assert calls  # the compositions answered the model's dropout or LSTM
    assert composed.leaves == plain.leaves
    for part in ("roundlog", "commitments"):  # files, byte for byte
        assert (tmp_path / "composed" / part).read_bytes() == (tmp_path / "plain" / part).read_bytes()
    assert audit(tmp_path / "composed", hardware="emulated:splitk").verdict == "replicated"


def test_factories_off_the_cpu_are_made_on_the_host_and_moved() -> None:
    seen = []

    def profile(func, args, kwargs):  # noqa: ANN001, ANN202 - a profile: how the op is computed
        seen.append((func, kwargs.get("device")))
        return func(*args, **kwargs)

    meta = torch.device("meta")
    out = portable.compute(
        profile, aten.arange.start_step, (0.0, 1.0, 0.1), {"dtype": torch.float64, "device": meta}
    )
    assert (
        out.device == meta
        and out.shape == (10,)
        and seen[-1] == (aten.arange.start_step, torch.device("cpu"))
    )
    cpu = portable.compute(profile, aten.linspace.default, (0.0, 1.0, 7), {"dtype": torch.float64})
    assert torch.equal(cpu, torch.linspace(0.0, 1.0, 7, dtype=torch.float64)) and seen[-1][1] is None
    x = torch.empty(3, dtype=torch.float64, device="meta")
    portable.compute(profile, aten.div.Scalar, (x, 3), {})
    assert seen[-1][0] is aten.div.Tensor  # the division, by a tensor on the device


def _correctly_rounded_root(x: float, r: float) -> bool:
    """Whether ``r`` is the double nearest ``sqrt(x)``: ``sqrt(x)`` lies strictly between the midpoints of
    ``r`` and its neighbours (exact rational arithmetic; a root is never a midpoint)."""
    from fractions import Fraction

    lo = (Fraction(r) + Fraction(math.nextafter(r, -math.inf))) / 2
    hi = (Fraction(r) + Fraction(math.nextafter(r, math.inf))) / 2
    return lo * lo < Fraction(x) < hi * hi


def test_ieee_sqrt_is_correctly_rounded_where_torchs_root_may_not_be() -> None:
    g = torch.Generator().manual_seed(0)
    # variances as the decompositions see them: off the FP32 grid, over many binades
    x = torch.rand(100_000, dtype=torch.float64, generator=g) * torch.pow(
        10.0, torch.randint(-12, 12, (100_000,), generator=g).double()
    )
    ours, theirs = portable.ieee_sqrt(x), torch.sqrt(x)
    differ = (ours != theirs).nonzero().flatten().tolist()
    sample = differ[:300] + list(range(300))
    assert all(_correctly_rounded_root(x[i].item(), ours[i].item()) for i in sample)
    # where torch's differs (MKL builds: about 1 %), torch's is the one off the nearest double
    assert not any(_correctly_rounded_root(x[i].item(), theirs[i].item()) for i in differ[:300])
    assert torch.equal(portable.ieee_sqrt(x[:7]), torch.sqrt(x[:7]))  # small tensors: the same scalar root


class _Dropped(torch.nn.Module):
    """Linear, dropout, linear: the dropout as ``F.dropout`` (ATen's CPU ops) or as a device's ``at::dropout``
    inside a C++ composite (``native_dropout`` while portable.inside_device_dropout holds: SDPA's math
    attention on a GPU)."""

    def __init__(self, as_device: bool) -> None:
        super().__init__()
        self.a, self.b, self.as_device = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3), as_device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).tanh()
        if self.as_device:
            with portable.inside_device_dropout():
                h = torch.ops.aten.native_dropout(h, 0.3, True)[0]
        else:
            h = F.dropout(h, 0.3, True)
        return self.b(h)


def _record_dropped(run, as_device: bool) -> Session:
    from detrl.core.sources import Sources

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    with Session(
        run, precision="verifiable", sources=Sources(seed=0), checkpoint_every=2, planned_steps=4
    ) as s:
        model = s.init(lambda: _Dropped(as_device))
        opt = s.track(torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in data:
            with s.step(batch=(x, y)):
                opt.zero_grad()
                F.cross_entropy(model(x.double()), y).backward()
                opt.step()
    return s


def test_a_devices_dropout_inside_a_composite_is_the_cpus_ops_forward_and_backward(
    tmp_path, monkeypatch
) -> None:
    plain = _record_dropped(tmp_path / "plain", as_device=False)
    monkeypatch.setattr(portable, "off_cpu", lambda device: True)  # a step as off the CPU: the mode sees all
    expanded = _record_dropped(tmp_path / "expanded", as_device=True)
    monkeypatch.undo()
    assert (
        expanded.leaves == plain.leaves and expanded.totals.rounded_elements == plain.totals.rounded_elements
    )
    for part in ("roundlog", "commitments"):
        assert (tmp_path / "expanded" / part).read_bytes() == (tmp_path / "plain" / part).read_bytes()
    # and outside such a composite a model's own native_dropout stays one op (models.Dropout's)
    x = torch.ones(4, 4, dtype=torch.float64)
    assert portable.device_dropout_now() is False and torch.ops.aten.native_dropout(x, 0.0, True)[0].equal(x)


@pytest.mark.parametrize("name", [n for n, s in zoo.SPECIMENS.items() if zoo.available(s)])
def test_every_zoo_model_records_the_same_bundle_through_what_a_gpu_step_runs(
    tmp_path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Every zoo model (Hugging Face GPT-2, Llama, Qwen2, Mistral, Mixtral, BERT, ViT, T5, torch's encoders,
    an LSTM, ...) recorded on the CPU as a step off the CPU runs (the native route off, the compositions of
    cpu_composites answering dropout and recurrent layers, SDPA's dropout flagged, divisions and factories
    through portable.compute) is the plain CPU recording, byte for byte."""
    specimen = zoo.SPECIMENS[name]
    plain = zoo.record(specimen, tmp_path / "plain", steps=2)
    monkeypatch.setattr(portable, "off_cpu", lambda device: True)
    as_gpu = zoo.record(specimen, tmp_path / "as_gpu", steps=2)
    monkeypatch.undo()
    assert as_gpu.leaves == plain.leaves
    for part in ("roundlog", "commitments"):
        assert (tmp_path / "as_gpu" / part).read_bytes() == (tmp_path / "plain" / part).read_bytes()


def test_the_decompositions_divide_as_ieee_on_every_device() -> None:
    x = torch.randn(100, dtype=torch.float64)
    assert torch.equal(portable.ieee_divide(x, 288), x / 288)  # the CPU: its own IEEE division
    meta = torch.empty(3, dtype=torch.float64, device="meta")
    assert portable.ieee_divide(meta, 288).device.type == "meta"  # off it: by a tensor on the device
