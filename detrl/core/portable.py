"""One op sequence on every device: the kernel choices a verifiable step pins.

The rounding log is keyed by op position within a step, so recorder and replayer must dispatch the same aten
ops in the same order. Composite torch functions choose a fused kernel by device, dtype and flags *above*
the dispatch modes, where detrl cannot see the choice. On every device (:class:`portable_kernels`):

* ``F.scaled_dot_product_attention`` becomes ``_scaled_dot_product_flash_attention_for_cpu`` on a CPU, a
  flash, memory-efficient or cuDNN kernel on CUDA, or the math decomposition. Inside a verifiable step it is
  always the math decomposition: logged matmuls (``bmm``), a softmax and exact steps, the same ops on every
  device, each rounded and logged like any other. (A fused kernel would be one op whose reduction order no
  emulated profile reorders and whose name differs between a CPU and a GPU.)
* ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` take a "fast path" in eval or under
  ``no_grad`` (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``): one fused op on some
  devices and configurations, not on others. Inside a verifiable step the fast path is off, so they run
  their plain Python forward, which calls SDPA, which is math as above.

Off the CPU, in a verifiable step (:class:`cpu_op_sequence`), where the op sequence must be the one a CPU
recording holds:

* ``F.dropout`` is ``native_dropout`` on CUDA, but ``empty_like``, ``bernoulli_``, ``div_`` and ``mul`` on
  a CPU (whose noise is rounded to FP32 before it scales: other bits too). Off the CPU it dispatches the
  CPU's ops (:func:`detrl.core.cpu_composites.dropout_as_on_cpu`), its mask drawn from the ``dropout`` stream either way.
* ``F.batch_norm`` (``nn.BatchNorm*d``, ``nn.InstanceNorm*d``) becomes ``cudnn_batch_norm`` while cuDNN is
  on: an op the rounding mode neither decomposes nor knows the writes of, and that a CPU never runs. cuDNN
  is off: batch norm is ``native_batch_norm`` on every device. (A convolution is ``convolution`` either
  way; without cuDNN, CUDA computes it with torch's own kernels.)
* ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their one-step cells are ``_cudnn_rnn`` with cuDNN, and without
  it per-step input products and fused cells (``_thnn_fused_lstm_cell``); a CPU projects the sequence once
  and dispatches each cell's parts. They run the CPU's composition in Python (:mod:`detrl.core.cpu_composites`).

And kernel properties: CUDA divides by a CPU scalar (a Python number) as a product with its reciprocal,
which can differ from IEEE division in the last bit, and computes ``arange`` with a fractional step (and its
kin) otherwise than a CPU. :func:`compute` gives such a division its divisor as a tensor on the dividend's
device (:func:`ieee_division`), which CUDA divides by exactly, and makes such a factory on the host.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from detrl.core import cpu_composites

#: SDPA's backend switches: (read, write) pairs of torch's global flags, math last. torch's own
#: ``sdpa_kernel`` context looks each one up by name and builds backend lists on every entry (about 20 µs,
#: a tenth of a CartPole DQN step); these are resolved once. Backends older torch builds lack are skipped.
_SDPA_SWITCHES = [
    (getattr(torch._C, f"_get_{name}_sdp_enabled"), getattr(torch._C, f"_set_sdp_use_{name}"))
    for name in ("cudnn", "flash", "mem_efficient", "overrideable", "math")
    if hasattr(torch._C, f"_get_{name}_sdp_enabled") and hasattr(torch._C, f"_set_sdp_use_{name}")
]


class portable_kernels:  # noqa: N801 - used as a context manager, like torch's own lower-case contexts
    """Within: SDPA is its math decomposition and the multi-head-attention fast path is off (both restored
    on exit). Re-entrant: each entry saves and restores the flags it found."""

    __slots__ = ("_saved",)

    def __init__(self) -> None:
        self._saved: list[tuple[bool, list[bool]]] = []

    def __enter__(self) -> None:
        self._saved.append((torch.backends.mha.get_fastpath_enabled(), [get() for get, _ in _SDPA_SWITCHES]))
        torch.backends.mha.set_fastpath_enabled(False)
        for k, (_, set_) in enumerate(_SDPA_SWITCHES):
            set_(k == len(_SDPA_SWITCHES) - 1)  # math only

    def __exit__(self, *exc: object) -> None:
        fast, enabled = self._saved.pop()
        for (_, set_), on in zip(_SDPA_SWITCHES, enabled):
            set_(on)
        torch.backends.mha.set_fastpath_enabled(fast)


aten = torch.ops.aten

#: Division by argument 1, and the overload that takes it as a tensor (``.Scalar`` ones take a number).
_DIVISIONS = {
    aten.div.Tensor: aten.div.Tensor,
    aten.div_.Tensor: aten.div_.Tensor,
    aten.div.Scalar: aten.div.Tensor,
    aten.div_.Scalar: aten.div_.Tensor,
    aten.div.Tensor_mode: aten.div.Tensor_mode,
    aten.div_.Tensor_mode: aten.div_.Tensor_mode,
    aten.div.Scalar_mode: aten.div.Tensor_mode,
    aten.div_.Scalar_mode: aten.div_.Tensor_mode,
}


#: Factories whose CUDA kernels give other bits than a CPU's (an ``arange`` with a fractional step differed in
#: 216 of 1,000 elements on an H100; ``linspace`` and ``logspace`` use the same kind of formula): off the CPU
#: they are computed on the host and moved.
_HOST_FACTORIES = frozenset(
    {
        aten.arange.default,
        aten.arange.start,
        aten.arange.start_step,
        aten.linspace.default,
        aten.logspace.default,
    }
)


def compute(profile: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``profile(func, args, kwargs)``, with the bits a CPU computes where a device's kernel differs from it
    in ways IEEE 754 does not allow: a factory of :data:`_HOST_FACTORIES` made on the host and moved, a
    division by a scalar given its divisor as a tensor (:func:`ieee_division`)."""
    if func in _HOST_FACTORIES:
        device = kwargs.get("device")
        if device is not None and off_cpu(torch.device(device)):
            return profile(func, args, {**kwargs, "device": torch.device("cpu")}).to(device)
        return profile(func, args, kwargs)
    return profile(*ieee_division(func, args), kwargs)


def ieee_sqrt(t: torch.Tensor) -> torch.Tensor:
    """``sqrt(t)`` of an FP64 tensor, correctly rounded (IEEE 754) on every device, as a new tensor.

    torch's CPU ``sqrt`` is not: builds with MKL take a vector library's (VML) root for larger tensors,
    within an ulp but off the nearest double in about 1 % of elements (1,180 of 100,000 uniform values
    here). A root of FP32-grid input still rounds to the same FP32 number (its distance to an FP32 midpoint
    is far above an FP64 ulp), but the decompositions take the root of a variance they did not round, and
    that root's last bit reaches every normalised element. NumPy's root is the processor's ``sqrt``
    instruction (correctly rounded); CUDA's double-precision ``sqrt`` is correctly rounded too."""
    if t.device.type == "cuda" or t.dtype != torch.float64:
        return torch.sqrt(t)
    host = t.detach().to("cpu").contiguous()
    return torch.from_numpy(np.sqrt(host.numpy())).to(t.device)


#: A list division by one scalar, and the overload that takes a scalar per tensor (measured on an H100: the
#: one-scalar kernel multiplies by the reciprocal, 333,450 of 10^6 elements differed; the list one divides).
_LIST_DIVISIONS = {
    aten._foreach_div.Scalar: aten._foreach_div.ScalarList,
    aten._foreach_div_.Scalar: aten._foreach_div_.ScalarList,
}


def ieee_divide(t: torch.Tensor, n: float) -> torch.Tensor:
    """``t / n``, correctly rounded on every device (see :func:`ieee_division`): the decompositions' means."""
    _, args = ieee_division(aten.div.Tensor, (t, n))
    return t / args[1]  # n itself, or off the CPU n as a 0-dim FP64 tensor on t's device


def ieee_division(func: Any, args: tuple) -> tuple[Any, tuple]:
    """``(func, args)``, or for a division of an FP64 tensor off the CPU by a CPU scalar, the division by
    that value as a 0-dim FP64 tensor on the dividend's device (the same result dtype: FP64 either way),
    which the device divides by exactly rather than multiplying by its rounded reciprocal; a list's
    division by one scalar, by that scalar once per tensor."""
    listed = _LIST_DIVISIONS.get(func)
    if listed is not None:
        tensors = args[0] if args else ()
        if (
            len(args) == 2
            and tensors
            and all(t.dtype == torch.float64 and off_cpu(t.device) for t in tensors)
        ):
            return listed, (tensors, [args[1]] * len(tensors))
        return func, args
    tensor_overload = _DIVISIONS.get(func)
    if tensor_overload is None or len(args) < 2:
        return func, args
    x, divisor = args[0], args[1]
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float64 or not off_cpu(x.device):
        return func, args
    if isinstance(divisor, torch.Tensor):
        if divisor.dim() != 0 or divisor.device.type != "cpu" or divisor.is_complex():
            return func, args
        value = divisor.item()
    elif isinstance(divisor, (int, float)) and not isinstance(divisor, bool):
        value = divisor
    else:
        return func, args
    on_device = torch.tensor(value, dtype=torch.float64, device=x.device)  # exact: an FP64 scalar is a double
    return tensor_overload, (x, on_device, *args[2:])


def off_cpu(device: torch.device) -> bool:
    """Whether ``device`` writes composites out otherwise than a CPU: where :class:`cpu_op_sequence` is
    entered and applies (tests also make it true of the CPU, to run the CPU compositions end to end)."""
    return device.type != "cpu"


#: Set while a composite written in C++ runs off the CPU with a dropout inside (SDPA's math attention with
#: ``dropout_p > 0``): its ``at::dropout`` reaches the modes as ``native_dropout`` there, as ``empty_like``,
#: ``bernoulli_``, ``div_`` and ``mul`` on a CPU, and the rounding mode dispatches the latter instead
#: (:meth:`detrl.core.rounding.RoundingMode` ``_device_dropout``).
_INSIDE_DEVICE_DROPOUT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "detrl_device_dropout", default=False
)


def device_dropout_now() -> bool:
    """Whether a ``native_dropout`` dispatched now is a device's ``at::dropout`` inside a C++ composite."""
    return _INSIDE_DEVICE_DROPOUT.get()


@contextlib.contextmanager
def inside_device_dropout() -> Iterator[None]:
    """Within: a ``native_dropout`` is a device's ``at::dropout`` (see :func:`device_dropout_now`)."""
    token = _INSIDE_DEVICE_DROPOUT.set(True)
    try:
        yield
    finally:
        _INSIDE_DEVICE_DROPOUT.reset(token)


_SDPA = torch._C._nn.scaled_dot_product_attention


def _sdpa_dropout(args: tuple, kwargs: dict) -> float:
    """The ``dropout_p`` of an SDPA call (its fifth argument)."""
    return float(args[4]) if len(args) > 4 else float(kwargs.get("dropout_p", 0.0))


class _AsOnCpu(TorchFunctionMode):
    """A torch-function mode with one job: the composites that a device writes out otherwise than a CPU
    (dropout, recurrent layers and cells) dispatch the CPU's aten ops on that device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        as_on_cpu = cpu_composites.as_on_cpu(func, args, kwargs)
        x = args[0] if args else kwargs.get("input", kwargs.get("query"))
        if isinstance(x, torch.Tensor) and off_cpu(x.device):
            if as_on_cpu is not None:
                return as_on_cpu(*args, **kwargs)
            if func is _SDPA and _sdpa_dropout(args, kwargs) > 0.0:
                with inside_device_dropout():  # its math decomposition's at::dropout
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


class cpu_op_sequence:  # noqa: N801 - a context manager, like portable_kernels
    """Within: a verifiable step off the CPU dispatches the aten ops a CPU would where a composite chooses
    by device: dropout and recurrent layers as on a CPU, and cuDNN off (see the module doc). Restored on
    exit."""

    __slots__ = ("_cudnn", "_mode")

    def __enter__(self) -> None:
        self._cudnn = torch._C._get_cudnn_enabled()
        torch._C._set_cudnn_enabled(False)
        self._mode = _AsOnCpu()
        self._mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            torch._C._set_cudnn_enabled(self._cudnn)
