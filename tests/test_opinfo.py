"""Every op in torch's op database (OpInfo) records in verifiable precision and replays byte for byte on
two emulated profiles (slow): as FP64, as a float32 island, and with complex values (detrl/testing/opinfo.py).
Each is refused in one line where the rules say so, and nothing else fails."""

from __future__ import annotations

import pytest
import torch

from detrl.testing import opinfo

if not opinfo.available():  # pragma: no cover - torch's test support needs expecttest (the test extra)
    pytest.skip("torch.testing._internal does not import (pip install expecttest)", allow_module_level=True)

#: Refusals the rules make, by op name: (exception type name, what its one line says).
REFUSED = {
    "sparse.sampled_addmm": ("UnroundableResult", "sparse_csr result"),
    "sparse.mm.reduce": ("ValueError", "sparse_csr tensor"),
    "linalg.eig": ("UnroundableResult", "no rule for aten.linalg_eig on complex128"),
    "linalg.eigvals": ("UnroundableResult", "on complex128 values"),
}
OPS = {dtype: dict(opinfo.ops(dtype)) for dtype in (torch.float64, torch.float32)}
CASES = [(dtype, name) for dtype, ops in OPS.items() for name in ops]


def _assert_fine(result: opinfo.Result) -> None:
    if result.status in ("ok", "plain", "no sample"):
        return
    error = result.error
    assert error is not None
    refused = REFUSED.get(result.name)
    line = str(error)
    assert refused is not None, f"{result.name}: {type(error).__name__}: {line[:300]}"
    assert type(error).__name__ == refused[0] and refused[1] in line and "\n" not in line, line


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "name"), CASES, ids=[f"{str(d)[6:]}-{n}" for d, n in CASES])
def test_every_op_records_and_replays(dtype: torch.dtype, name: str) -> None:
    _assert_fine(opinfo.check(name, OPS[dtype][name], dtype))


@pytest.mark.slow
def test_complex_ops_record_and_replay_or_are_refused_by_name() -> None:
    """With complex128 values (complex parameters) an op either replays byte for byte, or is refused in one
    line that names it: "no rule for aten.X on complex128 values". Never another error."""
    outcomes = {"ok": 0, "refused": 0}
    for name, op in opinfo.ops(torch.complex128):
        result = opinfo.check(name, op, torch.complex128)
        if result.status in ("ok", "plain", "no sample"):
            outcomes["ok"] += result.status == "ok"
            continue
        line = str(result.error)
        if name in REFUSED or "sparse" in line or "no rule for aten." in line:
            assert "\n" not in line, line
            outcomes["refused"] += 1
            continue
        raise AssertionError(f"{name}: {type(result.error).__name__}: {line[:300]}")
    assert outcomes["ok"] > 200, outcomes  # 271 of 390 at torch 2.13
