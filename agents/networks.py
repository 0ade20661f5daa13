"""Q-networks: an MLP for vector observations, the Nature CNN (Mnih et al. 2015) for Atari frames and the
MinAtar CNN (Young & Tian 2019) for MinAtar's 10x10 boards.

:class:`QNetworks` holds the online and the target network in one module, so the run's commitments and
checkpoints cover both, and the target starts as an exact copy of the online network.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class MLPQNetwork(nn.Module):
    """``obs (N, obs_dim) -> Q (N, n_actions)`` through ReLU hidden layers of the given widths."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: Sequence[int] = (120, 84)) -> None:
        super().__init__()
        widths = [obs_dim, *hidden, n_actions]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self._layers(obs, None)

    def flat_parameters(self) -> list[torch.Tensor]:
        """``[weight0, bias0, weight1, bias1, ...]``, input layer first (as ``agents/mlp_native.cpp`` takes them)."""
        params = [layer._parameters for layer in self.layers._modules.values()]
        return [t for p in params for t in (p["weight"], p["bias"])]

    @torch.no_grad()
    def forward_keeping_inputs(self, obs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`forward` outside autograd: ``Q (N, n_actions)`` and each layer's input (``obs`` first,
        then every hidden ReLU output), which :meth:`write_gradients` needs."""
        inputs: list[torch.Tensor] = []
        return self._layers(obs, inputs), inputs

    def _layers(self, obs: torch.Tensor, inputs: list[torch.Tensor] | None) -> torch.Tensor:
        # Parameters read straight from each layer's dict and functional calls, no module calls: a DQN acts
        # on one observation per env step, where module-call overhead cost as much as the arithmetic.
        params = [layer._parameters for layer in self.layers._modules.values()]
        w0 = params[0]["weight"]
        x = obs if obs.dtype == w0.dtype else obs.to(w0.dtype)
        for p in params[:-1]:
            if inputs is not None:
                inputs.append(x)
            x = torch.relu(F.linear(x, p["weight"], p["bias"]))
        if inputs is not None:
            inputs.append(x)
        return F.linear(x, params[-1]["weight"], params[-1]["bias"])

    @torch.no_grad()
    def write_gradients(self, grad_q: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        """Set every parameter's ``.grad`` from ``grad_q``, the loss's gradient by ``Q`` ``(N, n_actions)``,
        given :meth:`forward_keeping_inputs`' ``inputs``: the backward pass written out.

        These are the aten ops autograd runs for this network (the derivative formulas of ``addmm``, which
        ``F.linear`` is, and of ``relu``), on the same operands in the same layout, so the gradients are
        autograd's bit for bit; the autograd engine around them cost a CartPole update more than its matrix
        products. Layer by layer from the last, with ``g`` the gradient by the layer's output ``(N, out)``
        and ``x`` its input ``(N, in)``: ``weight.grad = g^T x``, ``bias.grad = sum_N g``, and the previous
        layer's ``g = relu'(x) * (g W)``.
        """
        params = [layer._parameters for layer in self.layers._modules.values()]
        g = grad_q
        for k in range(len(params) - 1, -1, -1):
            p, x = params[k], inputs[k]
            p["weight"].grad = g.t().mm(x)  # (out, in)
            p["bias"].grad = g.sum(0)  # (out,)
            if k:  # the input gradient, through the ReLU that produced x (the observation needs none)
                g = torch.ops.aten.threshold_backward(g.mm(p["weight"]), x, 0)


class NatureCNN(nn.Module):
    """``frames (N, stack, 84, 84) uint8 -> Q (N, n_actions)``: the Nature DQN's three convolutions and
    a 512-unit layer. Pixels are scaled to [0, 1] inside, so the replay buffer can keep uint8 frames."""

    def __init__(self, n_actions: int, stack: int = 4, screen: int = 84) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(stack, 32, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            n_flat = self.features(torch.zeros(1, stack, screen, screen)).shape[1]
        self.head = nn.Sequential(nn.Linear(n_flat, 512), nn.ReLU(), nn.Linear(512, n_actions))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = frames.to(self.head[0].weight.dtype) / 255.0
        return self.head(self.features(x))


class MinAtarCNN(nn.Module):
    """``board (N, channels, 10, 10) uint8 -> Q (N, n_actions)``: Young & Tian (2019)'s DQN network, one 3x3
    convolution of 16 channels (stride 1, no padding), then a 128-unit layer.

    The board's 0/1 cells are fed as they are (no scaling). Like :class:`MLPQNetwork`, the forward pass is
    functional: a DQN acts on one board per env step, where module calls cost about as much as the maths.
    """

    def __init__(self, n_actions: int, channels: int, height: int = 10, width: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 16, 3, stride=1)
        self.hidden = nn.Linear(16 * (height - 2) * (width - 2), 128)
        self.out = nn.Linear(128, n_actions)

    def forward(self, board: torch.Tensor) -> torch.Tensor:
        conv, hidden, out = self.conv._parameters, self.hidden._parameters, self.out._parameters
        x = board.to(conv["weight"].dtype)
        x = torch.relu(F.conv2d(x, conv["weight"], conv["bias"])).flatten(1)
        x = torch.relu(F.linear(x, hidden["weight"], hidden["bias"]))
        return F.linear(x, out["weight"], out["bias"])


class QNetworks(nn.Module):
    """The online network and its target (a frozen copy, refreshed by :meth:`update_target`)."""

    def __init__(self, online: nn.Module) -> None:
        super().__init__()
        self.online = online
        self.target = copy.deepcopy(online)
        self.target.requires_grad_(False)

    @torch.no_grad()
    def update_target(self, tau: float, list_ops: bool = True) -> None:
        """``target <- tau * online + (1 - tau) * target`` (tau = 1: a hard copy, as in Nature DQN).

        ``list_ops``: one list op for all tensors; else a ``lerp_`` a tensor, which a verifiable step computes
        in IEEE steps and rounds without a log entry (the list op is logged: a lerp lands on FP32 midpoints
        often, at about a thousand elements a step on CartPole's network)."""
        online, target = list(self.online.parameters()), list(self.target.parameters())
        if tau == 1.0:
            torch._foreach_copy_(target, online)
        elif list_ops:
            torch._foreach_lerp_(target, online, tau)
        else:
            for t, o in zip(target, online):
                t.lerp_(o, tau)


def build_q_network(
    kind: str, obs_shape: tuple[int, ...], n_actions: int, hidden: Sequence[int]
) -> nn.Module:
    """``kind`` ``"mlp"`` (flat observations), ``"nature_cnn"`` (``(stack, H, W)`` Atari frames) or
    ``"minatar_cnn"`` (``(channels, 10, 10)`` MinAtar boards)."""
    if kind == "mlp":
        if len(obs_shape) != 1:
            raise ValueError(f"agent.network=mlp needs vector observations, got shape {obs_shape}")
        return MLPQNetwork(obs_shape[0], n_actions, hidden)
    if len(obs_shape) != 3:
        raise ValueError(f"agent.network={kind} needs (channels, H, W) observations, got shape {obs_shape}")
    if kind == "minatar_cnn":
        if min(obs_shape[1:]) < 3:
            raise ValueError(f"agent.network=minatar_cnn needs boards of at least 3x3, got shape {obs_shape}")
        return MinAtarCNN(n_actions, channels=obs_shape[0], height=obs_shape[1], width=obs_shape[2])
    # The Nature CNN's 8x8/4, 4x4/2 and 3x3/1 convolutions need 36 pixels a side.
    if min(obs_shape[1:]) < 36:
        raise ValueError(
            f"agent.network=nature_cnn needs frames of at least 36x36, got shape {obs_shape} "
            "(MinAtar boards: agent.network=minatar_cnn)"
        )
    return NatureCNN(n_actions, stack=obs_shape[0], screen=obs_shape[1])
