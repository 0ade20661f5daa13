"""Adam for small networks: torch's fused kernel, called without the optimizer's per-step Python.

For a CartPole Q-network (six tensors, about 11k weights) ``torch.optim.Adam(fused=True).step`` spent
about 180 µs in Python (profiler scopes, ``_init_group``, regrouping the tensors by device and dtype) around
a 28 µs kernel: more than the update's matrix products. :class:`LeanAdam` is that optimizer, bit for bit:
its first step, and any step it cannot take as below, is torch's own; after it, a step is the same two
calls torch makes (``_foreach_add_`` on the step counters, then ``_fused_adam_``) on tensor lists kept
from the first. State, ``state_dict`` and ``load_state_dict`` are torch's, so checkpoints do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import Optimizer, _global_optimizer_post_hooks, _global_optimizer_pre_hooks


class LeanAdam(torch.optim.Adam):
    """``torch.optim.Adam(params, fused=True, ...)`` with a fast path for one parameter group of tensors on
    one device in one dtype, every one with a gradient. ``kwargs``: Adam's (lr, betas, eps, weight_decay)."""

    def __init__(self, params: Iterable[torch.Tensor], **kwargs: Any) -> None:
        super().__init__(params, fused=True, **kwargs)
        # (params, exp_avgs, exp_avg_sqs, steps): the lists torch would build each step; None until the
        # state exists, and again after load_state_dict or add_param_group replaced it.
        self._lists: tuple[list[torch.Tensor], ...] | None = None

    def _lean(self) -> bool:
        group = self.param_groups[0]
        return (
            len(self.param_groups) == 1
            and not group["amsgrad"]
            and not group["maximize"]
            and not group.get("decoupled_weight_decay", False)
            and not isinstance(group["lr"], torch.Tensor)
            and len({(p.device, p.dtype) for p in group["params"]}) == 1
            and all(p in self.state for p in group["params"])
        )

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Adam's step. torch wraps every optimizer class's ``step`` in a profiler scope and its hook loops,
        about 15 µs a step, half the fused kernel's time. LeanAdam's is not wrapped (``hooked`` below): it
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
        grads = None if lists is None else [p.grad for p in lists[0]]
        if closure is not None or lists is None or any(g is None for g in grads):  # type: ignore[union-attr]
            # Adam's own step, without the profiler and hook wrapper torch puts on it once an Adam exists:
            # this step is already inside LeanAdam's (step), whose hooks must run once.
            adam_step = torch.optim.Adam.step
            adam_step = adam_step.__wrapped__ if getattr(adam_step, "hooked", False) else adam_step
            loss = adam_step(self, closure)
            params = self.param_groups[0]["params"]
            if self._lean():
                states = [self.state[p] for p in params]
                self._lists = (
                    list(params),
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [s["step"] for s in states],
                )
            return loss
        params, exp_avgs, exp_avg_sqs, steps = lists
        group = self.param_groups[0]  # read each step: a schedule may change lr
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1)
        torch._fused_adam_(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            amsgrad=False, lr=group["lr"], beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip
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


#: LeanAdam's step as torch would wrap it: its profiler scope, step hooks and ``_optimizer_step_code``.
_step_with_hooks = Optimizer.profile_hook_step(LeanAdam._step)


class ListAdam(torch.optim.Adam):
    """``torch.optim.Adam(params, foreach=True, ...)`` with a fast path for one parameter group of CPU tensors
    in one dtype, every one with a gradient: the list ops torch's ``_multi_tensor_adam`` dispatches, in its
    order and with its arguments (so a verifiable step rounds and logs the same ops), called on tensor lists
    kept from the first step. A verifiable DQN update, which cannot take the fused kernel (nothing to round op
    by op), spent about 350 us in torch's Adam, much of it Python around the ten list ops: the step's
    wrapper, ``_init_group`` and the regrouping by device and dtype. Its first step, and any step it cannot
    take as below, is torch's own; state and checkpoints are torch's. ``kwargs``: Adam's (lr, betas, eps)."""

    def __init__(self, params: Iterable[torch.Tensor], **kwargs: Any) -> None:
        super().__init__(params, foreach=True, **kwargs)
        self._lists: tuple[list[torch.Tensor], ...] | None = None  # as LeanAdam's

    def _lean(self) -> bool:
        group = self.param_groups[0]
        params = group["params"]
        return (
            len(self.param_groups) == 1
            and group["foreach"]
            and not group["amsgrad"]
            and not group["maximize"]
            and not group["capturable"]
            and not group["differentiable"]
            and group["weight_decay"] == 0
            and not group.get("decoupled_weight_decay", False)
            and not isinstance(group["lr"], torch.Tensor)
            and not any(isinstance(b, torch.Tensor) for b in group["betas"])
            and len({(p.device, p.dtype) for p in params}) == 1
            and all(p.device.type == "cpu" and not p.is_complex() for p in params)
            and all(p in self.state and self.state[p]["step"].is_cpu for p in params)
        )

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Adam's step; torch's wrapper only while a step hook is registered or the profiler runs (as
        :meth:`LeanAdam.step`)."""
        if (
            self._optimizer_step_pre_hooks
            or self._optimizer_step_post_hooks
            or _global_optimizer_pre_hooks
            or _global_optimizer_post_hooks
            or torch.autograd._profiler_enabled()
        ):
            return _list_step_with_hooks(self, closure)
        return self._step(closure)

    step.hooked = True  # type: ignore[attr-defined]

    @torch.no_grad()
    def _step(self, closure: Callable[[], float] | None = None) -> float | None:
        lists = self._lists
        grads = None if lists is None else [p.grad for p in lists[0]]
        # the group is read each step: a caller may switch on weight decay, maximize, ... between steps
        lean = (
            lists is not None
            and self._lean()
            and len(lists[0]) == len(self.param_groups[0]["params"])
            and all(a is b for a, b in zip(lists[0], self.param_groups[0]["params"]))
        )
        if closure is not None or not lean or any(g is None for g in grads):  # type: ignore[union-attr]
            adam_step = torch.optim.Adam.step
            adam_step = adam_step.__wrapped__ if getattr(adam_step, "hooked", False) else adam_step
            loss = adam_step(self, closure)
            params = self.param_groups[0]["params"]
            self._lists = None
            if self._lean():
                states = [self.state[p] for p in params]
                self._lists = (
                    list(params),
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [s["step"] for s in states],
                )
            return loss
        assert lists is not None
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
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._lists is None or not set_to_none:
            super().zero_grad(set_to_none)
            return
        for p in self._lists[0]:
            p.grad = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._lists = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._lists = None


_list_step_with_hooks = Optimizer.profile_hook_step(ListAdam._step)
