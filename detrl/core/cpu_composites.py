"""Composites as ATen writes them out on a CPU, on any device: the same aten ops in the same order.

Dropout: ``F.dropout`` is ``native_dropout`` on CUDA, but ``empty_like``, ``bernoulli_``, ``div_`` and
``mul`` on a CPU (whose noise is rounded to FP32 before it scales). :func:`dropout_as_on_cpu` dispatches the
CPU's four ops on any device.

Recurrent layers: ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` call ``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh`` or
``torch.rnn_relu``, composites that ATen writes out by device *above* the dispatch modes (RNN.cpp). On a
CPU a layer first projects the whole sequence (``linear(input, w_ih, b_ih)``, one matrix product), then
runs each time step's cell as its parts: ``linear(h, w_hh, b_hh)``, ``add_``, ``unsafe_chunk``, the gate
activations in place, products and sums. On CUDA each step projects its own input, and an LSTM or GRU cell
is one fused op (``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell``), with cuDNN off as with it on. A
recording's rounding log is keyed by op position, so a CPU recording could not replay on a GPU, nor the
reverse. :func:`lstm`, :func:`gru`, :func:`rnn_tanh`, :func:`rnn_relu` and the one-step cells
(``nn.LSTMCell``, ...) run the CPU's composition in Python, which dispatches exactly its ops on any device
(``tests/test_portable.py`` compares the sequences, forward and backward, and the values with
ATen's on the CPU, over layers, directions, batch-first, biases, dropout and LSTM projections).

Between layers, in training with ``dropout > 0``, ATen calls ``dropout``, which is itself device-dependent:
here it is :func:`dropout_as_on_cpu`. Packed sequences (``PackedSequence``: the packed overloads, ``data``
and ``batch_sizes`` in place of the padded input) run the same cells over a batch that shrinks as sequences
end (ATen's ``PackedLayer``; backwards, ``ReversedPackedLayer``, which grows it), projected once on a CPU
too. :func:`as_on_cpu` finds the composition that answers a torch function call
(:class:`detrl.core.portable.cpu_op_sequence` asks it off the CPU).

The cell formulas, as RNN.cpp writes them for a CPU (``x`` the step's projected input, ``h``/``c`` the state)::

    LSTM  gates = linear(h, w_hh, b_hh).add_(x);  i, f, g, o = gates.unsafe_chunk(4, 1)
          i, f, g, o = i.sigmoid_(), f.sigmoid_(), g.tanh_(), o.sigmoid_()
          c' = (f * c).add_(i * g);  h' = o * c'.tanh();  h' = matmul(h', w_hr.t()) with projections
    GRU   xr, xz, xn = x.unsafe_chunk(3, 1);  hr, hz, hn = linear(h, w_hh, b_hh).unsafe_chunk(3, 1)
          r = hr.add_(xr).sigmoid_();  z = hz.add_(xz).sigmoid_();  n = xn.add(hn.mul_(r)).tanh_()
          h' = (h - n).mul_(z).add_(n)
    RNN   h' = tanh(linear(h, w_hh, b_hh).add_(x))   (or relu)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
aten = torch.ops.aten


def dropout_as_on_cpu(
    x: torch.Tensor, p: float, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout`` as ATen computes it on a CPU, on any device: the same aten ops with the same arguments
    (``empty_like``, ``bernoulli_.float``, ``div_.Scalar``, ``mul.Tensor``; ``zeros`` and ``mul`` at
    ``p = 1``), so a recording crosses between devices. tests/test_portable.py compares the sequences."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0.0 or not training or x.numel() == 0:
        return x
    multiply = aten.mul_.Tensor if inplace else aten.mul.Tensor
    if p == 1.0:
        return multiply(x, aten.zeros.default([], dtype=x.dtype, layout=torch.strided, device=x.device))
    return multiply(x, _noise(x, p))


def dropout_noise_as_on_cpu(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A training dropout with ``0 < p < 1`` as a CPU computes it: ``(x * noise, noise)`` (the part of
    :func:`dropout_as_on_cpu` that a device's ``native_dropout`` stands in for, inside composites written in
    C++: SDPA's math attention)."""
    noise = _noise(x, p)
    return aten.mul.Tensor(x, noise), noise


def _noise(x: torch.Tensor, p: float) -> torch.Tensor:
    """A CPU dropout's noise in ``x``'s shape: kept elements ``1 / (1 - p)``, the others 0, drawn and scaled
    by the CPU's ops (``empty_like``, ``bernoulli_.float``, ``div_.Scalar``)."""
    noise = aten.empty_like.default(x)
    aten.bernoulli_.float(noise, 1.0 - p)
    aten.div_.Scalar(noise, 1.0 - p)
    return noise


# The signatures of the functions they stand in for (``input`` as torch names it, for keyword callers).
def _dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:  # noqa: A002
    return dropout_as_on_cpu(input, p, training, inplace)


def _aten_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:  # noqa: A002
    return dropout_as_on_cpu(input, p, train)


def _aten_dropout_(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:  # noqa: A002
    return dropout_as_on_cpu(input, p, train, inplace=True)


#: torch's dropout functions -> their CPU composition here.
DROPOUTS_AS_ON_CPU: dict[Any, Callable[..., Any]] = {
    torch.nn.functional.dropout: _dropout,
    torch.dropout: _aten_dropout,
    torch.dropout_: _aten_dropout_,
}


class _Weights:
    """One direction of one layer: ``w_ih`` (gates*H, I), ``w_hh`` (gates*H, P), the biases (gates*H,) or
    None, and the LSTM projection ``w_hr`` (P, H) or None (P = H without one)."""

    __slots__ = ("b_hh", "b_ih", "w_hh", "w_hr", "w_ih")

    def __init__(self, flat: Sequence[Tensor], has_biases: bool, has_projections: bool) -> None:
        self.w_ih, self.w_hh = flat[0], flat[1]
        self.b_ih, self.b_hh = (flat[2], flat[3]) if has_biases else (None, None)
        self.w_hr = flat[4 if has_biases else 2] if has_projections else None

    def linear_ih(self, x: Tensor) -> Tensor:
        return F.linear(x, self.w_ih, self.b_ih)

    def linear_hh(self, h: Tensor) -> Tensor:
        return F.linear(h, self.w_hh, self.b_hh)

    def matmul_hr(self, h: Tensor) -> Tensor:
        return h if self.w_hr is None else torch.matmul(h, self.w_hr.t())


def _gather(params: Sequence[Tensor], has_biases: bool, has_projections: bool = False) -> list[_Weights]:
    """ATen's ``gather_params``: the flat weight list, cut into each layer's and direction's tensors."""
    per = 2 + 2 * has_biases + has_projections
    if len(params) % per:
        raise ValueError(f"got {len(params)} parameters for an RNN, not a multiple of {per}")
    return [_Weights(params[i : i + per], has_biases, has_projections) for i in range(0, len(params), per)]


# ---- cells: (step input, hidden, weights, whether the input is projected already) -> hidden, as RNN.cpp's
# CPU branch. A layer projects its whole sequence first; a cell function (nn.LSTMCell) projects its input.
def _lstm_cell(
    x: Tensor, hidden: tuple[Tensor, Tensor], w: _Weights, projected: bool
) -> tuple[Tensor, Tensor]:
    hx, cx = hidden
    gates = w.linear_hh(hx).add_(x if projected else w.linear_ih(x))  # (B, 4H); the hidden product first
    ingate, forgetgate, cellgate, outgate = gates.unsafe_chunk(4, 1)
    ingate, forgetgate = ingate.sigmoid_(), forgetgate.sigmoid_()
    cellgate, outgate = cellgate.tanh_(), outgate.sigmoid_()
    cy = (forgetgate * cx).add_(ingate * cellgate)  # (B, H)
    hy = w.matmul_hr(outgate * cy.tanh())  # (B, P)
    return hy, cy


def _gru_cell(x: Tensor, hidden: Tensor, w: _Weights, projected: bool) -> Tensor:
    xr, xz, xn = (x if projected else w.linear_ih(x)).unsafe_chunk(3, 1)  # the input product first
    hr, hz, hn = w.linear_hh(hidden).unsafe_chunk(3, 1)
    reset = hr.add_(xr).sigmoid_()
    update = hz.add_(xz).sigmoid_()
    new = xn.add(hn.mul_(reset)).tanh_()
    return (hidden - new).mul_(update).add_(new)


def _simple_cell(
    nonlinearity: Callable[[Tensor], Tensor],
) -> Callable[[Tensor, Tensor, _Weights, bool], Tensor]:
    def cell(x: Tensor, hidden: Tensor, w: _Weights, projected: bool) -> Tensor:
        return nonlinearity(w.linear_hh(hidden).add_(x if projected else w.linear_ih(x)))

    return cell


def _output(hidden: Any) -> Tensor:
    """A step's output: the hidden state (an LSTM's ``h``)."""
    return hidden[0] if isinstance(hidden, tuple) else hidden


def _run(
    cell: Callable, steps: Sequence[Tensor], hidden: Any, w: _Weights, reverse: bool
) -> tuple[list, Any]:
    """A layer's cell over its projected step inputs (last to first with ``reverse``): per-step outputs in
    time order, and the final hidden state."""
    outputs = []
    for x in reversed(steps) if reverse else steps:
        hidden = cell(x, hidden, w, True)
        outputs.append(_output(hidden))
    if reverse:
        outputs.reverse()
    return outputs, hidden


def _layer(cell: Callable, x: Tensor, hidden: Any, w: _Weights, reverse: bool = False) -> tuple[Tensor, Any]:
    """ATen's ``FullLayer`` on a CPU (with ``reverse``, its reversed twin): the sequence's input projection,
    then the cell per step, the outputs stacked in time order."""
    outputs, final = _run(cell, w.linear_ih(x).unbind(0), hidden, w, reverse)
    return torch.stack(outputs, 0), final


def _bidirectional_layer(cell: Callable, x: Tensor, hidden: tuple, w: tuple[_Weights, _Weights]) -> tuple:
    """ATen's ``FullBidirectionalLayer`` on a CPU: forward over the sequence, then backward, each from its
    own input projection; outputs concatenated on the feature axis."""
    fw_output, fw_final = _layer(cell, x, hidden[0], w[0])
    rev_output, rev_final = _layer(cell, x, hidden[1], w[1], reverse=True)
    return torch.cat([fw_output, rev_output], fw_output.dim() - 1), (fw_final, rev_final)


# ---- packed sequences: ``data`` (sum of the lengths, features), its rows time step by time step, each step
# the ``batch_sizes[t]`` sequences still running (sorted longest first, so the batch only shrinks)
def _slice(hidden: Any, start: int, end: int) -> Any:
    """ATen's ``hidden_slice``: rows ``start:end`` of the state (an LSTM's ``(h, c)`` evaluated ``c`` first, as
    GCC evaluates ``make_tuple``'s arguments)."""
    if isinstance(hidden, tuple):
        c = hidden[1].narrow(0, start, end - start)
        return hidden[0].narrow(0, start, end - start), c
    return hidden.narrow(0, start, end - start)


def _concat(hiddens: list) -> Any:
    """ATen's ``hidden_concat``: the states' rows one after another (an LSTM's ``c`` first, as in :func:`_slice`)."""
    if isinstance(hiddens[0], tuple):
        c = torch.cat([c for _, c in hiddens], 0)
        return torch.cat([h for h, _ in hiddens], 0), c
    return torch.cat(hiddens, 0)


def _packed_layer(
    cell: Callable, data: Tensor, hidden: Any, w: _Weights, sizes: list[int]
) -> tuple[Tensor, Any]:
    """ATen's ``PackedLayer`` on a CPU: the whole ``data`` projected once, then each step's rows through the
    cell. Where the batch shrinks, the state of the sequences that ended is set aside; the final state is
    theirs and the last step's, in batch order."""
    projected = w.linear_ih(data)
    outputs, ended = [], []
    offset, last = 0, sizes[0]
    for size in sizes:
        x = projected.narrow(0, offset, size)
        offset += size
        if size < last:
            ended.append(_slice(hidden, size, last))
            hidden = _slice(hidden, 0, size)
        last = size
        hidden = cell(x, hidden, w, True)
        outputs.append(_output(hidden))
    ended.append(hidden)
    ended.reverse()
    return torch.cat(outputs, 0), _concat(ended)


def _reversed_packed_layer(
    cell: Callable, data: Tensor, hidden0: Any, w: _Weights, sizes: list[int]
) -> tuple[Tensor, Any]:
    """ATen's ``ReversedPackedLayer`` on a CPU: the steps last to first, the batch growing by the initial
    state of each sequence that starts running (backwards); the outputs in time order."""
    projected = w.linear_ih(data)
    outputs = []
    offset, last = data.size(0), sizes[-1]
    hidden = _slice(hidden0, 0, last)
    for size in reversed(sizes):
        if size > last:
            hidden = _concat([hidden, _slice(hidden0, last, size)])
        x = projected.narrow(0, offset - size, size)
        offset -= size
        last = size
        hidden = cell(x, hidden, w, True)
        outputs.append(_output(hidden))
    outputs.reverse()
    return torch.cat(outputs, 0), hidden


def _packed_bidirectional_layer(
    cell: Callable, data: Tensor, hidden: tuple, w: tuple[_Weights, _Weights], sizes: list[int]
) -> tuple:
    """ATen's ``PackedBidirectionalLayer``: forward, then backward, outputs concatenated on the features."""
    fw_output, fw_final = _packed_layer(cell, data, hidden[0], w[0], sizes)
    rev_output, rev_final = _reversed_packed_layer(cell, data, hidden[1], w[1], sizes)
    return torch.cat([fw_output, rev_output], -1), (fw_final, rev_final)


def _stack(
    cell: Callable,
    x: Tensor,
    hiddens: list,
    weights: list[_Weights],
    layers: int,
    p: float,
    train: bool,
    bidir: bool,
    sizes: list[int] | None = None,
) -> tuple[Tensor, list]:
    """ATen's ``apply_layer_stack`` (``_rnn_impl``): the layers in turn, dropout between them. ``sizes``: a
    packed sequence's batch sizes (``x`` its data), else ``x`` is the (T, B, features) input."""
    one, both = (_layer, _bidirectional_layer) if sizes is None else (
        functools.partial(_packed_layer, sizes=sizes), functools.partial(_packed_bidirectional_layer, sizes=sizes)
    )  # fmt: skip
    finals: list = []
    for layer in range(layers):
        if bidir:
            pair = (hiddens[2 * layer], hiddens[2 * layer + 1])
            x, final = both(cell, x, pair, (weights[2 * layer], weights[2 * layer + 1]))
            finals.extend(final)
        else:
            x, final = one(cell, x, hiddens[layer], weights[layer])
            finals.append(final)
        if p != 0 and train and layer < layers - 1:
            x = dropout_as_on_cpu(x, p, True)
    return x, finals


def _lstm_stack(
    x: Tensor, hx: Sequence[Tensor], params: Sequence[Tensor], has_biases: bool, num_layers: int, dropout: float,
    train: bool, bidirectional: bool, sizes: list[int] | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """ATen's ``_lstm_impl``: ``(output, h_n, c_n)`` of the (T, B, I) input, or of a packed sequence's data."""
    if len(hx) != 2:
        raise ValueError("lstm expects two hidden states")
    has_projections = hx[0].shape[2] != hx[1].shape[2]
    weights = _gather(params, has_biases, has_projections)
    hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0)))
    out, finals = _stack(_lstm_cell, x, hiddens, weights, num_layers, dropout, train, bidirectional, sizes)
    # RNN.cpp returns make_tuple(outputs, stack(hy), stack(cy)), whose arguments GCC evaluates right to left
    c_n = torch.stack([c for _, c in finals], 0)  # (layers * directions, B, H)
    h_n = torch.stack([h for h, _ in finals], 0)  # (layers * directions, B, P)
    return out, h_n, c_n


def lstm(
    input: Tensor,  # noqa: A002 - torch.lstm's names
    hx: Sequence[Tensor],
    params: Sequence[Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.lstm`` (the input overload) as on a CPU: ``(output, h_n, c_n)``."""
    x = input.transpose(0, 1) if batch_first else input  # (T, B, I)
    out, h_n, c_n = _lstm_stack(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, None)
    return (out.transpose(0, 1) if batch_first else out), h_n, c_n


def lstm_packed(
    data: Tensor, batch_sizes: Tensor, hx: Sequence[Tensor], params: Sequence[Tensor], has_biases: bool,
    num_layers: int, dropout: float, train: bool, bidirectional: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``torch.lstm`` (the packed overload) as on a CPU: ``(output data, h_n, c_n)``."""
    sizes = _batch_sizes(batch_sizes)
    return _lstm_stack(data, hx, params, has_biases, num_layers, dropout, train, bidirectional, sizes)


def _batch_sizes(batch_sizes: Tensor) -> list[int]:
    """A packed sequence's batch sizes (a CPU int64 tensor, as ATen reads it: no op dispatched)."""
    if batch_sizes.dim() != 1 or batch_sizes.numel() == 0:
        raise ValueError(f"batch_sizes must be a non-empty 1-d tensor, got shape {tuple(batch_sizes.shape)}")
    return batch_sizes.tolist()


def _one_hidden(
    cell: Callable,
) -> tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, Tensor]]]:
    """``torch.gru`` / ``torch.rnn_tanh`` / ``torch.rnn_relu`` as on a CPU: the input overload and the packed one."""

    def stack(
        x: Tensor, hx: Tensor, params: Sequence[Tensor], has_biases: bool, num_layers: int, dropout: float,
        train: bool, bidirectional: bool, sizes: list[int] | None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """ATen's ``_rnn_impl_with_concat``: ``(output, h_n)`` of the (T, B, I) input or a packed sequence's data."""
        weights = _gather(params, has_biases)
        out, finals = _stack(
            cell, x, list(hx.unbind(0)), weights, num_layers, dropout, train, bidirectional, sizes
        )
        return out, torch.stack(finals, 0)  # h_n: (layers * directions, B, H)

    def rnn(
        input: Tensor,  # noqa: A002 - torch's names
        hx: Tensor,
        params: Sequence[Tensor],
        has_biases: bool,
        num_layers: int,
        dropout: float,
        train: bool,
        bidirectional: bool,
        batch_first: bool,
    ) -> tuple[Tensor, Tensor]:
        x = input.transpose(0, 1) if batch_first else input
        out, h_n = stack(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, None)
        if batch_first:  # after h_n was stacked
            out.transpose_(0, 1)  # ATen transposes the GRU/RNN output in place (the LSTM's out of place)
        return out, h_n

    def rnn_packed(
        data: Tensor, batch_sizes: Tensor, hx: Tensor, params: Sequence[Tensor], has_biases: bool,
        num_layers: int, dropout: float, train: bool, bidirectional: bool,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        sizes = _batch_sizes(batch_sizes)
        return stack(data, hx, params, has_biases, num_layers, dropout, train, bidirectional, sizes)

    return rnn, rnn_packed


_tanh_cell, _relu_cell = _simple_cell(torch.tanh), _simple_cell(torch.relu)
gru, gru_packed = _one_hidden(_gru_cell)
rnn_tanh, rnn_tanh_packed = _one_hidden(_tanh_cell)
rnn_relu, rnn_relu_packed = _one_hidden(_relu_cell)


def _cell_function(cell: Callable) -> Callable[..., Any]:
    def step(
        input: Tensor,  # noqa: A002 - torch's names
        hx: Any,
        w_ih: Tensor,
        w_hh: Tensor,
        b_ih: Tensor | None = None,
        b_hh: Tensor | None = None,
    ) -> Any:
        """``torch.lstm_cell`` / ``gru_cell`` / ``rnn_tanh_cell`` / ``rnn_relu_cell`` (``nn.LSTMCell``, ...)
        as on a CPU: one step from an unprojected input."""
        w = _Weights([w_ih, w_hh, b_ih, b_hh], b_ih is not None or b_hh is not None, False)
        return cell(input, tuple(hx) if cell is _lstm_cell else hx, w, False)

    return step


_VF = torch._C._VariableFunctions
#: torch's recurrent functions -> their CPU compositions here: (the input overload, the packed one).
AS_ON_CPU: dict[Any, tuple[Callable[..., Any], Callable[..., Any]]] = {
    _VF.lstm: (lstm, lstm_packed),
    _VF.gru: (gru, gru_packed),
    _VF.rnn_tanh: (rnn_tanh, rnn_tanh_packed),
    _VF.rnn_relu: (rnn_relu, rnn_relu_packed),
}


#: torch's one-step cell functions -> their CPU composition here.
CELLS_AS_ON_CPU: dict[Any, Callable[..., Any]] = {
    _VF.lstm_cell: _cell_function(_lstm_cell),
    _VF.gru_cell: _cell_function(_gru_cell),
    _VF.rnn_tanh_cell: _cell_function(_tanh_cell),
    _VF.rnn_relu_cell: _cell_function(_relu_cell),
}


def as_on_cpu(func: Any, args: tuple, kwargs: dict) -> Callable[..., Any] | None:
    """The CPU composition that answers this call of a torch function (dropout, a recurrent layer or
    cell), or None: not one of them."""
    simple = DROPOUTS_AS_ON_CPU.get(func) or CELLS_AS_ON_CPU.get(func)
    if simple is not None:
        return simple
    overloads = AS_ON_CPU.get(func)
    if overloads is None or kwargs or len(args) != 9:
        return None
    # the packed overload has the batch sizes second (an integer tensor), where the input overload has the
    # hidden state (a float tensor, or an LSTM's list of two)
    second = args[1]
    packed = isinstance(second, Tensor) and not (second.is_floating_point() or second.is_complex())
    return overloads[1] if packed else overloads[0]
