"""Adam for small networks: torch's own steps, called without the optimizer's per-step Python.

For a CartPole Q-network (six tensors, about 11k weights) ``torch.optim.Adam(fused=True).step`` spent
about 180 µs in Python (profiler scopes, ``_init_group``, regrouping the tensors by device and dtype) around
a 28 µs kernel: more than the update's matrix products. :class:`LeanAdam` is that optimizer, bit for bit;
:class:`LoopAdam` is torch's per-tensor Adam, which a verifiable update takes (it rounds op by op, and a
fused kernel offers nothing to round); :class:`ListAdam` is torch's list-op (``foreach``) Adam, which
verifiable updates took before (bundles of the DQN's op-sequence revision 2 replay with it). All keep the
tensor lists torch builds from their first step, which is torch's own, as is any step they cannot take on
those lists; after it, a step dispatches the ops torch's would, in its order, on the kept lists. State, ``state_dict`` and ``load_state_dict`` are
torch's, so checkpoints do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import Optimizer, _global_optimizer_post_hooks, _global_optimizer_pre_hooks


class _KeptListsAdam(torch.optim.Adam):
    """Adam with a fast path on tensor lists kept from torch's first step: ``(params, exp_avgs,
    exp_avg_sqs, steps)`` of one parameter group. A subclass says when the fast path applies, by the group's
    settings (:meth:`_settings_lean`, read every step: a caller may switch weight decay, maximize, ...
    between steps) and by its tensors (:meth:`_tensors_lean`, read when the lists are built: they change
    only through load_state_dict and add_param_group, which drop the lists), and takes it
    (:meth:`_fast_step`)."""

    def __init__(self, params: Iterable[torch.Tensor], **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        # the lists torch would build each step; None until the state exists, and again after
        # load_state_dict or add_param_group replaced it
        self._lists: tuple[list[torch.Tensor], ...] | None = None

    def _settings_lean(self) -> bool:
        raise NotImplementedError

    def _tensors_lean(self) -> bool:
        raise NotImplementedError

    def _fast_step(self, lists: tuple[list[torch.Tensor], ...], grads: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Adam's step. torch wraps every optimizer class's ``step`` in a profiler scope and its hook loops,
        about 15 µs a step, half the fused kernel's time. This one is not wrapped (``hooked`` below): it
        takes torch's wrapper only while a step hook is registered or the profiler runs."""
        if (
            self._optimizer_step_pre_hooks
            or self._optimizer_step_post_hooks
            or _global_optimizer_pre_hooks
            or _global_optimizer_post_hooks
            or torch.autograd._profiler_enabled()
        ):
            return _step_with_hooks(self, closure)
        return self._step(closure)

    step.hooked = True  # type: ignore[attr-defined]  # torch's Optimizer then leaves step unwrapped

    @torch.no_grad()
    def _step(self, closure: Callable[[], float] | None = None) -> float | None:
        lists = self._lists
        group = self.param_groups[0]
        lean = (
            lists is not None
            and self._settings_lean()
            and len(lists[0]) == len(group["params"])
            and all(a is b for a, b in zip(lists[0], group["params"]))
        )
        grads = [p.grad for p in lists[0]] if lean else []  # type: ignore[index]
        if closure is not None or not lean or any(g is None for g in grads):
            # Adam's own step, without the profiler and hook wrapper torch puts on it once an Adam exists:
            # this step is already inside this class's (step), whose hooks must run once.
            adam_step = torch.optim.Adam.step
            adam_step = adam_step.__wrapped__ if getattr(adam_step, "hooked", False) else adam_step
            loss = adam_step(self, closure)
            self._lists = None
            if self._settings_lean() and self._tensors_lean():
                params = self.param_groups[0]["params"]
                states = [self.state[p] for p in params]
                self._lists = (
                    list(params),
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [s["step"] for s in states],
                )
            return loss
        assert lists is not None
        self._fast_step(lists, grads)  # type: ignore[arg-type]
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._lists is None or not set_to_none:
            super().zero_grad(set_to_none)
            return
        for p in self._lists[0]:
            p.grad = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._lists = None  # the state tensors were replaced

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._lists = None


#: The kept-lists step as torch would wrap it: its profiler scope (named after the subclass), step hooks and
#: ``_optimizer_step_code``.
_step_with_hooks = Optimizer.profile_hook_step(_KeptListsAdam._step)


def _plain_group(opt: torch.optim.Adam) -> bool:
    """One parameter group, plain Adam (no amsgrad, maximize or decoupled weight decay), a number for lr."""
    group = opt.param_groups[0]
    return (
        len(opt.param_groups) == 1
        and not group["amsgrad"]
        and not group["maximize"]
        and not group.get("decoupled_weight_decay", False)
        and not isinstance(group["lr"], torch.Tensor)
    )


def _op_by_op_group(opt: torch.optim.Adam) -> bool:
    """A plain group whose step torch takes op by op with number arguments: not capturable or
    differentiable, no weight decay, betas numbers (what ListAdam's and LoopAdam's fast steps dispatch)."""
    group = opt.param_groups[0]
    return (
        _plain_group(opt)
        and not group["capturable"]
        and not group["differentiable"]
        and group["weight_decay"] == 0
        and not any(isinstance(b, torch.Tensor) for b in group["betas"])
    )


def _real_cpu_tensors(opt: torch.optim.Adam) -> bool:
    """:func:`_one_kind`, every parameter a real CPU tensor and every step counter on the CPU."""
    params = opt.param_groups[0]["params"]
    return (
        _one_kind(opt)
        and all(p.device.type == "cpu" and not p.is_complex() for p in params)
        and all(opt.state[p]["step"].is_cpu for p in params)
    )


def _one_kind(opt: torch.optim.Adam) -> bool:
    """Every tensor of the (one) group on one device in one dtype, every one with state."""
    params = opt.param_groups[0]["params"]
    return len({(p.device, p.dtype) for p in params}) == 1 and all(p in opt.state for p in params)


class LeanAdam(_KeptListsAdam):
    """``torch.optim.Adam(params, fused=True, ...)`` with a fast path for one parameter group of tensors on
    one device in one dtype, every one with a gradient: the same two calls torch makes (``_foreach_add_``
    on the step counters, then ``_fused_adam_``). ``kwargs``: Adam's (lr, betas, eps, weight_decay)."""

    def __init__(self, params: Iterable[torch.Tensor], **kwargs: Any) -> None:
        super().__init__(params, fused=True, **kwargs)

    def _settings_lean(self) -> bool:
        return _plain_group(self)

    def _tensors_lean(self) -> bool:
        return _one_kind(self)

    def _fast_step(self, lists: tuple[list[torch.Tensor], ...], grads: list[torch.Tensor]) -> None:
        params, exp_avgs, exp_avg_sqs, steps = lists
        group = self.param_groups[0]  # read each step: a schedule may change lr
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1)
        torch._fused_adam_(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip


class LoopAdam(_KeptListsAdam):
    """``torch.optim.Adam(params, foreach=False, ...)`` with a fast path for one parameter group of CPU
    tensors in one dtype, every one with a gradient: the per-tensor ops torch's ``_single_tensor_adam``
    dispatches, parameter by parameter, in its order and with its arguments. A verifiable DQN update takes
    it: each of those ops is plain IEEE arithmetic (add, multiply, divide, square root) or one torch splits
    into such steps (lerp, addcmul, addcdiv), so it is rounded without a log entry, where ListAdam's list
    ops of the same names are logged (about 500 entries an update on CartPole: Adam's first moment of a
    zero gradient, ``0.9 * m``, lands on a FP32 midpoint for one mantissa in ten). ``native``: a module
    whose ``adam_step`` dispatches those ops from C++ (``agents/mlp_native.cpp``: about 50 calls a step on
    CartPole, where each Python call cost more than its kernel), or None for the Python loop below; the
    two give the same bits. ``kwargs``: Adam's (lr, betas, eps)."""

    def __init__(self, params: Iterable[torch.Tensor], native: Any = None, **kwargs: Any) -> None:
        super().__init__(params, foreach=False, **kwargs)
        # (a module built from an older source has no adam_step: the Python loop then)
        self._native_step = getattr(native, "adam_step", None)

    def _settings_lean(self) -> bool:
        group = self.param_groups[0]
        return _op_by_op_group(self) and group["foreach"] is False and not group["fused"]

    def _tensors_lean(self) -> bool:
        return _real_cpu_tensors(self)

    def _fast_step(self, lists: tuple[list[torch.Tensor], ...], grads: list[torch.Tensor]) -> None:
        group = self.param_groups[0]  # read each step: a schedule may change lr
        lr, eps = group["lr"], group["eps"]
        beta1, beta2 = group["betas"]
        params, exp_avgs, exp_avg_sqs, steps = lists
        if self._native_step is not None:
            self._native_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps)
            return
        # torch's _single_tensor_adam (not capturable, no weight decay, real tensors), op for op
        for param, grad, exp_avg, exp_avg_sq, step_t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            step_t += 1
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = step_t.item()
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = bias_correction2**0.5
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-step_size)


class ListAdam(_KeptListsAdam):
    """``torch.optim.Adam(params, foreach=True, ...)`` with a fast path for one parameter group of CPU tensors
    in one dtype, every one with a gradient: the list ops torch's ``_multi_tensor_adam`` dispatches, in its
    order and with its arguments (so a verifiable step rounds and logs the same ops). A verifiable DQN
    update spent about 350 us in torch's Adam, much of it Python around the ten list ops: the step's
    wrapper, ``_init_group`` and the regrouping by device and dtype. ``kwargs``: Adam's (lr, betas, eps)."""

    def __init__(self, params: Iterable[torch.Tensor], **kwargs: Any) -> None:
        super().__init__(params, foreach=True, **kwargs)

    def _settings_lean(self) -> bool:
        return _op_by_op_group(self) and bool(self.param_groups[0]["foreach"])

    def _tensors_lean(self) -> bool:
        return _real_cpu_tensors(self)

    def _fast_step(self, lists: tuple[list[torch.Tensor], ...], grads: list[torch.Tensor]) -> None:
        params, exp_avgs, exp_avg_sqs, steps = lists
        group = self.param_groups[0]  # read each step: a schedule may change lr
        lr, eps = group["lr"], group["eps"]
        beta1, beta2 = group["betas"]
        # torch's _multi_tensor_adam (foreach, not capturable, CPU step counters), op for op
        torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        bias_correction1 = [1 - beta1 ** s.item() for s in steps]
        bias_correction2 = [1 - beta2 ** s.item() for s in steps]
        step_size = [(lr / bc) * -1 for bc in bias_correction1]
        bias_correction2_sqrt = [bc**0.5 for bc in bias_correction2]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)
