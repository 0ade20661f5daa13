"""One op sequence on every device: the kernel choices a verifiable step pins.

The rounding log is keyed by op position within a step, so recorder and replayer must dispatch the same aten
ops in the same order. Two composite torch functions choose a fused kernel by device, dtype and flags
*above* the dispatch modes, where detrl cannot see the choice:

* ``F.scaled_dot_product_attention`` becomes ``_scaled_dot_product_flash_attention_for_cpu`` on a CPU, a
  flash, memory-efficient or cuDNN kernel on CUDA, or the math decomposition. Inside a verifiable step it is
  always the math decomposition: logged matmuls (``bmm``), a softmax and exact steps, the same ops on every
  device, each rounded and logged like any other. (A fused kernel would be one op whose reduction order no
  emulated profile reorders and whose name differs between a CPU and a GPU.)
* ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` take a "fast path" in eval or under
  ``no_grad`` (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``): one fused op on some
  devices and configurations, not on others. Inside a verifiable step the fast path is off, so they run
  their plain Python forward, which calls SDPA, which is math as above.
"""

from __future__ import annotations

import torch

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
