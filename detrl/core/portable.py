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

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


@contextlib.contextmanager
def portable_kernels() -> Iterator[None]:
    """Within: SDPA is its math decomposition and the multi-head-attention fast path is off (restored on
    exit)."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
